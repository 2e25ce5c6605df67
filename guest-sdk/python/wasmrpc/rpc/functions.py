"""`torch.distributed.rpc.functions` for plugins: `async_execution`.

```python
from wasmrpc import remote, remote_class, rpc
from wasmrpc.rpc import functions

@remote
@functions.async_execution
def async_add(to, x, y):
    return rpc.rpc_async(to, torch.add, args=(x, y))

@remote_class
class AsyncExecutionClass:
    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        ...
```

As in PyTorch, `@staticmethod` / `@classmethod` go *above*
`@async_execution`; the other order is refused when the module is
imported (the build reads the manifest that way), rather than silently
registering a method that is not async.
"""

from .. import _registry

__all__ = ["async_execution"]


def async_execution(fn):
    """Marks a function or `@remote_class` method that returns a `Future`:
    the call completes when that future does, as
    `@torch.distributed.rpc.functions.async_execution`.

    Works above or below `@remote` on a function (a function `@remote`
    already registered is switched to async), and below `@staticmethod` /
    `@classmethod` in a class."""
    if isinstance(fn, (staticmethod, classmethod)):
        # `@async_execution` over `@staticmethod` would mark the wrapper,
        # which `@remote_class` unwraps: the method would be served as a
        # plain function. PyTorch documents the other order; name it.
        kind = type(fn).__name__
        name = getattr(fn.__func__, "__qualname__", repr(fn.__func__))
        raise TypeError(
            f"@async_execution is applied to a {kind} ({name}): put @{kind} above "
            f"@rpc.functions.async_execution (@{kind} first, then @async_execution, "
            "then def), as PyTorch requires"
        )
    if not callable(fn):
        raise TypeError(f"@async_execution takes a function, not {type(fn).__name__}")
    fn.__wasmrpc_async__ = True
    # `@async_execution` above `@remote`: the function is already in the
    # registry as a plain function; make its entry async.
    key = getattr(fn, "__wasmrpc_ref__", None)
    entry = _registry.functions.get(key) if key is not None else None
    if entry is not None and entry[0] is fn:
        _registry.functions[key] = (fn, True, entry[2])
    return fn
