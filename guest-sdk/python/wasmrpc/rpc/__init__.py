"""`torch.distributed.rpc` for plugins: `rpc_sync`, `rpc_async`, `remote`,
`RRef`, `get_worker_info`, and `torch.futures.Future`.

`func` is a registered name: an aten op (`"aten::add"`, or `torch.add`
from `wasmrpc.torch`), a function of another plugin (`"seed_fns::f"`), or
a bare name for this plugin's own function (`"my_add"`, or the decorated
function itself).

A registered function can also be an argument: it travels as a reference
to its registered name (`FunctionRef`), never as code; `functions` has
`async_execution`."""

from .. import _host, _registry, _scope


class WorkerInfo:
    """A worker's rank (`id`) and name."""

    __slots__ = ("id", "name")

    def __init__(self, id, name):  # noqa: A002 (PyTorch's field name)
        self.id = id
        self.name = name

    def __eq__(self, other):
        return isinstance(other, WorkerInfo) and (self.id, self.name) == (other.id, other.name)

    def __hash__(self):
        return hash((self.id, self.name))

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, name={self.name})"


def _to(to):
    return to.name if isinstance(to, WorkerInfo) else str(to)


def _func(func):
    if isinstance(func, str):
        return func
    # A @remote function's name, or a static method's `Class.method`
    # (PyTorch's `rpc_sync(ps, ParameterServer.update, ...)`).
    name = getattr(func, "__wasmrpc_name__", None) or getattr(func, "__wasmrpc_ref__", None)
    if name is None:
        raise TypeError(
            f"{func!r} is not a registered function: pass its name, a @remote function "
            "of this plugin, or an op of wasmrpc.torch"
        )
    return name


class FunctionRef:
    """A function by its registered name (`"other_plugin::f"`,
    `"aten::add"`, `"my_plugin::MyClass.static_method"`): what a function
    reference that names no function of this plugin becomes when it
    arrives, and what a plugin builds to pass a function it cannot import
    (`FunctionRef("other_plugin::f")`). Calling it runs the function on
    this worker by `rpc_sync`; passing it (as an argument, or as `func`
    of `rpc_sync`) passes the name again."""

    def __init__(self, name):
        if not isinstance(name, str) or not name:
            raise TypeError(f"FunctionRef takes a registered name (a non-empty str), not {name!r}")
        # `__wasmrpc_name__` is how `rpc_sync(dst, f)` names any function.
        self.__wasmrpc_name__ = name
        local = name.rpartition("::")[2]
        self.__qualname__ = local
        self.__name__ = local.rpartition(".")[2]

    @property
    def name(self):
        """The registered name."""
        return self.__wasmrpc_name__

    def __call__(self, *args, **kwargs):
        return rpc_sync(get_worker_info().name, self.__wasmrpc_name__, args=args, kwargs=kwargs)

    def __eq__(self, other):
        return isinstance(other, FunctionRef) and other.name == self.name

    def __hash__(self):
        return hash(("FunctionRef", self.name))

    def __repr__(self):
        return f"FunctionRef({self.name!r})"


def _handle_kind(name):
    _, types = _host.bindings()
    return getattr(types.HandleKind, name)


def _mode(name):
    _, types = _host.bindings()
    return getattr(types.RpcMode, name)


def rpc_sync(to, func, args=None, kwargs=None, timeout=None):
    """Runs `func(*args, **kwargs)` on worker `to` and returns its result."""
    if _serving():
        # A wait that serves the instance's other calls meanwhile.
        return rpc_async(to, func, args, kwargs, timeout).wait()
    call = _host.call_args(tuple(args or ()), dict(kwargs or {}))
    nodes = _host.call("rpc_sync", _to(to), _func(func), call, _timeout(timeout))
    return _host.from_value(nodes)


def rpc_async(to, func, args=None, kwargs=None, timeout=None):
    """Starts `func(*args, **kwargs)` on worker `to`; returns a `Future`."""
    call = _host.call_args(tuple(args or ()), dict(kwargs or {}))
    h = _host.call("rpc_handle", _mode("ASYNC"), _to(to), _func(func), call, _timeout(timeout))
    return Future._own(h)


