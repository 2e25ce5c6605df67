#!/usr/bin/env python3
"""The torch.distributed.rpc side of `wasmrpc-bench` (TensorPipe backend).

Started by `wasmrpc-bench` with the set-up's interpreter; runnable alone:

    $WASMRPC_ENV/venv/bin/python bench/torch_rpc_bench.py --quick

It spawns its own worker processes with torch.multiprocessing and measures
the same rows as the Rust side (latencies with the same repetition counts),
on the same layout:
rank 0 measures, the other ranks serve. Every result is one JSON line on
stdout:

    {"row": "rtt_noop", "unit": "us", "median": 601.2, "p99": 880.0, "n": 5000}

Progress lines are `{"progress": "..."}`; a row that cannot be measured is
`{"row": ..., "na": "why"}`. Everything else (torch's own warnings) goes to
stderr.
"""

import argparse
import json
import os
import socket
import sys
import time
from collections import deque

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

ECHO_SIZES = [("echo_4k", 4 << 10), ("echo_1m", 1 << 20), ("echo_64m", 64 << 20)]
WINDOW = 128
ALL_TO_ALL_WINDOW = 64


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def progress(text):
    emit({"progress": text})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(sorted_values, q):
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]


def latency_row(row, samples_ns, **extra):
    s = sorted(x / 1000.0 for x in samples_ns)
    emit(dict(row=row, unit="us", median=percentile(s, 0.5), p99=percentile(s, 0.99), n=len(s), **extra))


# ---- functions the workers serve (module-level, so they pickle by name) ----


def noop(x):
    return None


def py_add(a, b):
    return a + b


def echo(t):
    return t


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def load(peers, seconds, window):
    """Calls the peers round robin with `window` calls in flight for `seconds`."""
    q = deque()
    done = 0
    i = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        while len(q) < window:
            q.append(rpc.rpc_async(peers[i % len(peers)], noop, args=(i,)))
            i += 1
        q.popleft().wait()
        done += 1
    while q:
        q.popleft().wait()
        done += 1
    return done, time.perf_counter() - start


# ---- the measurements, run by rank 0 of a group of 2 ----


def wanted(cfg, row):
    return not cfg.only or any(o in row for o in cfg.only)


def timed_calls(n, warmup, call):
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    return samples


def windowed(dst, n, window):
    q = deque()
    start = time.perf_counter()
    for i in range(n):
        q.append(rpc.rpc_async(dst, noop, args=(i,)))
        if len(q) >= window:
            q.popleft().wait()
    while q:
        q.popleft().wait()
    return time.perf_counter() - start


