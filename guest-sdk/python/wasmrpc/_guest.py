"""The world's `guest` exports: calls arrive here by name, run the
registered Python function, method or constructor, and go back as an
outcome; a Python exception goes back as its class and message."""

import sys

from . import _host, _registry, _scope, _values
from .rpc import Future
from .state import log

try:
    from wit_world.exports import guest
except ImportError:  # an ordinary Python (the build reading the manifest)
    guest = None

# The nodes whose value is the argument itself (`_values.from_nodes`'s
# scalars), told apart by their exact class.
_SCALAR_NODES = (
    frozenset((_host._wit_types.Node_Int, _host._wit_types.Node_Float, _host._wit_types.Node_Str))
    if _host._wit_types is not None
    else frozenset()
)

# Exception classes a caller can rebuild (the world's error kinds).
_KINDS = {cls.__name__: kind for kind, cls in _host.ERROR_CLASSES.items()}

_objects = {}
_next_object = [1]


def error_record(error):
    """The world `remote-error` of a Python exception: its class when the
    caller can rebuild it, else the `RuntimeError` PyTorch raises when it
    cannot (naming the original class and message)."""
    _, types = _host.bindings()
    cls = type(error).__name__
    if isinstance(error, KeyError) and len(error.args) == 1:
        message = str(error.args[0])
    else:
        message = str(error)
    kind = _KINDS.get(cls)
    if kind is None:
        known = ", ".join(c.__name__ for c in _host.ERROR_CLASSES.values())
        message = (
            f"Failed to create original exception type. Error msg was {cls} is not an "
            f"exception class RPC can rebuild (one of {known}). Original exception on "
            f"remote side was {cls}: {message}"
        )
        kind = "RUNTIME_ERROR"
    return types.RemoteError(getattr(types.ErrorKind, kind), message)


def _decode(args, types):
    positional = [_values.from_nodes(a, types) for a in args.args]
    keywords = {k: _values.from_nodes(v, types) for k, v in args.kwargs}
    return positional, keywords


def _run(scope, fn, args, is_async, end_scope):
    # The path of every call: each Python frame here costs a few hundred
    # nanoseconds in the component's interpreter, so decoding and encoding
    # stay inline (the kit's own code was half a Python no-op's call), the
    # world's types are read without a frame of `bindings()`, and an
    # argument or a result that is one scalar node is converted here
    # rather than in a frame of `from_nodes` or `to_nodes`.
    prev, _scope.current = _scope.current, scope
    try:
        types = _host._wit_types or _host.bindings()[1]
        positional = [
            a[0].value
            if len(a) == 1 and type(a[0]) in _SCALAR_NODES
            else _values.from_nodes(a, types)
            for a in args.args
        ]
        if args.kwargs:
            keywords = {k: _values.from_nodes(v, types) for k, v in args.kwargs}
            result = fn(*positional, **keywords)
        else:
            result = fn(*positional)
        if is_async:
            if isinstance(result, Future):
                return guest.Outcome_Future(result._moved_handle())
        elif _registry.plugin["single_instance"] and _kept(result):
            result = None
        kind = type(result)
        if kind is int:
            return guest.Outcome_Returned([types.Node_Int(result)])
        if kind is float:
            return guest.Outcome_Returned([types.Node_Float(result)])
        return guest.Outcome_Returned(_values.to_nodes(result, types, move=True))
    except BaseException as e:  # noqa: BLE001 (every error goes back to the caller)
        return guest.Outcome_Raised(error_record(e))
    finally:
        _scope.current = prev
        if end_scope:
            scope.alive = False


def local_object(oid):
    """The object `oid` of this instance (`None` if it was dropped)."""
    entry = _objects.get(oid)
    return None if entry is None else entry[1]


_MODULE_SCOPE = _scope.Scope()
"""The scope of a single-instance plugin's calls: the instance's one guest
host, whose handles live as long as it (released as they are collected)."""

_keeps = {}
"""Object id -> how many RRefs hold it (a single-instance plugin hands the
same object to several `remote()`s)."""


def _function_scope():
    """The scope a function runs in: the instance's in a single-instance
    plugin; the object's when the worker runs it beside the object of this
    instance (its handles stay the object's and are released as they are
    collected); else a scope of its own."""
    if _registry.plugin["single_instance"]:
        return _MODULE_SCOPE, False
    for scope, _ in _objects.values():
        return scope, False
    return _scope.Scope(), True


def _kept(result):
    """In a single-instance plugin, offers `result` (an object of one of the
    plugin's classes) to the `remote()` that called: `True` when the worker
    keeps the object itself (the caller gets an RRef to it)."""
    if not _registry.plugin["single_instance"]:
        return False
    name = exported_class(result)
    if name is None:
        return False
    return _keep(result, name, lambda oid: _host.call("keep_object", oid, name))


def exported_class(obj):
    """The registered name of `obj`'s class when the plugin exports it
    (`@remote_class`), else `None`."""
    name = getattr(type(obj), "__wasmrpc_name__", None)
    entry = _registry.classes.get(name) if isinstance(name, str) else None
    if entry is None or entry[0] is not type(obj):
        return None
    return name