def remote(to, func, args=None, kwargs=None, timeout=None):
    """Runs `func(*args, **kwargs)` on worker `to`, keeping the result there;
    returns an `RRef` to it."""
    call = _host.call_args(tuple(args or ()), dict(kwargs or {}))
    h = _host.call("rpc_handle", _mode("REMOTE"), _to(to), _func(func), call, _timeout(timeout))
    return RRef._own(h)


def _serving():
    """Whether this plugin's waits serve its other calls meanwhile (a
    single-instance plugin's: its one instance would otherwise stay busy
    while a call waits, and a call it waits for could never run)."""
    return _registry.plugin["single_instance"]


def _wait_serving(handle):
    """`fut.wait()` in a single-instance plugin: while the future is not
    done, the worker may hand this instance a call that waits for it (a
    method of one of its objects, one of its functions); it runs here, as
    another thread of a Python process would run while this one waits."""
    from .._guest import serve_visit  # noqa: PLC0415 (`_guest` imports this module)

    _, types = _host.bindings()
    while True:
        wake = _host.call("future_wait_serving", handle)
        if isinstance(wake, types.Wake_Done):
            return wake.value
        serve_visit(wake.value)


def _timeout(timeout):
    return None if timeout is None or timeout < 0 else float(timeout)


def get_worker_info(worker_name=None):
    """This worker's `WorkerInfo`, or that of `worker_name`."""
    w = _host.call("get_worker_info", worker_name)
    return WorkerInfo(w.id, w.name)


def restart_count():
    """How many times the group was restarted after a failure
    (`TORCHELASTIC_RESTART_COUNT`, set by `wasmrpc launch --max-restarts`
    and torchrun): 0 on a first start. An entry that checkpoints resumes
    when it is above 0."""
    return rpc_sync(get_worker_info().name, "wasmrpc::restart_count")


def failed_workers():
    """The workers this worker declared failed (silent for the failure
    window), in order, as `{"worker": name, "cause": text}` dicts."""
    return rpc_sync(get_worker_info().name, "wasmrpc::failed_workers")


def next_worker_failure(known=()):
    """A `Future` of the next failure of a worker not in `known` (names of
    the failures already seen), as `{"worker": name, "cause": text}`; it has
    no timeout."""
    return rpc_async(
        get_worker_info().name, "wasmrpc::next_worker_failure", args=(list(known),), timeout=0
    )


class _Handle:
    """A handle of the worker's tables, released when collected while the
    call that made it runs."""

    __slots__ = ("_h", "_scope", "__weakref__")
    _KIND = None

    @classmethod
    def _own(cls, handle):
        o = object.__new__(cls)
        o._h = handle
        o._scope = _scope.current
        return o

    def _handle(self):
        if self._h is None or (self._scope is not None and not self._scope.alive):
            raise RuntimeError(f"this {type(self).__name__} belongs to a call that has ended")
        return self._h

    def _moved_handle(self):
        return _host.call("dup", _handle_kind(self._KIND), self._handle())

    def __del__(self):
        h, scope = getattr(self, "_h", None), getattr(self, "_scope", None)
        if h is not None and scope is not None and scope.alive:
            self._h = None
            try:
                _host.call("drop_handle", _handle_kind(self._KIND), h)
            except Exception:  # noqa: BLE001 (the call may be ending)
                pass


