"""PyTorch's parameter server example under PyTorch, on the port's data:
`tests/pytorch-examples/parameter_server/rpc_parameter_server.py` imported
unmodified (torchvision stubbed: its data comes from here instead) and run
by `torch.distributed.rpc` on two processes, `parameter_server` and
`trainer_1`, on the digits the port's launch section reads, with the same
upscaling, normalization, split and batch size. Prints the original's own
lines ("Rank 1 training batch ..." and "Accuracy ...").

    python reference.py EXAMPLE_DIR DIGITS_CSV_GZ PORT
"""

import gzip
import os
import sys
import types

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn.functional as F

# The original imports torchvision for its MNIST loaders, which this run
# replaces; nothing else of torchvision is used.
sys.modules["torchvision"] = types.SimpleNamespace(datasets=None, transforms=None)
sys.path.insert(0, sys.argv[1])
import rpc_parameter_server as example  # noqa: E402


class Loader:
    """As the port's `_Loader`: shuffled batches and `len(loader.dataset)`."""

    def __init__(self, images, labels, batch_size):
        self.dataset = labels.tolist()
        self._images, self._labels, self._batch = images, labels, batch_size

    def __iter__(self):
        order = torch.randperm(len(self.dataset))
        for i in range(0, len(self.dataset), self._batch):
            picked = order[i : i + self._batch]
            yield self._images[picked], self._labels[picked]


def digits(path):
    """As the port's `_digits`."""
    pixels, labels = [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) == 65:
                pixels.append([float(v) / 16.0 for v in fields[:64]])
                labels.append(int(float(fields[64])))
    images = torch.tensor(pixels, dtype=torch.float32).view(len(labels), 1, 8, 8)
    images = F.pad(images.repeat_interleave(3, dim=2).repeat_interleave(3, dim=3), (2, 2, 2, 2))
    return (images - 0.1307) / 0.3081, torch.tensor(labels, dtype=torch.long)


def run(rank, data, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    if rank == 0:
        example.run_parameter_server(0, 2)
        return
    images, labels = digits(data)
    train_loader = Loader(images[:1437], labels[:1437], batch_size=32)
    test_loader = Loader(images[1437:], labels[1437:], batch_size=32)
    example.run_worker(1, 2, 0, train_loader, test_loader)


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[2], sys.argv[3]), nprocs=2)
