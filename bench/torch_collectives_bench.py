"""torch.distributed's side of `cargo xtask bench collectives`.

One rank of a Gloo process group, started once per rank by the bench
(host/c10d/benches/collectives.rs), which starts its own ranks the same way:
each rank is a process, all meet in one FileStore file, tensors are float32
on the CPU. For every (op, size) the ranks run `warmup` unmeasured calls,
then a barrier, then `iters` calls back to back; rank 0 prints one line

    RESULT <op> <bytes> <seconds per call>

where <bytes> is the size nccl-tests calls the buffer size: the tensor for
all_reduce and broadcast, the whole gathered output for all_gather, the whole
input for reduce_scatter (each rank contributes or receives bytes/world).
"""

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--file", required=True)
    p.add_argument(
        "--case",
        action="append",
        default=[],
        help="op:bytes:warmup:iters, repeatable",
    )
    a = p.parse_args()
    store = dist.FileStore(a.file, a.world)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=120),
    )
    n = a.world
    for case in a.case:
        op, nbytes, warmup, iters = case.split(":")
        nbytes, warmup, iters = int(nbytes), int(warmup), int(iters)
        elems = nbytes // 4
        if op == "all_reduce":
            t = torch.ones(elems)
            call = lambda: dist.all_reduce(t)
        elif op == "broadcast":
            t = torch.ones(elems)
            call = lambda: dist.broadcast(t, 0)
        elif op == "all_gather":
            inp = torch.ones(elems // n)
            outs = [torch.empty(elems // n) for _ in range(n)]
            call = lambda: dist.all_gather(outs, inp)
        elif op == "reduce_scatter":
            ins = [torch.ones(elems // n) for _ in range(n)]
            out = torch.empty(elems // n)
            call = lambda: dist.reduce_scatter(out, ins)
        else:
            raise SystemExit(f"unknown op {op}")
        for _ in range(warmup):
            call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        seconds = (time.perf_counter() - start) / iters
        if a.rank == 0:
            print(f"RESULT {op} {nbytes} {seconds:.9f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