class RRef(_Handle):
    """A reference to a value owned by some worker."""

    __slots__ = ()
    _KIND = "RREF"

    def __init__(self, value):
        """`RRef(value)`: a local RRef owning `value`.

        An object of one of the plugin's classes is held itself, not
        copied, in a single-instance plugin (`wasmrpc.single_instance()`):
        it stays in the worker's one instance and its methods run there
        through the RRef's proxies, from any worker, as PyTorch's
        `rpc.RRef(ParameterServer())`. Elsewhere the worker refuses it with
        `TypeError` (each call's instance ends with the call)."""
        from .._guest import exported_class, rref_in_place  # noqa: PLC0415 (`_guest` imports this module)

        name = exported_class(value)
        if name is not None:
            self._h = rref_in_place(value, name)
        else:
            self._h = _host.call("rref_new", _host.value(value))
        self._scope = _scope.current

    def to_here(self, timeout=None):
        """The value, fetched from its owner (in a single-instance plugin,
        the plugin's other calls on this worker run while it waits)."""
        if _serving():
            return Future._own(_host.call("rref_fetch", self._handle())).wait()
        return _host.from_value(_host.call("rref_to_here", self._handle()))

    def local_value(self):
        """The value, on its owner (PyTorch's `RuntimeError` elsewhere).

        An RRef to an object of a plugin class (`rpc.remote(dst,
        "ns::MyClass", args)`, or `rpc.remote(dst, MyClass, args)`) gives
        the object itself in a function of the same plugin that the owner
        runs with the RRef among its arguments: the worker runs such a call
        beside the object, in its instance (PyTorch's `_call_method(method,
        rref)` idiom). Anywhere else the object is out of reach (it is
        never copied) and its methods run through
        `rref.rpc_sync().method(...)`."""
        if not self.is_owner():
            me = get_worker_info()
            raise RuntimeError(
                f"can't call local_value() on user {me}. Call it on owner {self.owner()}"
            )
        obj = _local_object(self)
        if obj is not None:
            return obj
        try:
            return self.to_here()
        except TypeError as e:
            # The worker refuses to copy an object out of its owner; say
            # where the object can be had instead (its `__getstate__` hint
            # is for Rust classes: a Python class serves no `_` methods).
            owner = self.owner()
            raise TypeError(
                f"rref.local_value() on worker {owner.name}, the RRef's owner: it holds an "
                "object of a plugin class, which stays in its own instance and is never "
                "copied. local_value() gives it only in a function of the same plugin that "
                f"{owner.name} runs with this RRef among its arguments (PyTorch's "
                "_call_method idiom: rpc.rpc_sync(rref.owner(), _call_method, "
                "args=(MyClass.method, rref))); from here, call its methods through "
                "rref.rpc_sync().method(...) (or rpc_async() / remote()). "
                f"The worker said: {e}"
            ) from None

    def owner(self):
        """The owner's `WorkerInfo`."""
        w = _host.call("rref_owner", self._handle())
        return WorkerInfo(w.id, w.name)

    def owner_name(self):
        """The owner's name."""
        return self.owner().name

    def is_owner(self):
        """Whether this worker owns the value."""
        return _host.call("rref_is_owner", self._handle())

    def confirmed_by_owner(self):
        """Whether the owner knows of this user."""
        return _host.call("rref_confirmed", self._handle())

    def rpc_sync(self, timeout=None):
        """A proxy: `rref.rpc_sync().method(*args)` runs on the owner."""
        return _Proxy(self, "SYNC", timeout)

    def rpc_async(self, timeout=None):
        """A proxy whose calls return `Future`s."""
        return _Proxy(self, "ASYNC", timeout)

    def remote(self, timeout=None):
        """A proxy whose calls return `RRef`s."""
        return _Proxy(self, "REMOTE", timeout)


def _local_object(rref):
    """The object `rref` holds when it lives in this instance (a function
    the owner runs beside it), else `None`."""
    oid = _host.call("rref_local_object", rref._handle())
    if oid is None:
        return None
    from .._guest import local_object  # noqa: PLC0415 (`_guest` imports this module)

    return local_object(oid)


