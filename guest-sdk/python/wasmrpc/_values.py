"""Python values to and from the world's `value` (a tree of nodes, root
first; containers name their children by index)."""

import collections
import dataclasses
import functools
import inspect

from . import _registry

FUNCTION_REF = "wasmrpc.FunctionRef"
"""The reserved record type name of a function reference: a record
`wasmrpc.FunctionRef { name: str }` whose `name` is a registered name,
qualified (`seed_fns_py::my_function`, `seed_fns_py::MyClass.method`,
`aten::add`). A function itself never crosses RPC (no pickle): only the
name it is served under, which the receiver resolves (`function_from_name`).
A Rust plugin receives it as this record and can send one."""


_Kit = collections.namedtuple(
    "_Kit", "device dtype Tensor FunctionRef Future RRef WorkerInfo Module transfer"
)

_kit = None
"""The kit's classes `_push` and `_build` tell values apart by, imported on
first use (their modules import this one) and kept: an import statement in
a function runs the import machinery on every call, which was a third of a
Python no-op call's time in the interpreter (`wasmrpc-bench anatomy
--local --call python`, under `perf`)."""


def _kit_classes():
    global _kit
    if _kit is None:
        from ._dtypes import device, dtype
        from .nn import _transfer
        from .nn.modules import Module
        from .rpc import FunctionRef, Future, RRef, WorkerInfo
        from .tensor import Tensor

        _kit = _Kit(device, dtype, Tensor, FunctionRef, Future, RRef, WorkerInfo, Module, _transfer)
    return _kit


def to_nodes(obj, types, move=False):
    """The nodes of `obj`. Tensors and RRefs go by handle; with `move`, each
    gets a handle of its own (a dup) that the receiver then owns."""
    # A scalar or a tensor is most values (a no-op's result, a loss, an
    # op's argument).
    kind = type(obj)
    if _kit is not None and kind is _kit.Tensor:
        return [types.Node_Tensor(obj._moved_handle() if move else obj._handle())]
    if kind is int:
        return [types.Node_Int(obj)]
    if kind is float:
        return [types.Node_Float(obj)]
    if obj is None:
        return [types.Node_None_()]
    nodes = []
    _push(obj, types, nodes, move, 0)
    return nodes


