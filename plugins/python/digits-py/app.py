"""`model.py`'s models trained in a plugin, for the parity test with
PyTorch (`tests/all/python_plugins/pytorch_parity.rs`): the operator
grants the data at `/data` and the initial weights at `/init`
(safetensors files written by `reference.py` under real PyTorch)."""

import wasmrpc
from wasmrpc import remote

import model as m


@remote
def train(name, epochs, lr, dropout=False):
    """Trains model `name` (`"cnn"` or `"lstm"`) from `/init/<name>.safetensors`
    on `/data/digits.csv`: `(per-epoch losses, accuracy on the data)`."""
    model = m.make_model(name, dropout)
    model.load_state_dict(wasmrpc.load(f"/init/{name}.safetensors"))
    images, labels = m.read_digits("/data/digits.csv")
    losses = m.train(model, images, labels, epochs, lr)
    return losses, m.accuracy(model, images, labels)
