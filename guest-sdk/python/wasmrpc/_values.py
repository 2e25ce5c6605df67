"""Python values to and from the world's `value` (a tree of nodes, root
first; containers name their children by index)."""

import dataclasses


def to_nodes(obj, types, move=False):
    """The nodes of `obj`. Tensors and RRefs go by handle; with `move`, each
    gets a handle of its own (a dup) that the receiver then owns."""
    nodes = []
    _push(obj, types, nodes, move, 0)
    return nodes


def _push(obj, types, nodes, move, depth):
    from ._dtypes import device, dtype
    from .tensor import Tensor
    from .rpc import Future, RRef, WorkerInfo

    if depth > 128:
        raise ValueError("a value nested deeper than 128 levels")
    at = len(nodes)
    nodes.append(None)
    if obj is None:
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
    elif isinstance(obj, Future):
        # A future is a handle to a call in progress on this worker, not a
        # value: PyTorch refuses it with the same error, as an argument or
        # as the result of a function that is not `async_execution`.
        raise RuntimeError("Can not pickle torch.futures.Future")
    else:
        raise TypeError(f"cannot send a value of type {type(obj).__name__} over RPC")
    nodes[at] = node
    return at


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
    if not nodes:
        raise ValueError("a value with no nodes")
    return _build(nodes, 0, types)


def _build(nodes, at, types):
    from .tensor import Tensor
    from .rpc import Future, RRef, WorkerInfo

    n = nodes[at]

    def child(i):
        if i <= at or i >= len(nodes):
            raise ValueError(f"node {at} names node {i}, not a later node")
        return _build(nodes, i, types)

    if isinstance(n, types.Node_None_):
        return None
    if isinstance(n, (types.Node_Boolean, types.Node_Int, types.Node_Float, types.Node_Str)):
        return n.value
    if isinstance(n, types.Node_Bytes):
        return bytes(n.value)
    if isinstance(n, types.Node_List):
        return [child(i) for i in n.value]
    if isinstance(n, types.Node_Tuple):
        return tuple(child(i) for i in n.value)
    if isinstance(n, types.Node_Dict):
        return {child(k): child(v) for k, v in n.value}
    if isinstance(n, types.Node_Record):
        return Record(n.value.name, [(k, child(v)) for k, v in n.value.fields])
    if isinstance(n, types.Node_Worker):
        return WorkerInfo(n.value.id, n.value.name)
    if isinstance(n, types.Node_Tensor):
        return Tensor._own(n.value)
    if isinstance(n, types.Node_Rref):
        return RRef._own(n.value)
    raise TypeError(f"unknown node {n!r}")