def _push(obj, types, nodes, move, depth):
    kit = _kit or _kit_classes()
    device, dtype, Tensor, FunctionRef, Future, RRef, WorkerInfo, _, _transfer = kit

    if depth > 128:
        raise ValueError("a value nested deeper than 128 levels")
    at = len(nodes)
    nodes.append(None)
    # The common exact types first, by identity: a failed `isinstance`
    # also looks `obj.__class__` up, and a tensor failed six of them.
    kind = type(obj)
    if kind is Tensor:
        node = types.Node_Tensor(obj._moved_handle() if move else obj._handle())
    elif kind is int:
        node = types.Node_Int(obj)
    elif kind is float:
        node = types.Node_Float(obj)
    elif obj is None:
        node = types.Node_None_()
    elif isinstance(obj, bool):
        node = types.Node_Boolean(obj)
    elif isinstance(obj, int):
        node = types.Node_Int(obj)
    elif isinstance(obj, float):
        node = types.Node_Float(obj)
    elif isinstance(obj, str):
        node = types.Node_Str(obj)
    elif isinstance(obj, (bytes, bytearray)):
        node = types.Node_Bytes(bytes(obj))
    elif isinstance(obj, Tensor):
        node = types.Node_Tensor(obj._moved_handle() if move else obj._handle())
    elif isinstance(obj, RRef):
        node = types.Node_Rref(obj._moved_handle() if move else obj._handle())
    elif isinstance(obj, WorkerInfo):
        node = types.Node_Worker(types.WorkerInfo(obj.id, obj.name))
    elif isinstance(obj, dtype):
        # aten ops take a dtype as its ScalarType code.
        node = types.Node_Int(obj.code)
    elif isinstance(obj, device):
        node = types.Node_Str(str(obj))
    elif isinstance(obj, list):
        node = types.Node_List([_push(v, types, nodes, move, depth + 1) for v in obj])
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        fields = [(f, _push(getattr(obj, f), types, nodes, move, depth + 1)) for f in obj._fields]
        node = types.Node_Record(types.RecordNode(type(obj).__name__, fields))
    elif isinstance(obj, tuple):
        node = types.Node_Tuple([_push(v, types, nodes, move, depth + 1) for v in obj])
    elif isinstance(obj, dict):
        node = types.Node_Dict(
            [
                (_push(k, types, nodes, move, depth + 1), _push(v, types, nodes, move, depth + 1))
                for k, v in obj.items()
            ]
        )
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [
            (f.name, _push(getattr(obj, f.name), types, nodes, move, depth + 1))
            for f in dataclasses.fields(obj)
        ]
        node = types.Node_Record(types.RecordNode(type(obj).__name__, fields))
    elif isinstance(obj, Record):
        fields = [(k, _push(v, types, nodes, move, depth + 1)) for k, v in obj._fields.items()]
        node = types.Node_Record(types.RecordNode(obj._name, fields))
    elif _is_module(obj) or _is_module_class(obj):
        # A module travels by value, as data (`nn/_transfer.py`).
        if isinstance(obj, type):
            name, record = _transfer.MODULE_CLASS, _transfer.class_record(obj)
        else:
            name, record = _transfer.MODULE, _transfer.to_record(obj)
        fields = [(k, _push(v, types, nodes, move, depth + 1)) for k, v in record.items()]
        node = types.Node_Record(types.RecordNode(name, fields))
    elif isinstance(obj, FunctionRef) or inspect.isroutine(obj) or isinstance(obj, functools.partial):
        name = function_ref_name(obj)
        str_at = _push(name, types, nodes, move, depth + 1)
        node = types.Node_Record(types.RecordNode(FUNCTION_REF, [("name", str_at)]))
    elif isinstance(obj, type):
        raise TypeError(
            f"cannot send the class {obj.__qualname__} over RPC: a class is not a value "
            "(make an object of a @remote_class on a worker with "
            "rpc.remote(dst, \"NAMESPACE::Class\", args) and pass its RRef)"
        )
    elif isinstance(obj, Future):
        # A future is a handle to a call in progress on this worker, not a
        # value: PyTorch refuses it with the same error, as an argument or
        # as the result of a function that is not `async_execution`.
        raise RuntimeError("Can not pickle torch.futures.Future")
    else:
        raise TypeError(f"cannot send a value of type {type(obj).__name__} over RPC")
    nodes[at] = node
    return at


def _is_module(obj):
    return isinstance(obj, (_kit or _kit_classes()).Module)


def _is_module_class(obj):
    return isinstance(obj, type) and issubclass(obj, (_kit or _kit_classes()).Module)