def measure(cfg):
    dst = "worker1"
    quick = cfg.quick
    # Warm the connection both ways.
    for i in range(50):
        rpc.rpc_sync(dst, noop, args=(i,))

    if wanted(cfg, "rss_idle") or wanted(cfg, "rss_after_calls"):
        progress("torch: resident memory of the idle worker")
        idle = rpc.rpc_sync(dst, rss_kib)
        emit(dict(row="rss_idle", unit="MiB", median=idle / 1024.0, n=1))
        n = cfg.memory_calls
        progress(f"torch: {n} calls for the resident memory after them")
        windowed(dst, n, WINDOW)
        after = rpc.rpc_sync(dst, rss_kib)
        emit(dict(row="rss_after_calls", unit="MiB", median=after / 1024.0, n=n, calls=n))

    if wanted(cfg, "rtt_noop"):
        progress("torch: round trip of a no-op (Python function)")
        n = 500 if quick else 5000
        latency_row("rtt_noop", timed_calls(n, n // 10, lambda: rpc.rpc_sync(dst, noop, args=(1,))))

    if wanted(cfg, "rtt_py_add"):
        progress("torch: round trip of a + b (Python function)")
        a, b = torch.ones(4), torch.ones(4)
        n = 500 if quick else 5000
        latency_row("rtt_py_add", timed_calls(n, n // 10, lambda: rpc.rpc_sync(dst, py_add, args=(a, b))))

    if wanted(cfg, "rtt_aten_add"):
        progress("torch: round trip of aten::add (builtin op)")
        a, b = torch.ones(4), torch.ones(4)
        n = 500 if quick else 5000
        latency_row("rtt_aten_add", timed_calls(n, n // 10, lambda: rpc.rpc_sync(dst, torch.add, args=(a, b))))

    if wanted(cfg, "async_128"):
        progress("torch: async calls with 128 in flight")
        # Five blocks; the median block's rate (as the Rust side does).
        n = 3000 if quick else 20000
        windowed(dst, n // 10, WINDOW)
        rates = sorted((n // 5) / windowed(dst, n // 5, WINDOW) for _ in range(5))
        emit(dict(row="async_128", unit="calls/s", median=rates[2], n=n))

    for row, size in ECHO_SIZES:
        if not wanted(cfg, row):
            continue
        progress(f"torch: echo of a {size} B tensor")
        t = torch.rand(size // 4)
        n = {"echo_4k": (500, 3000), "echo_1m": (100, 500), "echo_64m": (5, 20)}[row][0 if quick else 1]
        latency_row(row, timed_calls(n, max(1, n // 10), lambda: rpc.rpc_sync(dst, echo, args=(t,))), bytes=size)

    if wanted(cfg, "remote_to_here"):
        progress("torch: remote() + to_here()")
        n = 300 if quick else 2000
        latency_row("remote_to_here", timed_calls(n, n // 10, lambda: rpc.remote(dst, noop, args=(1,)).to_here()))

    for row, size, counts in [("dist_autograd_16", 16, (200, 1000)), ("dist_autograd_256", 256, (50, 200))]:
        if not wanted(cfg, row):
            continue
        progress(f"torch: distributed autograd step, {size}x{size} matmul")
        a = torch.rand(size, size, requires_grad=True)
        b = torch.rand(size, size, requires_grad=True)

        def step():
            with dist_autograd.context() as ctx:
                loss = rpc.rpc_sync(dst, torch.matmul, args=(a, b)).sum()
                dist_autograd.backward(ctx, [loss])
                grads = dist_autograd.get_gradients(ctx)
                assert len(grads) == 2

        n = counts[0] if quick else counts[1]
        latency_row(row, timed_calls(n, n // 10, step))


def main_group(rank, port, cfg):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        try:
            measure(cfg)
        except Exception as e:  # report, and still shut down
            emit({"error": f"{type(e).__name__}: {e}"})
    rpc.shutdown()


def cuda_group(rank, port, cfg):
    """cuda_echo_64m: a 64 MiB CUDA tensor echoed with the device map
    cuda:0 -> cuda:0 (responses through its inverse), each call followed by
    a device synchronisation, as the Rust side does."""
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    if rank == 0:
        opts.set_device_map("worker1", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        try:
            progress("torch: echo of a 64 MiB CUDA tensor, device map cuda:0 -> cuda:0")
            t = torch.rand((64 << 20) // 4, device="cuda:0")

            def call():
                back = rpc.rpc_sync("worker1", echo, args=(t,))
                torch.cuda.synchronize(0)
                return back

            back = call()
            if back.device != t.device or not torch.equal(back, t):
                raise RuntimeError(f"the CUDA echo returned a different tensor (on {back.device})")
            n = 5 if cfg.quick else 20
            latency_row("cuda_echo_64m", timed_calls(n, max(1, n // 10), call), bytes=64 << 20)
        except Exception as e:  # report, and still shut down
            emit({"row": "cuda_echo_64m", "na": f"failed: {type(e).__name__}: {e}"})
    rpc.shutdown()


def run_cuda(cfg, ctx):
    if not wanted(cfg, "cuda_echo_64m"):
        return
    if not torch.cuda.is_available():
        emit({"row": "cuda_echo_64m", "na": "no GPU"})
        return
    progress("torch: starting a group of 2 workers, device map cuda:0 -> cuda:0")
    mp.start_processes(cuda_group, args=(free_port(), cfg), nprocs=2, join=True, start_method="spawn")


# ---- init_rpc + shutdown, and all-to-all, each in a group of its own ----


def init_group(rank, world, ports, barrier, queue):
    for port in ports:
        barrier.wait()
        t0 = time.time()
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
        rpc.shutdown()
        queue.put((port, rank, t0, time.time()))


def all_to_all_group(rank, world, port, seconds, queue):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    peers = [f"worker{r}" for r in range(world) if r != rank]
    load(peers, 0.3, ALL_TO_ALL_WINDOW)  # warm every connection
    # Every rank starts its load right after a barrier, as the Rust side does.
    rpc.api._barrier([f"worker{r}" for r in range(world)])
    done, secs = load(peers, seconds, ALL_TO_ALL_WINDOW)
    queue.put((rank, done, secs))
    rpc.shutdown()


def run_init(cfg, ctx):
    reps = 1 if cfg.quick else 3
    for world in (2, 4, 8):
        row = f"init_w{world}"
        if not wanted(cfg, row):
            continue
        progress(f"torch: init_rpc + shutdown, world {world} ({reps} runs)")
        ports = [free_port() for _ in range(reps)]
        barrier = ctx.Barrier(world)
        queue = ctx.Queue()
        procs = [ctx.Process(target=init_group, args=(r, world, ports, barrier, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=300) for _ in range(world * reps)]
        for p in procs:
            p.join()
        samples = []
        for port in ports:
            rs = [r for r in results if r[0] == port]
            samples.append((max(r[3] for r in rs) - min(r[2] for r in rs)) * 1e9)
        latency_row(row, samples)


def run_all_to_all(cfg, ctx):
    for world in (4, 8):
        row = f"all_to_all_w{world}"
        if not wanted(cfg, row):
            continue
        seconds = 1.0 if cfg.quick else 3.0
        progress(f"torch: all-to-all, world {world}, {seconds:.0f} s")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=all_to_all_group, args=(r, world, port, seconds, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=300) for _ in range(world)]
        for p in procs:
            p.join()
        total = sum(r[1] for r in results)
        secs = max(r[2] for r in results)
        emit(dict(row=row, unit="calls/s", median=total / secs, n=total))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--only", action="append", default=[], help="rows whose id contains this text")
    ap.add_argument("--memory-calls", type=int, default=20000, help="calls before the second resident-memory reading")
    cfg = ap.parse_args()
    emit({"torch_version": torch.__version__, "pid": os.getpid()})
    ctx = mp.get_context("spawn")
    main_rows = ["rss_idle", "rss_after_calls", "rtt_noop", "rtt_py_add", "rtt_aten_add", "async_128", "remote_to_here",
                 "dist_autograd_16", "dist_autograd_256"] + [r for r, _ in ECHO_SIZES]
    if any(wanted(cfg, r) for r in main_rows):
        progress("torch: starting a group of 2 workers")
        mp.start_processes(main_group, args=(free_port(), cfg), nprocs=2, join=True, start_method="spawn")
    run_cuda(cfg, ctx)
    run_init(cfg, ctx)
    run_all_to_all(cfg, ctx)
    emit({"done": True})


if __name__ == "__main__":
    main()
