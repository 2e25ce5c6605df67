"""A plugin's functions and classes as objects a Python program can call
and pass, read from the plugin file (nothing is compiled or run here).

```python
import wasmrpc
from wasmrpc import rpc

seed = wasmrpc.plugin("target/wasm-plugins/python/seed-fns-py.wasm")
rpc.rpc_sync("worker1", seed.my_tensor_function, args=(a, b))     # seed_fns_py::my_tensor_function
acc = rpc.remote("worker1", seed.Accumulator, args=(10,))          # an object on worker1
rpc.rpc_sync("worker1", seed._call_method, args=(seed.Accumulator.add, acc, 5))
```

A `FunctionRef` is a registered name: called by RPC it runs that
function; passed as an argument it travels as a reference to the name (the
guest kit's `FunctionRef` record), which the receiver resolves among what
it serves. A name the plugin does not export is an `AttributeError` that
lists what it has.
"""

from . import _native

FUNCTION_REF = "wasmrpc.FunctionRef"
"""The record a function reference travels as (the kit's name for it)."""


class FunctionRef:
    """A function registered under `name` (`"plugin::function"`,
    `"plugin::Class.method"`, `"aten::add"`)."""

    __slots__ = ("__wasmrpc_name__",)

    def __init__(self, name):
        if not isinstance(name, str) or "::" not in name:
            raise ValueError(f"a registered name is `namespace::name`, not {name!r}")
        self.__wasmrpc_name__ = name

    @property
    def __name__(self):
        return self.__wasmrpc_name__.rsplit("::", 1)[1].rsplit(".", 1)[-1]

    def __eq__(self, other):
        return isinstance(other, FunctionRef) and other.__wasmrpc_name__ == self.__wasmrpc_name__

    def __hash__(self):
        return hash(self.__wasmrpc_name__)

    def __repr__(self):
        return f"FunctionRef({self.__wasmrpc_name__!r})"

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"{self.__wasmrpc_name__} runs on a worker that serves it: call it with "
            "rpc.rpc_sync(worker, ref, args), not here"
        )


class PluginClass(FunctionRef):
    """A plugin class: `rpc.remote(worker, cls, args)` makes an object on
    that worker; `cls.method` is a reference to a method."""

    __slots__ = ("_methods",)

    def __init__(self, name, methods):
        super().__init__(name)
        self._methods = tuple(methods)

    def __getattr__(self, method):
        if method.startswith("__") or method not in self._methods:
            raise AttributeError(
                f"{self.__wasmrpc_name__} has no method {method!r}; it has: "
                + (", ".join(self._methods) or "none")
            )
        return FunctionRef(f"{self.__wasmrpc_name__}.{method}")


class Plugin:
    """What the plugin file at `path` exports, under the namespace workers
    serve it as."""

    def __init__(self, path):
        namespace, functions, classes = _native.plugin_exports(str(path))
        self.namespace = namespace
        self._functions = tuple(functions)
        self._classes = dict(classes)

    def __getattr__(self, name):
        if name in self._functions:
            return FunctionRef(f"{self.namespace}::{name}")
        if name in self._classes:
            return PluginClass(f"{self.namespace}::{name}", self._classes[name])
        raise AttributeError(
            f"plugin {self.namespace} exports no {name!r}; it has: "
            + ", ".join(sorted(self._functions + tuple(self._classes)))
        )

    def __dir__(self):
        return sorted(self._functions + tuple(self._classes))

    def __repr__(self):
        return f"<plugin {self.namespace}: {len(self._functions)} functions, {len(self._classes)} classes>"


def plugin(path):
    """The plugin file at `path` (a `.wasm` a worker serves), for naming
    its functions and classes."""
    return Plugin(path)
