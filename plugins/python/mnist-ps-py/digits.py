"""The data of the MNIST parameter server port: scikit-learn's 8x8 digits
(the demo's `digits.csv.gz`) in place of torchvision's MNIST, which cannot
be downloaded here. Each image is scaled up to MNIST's 28x28 and normalized
with MNIST's mean and deviation, as the original's transforms do. This one
file serves the port (`app.py`) and the original under PyTorch
(`reference.py`): the import below is the only difference."""

import gzip

try:  # in a wasmrpc plugin
    from wasmrpc import torch
except ImportError:  # under PyTorch
    import torch

F = torch.nn.functional


class Loader:
    """What the example uses of a `torch.utils.data.DataLoader`: its
    batches, in a new random order each pass, and `len(loader.dataset)`."""

    def __init__(self, images, labels, batch_size):
        self.dataset = labels.tolist()
        self._images, self._labels, self._batch = images, labels, batch_size

    def __iter__(self):
        order = torch.randperm(len(self.dataset))
        for i in range(0, len(self.dataset), self._batch):
            picked = order[i : i + self._batch]
            yield self._images[picked], self._labels[picked]


def read(path):
    """`(images, labels)`: N x 1 x 28 x 28 normalized images and labels."""
    pixels, labels = [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) == 65:
                pixels.append([float(v) / 16.0 for v in fields[:64]])
                labels.append(int(float(fields[64])))
    images = torch.tensor(pixels, dtype=torch.float32).view(len(labels), 1, 8, 8)
    # 8x8 to 28x28: each pixel three times each way, then a 2-pixel border.
    images = F.pad(images.repeat_interleave(3, dim=2).repeat_interleave(3, dim=3), (2, 2, 2, 2))
    return (images - 0.1307) / 0.3081, torch.tensor(labels, dtype=torch.long)


def loaders(path, batch_size=32):
    """The train and test loaders: the first 1437 digits, the other 360."""
    images, labels = read(path)
    return (
        Loader(images[:1437], labels[:1437], batch_size),
        Loader(images[1437:], labels[1437:], batch_size),
    )
