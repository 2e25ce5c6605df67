"""The trainers' sandboxed step of the Python-driven parameter server
(`examples/python/parameter_server.py`): a two-layer MLP's cross-entropy on
one batch, with the parameters the driver sends (served as
`mlp_loss_py::batch_loss`).

The driver keeps the model (`torch.nn`) and the data; it calls this in a
distributed autograd context, so the loss it gets back carries the graph
that leads to its own parameters, and its backward pass and optimizer step
see the trainers' work as if it had been done locally.
"""

from wasmrpc import remote
from wasmrpc.nn import functional as F


@remote
def batch_loss(w1, b1, w2, b2, images, labels):
    """Mean cross-entropy of `relu(images W1^T + b1) W2^T + b2` (the
    layers of `nn.Linear`) against `labels`."""
    hidden = F.relu(F.linear(images, w1, b1))
    return F.cross_entropy(F.linear(hidden, w2, b2), labels)
