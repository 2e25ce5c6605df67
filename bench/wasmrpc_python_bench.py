#!/usr/bin/env python3
"""The Python-program rows of `wasmrpc-bench`: wasmrpc's Python package
(`host/python`) called from a Python process, measured as
`bench/torch_rpc_bench.py` measures torch.distributed.rpc from Python.

Started by `wasmrpc-bench` with the set-up's interpreter and the package
on `PYTHONPATH` (a release build of the extension module). It starts a
second Python process that joins as rank 1 and serves builtin ops; rank 0
(this process) measures, with the torch script's repetition counts:

- `py_rtt_aten_add`: `rpc_sync(peer, torch.add, args=(a, b))` on two
  4-element tensors (torch: `rtt_aten_add`);
- `py_echo_64m`: a 64 MiB tensor sent and returned (`aten::detach`, which
  returns its argument's storage; torch: `echo_64m`, a Python function
  returning its argument).

Output: one JSON line per row, as the torch script writes them.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch

# The torch script's measuring and reporting, so both sides count alike.
from torch_rpc_bench import emit, latency_row, timed_calls
from wasmrpc import rpc


# Two processes of one host, as `torchrun --nproc-per-node 2` would start
# them: each sizes its runtime to its share of the cores (the workers of
# our Rust rows get the same share).
os.environ["LOCAL_WORLD_SIZE"] = "2"


def options(init_method):
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=120)


def serve(init_method):
    rpc.init_rpc("peer", rank=1, world_size=2, rpc_backend_options=options(init_method))
    rpc.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--serve", metavar="INIT_METHOD", help=argparse.SUPPRESS)
    # The bench passes it to every script; these rows read no memory.
    ap.add_argument("--memory-calls", type=int, help=argparse.SUPPRESS)
    cfg = ap.parse_args()
    if cfg.serve:
        serve(cfg.serve)
        return
    wanted = lambda row: not cfg.only or row in cfg.only  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        peer = subprocess.Popen([sys.executable, __file__, "--serve", init_method])
        rpc.init_rpc("driver", rank=0, world_size=2, rpc_backend_options=options(init_method))
        try:
            if wanted("py_rtt_aten_add"):
                emit({"progress": "wasmrpc from Python: round trip of aten::add"})
                a, b = torch.rand(4), torch.rand(4)
                n = 1000 if cfg.quick else 5000
                latency_row(
                    "py_rtt_aten_add",
                    timed_calls(n, n // 10, lambda: rpc.rpc_sync("peer", torch.add, args=(a, b))),
                )
            if wanted("py_echo_64m"):
                emit({"progress": "wasmrpc from Python: echo of a 64 MiB tensor"})
                t = torch.rand((64 << 20) // 4)
                back = rpc.rpc_sync("peer", "aten::detach", args=(t,))
                if not torch.equal(back, t):
                    raise RuntimeError("the echo returned a different tensor")
                n = 5 if cfg.quick else 20
                latency_row(
                    "py_echo_64m",
                    timed_calls(n, max(1, n // 10), lambda: rpc.rpc_sync("peer", "aten::detach", args=(t,))),
                    bytes=64 << 20,
                )
        except Exception as e:  # noqa: BLE001 (reported; the group still shuts down)
            emit({"error": f"{type(e).__name__}: {e}"})
        finally:
            rpc.shutdown()
            peer.wait(timeout=60)


if __name__ == "__main__":
    main()
