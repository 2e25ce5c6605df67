"""The batching parameter server under PyTorch: `app.py` itself, with its
imports replaced by PyTorch's (`torch.distributed.rpc`, torchvision) and
the two kit calls of its last lines left out, run by
`torch.distributed.rpc` on three processes (`server`, `trainer1`,
`trainer2`). Prints `run`'s result (each trainer's losses) as JSON, for
the test that compares it with the port's
(`host/tests/cli/pytorch_examples.rs`).

    python reference.py PORT
"""

import json
import os
import sys
import types

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))

# The kit's imports, and PyTorch's for the same names.
KIT_IMPORTS = {
    "import wasmrpc": None,
    "from wasmrpc import rpc, torch, torchvision": (
        "import torch\nimport torch.distributed.rpc as rpc\nimport torchvision"
    ),
    "from wasmrpc.torch import nn, optim": "from torch import nn, optim",
}


def load_app():
    """`app.py` as a module named `app` under PyTorch (in every process, so
    the functions RPC names by module resolve in each)."""
    lines = []
    with open(os.path.join(HERE, "app.py"), encoding="utf-8") as f:
        for line in f.read().splitlines():
            if line in KIT_IMPORTS:
                if KIT_IMPORTS[line] is not None:
                    lines.append(KIT_IMPORTS[line])
            elif line.startswith("wasmrpc."):
                continue
            else:
                lines.append(line)
    module = types.ModuleType("app")
    module.__file__ = os.path.join(HERE, "app.py")
    sys.modules["app"] = module
    exec(compile("\n".join(lines), module.__file__, "exec"), module.__dict__)  # noqa: S102 (our own file)
    return module


app = load_app()


def run(rank, port):
    import torch.distributed.rpc as rpc

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    names = ["server", "trainer1", "trainer2"]
    rpc.init_rpc(names[rank], rank=rank, world_size=len(names))
    if rank == 0:
        print(json.dumps(app.run(names[1:])), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=3, join=True)
