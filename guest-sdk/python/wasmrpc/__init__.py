"""wasmrpc's Python guest kit: write the functions a PyTorch RPC user
already has, run them in a sandbox on any worker.

```python
from wasmrpc import remote, rpc, torch

@remote
def my_py_add(a, b):
    return a + b

@remote
def nested_rpc(dst):
    return rpc.rpc_sync(dst, torch.add, args=(torch.ones(2, 2), 1))
```

- `@remote` registers a function under its name (`NAMESPACE::my_py_add`);
  `@remote(async_execution=True)` one that returns a `rpc.Future`.
- `@remote_class` registers a class whose objects live in RRefs on their
  owner (`rpc.remote(dst, "NAMESPACE::MyClass", args)`), methods called
  through RRef proxies; `@async_execution` (also
  `rpc.functions.async_execution`) marks a method returning a `Future`.
- A registered function (`@remote`, `MyClass.method` of a `@remote_class`,
  a `wasmrpc.torch` op) can be an RPC argument: it travels as a reference
  to its registered name (`rpc.FunctionRef`), never as code.
- `Tensor` is a handle to a tensor of the worker; `a + b`, `a @ b`,
  `a.sum()` and every `aten::` op by name run there, under the worker's op
  policy. `wasmrpc.torch` speaks PyTorch: dtypes, factories, indexing,
  `torch.nn` (modules, layers, losses, `functional`, `init`), `torch.optim`
  (local SGD/Adam/AdamW), `torch.futures`, and any `aten::` op by name.
- Errors raised by the worker arrive as their Python classes (`ValueError`,
  `RuntimeError`, `TimeoutError`, ...); a plugin's own `ValueError` reaches
  its caller as a `ValueError`.
- Files only in the folders the worker's operator granted the plugin
  (`--grant-dir`): `open()` works there; `wasmrpc.save` and `wasmrpc.load`
  write and read tensors (safetensors; `.npy`/`.npz` read), never a pickle.
- No pickle, network, environment or time of day: what a plugin can do is
  what the world `guest-sdk/wit/plugin.wit` imports.

Build with `wasmrpc plugin build-py DIR` (or `cargo xtask build-py DIR`).
"""

from . import dist_autograd, futures, nn, optim, profiler, progress, rpc, torch
from ._registry import permissions
from ._values import Record
from .autograd import no_grad
from .rpc import Future, RRef, WorkerInfo, get_worker_info
from .state import get_global, lock, log, set_global, sleep
from .files import load, load_with_metadata, save, write_file
from .tensor import Tensor

__all__ = [
    "Future",
    "RRef",
    "Record",
    "Tensor",
    "WorkerInfo",
    "async_execution",
    "export_module",
    "single_instance",
    "dist_autograd",
    "futures",
    "get_global",
    "get_worker_info",
    "load",
    "load_with_metadata",
    "lock",
    "log",
    "nn",
    "no_grad",
    "optim",
    "profiler",
    "progress",
    "permissions",
    "remote",
    "remote_class",
    "rpc",
    "save",
    "set_global",
    "sleep",
    "torch",
    "write_file",
]

from types import FunctionType as _FunctionType

from . import _registry
from .rpc.functions import async_execution


def remote(fn=None, *, async_execution=False, name=None):
    """Registers a function of the plugin, served as `NAMESPACE::name`.

    It is async (returns a `Future`) with `async_execution=True` or when
    `@rpc.functions.async_execution` marks it (above or below `@remote`)."""

    def register(f):
        key = name or f.__name__
        if key.startswith("_wasmrpc"):
            raise ValueError(f"@remote name {key!r}: names starting with `_wasmrpc` are the kit's own")
        is_async = bool(async_execution) or getattr(f, "__wasmrpc_async__", False)
        _registry.functions[key] = (f, is_async, _registry.params_of(f))
        f.__wasmrpc_name__ = key
        # Its name within the plugin, for passing it as an RPC argument
        # (a function reference, see `_values`).
        f.__wasmrpc_ref__ = key
        return f

    return register(fn) if fn is not None else register


