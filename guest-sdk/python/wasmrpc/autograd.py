"""Local autograd: grad mode (`no_grad`, `enable_grad`, `set_grad_enabled`,
`is_grad_enabled`) and the request behind `Tensor.requires_grad_`,
`.grad` and `.backward()`.

Grad mode lives in the worker (its `SetGradEnabled` request answers the
previous mode), so every op the kit runs sees it, as in torch."""

from . import _host


def _autograd(case, payload=None):
    _, types = _host.bindings()
    cls = getattr(types, f"AutogradCall_{case}")
    call = cls() if payload is None else cls(payload)
    return _host.from_value(_host.call("autograd", call))


def _set_enabled(mode):
    """Sets grad mode; returns the previous one."""
    return bool(_autograd("SetGradEnabled", bool(mode)))


def is_grad_enabled():
    """Whether ops record gradients now (asked of the worker: two requests,
    setting the mode and setting it back)."""
    prev = _set_enabled(True)
    if not prev:
        _set_enabled(False)
    return prev


class _GradMode:
    """A context manager that sets grad mode on entry and restores it on
    exit; also a decorator (`@torch.no_grad()` or `@torch.no_grad`)."""

    _MODE = None

    def __new__(cls, fn=None):
        self = super().__new__(cls)
        if callable(fn):
            # `@torch.no_grad` without parentheses.
            return self(fn)
        return self

    def __init__(self, fn=None):
        self._prev = []

    def __enter__(self):
        self._prev.append(_set_enabled(self._mode()))
        return self

    def __exit__(self, *exc):
        _set_enabled(self._prev.pop())
        return False

    def _mode(self):
        return self._MODE

    def __call__(self, fn):
        mode = self

        def wrapper(*args, **kwargs):
            with type(mode)() if not isinstance(mode, set_grad_enabled) else set_grad_enabled(mode._MODE):
                return fn(*args, **kwargs)

        wrapper.__name__ = getattr(fn, "__name__", "wrapper")
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        wrapper.__wrapped__ = fn
        return wrapper


class no_grad(_GradMode):  # noqa: N801 (torch's name)
    """`with no_grad():` (or `@no_grad()`): ops record no gradient."""

    _MODE = False


class enable_grad(_GradMode):  # noqa: N801 (torch's name)
    """`with enable_grad():` (or `@enable_grad()`): ops record gradients."""

    _MODE = True


class inference_mode(no_grad):  # noqa: N801 (torch's name)
    """`no_grad` (the worker has no separate inference mode)."""

    def __new__(cls, mode=True):
        if callable(mode):
            return no_grad.__new__(cls, mode)
        return super().__new__(cls)

    def __init__(self, mode=True):
        super().__init__()
        self._MODE = not mode if isinstance(mode, bool) else False


class set_grad_enabled(_GradMode):  # noqa: N801 (torch's name)
    """`set_grad_enabled(False)` sets grad mode at once, and restores the
    previous mode on exit when used as `with set_grad_enabled(mode):`."""

    def __new__(cls, mode):
        return object.__new__(cls)

    def __init__(self, mode):
        super().__init__()
        self._MODE = bool(mode)
        self._prev.append(_set_enabled(self._MODE))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._prev:
            _set_enabled(self._prev.pop())
        return False
