"""`torch.distributed.autograd` for plugins: `context()`, `backward`,
`get_gradients`. RPCs made while a context is open are recorded, as in
PyTorch's FAST mode."""

from .autograd import _autograd


class context:  # noqa: N801 (torch's name)
    """`with dist_autograd.context() as context_id:`."""

    def __enter__(self):
        self._id = _autograd("ContextNew")
        return self._id

    def __exit__(self, *exc):
        _autograd("ContextRelease", self._id)
        return False


def backward(context_id, roots, retain_graph=False):
    """Runs the backward pass from the scalar `roots` across workers."""
    handles = [t._handle() for t in roots]
    _autograd("DistBackward", (context_id, handles, bool(retain_graph)))


def get_gradients(context_id):
    """The context's gradients, by tensor: `grads[t]` is the gradient of the
    tensor `t` (looked up by the tensor's identity in the worker, so any
    handle to it finds it)."""
    return Gradients(_autograd("GetGradients", context_id))


class Gradients:
    """A mapping from tensors to their gradients in one context."""

    def __init__(self, triples):
        self._by_id = {ident: (t, g) for ident, t, g in triples}

    def __getitem__(self, tensor):
        return self._by_id[_autograd("Identity", tensor._handle())][1]

    def __contains__(self, tensor):
        return _autograd("Identity", tensor._handle()) in self._by_id

    def __len__(self):
        return len(self._by_id)

    def __iter__(self):
        return (t for t, _ in self._by_id.values())

    def keys(self):
        """The tensors."""
        return list(self)

    def values(self):
        """The gradients."""
        return [g for _, g in self._by_id.values()]

    def items(self):
        """`(tensor, gradient)` pairs."""
        return list(self._by_id.values())