def remote_class(cls=None, *, name=None):
    """Registers a class: `remote(dst, "NAMESPACE::Class", args)` makes an
    object on `dst`; its public methods are served through RRef proxies,
    one call at a time; its static and class methods also as functions
    `Class.method`."""

    def register(c):
        key = name or c.__name__
        methods = {}
        for attr, member in vars(c).items():
            if attr.startswith("_"):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                # Served as a function `Class.method`, and through proxies
                # like any method. `@staticmethod` over `@async_execution`
                # marks the function inside (the other order is refused
                # by `async_execution` itself).
                f = member.__get__(None, c)
                is_async = getattr(member.__func__, "__wasmrpc_async__", False)
                params = _registry.params_of(f)
                _registry.functions[f"{key}.{attr}"] = (f, is_async, params)
                methods[attr] = (is_async, params)
                member.__func__.__wasmrpc_ref__ = f"{key}.{attr}"
            elif callable(member):
                is_async = getattr(member, "__wasmrpc_async__", False)
                methods[attr] = (is_async, _registry.params_of(member, skip_self=True))
                if isinstance(member, _FunctionType):
                    # `Class.method` can then be passed as an RPC argument,
                    # by this name (a function reference, see `_values`).
                    member.__wasmrpc_ref__ = f"{key}.{attr}"
        init = c.__init__ if "__init__" in vars(c) else None
        ctor = _registry.params_of(init, skip_self=True) if init else []
        _registry.classes[key] = (c, ctor, methods)
        c.__wasmrpc_name__ = key
        return c

    return register(cls) if cls is not None else register


def single_instance():
    """Runs this plugin in one instance per worker: every call of it on a
    worker runs there, one at a time, so module-level state (a global
    object, a cache, a lock) is shared by all of them, as in one Python
    process, and a `Tensor` kept in a global stays valid across calls. A
    function called by `rpc.remote()` that returns an object of one of the
    plugin's classes hands the object itself to the RRef (PyTorch's
    `rpc.remote(ps, get_parameter_server)`); `rpc_sync` of it raises
    `TypeError`, as an object is never copied (no pickle).
    `rpc.RRef(obj)` of one of its objects holds the object itself. While a
    call waits on a future (`Future.wait`, `wait_all`, `rpc_sync`,
    `to_here`), the plugin's other calls on the worker run in the instance,
    as a Python process's other threads would; a call waiting in `sleep`
    or a lock holds the instance. Call it at module level."""
    _registry.plugin["single_instance"] = True


def export_module(module):
    """Registers every function and class `module` defines (not the names it
    imports), as `@remote` and `@remote_class` would, and returns how many:
    PyTorch code ported as it is written carries no decorators, and
    `export_module(__name__)` (or `export_module(rnn)` for a module it
    imports) serves it. Every function of the module becomes callable by
    any peer that may call the plugin, so export only modules written to be
    called remotely. A name another function or class already holds raises
    `ValueError`."""
    import inspect
    import sys

    if isinstance(module, str):
        module = sys.modules[module]
    count = 0
    for attr, member in list(vars(module).items()):
        if getattr(member, "__module__", None) != module.__name__ or getattr(member, "__name__", None) != attr:
            continue  # imported, or an alias
        if inspect.isclass(member):
            table, register = _registry.classes, remote_class
        elif isinstance(member, _FunctionType):
            table, register = _registry.functions, remote
        else:
            continue
        held = table.get(attr)
        if held is not None:
            if held[0] is member:
                continue  # decorated already
            raise ValueError(
                f"export_module({module.__name__}): `{attr}` is already registered by "
                f"{getattr(held[0], '__module__', '?')}.{attr}"
            )
        register(member)
        count += 1
    return count
