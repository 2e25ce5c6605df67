"""A fake worker for the kit's tests: the world's `host` functions the kit
calls, implemented in-process with real torch tensors in a handle table.

It proves the kit's Python logic (which ops it asks for, with which
arguments, and what it does with the answers), not the wasm path: no
component is built, no value crosses a real boundary, and libtorch is
reached through `torch.ops.aten` rather than the worker's shim. To keep it
honest about what the worker serves, `op` refuses any aten op outside the
default policy's families, read from `host/src/ops/family/table.rs`.

`install()` puts fake `componentize_py_types`, `wit_world`,
`wit_world.imports.host` and `wit_world.imports.types` modules in
`sys.modules`; import `wasmrpc` after it.
"""

import enum
import os
import re
import sys
import types as pytypes
from dataclasses import dataclass

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


# ---- componentize_py_types -------------------------------------------------


@dataclass
class Ok:
    value: object


class Err(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value


# ---- wit_world.imports.types ----------------------------------------------


def _variant(name):
    @dataclass
    class V:
        value: object = None

    V.__name__ = V.__qualname__ = name
    return V


T = pytypes.ModuleType("wit_world.imports.types")
for _case in ("None_", "Boolean", "Int", "Float", "Str", "Bytes", "List", "Tuple", "Dict", "Record",
              "Worker", "Tensor", "Rref"):
    setattr(T, f"Node_{_case}", _variant(f"Node_{_case}"))
for _case in ("SetRequiresGrad", "Grad", "Backward", "SetGradEnabled", "Identity", "ContextNew",
              "ContextRelease", "CurrentContext", "DistBackward", "GetGradients", "OptimizerNew",
              "OptimizerStep", "OptimizerDrop"):
    setattr(T, f"AutogradCall_{_case}", _variant(f"AutogradCall_{_case}"))


@dataclass
class RecordNode:
    name: str
    fields: list


@dataclass
class WorkerInfo:
    id: int
    name: str


@dataclass
class CallArgs:
    args: list
    kwargs: list


@dataclass
class RemoteError:
    kind: object
    message: str


@dataclass
class TensorMeta:
    dtype: object
    shape: list
    requires_grad: bool


T.RecordNode, T.WorkerInfo, T.CallArgs, T.RemoteError, T.TensorMeta = (
    RecordNode, WorkerInfo, CallArgs, RemoteError, TensorMeta)
T.ErrorKind = enum.Enum("ErrorKind", "RUNTIME_ERROR VALUE_ERROR TYPE_ERROR TIMEOUT_ERROR KEY_ERROR INDEX_ERROR "
                                     "ATTRIBUTE_ERROR NOT_IMPLEMENTED_ERROR ASSERTION_ERROR CONNECTION_ERROR")
T.Dtype = enum.Enum("Dtype", "FLOAT32 FLOAT64 FLOAT16 BFLOAT16 INT64 INT32 INT16 INT8 UINT8 BOOLEAN")
T.HandleKind = enum.Enum("HandleKind", "TENSOR RREF FUTURE")
T.RpcMode = enum.Enum("RpcMode", "SYNC ASYNC REMOTE")
T.LogLevel = enum.Enum("LogLevel", "ERROR WARN INFO DEBUG")

_TORCH_DTYPES = {
    "FLOAT32": torch.float32, "FLOAT64": torch.float64, "FLOAT16": torch.float16,
    "BFLOAT16": torch.bfloat16, "INT64": torch.int64, "INT32": torch.int32, "INT16": torch.int16,
    "INT8": torch.int8, "UINT8": torch.uint8, "BOOLEAN": torch.bool,
}
_WIT_DTYPES = {v: getattr(T.Dtype, k) for k, v in _TORCH_DTYPES.items()}


# ---- the op policy's families -----------------------------------------------


def _policy():
    """`aten` base names the default policy serves, with in-place forms."""
    text = open(os.path.join(ROOT, "host", "src", "ops", "family", "table.rs")).read()
    allowed = set()
    for block in re.findall(r"Family \{(.*?)\n    \}", text, re.S):
        if 'namespace: "aten"' not in block:
            continue
        members = re.findall(r'"([a-z0-9_]+)"', block.split("members:", 1)[1])
        allowed.update(members)
        if "in_place: true" in block:
            allowed.update(m + "_" for m in members if not m.endswith("_"))
    return allowed


# ---- the host ---------------------------------------------------------------


class FakeHost:
    """The world's `host` interface over real torch tensors."""

    def __init__(self):
        self.tensors = {}
        self.futures = {}
        self.next = 1
        self.grad_enabled = True
        self.allowed = _policy()
        self.ops = []  # every op name called, in order
        self.logs = []
        self.rpcs = []  # every (to, function) of rpc_sync, in order
        self.rrefs = {}

    # handles
    def _insert(self, t):
        h = self.next
        self.next += 1
        self.tensors[h] = t
        return h

    def _get(self, h):
        if h not in self.tensors:
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, f"no tensor handle {h}"))
        return self.tensors[h]

    # values
    def _from_nodes(self, nodes, at=0):
        n = nodes[at]
        kid = lambda i: self._from_nodes(nodes, i)  # noqa: E731
        if isinstance(n, T.Node_None_):
            return None
        if isinstance(n, (T.Node_Boolean, T.Node_Int, T.Node_Float, T.Node_Str, T.Node_Bytes)):
            return n.value
        if isinstance(n, T.Node_List):
            return [kid(i) for i in n.value]
        if isinstance(n, T.Node_Tuple):
            return tuple(kid(i) for i in n.value)
        if isinstance(n, T.Node_Dict):
            return {kid(k): kid(v) for k, v in n.value}
        if isinstance(n, T.Node_Tensor):
            return self._get(n.value)
        raise Err(RemoteError(T.ErrorKind.TYPE_ERROR, f"the fake host takes no {type(n).__name__}"))

    def _to_nodes(self, obj):
        nodes = []

        def push(o):
            at = len(nodes)
            nodes.append(None)
            if o is None:
                node = T.Node_None_()
            elif isinstance(o, bool):
                node = T.Node_Boolean(o)
            elif isinstance(o, int):
                node = T.Node_Int(o)
            elif isinstance(o, float):
                node = T.Node_Float(o)
            elif isinstance(o, str):
                node = T.Node_Str(o)
            elif isinstance(o, torch.Tensor):
                node = T.Node_Tensor(self._insert(o))
            elif isinstance(o, list):
                node = T.Node_List([push(v) for v in o])
            elif isinstance(o, tuple):
                node = T.Node_Tuple([push(v) for v in o])
            elif isinstance(o, torch.dtype):
                node = T.Node_Int({v: k for k, v in _CODES.items()}[o])
            else:
                raise Err(RemoteError(T.ErrorKind.TYPE_ERROR, f"cannot return {type(o).__name__}"))
            nodes[at] = node
            return at

        push(obj)
        return nodes

    # host functions
    def op(self, name, args):
        if not name.startswith("aten::"):
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, f"the fake host runs only aten ops, not {name}"))
        base, _, overload = name[len("aten::"):].partition(".")
        if base not in self.allowed:
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR,
                                  f"op `{name}` is not allowed by the worker's op policy"))
        self.ops.append(base)
        positional = [self._from_nodes(a) for a in args.args]
        keywords = {k: self._from_nodes(v) for k, v in args.kwargs}
        try:
            fn = getattr(torch.ops.aten, base)
            if overload:
                fn = getattr(fn, overload)
            with torch.set_grad_enabled(self.grad_enabled):
                out = fn(*positional, **keywords)
        except Err:
            raise
        except Exception as e:  # noqa: BLE001 (the worker's errors are RuntimeErrors)
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, str(e))) from e
        return self._to_nodes(out)

    def tensor_new(self, dtype, shape, data):
        d = _TORCH_DTYPES[dtype.name]
        n = 1
        for s in shape:
            n *= s
        t = torch.frombuffer(bytearray(data), dtype=d, count=n) if n else torch.empty(0, dtype=d)
        return self._insert(t.reshape(list(shape)).clone())

    def tensor_info(self, h):
        t = self._get(h)
        return TensorMeta(_WIT_DTYPES[t.dtype], list(t.shape), t.requires_grad)

    def tensor_read(self, h):
        t = self._get(h).detach().contiguous()
        return self.tensor_info(h), t.reshape(-1).view(torch.uint8).numpy().tobytes()

    def dup(self, kind, h):
        return self._insert(self._get(h))

    def drop_handle(self, kind, h):
        self.tensors.pop(h, None)

    def autograd(self, call):
        v = call.value
        case = type(call).__name__.split("_", 1)[1]
        if case == "SetRequiresGrad":
            self._get(v[0]).requires_grad_(v[1])
            return self._to_nodes(None)
        if case == "Grad":
            return self._to_nodes(self._get(v).grad)
        if case == "Backward":
            try:
                self._get(v).backward()
            except RuntimeError as e:
                raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, str(e))) from e
            return self._to_nodes(None)
        if case == "SetGradEnabled":
            prev, self.grad_enabled = self.grad_enabled, bool(v)
            return self._to_nodes(prev)
        if case == "Identity":
            return self._to_nodes(id(self._get(v)))
        raise Err(RemoteError(T.ErrorKind.NOT_IMPLEMENTED_ERROR, f"the fake host has no {case}"))

    def set_grad(self, h, g):
        t = self._get(h)
        try:
            t.grad = None if g is None else self._get(g)
        except RuntimeError as e:
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, str(e))) from e

    def log(self, level, message):
        self.logs.append((level.name, message))

    # futures: values kept as given; enough for wait_all / collect_all
    def future_new(self):
        h = self.next
        self.next += 1
        self.futures[h] = None
        return h

    def future_set(self, fut, outcome):
        self.futures[fut] = outcome

    def future_wait(self, fut):
        outcome = self.futures.get(fut)
        if outcome is None:
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, "the fake host cannot wait on an unset future"))
        if isinstance(outcome, Err):
            raise outcome
        return outcome.value

    def future_then(self, fut, function, extra):
        """The worker's `future_then`, for a future already set: calls the
        plugin's own `function` with the value and `extra` now (a callback's
        error becomes a `RuntimeError`, a failed future's error passes)."""
        from wasmrpc import _registry, _values

        outcome = self.futures.get(fut)
        if outcome is None:
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, "the fake host chains only completed futures"))
        entry = _registry.functions.get(function)
        if entry is None:
            raise Err(RemoteError(T.ErrorKind.ATTRIBUTE_ERROR, f"plugin has no function `{function}`"))
        out = self.future_new()
        if isinstance(outcome, Err):
            self.futures[out] = outcome
            return out
        args = [_values.from_nodes(n, T) for n in [outcome.value, *extra]]
        try:
            self.futures[out] = Ok(_values.to_nodes(entry[0](*args), T, move=True))
        except Exception as e:  # noqa: BLE001 (the callback's error fails the chained future)
            self.futures[out] = Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, str(e)))
        return out

    def future_done(self, fut):
        return self.futures.get(fut) is not None

    def get_worker_info(self, name):
        return WorkerInfo(0, name or "worker0")

    # rpc: the kit's own registered functions, called in this process. The
    # arguments are decoded, and the result encoded, by the kit's own
    # `_values`, so a value makes the round trip a real call makes (kit
    # nodes out, kit nodes back), without a second plugin or worker.
    def rpc_sync(self, to, function, args, timeout):
        from wasmrpc import _registry, _values

        self.rpcs.append((to, function))
        if function.startswith("aten::"):
            return self.op(function, args)
        namespace, sep, local = function.rpartition("::")
        entry = _registry.functions.get(local) if (not sep or namespace == _registry.namespace()) else None
        if entry is None:
            raise Err(RemoteError(T.ErrorKind.RUNTIME_ERROR, f"no function `{function}` on worker {to}"))
        positional = [_values.from_nodes(a, T) for a in args.args]
        keywords = {k: _values.from_nodes(v, T) for k, v in args.kwargs}
        try:
            out = entry[0](*positional, **keywords)
        except Exception as e:  # noqa: BLE001 (the callee's error goes back as its class)
            kind = {"ValueError": "VALUE_ERROR", "TypeError": "TYPE_ERROR", "KeyError": "KEY_ERROR",
                    "AttributeError": "ATTRIBUTE_ERROR"}.get(type(e).__name__, "RUNTIME_ERROR")
            raise Err(RemoteError(getattr(T.ErrorKind, kind), str(e))) from e
        return _values.to_nodes(out, T, move=True)

    # rrefs: enough for `is_owner`, `owner` and `local_value` / `to_here`
    def rref_is_owner(self, h):
        return self.rrefs[h]["owner"].name == self.get_worker_info(None).name

    def rref_owner(self, h):
        return self.rrefs[h]["owner"]

    def rref_local_object(self, h):
        # The worker answers an id only for an object of the calling
        # instance (`PluginObject::local_to`).
        return self.rrefs[h].get("local")

    def rref_to_here(self, h):
        r = self.rrefs[h]
        if r["class"] is not None:
            # The worker's `object_not_copyable` (host/src/rref/owner.rs).
            raise Err(RemoteError(T.ErrorKind.TYPE_ERROR, (
                f"to_here() of RRef {h}: it holds an object of class {r['class']} on worker "
                f"{r['owner'].name}, and objects stay on their owner; call its methods through "
                "rref.rpc_sync(), rref.rpc_async() or rref.remote(), or give the class a "
                "__getstate__ method to copy its state")))
        return self._to_nodes(r["value"])

    # test helpers
    def make_rref(self, value=None, cls=None, owner="worker0", local=None):
        """A kit `RRef` owned by worker `owner` (rank 1 unless `worker0`,
        this worker) holding `value`, or an object of plugin class `cls`;
        `local`, the object's id when it lives in this instance (the worker
        runs the call beside it)."""
        from wasmrpc.rpc import RRef

        h = self.next
        self.next += 1
        self.rrefs[h] = {"owner": WorkerInfo(0 if owner == "worker0" else 1, owner), "value": value,
                         "class": cls, "local": local}
        return RRef._own(h)

    def to_kit(self, t):
        """A kit `Tensor` for the torch tensor `t` (shared, not copied)."""
        from wasmrpc.tensor import Tensor

        return Tensor._own(self._insert(t))

    def to_torch(self, kit_tensor):
        """The torch tensor behind a kit `Tensor`."""
        return self._get(kit_tensor._handle())


_CODES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
          6: torch.float32, 7: torch.float64, 11: torch.bool, 15: torch.bfloat16}

HOST = None


def install():
    """Installs the fake modules (once) and returns the `FakeHost`."""
    global HOST
    if HOST is not None:
        return HOST
    HOST = FakeHost()
    cpt = pytypes.ModuleType("componentize_py_types")
    cpt.Ok, cpt.Err = Ok, Err
    world = pytypes.ModuleType("wit_world")
    imports = pytypes.ModuleType("wit_world.imports")
    host_mod = pytypes.ModuleType("wit_world.imports.host")
    for name in dir(HOST):
        if not name.startswith("_") and name not in ("to_kit", "to_torch", "make_rref"):
            setattr(host_mod, name, getattr(HOST, name))
    imports.host, imports.types, world.imports = host_mod, T, imports
    sys.modules.update({
        "componentize_py_types": cpt,
        "wit_world": world,
        "wit_world.imports": imports,
        "wit_world.imports.host": host_mod,
        "wit_world.imports.types": T,
    })
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
    return HOST
