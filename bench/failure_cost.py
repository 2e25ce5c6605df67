#!/usr/bin/env python3
"""What losing a worker costs: the demo's parameter server under `wasmrpc
launch --max-restarts 1`, beside torch.distributed.rpc's parameter server
(the same model, data and checkpoints) under `torchrun --max-restarts 1`,
each run once undisturbed and once with a trainer killed (SIGKILL) right
after the checkpoint of epoch KILL_AFTER, in one run of this script.

For each side it prints: how long the launcher took to see the failure
(kill to its first line about it), how long until the restarted group had
resumed (kill to the first epoch reported after the restart), and the time
lost (the killed run's wall time minus the undisturbed run's), and the
ratios torch / wasmrpc.

    python3 bench/failure_cost.py --wasmrpc target/debug/wasmrpc \\
        --plugin target/wasm-plugins/wasm32-unknown-unknown/release/wasmrpc_plugin_param_server.wasm

Run it with the torch venv's Python (`.wasmrpc-env/venv/bin/python`):
torchrun and torch come from there. `--torch-job` is the torch side's job
itself, which torchrun starts; it is not meant to be run by hand.
"""

import argparse
import gzip
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TRAINERS = 3
HIDDEN, BATCH, LR = 32, 16, 0.1


# --------------------------------------------------------------- torch job
def load_digits(path):
    with gzip.open(path, "rt") as f:
        rows = [[int(v) for v in line.split(",")] for line in f if line.strip()]
    return rows


