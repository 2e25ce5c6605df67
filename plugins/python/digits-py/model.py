"""PyTorch's parameter server tutorial's model and training loop, and an
LSTM model, as PyTorch users write them. This one file runs both in a
wasmrpc Python plugin (`app.py` imports it) and under real PyTorch
(`reference.py`): the only difference is the import below.

Adapted to scikit-learn's 8x8 digits (the tutorial trains on 28x28 MNIST,
which cannot be downloaded here): the first linear layer takes the 2x2x64
features an 8x8 image leaves after the convolutions and the pooling
(torch's tutorial has 9216 for 28x28).
"""

try:  # in a wasmrpc plugin
    from wasmrpc import torch
except ImportError:  # under PyTorch
    import torch

nn = torch.nn
F = torch.nn.functional
optim = torch.optim


class Net(nn.Module):
    """The tutorial's CNN."""

    def __init__(self, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout2d(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


class RowLSTM(nn.Module):
    """An LSTM reading an image row by row (8 steps of 8 pixels)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 10)

    def forward(self, x):
        rows = x.view(x.shape[0], 8, 8)
        output, (h, c) = self.lstm(rows)
        return F.log_softmax(self.fc(output[:, -1, :]), dim=1)


def make_model(name, dropout=True):
    """`"cnn"` or `"lstm"`."""
    if name == "cnn":
        return Net(dropout)
    if name == "lstm":
        return RowLSTM()
    raise ValueError(f"unknown model {name!r}")


def read_digits(path):
    """`(images, labels)`: rows of 64 pixels scaled to 0..1 (N x 1 x 8 x 8)
    and digit labels, from a CSV of 64 pixel columns and a label column."""
    pixels, labels = [], []
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) != 65:
                continue
            pixels.append([float(v) / 16.0 for v in fields[:64]])
            labels.append(int(float(fields[64])))
    images = torch.tensor(pixels, dtype=torch.float32).view(len(labels), 1, 8, 8)
    return images, torch.tensor(labels, dtype=torch.long)


def train(model, images, labels, epochs, lr, batch_size=64):
    """The tutorial's loop (locally): SGD, `F.nll_loss`, `backward`, `step`,
    batches in order. Returns the mean loss of each epoch."""
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    n = labels.shape[0]
    for _ in range(epochs):
        model.train()
        total, batches = 0.0, 0
        for i in range(0, n, batch_size):
            data, target = images[i : i + batch_size], labels[i : i + batch_size]
            optimizer.zero_grad()
            model_output = model(data)
            loss = F.nll_loss(model_output, target)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        losses.append(total / batches)
    return losses


def accuracy(model, images, labels):
    """The share of `images` the model classifies right."""
    model.eval()
    with torch.no_grad():
        predicted = model(images).argmax(dim=1)
        return (predicted == labels).float().mean().item()
