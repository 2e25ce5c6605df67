"""Tensor files in the folders the worker's operator granted the plugin
(`wasmrpc worker --grant-dir NAMESPACE:/GUEST=HOST[:ro|:rw]`).

Plain files need nothing from this module: inside a granted folder,
Python's own `open()`, `os.listdir()` and `csv` work as usual (WASI
preopens), and everything outside the granted folders is refused.

Tensors are saved as safetensors (what `safetensors.torch.load_file`
reads) and loaded from safetensors, NumPy `.npy` and `.npz` files, by the
worker. No pickle is ever loaded: a `torch.save` file is refused with how
to convert it.

```python
import wasmrpc
from wasmrpc import torch

wasmrpc.save({"w": torch.ones(2, 2)}, "/ckpt/model.safetensors")
state = wasmrpc.load("/ckpt/model.safetensors")   # {"w": Tensor}
```

A grant with a quota is read-only to `open()` (the sandbox cannot count
the bytes it writes): write there with `wasmrpc.save` and
`wasmrpc.write_file`, which the worker counts against the quota.
"""

from . import _host
from .tensor import Tensor


def save(tensors, path, metadata=None):
    """Saves a dict of name to `Tensor` (a `state_dict`) to the
    safetensors file `path`, atomically, with optional string metadata
    (as `safetensors.torch.save_file(tensors, path, metadata)`)."""
    if not isinstance(tensors, dict):
        raise TypeError(
            f"save takes a dict of name to Tensor (a state_dict), not {type(tensors).__name__}"
        )
    pairs = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names are strings, not {type(name).__name__}")
        if not isinstance(t, Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a Tensor")
        pairs.append((name, t._handle()))
    meta = [(str(k), str(v)) for k, v in (metadata or {}).items()]
    _host.call("save_tensors", str(path), pairs, meta)


def load(path):
    """Every tensor of the safetensors, `.npy` or `.npz` file `path`, as a
    dict of name to `Tensor` in the file's order (an `.npy` file's one
    tensor is named after the file)."""
    return load_with_metadata(path)[0]


def load_with_metadata(path):
    """`(tensors, metadata)`: `load(path)` and the file's string metadata."""
    pairs, meta = _host.call("load_tensors", str(path))
    return ({name: Tensor._own(h) for name, h in pairs}, dict(meta))


def write_file(path, data):
    """Writes `data` (bytes or str) to the file `path` in a granted folder,
    atomically; counted against the grant's quota."""
    if isinstance(data, str):
        data = data.encode()
    _host.call("write_file", str(path), bytes(data))
