"""`torch.distributed`'s RPC-side modules: `autograd` and `optim`."""

from . import autograd, optim  # noqa: F401

__all__ = ["autograd", "optim"]