def _describe(fn):
    """How an error names a function: its qualified name and module."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


_ONLY_REGISTERED = (
    "only functions registered with @remote or @remote_class (a method as "
    "Class.method), or wasmrpc.torch ops, can be passed, by their registered name; "
    "a function is never pickled"
)


def function_ref_name(fn):
    """The qualified registered name `fn` is sent as, or a `TypeError`.

    - `FunctionRef`: its name (a bare one qualified as this plugin's);
    - a `@remote` function: `NAMESPACE::name`;
    - a method of a `@remote_class` taken from the class (`Class.method`,
      instance, static or class method): `NAMESPACE::Class.method`;
    - a `wasmrpc.torch` op: `aten::NAME`.

    Anything else (a lambda, an unregistered function, a method bound to an
    object, a `functools.partial`) is refused: it could only travel as
    code, and nothing is pickled."""
    if isinstance(fn, (_kit or _kit_classes()).FunctionRef):
        name = fn.__wasmrpc_name__
        return name if "::" in name else _registry.qualified(name)
    if inspect.ismethod(fn) and not isinstance(fn.__self__, type):
        # A bound method's attributes read through to its function, so it
        # would look registered; but it carries its object, which is state,
        # not a name.
        owner = type(fn.__self__).__qualname__
        raise TypeError(
            f"cannot send the bound method {_describe(fn)} over RPC: it is bound to a "
            f"{owner} object, which cannot be sent with it; pass the function from its "
            f"class ({owner}.{fn.__name__}) and the object as an RRef; {_ONLY_REGISTERED}"
        )
    ref = getattr(fn, "__wasmrpc_ref__", None)
    if isinstance(ref, str) and _registry.local_callable(ref) is not None:
        return _registry.qualified(ref)
    name = getattr(fn, "__wasmrpc_name__", None)
    if isinstance(name, str) and "::" in name:
        return name
    raise TypeError(f"cannot send the function {_describe(fn)} over RPC: {_ONLY_REGISTERED}")


def function_from_name(name):
    """The callable a function reference `name` stands for on this worker:
    this plugin's own function or class method when `name` is in its
    namespace (or bare), the kit's `wasmrpc.torch` op for `aten::NAME`,
    else a `FunctionRef` that calls it on this worker by `rpc_sync`."""
    namespace, sep, local = name.rpartition("::")
    if not sep or namespace == _registry.namespace():
        fn = _registry.local_callable(local)
        if fn is not None:
            return fn
    elif namespace == "aten":
        from . import torch as kit_torch

        # The kit's own function for the op when it has one (factories
        # take torch's arguments), else the op by name: either way the op
        # runs here under the worker's policy, without an RPC round trip.
        fn = None if "." in local else getattr(kit_torch, local, None)
        if fn is not None and getattr(fn, "__wasmrpc_name__", None) == name:
            return fn
        return kit_torch._op_function(local)
    return (_kit or _kit_classes()).FunctionRef(name)


def _function_from_record(record, child):
    fields = dict(record.fields)
    if set(fields) != {"name"}:
        raise ValueError(
            f"a {FUNCTION_REF} record has one field, `name`; got {sorted(fields)}"
        )
    name = child(fields["name"])
    if not isinstance(name, str) or not name:
        raise ValueError(f"the name of a {FUNCTION_REF} is a non-empty string, not {name!r}")
    return function_from_name(name)


class Record:
    """A named record that arrived (a Python object, dataclass or named
    tuple of the caller): its fields are attributes."""

    def __init__(self, name, fields):
        self._name = name
        self._fields = dict(fields)

    def __getattr__(self, attr):
        fields = self.__dict__.get("_fields", {})
        if attr in fields:
            return fields[attr]
        raise AttributeError(f"'{self._name}' object has no attribute '{attr}'")

    def __repr__(self):
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"{self._name}({inner})"


def from_nodes(nodes, types):
    """The Python value of `nodes`; tensors and RRefs become objects that own
    their handles."""
    if len(nodes) == 1:
        # One scalar node, most arguments: no frame of `_build` for it.
        kind = type(nodes[0])
        if kind is types.Node_Int or kind is types.Node_Float or kind is types.Node_Str:
            return nodes[0].value
    elif not nodes:
        raise ValueError("a value with no nodes")
    return _build(nodes, 0, types)


def _build(nodes, at, types):
    n = nodes[at]
    # Nodes are told apart by their exact class, not `isinstance`: each
    # failed `isinstance` also looks the object's `__class__` up, and a
    # tensor node failed eleven of them before it was found. Scalars come
    # first, before the closure containers need is made: most arguments
    # and results are one scalar node.
    kind = type(n)
    if (
        kind is types.Node_Int
        or kind is types.Node_Float
        or kind is types.Node_Str
        or kind is types.Node_Boolean
    ):
        return n.value
    if kind is types.Node_Tensor:
        return (_kit or _kit_classes()).Tensor._own(n.value)
    if kind is types.Node_None_:
        return None

    def child(i):
        if i <= at or i >= len(nodes):
            raise ValueError(f"node {at} names node {i}, not a later node")
        return _build(nodes, i, types)

    kit = _kit or _kit_classes()
    RRef, WorkerInfo, _transfer = kit.RRef, kit.WorkerInfo, kit.transfer
    if kind is types.Node_Bytes:
        return bytes(n.value)
    if kind is types.Node_List:
        return [child(i) for i in n.value]
    if kind is types.Node_Tuple:
        return tuple(child(i) for i in n.value)
    if kind is types.Node_Dict:
        return {child(k): child(v) for k, v in n.value}
    if kind is types.Node_Record:
        if n.value.name == FUNCTION_REF:
            return _function_from_record(n.value, child)
        if n.value.name in _transfer.RECORDS:
            return _transfer.from_record(n.value.name, {k: child(v) for k, v in n.value.fields})
        return Record(n.value.name, [(k, child(v)) for k, v in n.value.fields])
    if kind is types.Node_Worker:
        return WorkerInfo(n.value.id, n.value.name)
    if kind is types.Node_Rref:
        return RRef._own(n.value)
    raise TypeError(f"unknown node {n!r}")