def _keep(obj, name, ask):
    """Has the worker keep `obj` (of exported class `name`) under its id in
    this instance, as `ask(oid)` asks; a kept object stays in the instance
    until the last of the worker's references to it is dropped. Returns
    what `ask` returned (falsy: not kept)."""
    oid = next((i for i, (_, o) in _objects.items() if o is obj), None)
    fresh = oid is None
    if fresh:
        oid = _next_object[0]
        _next_object[0] += 1
    kept = ask(oid)
    if not kept:
        return kept
    if fresh:
        _objects[oid] = (_MODULE_SCOPE, obj)
    _keeps[oid] = _keeps.get(oid, 0) + 1
    return kept


def rref_in_place(obj, name):
    """`RRef(obj)` of an object of the plugin's exported class `name`: the
    handle of an RRef this worker owns that holds the object itself, in
    this instance (a single-instance plugin's; the worker refuses it
    elsewhere with `TypeError`)."""
    return _keep(obj, name, lambda oid: _host.call("rref_of_object", oid, name))


def _construct(cls, args):
    """Makes an object of `cls`; it keeps its scope (its handles) until it
    is dropped (in a single-instance plugin, the instance's scope, whose
    handles are released as they are collected)."""
    scope = _MODULE_SCOPE if _registry.plugin["single_instance"] else _scope.Scope()
    prev, _scope.current = _scope.current, scope
    try:
        positional, keywords = _decode(args, _host.bindings()[1])
        obj = cls(*positional, **keywords)
    except BaseException as e:  # noqa: BLE001 (the error goes back to the caller)
        scope.alive = False
        return guest.Outcome_Raised(error_record(e))
    finally:
        _scope.current = prev
    oid = _next_object[0]
    _next_object[0] += 1
    _objects[oid] = (scope, obj)
    return guest.Outcome_Object(oid)


class Guest:
    """The implementation of the world's `guest` interface."""

    def describe(self):
        """The manifest."""
        m = _registry.describe()
        kinds = {
            "function": guest.ExportKind.FUNCTION,
            "async-function": guest.ExportKind.ASYNC_FUNCTION,
            "constructor": guest.ExportKind.CONSTRUCTOR,
            "method": guest.ExportKind.METHOD,
            "async-method": guest.ExportKind.ASYNC_METHOD,
        }
        exports = [
            guest.Export(e["name"], kinds[e["kind"]], e["class"], e["params"]) for e in m["exports"]
        ]
        return guest.Manifest(m["name"], m["version"], exports, m["ops"], m["calls"])

    def call(self, name, args):
        """Runs the function `name`, or constructs an object of class `name`."""
        entry = _registry.functions.get(name)
        if entry is not None:
            # `_function_scope()`'s common case (a scope of the call's
            # own) without its frame.
            if _registry.plugin["single_instance"] or _objects:
                scope, end_scope = _function_scope()
            else:
                scope, end_scope = _scope.Scope(), True
            return _run(scope, entry[0], args, entry[1], end_scope)
        if name in _registry.classes:
            return _construct(_registry.classes[name][0], args)
        _, types = _host.bindings()
        return guest.Outcome_Raised(
            types.RemoteError(types.ErrorKind.ATTRIBUTE_ERROR, f"no function or class `{name}`")
        )

    def call_method(self, object, class_, method, args):  # noqa: A002 (the world's name)
        """Runs `method` on object `object`."""
        _, types = _host.bindings()
        entry = _objects.get(object)
        methods = _registry.classes.get(class_, (None, None, {}))[2]
        if entry is None or method not in methods:
            return guest.Outcome_Raised(
                types.RemoteError(
                    types.ErrorKind.ATTRIBUTE_ERROR,
                    f"'{class_}' object has no attribute '{method}'",
                )
            )
        scope, obj = entry
        return _run(scope, getattr(obj, method), args, methods[method][0], end_scope=False)

    def drop_object(self, object, class_):  # noqa: A002 (the world's name)
        """Destroys object `object` (an object several RRefs keep, when the
        last lets go); its handles are released by the host."""
        if _keeps.get(object, 0) > 1:
            _keeps[object] -= 1
            return
        _keeps.pop(object, None)
        entry = _objects.pop(object, None)
        if entry is not None and entry[0] is not _MODULE_SCOPE:
            entry[0].alive = False


def serve_visit(visit):
    """Runs a call the worker handed this instance while one of its calls
    waits on a future (`rpc.Future.wait` in a single-instance plugin): a
    function, a constructor (both by name, as the `call` export runs them)
    or a method; then tells the worker its outcome."""
    _, types = _host.bindings()
    g = Guest()
    if visit.object is None:
        out = g.call(visit.name, visit.args)
    else:
        out = g.call_method(visit.object, visit.class_, visit.name, visit.args)
    if isinstance(out, guest.Outcome_Returned):
        outcome = types.VisitOutcome_Returned(out.value)
    elif isinstance(out, guest.Outcome_Raised):
        outcome = types.VisitOutcome_Raised(out.value)
    elif isinstance(out, guest.Outcome_Future):
        outcome = types.VisitOutcome_Future(out.value)
    else:
        outcome = types.VisitOutcome_Object(out.value)
    _host.call("visit_done", visit.id, outcome)


class _LogWriter:
    """`print` inside a plugin: each line goes to the worker's log (the
    component's own stdout and stderr go nowhere)."""

    def __init__(self, level):
        self._level = level
        self._buffer = ""

    def write(self, text):
        self._buffer += text
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            try:
                log(line, level=self._level)
            except Exception:  # noqa: BLE001 (outside a call there is no log)
                pass
        return len(text)

    def flush(self):
        """Lines are written as they end."""


if sys.platform == "wasi":
    sys.stdout = _LogWriter("info")
    sys.stderr = _LogWriter("warn")