class _Proxy:
    def __init__(self, rref, mode, timeout):
        self._rref, self._mode, self._timeout = rref, mode, _timeout(timeout)

    def _call_here(self, obj, method, args, kwargs):
        """A proxy's call on an object of this very instance: run in place
        (the owner would queue it behind the running call, which is this
        one, and wait for ever)."""
        if self._mode == "SYNC":
            out = getattr(obj, method)(*args, **kwargs)
            return out.wait() if isinstance(out, Future) else out
        if self._mode == "REMOTE":
            out = getattr(obj, method)(*args, **kwargs)
            return RRef(out.wait() if isinstance(out, Future) else out)
        fut = Future()
        try:
            out = getattr(obj, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (the future carries it)
            fut.set_exception(e)
            return fut
        if isinstance(out, Future):
            return out
        fut.set_result(out)
        return fut

    def __getattr__(self, method):
        def call(*args, **kwargs):
            obj = _local_object(self._rref)
            if obj is not None:
                return self._call_here(obj, method, args, kwargs)
            a = _host.call_args(args, kwargs)
            h = self._rref._handle()
            if self._mode == "SYNC" and _serving():
                fut = Future._own(
                    _host.call("rref_call_handle", h, _mode("ASYNC"), method, a, self._timeout)
                )
                return fut.wait()
            if self._mode == "SYNC":
                return _host.from_value(_host.call("rref_call_sync", h, method, a, self._timeout))
            out = _host.call("rref_call_handle", h, _mode(self._mode), method, a, self._timeout)
            return Future._own(out) if self._mode == "ASYNC" else RRef._own(out)

        return call


class Future(_Handle):
    """`torch.futures.Future`: the result of an `rpc_async`, or one of your
    own to complete with `set_result`."""

    __slots__ = ()
    _KIND = "FUTURE"

    def __init__(self):
        self._h = _host.call("future_new")
        self._scope = _scope.current

    @classmethod
    def shared(cls, key, take=False):
        """The worker-wide future named `key` (one per plugin and worker),
        made unset on first use, so one call can complete what others wait
        on; with `take`, the name is forgotten after this handle."""
        return cls._own(_host.call("future_shared", str(key), bool(take)))

    def wait(self):
        """The result; raises the call's error. In a single-instance
        plugin, the plugin's other calls on this worker run while it
        waits."""
        if _serving():
            return _host.from_value(_wait_serving(self._handle()))
        return _host.from_value(_host.call("future_wait", self._handle()))

    def done(self):
        """Whether it completed."""
        return _host.call("future_done", self._handle())

    def set_result(self, result):
        """Completes it with `result`."""
        _host.call("future_set", self._handle(), _host.Ok(_host.value(result)))

    def set_exception(self, error):
        """Completes it with `error`."""
        _host.call("future_set", self._handle(), _host.Err(_remote_error(error)))

    def value(self):
        """The result of a completed future (`torch.futures.Future.value`):
        as `wait`, which answers at once once it is done."""
        return self.wait()

    def then(self, callback, *extra):
        """A future of `callback(fut, *extra)`, as `torch.futures.Future.then`:
        once this future completes, `callback`, a `@remote` function of this
        plugin (or its name), is given it, completed, and calls
        `fut.wait()` for the value. An exception the callback raises fails
        the returned future as a `RuntimeError` with its message. Unlike
        torch, a future that fails does not call the callback: the returned
        future fails with the same error. Anything but a function or a name
        is refused as torch's binding refuses it (`then(None)`)."""
        if not (isinstance(callback, str) or callable(callback)):
            raise TypeError(
                "then(): incompatible function arguments. The following argument types are "
                "supported:\n    1. (self: torch._C.Future, arg0: Callable) -> torch._C.Future"
                f"\n\nInvoked with: {self!r}, {callback!r}"
            )
        name = _func(callback).rsplit("::", 1)[-1]
        if _registry.local_callable(name) is None:
            raise AttributeError(
                f"then(): {name!r} is not a @remote function of this plugin (a callback runs "
                "here, later, in a call of its own)"
            )
        values = [_host.value(v) for v in [name, *extra]]
        return Future._own(_host.call("future_then", self._handle(), THEN_TRAMPOLINE, values))


THEN_TRAMPOLINE = "_wasmrpc_then"
"""The function `Future.then` chains through. The host calls a plugin's own
function with the value once a future completes; this one gives the
callback a completed `Future` instead, as torch does. Every Python plugin
exports it; names starting with `_wasmrpc` are the kit's own."""


def _then_trampoline(value, callback, *extra):
    fn = _registry.local_callable(callback)
    if fn is None:
        raise AttributeError(f"then(): this plugin has no @remote function {callback!r}")
    fut = Future()
    fut.set_result(value)
    return fn(fut, *extra)


_registry.functions[THEN_TRAMPOLINE] = (_then_trampoline, False, ["value", "callback"])


def _remote_error(error):
    """The world `remote-error` of a Python exception."""
    from .._guest import error_record

    return error_record(error)


# `wasmrpc.rpc.functions`, as `torch.distributed.rpc.functions`.
from . import functions  # noqa: E402 (after the names it does not need)