def torch_job(args):
    """The torch side, one process of torchrun: rank 0 is the parameter
    server, ranks 1.. the trainers, as in PyTorch's parameter server
    tutorial (RRefs to the parameters, distributed autograd, a
    DistributedOptimizer); the server checkpoints every epoch with
    torch.save and resumes from it after a restart."""
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    rank = int(os.environ["RANK"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torch.distributed.rpc does not survive torchrun's restart on the
    # agent's store: the restarted round's init_rpc reads the failed
    # round's addresses there and its Gloo mesh fails ("Connection
    # refused"). Each round gets a store of its own, hosted by rank 0.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    port = int(os.environ["MASTER_PORT"]) + 1 + restarts
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=TRAINERS + 1,
                 rpc_backend_options=options)
    if rank == 0:
        run_server(args, restarts, torch, dist_autograd, rpc, DistributedOptimizer)
    rpc.shutdown()


class Server:
    """The parameter server's state (one per process, as the tutorial's
    global `param_server`)."""

    params = None
    lock = None


def server_params():
    return [rpc_module().RRef(p) for p in Server.params]


def rpc_module():
    import torch.distributed.rpc as rpc

    return rpc


def server_forward(x):
    import torch

    w1, b1, w2, b2 = Server.params
    return torch.relu(x @ w1 + b1) @ w2 + b2


def server_lock(acquire):
    if acquire:
        Server.lock.acquire()
    else:
        Server.lock.release()


def train_epoch(data_path, rank, epoch):
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    rows = load_digits(data_path)
    train = [r for i, r in enumerate(rows) if i % 5 != 4]
    mine = [r for j, r in enumerate(train) if j % TRAINERS == rank - 1]
    x = torch.tensor([r[:64] for r in mine], dtype=torch.float32) / 16.0
    y = torch.tensor([r[64] for r in mine])
    params = rpc.rpc_sync("worker0", server_params)
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    total = 0.0
    for start in range(0, len(mine), BATCH):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        # One step at a time on the server: an optimizer step changes the
        # parameters in place under another trainer's graph otherwise.
        rpc.rpc_sync("worker0", server_lock, args=(True,))
        try:
            with dist_autograd.context() as cid:
                out = rpc.rpc_sync("worker0", server_forward, args=(xb,))
                loss = torch.nn.functional.cross_entropy(out, yb)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
        finally:
            rpc.rpc_sync("worker0", server_lock, args=(False,))
        total += float(loss)
    return total


def run_server(args, restarts, torch, dist_autograd, rpc, DistributedOptimizer):
    import threading

    Server.lock = threading.Lock()
    ckpt = os.path.join(args.checkpoints, "torch.pt")
    first = 1
    if restarts > 0 and os.path.exists(ckpt):
        state = torch.load(ckpt)
        Server.params = [p.requires_grad_(True) for p in state["params"]]
        first = state["epoch"] + 1
        print(f"resumed from the checkpoint of epoch {state['epoch']}", flush=True)
    else:
        g = torch.Generator().manual_seed(1)
        def init(*shape, fan_in):
            bound = 1 / fan_in ** 0.5
            return ((torch.rand(*shape, generator=g) * 2 - 1) * bound).requires_grad_(True)
        Server.params = [init(64, HIDDEN, fan_in=64), init(HIDDEN, fan_in=64),
                         init(HIDDEN, 10, fan_in=HIDDEN), init(10, fan_in=HIDDEN)]
    rows = load_digits(args.data)
    test = [r for i, r in enumerate(rows) if i % 5 == 4]
    xt = torch.tensor([r[:64] for r in test], dtype=torch.float32) / 16.0
    yt = torch.tensor([r[64] for r in test])
    for epoch in range(first, args.epochs + 1):
        futs = [rpc.rpc_async(f"worker{t}", train_epoch, args=(args.data, t, epoch))
                for t in range(1, TRAINERS + 1)]
        for f in futs:
            f.wait()
        with torch.no_grad():
            acc = float((server_forward(xt).argmax(1) == yt).float().mean())
        tmp = ckpt + ".tmp"
        torch.save({"params": [p.detach() for p in Server.params], "epoch": epoch}, tmp)
        os.replace(tmp, ckpt)
        print(f"epoch {epoch}/{args.epochs} accuracy {acc:.3f}", flush=True)


# ------------------------------------------------------------------ driver
def watch(cmd, env, kill_after, checkpoint_step, kill_pid, markers):
    """Runs `cmd`; once `checkpoint_step()` reaches `kill_after` (if given),
    kills `kill_pid(proc)` with SIGKILL. Returns the wall time and, for
    each marker, the time of the first line after the kill holding it."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killed_at, seen, lines = None, {}, []
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], 0.002)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if killed_at is not None:
                for name, marker in markers.items():
                    if name not in seen and marker in line:
                        seen[name] = time.monotonic() - killed_at
        if kill_after is not None and killed_at is None and (checkpoint_step() or 0) >= kill_after:
            pid = kill_pid(proc)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        if time.monotonic() - started > 600:
            os.killpg(proc.pid, signal.SIGKILL)
            sys.exit("a run took more than 10 minutes:\n" + "".join(lines[-40:]))
    proc.wait()
    if proc.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({proc.returncode}):\n" + "".join(lines[-40:]))
    if kill_after is not None and killed_at is None:
        sys.exit("the run ended before it could be killed")
    return time.monotonic() - started, seen


def child_pid(parent, match):
    """The pid of `parent`'s child whose environment or command line holds
    `match` (bytes)."""
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            children = open(f"/proc/{parent}/task/{task}/children").read().split()
        except OSError:
            continue
        for pid in children:
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if match in env or any(match == a for a in cmdline):
                return int(pid)
    return None


def wasmrpc_side(args, ckpt, kill):
    def step():
        try:
            import json
            return json.load(open(os.path.join(ckpt, "checkpoint.json")))["step"]
        except (OSError, ValueError, KeyError):
            return None

    def trainer(proc):
        # `--name worker2` in the worker's command line.
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            for pid in open(f"/proc/{proc.pid}/task/{task}/children").read().split():
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                if b"worker2" in cmdline:
                    return int(pid)
        return None

    cmd = [args.wasmrpc, "launch", "--nproc", str(TRAINERS + 1), "--max-restarts", "1",
           "--plugins", args.plugin,
           "--grant-dir", f"param_server:/data={os.path.dirname(args.data)}:ro",
           "--grant-dir", f"param_server:/ckpt={ckpt}:rw",
           "--entry", "param_server::run", "--", str(TRAINERS), str(args.epochs)]
    env = dict(os.environ, RUST_LOG="info")
    markers = {"seen": "worker2 failed", "resumed": "resumed from the checkpoint"}
    return watch(cmd, env, args.kill_after if kill else None, step, trainer, markers)


def torch_side(args, ckpt, kill):
    def step():
        try:
            import torch
            return torch.load(os.path.join(ckpt, "torch.pt"))["epoch"]
        except Exception:  # noqa: BLE001 (absent or being replaced)
            return None

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(TRAINERS + 1), "--max-restarts",
           "1", os.path.abspath(__file__), "--torch-job", "--data", args.data,
           "--checkpoints", ckpt, "--epochs", str(args.epochs)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    markers = {"seen": "exitcode: -9", "resumed": "resumed from the checkpoint"}
    return watch(cmd, env, args.kill_after if kill else None, step,
                 lambda proc: child_pid(proc.pid, b"RANK=2"), markers)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wasmrpc", help="the wasmrpc binary")
    p.add_argument("--plugin", help="the param-server plugin (.wasm)")
    p.add_argument("--data", default=os.path.join(here, "..", "examples", "data", "digits.csv.gz"))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--kill-after", type=int, default=2,
                   help="kill a trainer once this epoch is checkpointed")
    p.add_argument("--torch-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoints", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.data = os.path.abspath(args.data)
    if args.torch_job:
        return torch_job(args)
    if not (args.wasmrpc and args.plugin):
        p.error("--wasmrpc and --plugin are required")
    results = {}
    for side, run in [("wasmrpc", wasmrpc_side), ("torch.distributed.rpc", torch_side)]:
        walls = {}
        for kill in (False, True):
            ckpt = tempfile.mkdtemp(prefix="failure-cost-")
            try:
                walls[kill] = run(args, ckpt, kill)
            finally:
                shutil.rmtree(ckpt, ignore_errors=True)
            label = "killed" if kill else "undisturbed"
            print(f"{side}: {label} run {walls[kill][0]:.2f} s", flush=True)
        seen = walls[True][1]
        results[side] = {
            "seen": seen.get("seen"),
            "resumed": seen.get("resumed"),
            "lost": walls[True][0] - walls[False][0],
        }
    print(f"\n{args.epochs} epochs, {TRAINERS} trainers, a trainer killed (SIGKILL) after "
          f"epoch {args.kill_after}'s checkpoint; seconds after the kill:")
    print(f"{'':24}{'failure seen':>14}{'resumed':>10}{'time lost':>11}")
    for side, r in results.items():
        cells = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("seen", "resumed", "lost")]
        print(f"{side:24}{cells[0]:>14}{cells[1]:>10}{cells[2]:>11}")
    w, t = results["wasmrpc"], results["torch.distributed.rpc"]
    if w["lost"] > 0 and t["lost"] is not None:
        print(f"time lost, torch / wasmrpc: {t['lost'] / w['lost']:.1f}x")


if __name__ == "__main__":
    main()
