"""PyTorch's parameter server example under PyTorch, on the port's data:
`tests/pytorch-examples/parameter_server/rpc_parameter_server.py` imported
unmodified (torchvision stubbed: its data comes from here instead) and run
by `torch.distributed.rpc` on two processes, `parameter_server` and
`trainer_1`, on the data the port's launch section reads (`digits.py`).
Prints the original's own lines ("Rank 1 training batch ..." and
"Accuracy ...").

    python reference.py EXAMPLE_DIR DIGITS_CSV_GZ PORT
"""

import os
import sys
import types

import torch.multiprocessing as mp

import digits

# The original imports torchvision for its MNIST loaders, which this run
# replaces; nothing else of torchvision is used.
sys.modules["torchvision"] = types.SimpleNamespace(datasets=None, transforms=None)
sys.path.insert(0, sys.argv[1])
import rpc_parameter_server as example  # noqa: E402


def run(rank, data, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    if rank == 0:
        example.run_parameter_server(0, 2)
        return
    train_loader, test_loader = digits.loaders(data)
    example.run_worker(1, 2, 0, train_loader, test_loader)


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[2], sys.argv[3]), nprocs=2)
