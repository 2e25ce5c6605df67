"""How a `Module` travels over RPC: by value, as PyTorch pickles one
(`return self.model` from a remote call gives the caller a copy), but as
data only, never code.

A module is the record `wasmrpc.Module`:

- `class`: where its class is defined, `"module:QualName"`; the receiver
  finds the class among the modules its plugin has already imported (its
  own files, the kit's layers, `wasmrpc.torchvision`), and it must be a
  subclass of `nn.Module`; nothing is imported and no constructor runs;
- `parameters`: name to `wasmrpc.Parameter { data, requires_grad }` (or
  `None`), in registration order, so `parameters()` lists them in the
  sender's order;
- `buffers`, `modules` (children, by the same rule), `non_persistent`,
  `training`;
- `attributes`: the module's other attributes (sizes, flags, ...), which
  must be data: a function among them is refused on both sides (the
  receiver would run it when the module runs), while a `Module` class (a
  layer factory such as torchvision's `norm_layer`) travels as the record
  `wasmrpc.ModuleClass { class }`, found by the same rule.

What a hostile sender can do is therefore bounded: name a module class
the receiver already has, with tensors and plain values for its state.
"""

import sys

MODULE = "wasmrpc.Module"
PARAMETER = "wasmrpc.Parameter"
MODULE_CLASS = "wasmrpc.ModuleClass"
RECORDS = (MODULE, PARAMETER, MODULE_CLASS)

_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent", "training")


def class_name(cls):
    """`"module:QualName"` of a `Module` class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def find_class(name):
    """The `Module` class `name` (`"module:QualName"`) names among the
    modules already imported here, or a `ValueError` that says why not."""
    from .modules import Module

    module_name, sep, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not sep or not module_name or not qualname:
        raise ValueError(f"a module's class is named \"module:QualName\", not {name!r}")
    found = sys.modules.get(module_name)
    for part in qualname.split("."):
        if found is None or part.startswith("__") or "<" in part:
            found = None
            break
        found = getattr(found, part, None)
    if not (isinstance(found, type) and issubclass(found, Module)):
        raise ValueError(
            f"a module of class {name} arrived, which this plugin does not have (the class "
            "must be an nn.Module defined in a file the plugin has imported)"
        )
    return found


def to_record(module):
    """The fields of `module`'s `wasmrpc.Module` record (values the caller
    encodes as usual)."""
    from ..rpc import FunctionRef
    from .._values import Record

    d = module.__dict__
    attributes = {}
    for key, value in d.items():
        if key in _TABLES:
            continue
        if callable(value) and not isinstance(value, type) or isinstance(value, FunctionRef):
            raise TypeError(
                f"cannot send the {type(module).__name__} module over RPC: its attribute "
                f"{key!r} is a function, and a module travels as data only"
            )
        attributes[key] = value
    return {
        "class": class_name(type(module)),
        "parameters": {
            k: None if p is None else Record(PARAMETER, [("data", p), ("requires_grad", p.requires_grad)])
            for k, p in d["_parameters"].items()
        },
        "buffers": dict(d["_buffers"]),
        "modules": dict(d["_modules"]),
        "non_persistent": sorted(d.get("_non_persistent", ())),
        "training": bool(d.get("training", True)),
        "attributes": attributes,
    }


def class_record(cls):
    """The fields of the `wasmrpc.ModuleClass` record of `cls`."""
    return {"class": class_name(cls)}


def _check_names(table, what, where):
    if not isinstance(table, dict):
        raise ValueError(f"{where}: its {what} are a dict, not {type(table).__name__}")
    for k in table:
        if not isinstance(k, str) or not k or k.startswith("__"):
            raise ValueError(f"{where}: {k!r} is not a name for one of its {what}")


def from_record(name, fields):
    """The value of a `wasmrpc.*` module record `name` whose fields
    arrived decoded (`fields`: name to value)."""
    from ..rpc import FunctionRef
    from ..tensor import Tensor
    from .modules import Module, Parameter

    if name == MODULE_CLASS:
        if set(fields) != {"class"}:
            raise ValueError(f"a {MODULE_CLASS} record has one field, `class`; got {sorted(fields)}")
        return find_class(fields["class"])
    if name == PARAMETER:
        data, requires_grad = fields.get("data"), fields.get("requires_grad")
        if set(fields) != {"data", "requires_grad"} or not isinstance(data, Tensor) or not isinstance(
            requires_grad, bool
        ):
            raise ValueError(f"a {PARAMETER} record holds a tensor `data` and a bool `requires_grad`")
        return Parameter(data, requires_grad=requires_grad)
    want = {"class", "parameters", "buffers", "modules", "non_persistent", "training", "attributes"}
    if set(fields) != want:
        raise ValueError(f"a {MODULE} record has the fields {sorted(want)}; got {sorted(fields)}")
    cls = find_class(fields["class"])
    where = f"a {cls.__name__} module that arrived"
    params, buffers, modules = fields["parameters"], fields["buffers"], fields["modules"]
    attributes, non_persistent = fields["attributes"], fields["non_persistent"]
    for table, what in (
        (params, "parameters"),
        (buffers, "buffers"),
        (modules, "children"),
        (attributes, "attributes"),
    ):
        _check_names(table, what, where)
    for k, p in params.items():
        if p is not None and not isinstance(p, Parameter):
            raise ValueError(f"{where}: its parameter {k!r} is not a {PARAMETER}")
    for k, b in buffers.items():
        if b is not None and not isinstance(b, Tensor):
            raise ValueError(f"{where}: its buffer {k!r} is not a tensor")
    for k, m in modules.items():
        if m is not None and not isinstance(m, Module):
            raise ValueError(f"{where}: its child {k!r} is not a module")
    for k, v in attributes.items():
        if k in _TABLES or isinstance(v, FunctionRef) or (callable(v) and not isinstance(v, type)):
            raise ValueError(f"{where}: its attribute {k!r} is not data")
    if not isinstance(non_persistent, list) or not all(k in buffers for k in non_persistent):
        raise ValueError(f"{where}: its non-persistent buffers are not among its buffers")
    if not isinstance(fields["training"], bool):
        raise ValueError(f"{where}: `training` is not a bool")
    module = object.__new__(cls)
    state = module.__dict__
    state.update(attributes)
    state["_parameters"] = params
    state["_buffers"] = buffers
    state["_modules"] = modules
    state["_non_persistent"] = set(non_persistent)
    state["training"] = fields["training"]
    return module
