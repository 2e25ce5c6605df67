"""`torch`-like functions for plugins: `torch.ones(2, 2)`, `torch.add(a,
b)`, `torch.tensor([...])`, and any `aten::` op by its name
(`torch.matmul`, `torch.relu`, ...). Every one runs in the worker. Each
function also names its op for RPC: `rpc_sync(dst, torch.add, args=(t,
1))` calls `aten::add` there."""

from .tensor import Tensor, op, tensor

__all__ = ["Tensor", "ones", "rand", "tensor", "zeros"]


def _size(size):
    if len(size) == 1 and isinstance(size[0], (list, tuple)):
        return list(size[0])
    return list(size)


def ones(*size, **kwargs):
    """`torch.ones(2, 2)` (float32)."""
    return op("aten::ones", _size(size), **kwargs)


def zeros(*size, **kwargs):
    """`torch.zeros(2, 2)` (float32)."""
    return op("aten::zeros", _size(size), **kwargs)


def rand(*size, **kwargs):
    """`torch.rand(2, 2)` (needs the worker to allow random ops)."""
    return op("aten::rand", _size(size), **kwargs)


for _f, _name in ((ones, "ones"), (zeros, "zeros"), (rand, "rand")):
    _f.__wasmrpc_name__ = f"aten::{_name}"


def __getattr__(name):
    if name.startswith("_"):
        raise AttributeError(name)

    def fn(*args, **kwargs):
        return op(f"aten::{name}", *args, **kwargs)

    fn.__name__ = name
    fn.__wasmrpc_name__ = f"aten::{name}"
    return fn
