"""What a plugin exports: the functions and classes its decorators
registered, and the manifest that describes them."""

import inspect

# The plugin's identity, set by the build's entry module before the
# plugin's own module is imported.
plugin = {"name": None, "version": "0.1.0", "ops": [], "calls": [], "single_instance": False}

functions = {}
"""Function name -> (callable, is_async, parameter names)."""

classes = {}
"""Class name -> (class, constructor parameters, {method: (is_async, params)})."""


def configure(name, version="0.1.0"):
    """Names the plugin (the build calls it)."""
    plugin["name"] = name
    plugin["version"] = version


def namespace():
    """The namespace workers serve this plugin under (`None` before the
    build names it): the host's `plugin_namespace` of its name, without a
    `wasmrpc-plugin-` prefix and with `-` as `_` (`seed-fns-py` ->
    `seed_fns_py`)."""
    name = plugin["name"]
    if not name:
        return None
    prefix = "wasmrpc-plugin-"
    if name.startswith(prefix):
        name = name[len(prefix):]
    return name.replace("-", "_")


def qualified(local):
    """`NAMESPACE::local` for a name registered in this plugin (`f`,
    `Class.method`)."""
    ns = namespace()
    if ns is None:
        raise RuntimeError(
            f"cannot name this plugin's `{local}` to another worker: the plugin has no name "
            "(build it with `wasmrpc plugin build-py`)"
        )
    return f"{ns}::{local}"


def local_callable(local):
    """This plugin's function or class method registered as `local` (`f`,
    `Class.method`: the plain function of an instance method, so
    `method(obj, *args)` works), or `None`."""
    entry = functions.get(local)
    if entry is not None:
        return entry[0]
    cls_name, dot, method = local.rpartition(".")
    if dot and cls_name in classes:
        cls, _, methods = classes[cls_name]
        if method in methods:
            return getattr(cls, method)
    return None


def permissions(ops=(), calls=()):
    """Declares ops beyond the worker's families and other plugins'
    functions this plugin asks to call (as `wasmrpc_guest::permissions!`)."""
    plugin["ops"].extend(o for o in ops if o not in plugin["ops"])
    plugin["calls"].extend(c for c in calls if c not in plugin["calls"])


def params_of(fn, skip_self=False):
    """Parameter names in order (without `self`, `*args`, `**kwargs`)."""
    params = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return params[1:] if skip_self and params else params


def exports():
    """Every export as `(name, kind, class, params)`, kind one of
    `function`, `async-function`, `constructor`, `method`, `async-method`."""
    out = []
    for name, (_, is_async, params) in functions.items():
        out.append((name, "async-function" if is_async else "function", None, params))
    for cname, (_, ctor_params, methods) in classes.items():
        out.append((cname, "constructor", cname, ctor_params))
        for m, (is_async, params) in methods.items():
            out.append((m, "async-method" if is_async else "method", cname, params))
    return out


def _code_names(code):
    """Every attribute and global name `code` and the code nested in it
    (comprehensions, lambdas, inner functions) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def reaches_objects(fn):
    """Whether `fn` reaches an RRef's object in place (it calls
    `local_value`): the worker that owns an object of this plugin then runs
    a call of `fn` with the object's RRef beside the object, in its
    instance, so `rref.local_value()` is the object itself. Read from the
    code, so a helper that calls `local_value` for it does not count."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and "local_value" in _code_names(code):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def describe():
    """The manifest as plain data (what the build writes into the
    component, and what the component's `describe` returns)."""
    if not plugin["name"]:
        raise RuntimeError("the plugin has no name: build it with `wasmrpc plugin build-py`")
    return {
        "name": plugin["name"],
        "version": plugin["version"],
        "exports": [
            {"name": n, "kind": k, "class": c, "params": p} for n, k, c, p in exports()
        ],
        "ops": list(plugin["ops"]),
        "calls": list(plugin["calls"]),
        "reaches_objects": sorted(n for n, (f, _, _) in functions.items() if reaches_objects(f)),
        "single_instance": bool(plugin["single_instance"]),
    }
