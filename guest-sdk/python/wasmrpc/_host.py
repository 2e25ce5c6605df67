"""The bridge to the worker: the world's `host` imports, called with Python
values, their errors raised as the Python classes they name.

The generated bindings (`wit_world`) exist only when componentize-py builds
the component. They are imported here, at import time: a component can
import only what its build imported (it has no files at run time). On an
ordinary Python (the build reading a plugin's manifest) they are absent,
and only calls into the worker fail.
"""

from . import _values

try:
    from componentize_py_types import Err, Ok
    from wit_world.imports import host as _wit_host
    from wit_world.imports import types as _wit_types
except ImportError:  # an ordinary Python: no worker to call
    Err = Ok = _wit_host = _wit_types = None


def bindings():
    """`(host, types)`: the world's generated modules."""
    if _wit_host is None:
        raise RuntimeError("no worker: this Python is not running inside a wasmrpc plugin")
    return (_wit_host, _wit_types)


# The Python class of each error kind of the world, in the world's order.
ERROR_CLASSES = {
    "RUNTIME_ERROR": RuntimeError,
    "VALUE_ERROR": ValueError,
    "TYPE_ERROR": TypeError,
    "TIMEOUT_ERROR": TimeoutError,
    "KEY_ERROR": KeyError,
    "INDEX_ERROR": IndexError,
    "ATTRIBUTE_ERROR": AttributeError,
    "NOT_IMPLEMENTED_ERROR": NotImplementedError,
    "ASSERTION_ERROR": AssertionError,
    "CONNECTION_ERROR": ConnectionError,
}


def raise_remote(error):
    """Raises a world `remote-error` as the Python exception it names."""
    cls = ERROR_CLASSES.get(error.kind.name, RuntimeError)
    raise cls(error.message)


# The functions below run on every host call (every op a plugin runs):
# they read the bindings' globals themselves, calling `bindings()` only for
# its error when there are none (a frame each is a few hundred
# nanoseconds in the component's interpreter).


def call(name, *args):
    """Calls the host function `name`; a `remote-error` becomes a raise."""
    host = _wit_host or bindings()[0]
    try:
        return getattr(host, name)(*args)
    except Err as e:
        raise_remote(e.value)


def call_args(args, kwargs):
    """A world `call-args` borrowing the handles in `args` and `kwargs`."""
    types = _wit_types or bindings()[1]
    to_nodes = _values.to_nodes
    return types.CallArgs(
        [to_nodes(a, types) for a in args],
        [(k, to_nodes(v, types)) for k, v in kwargs.items()] if kwargs else [],
    )


def value(obj):
    """A world `value` borrowing the handles in `obj`."""
    _, types = bindings()
    return _values.to_nodes(obj, types)


def from_value(nodes):
    """The Python value of a world `value` the host returned (its handles
    are now owned by Python objects)."""
    return _values.from_nodes(nodes, _wit_types or bindings()[1])
