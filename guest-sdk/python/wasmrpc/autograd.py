"""Local autograd helpers (`no_grad`) and the request behind
`Tensor.requires_grad_`, `.grad` and `.backward()`."""

from . import _host


def _autograd(case, payload=None):
    _, types = _host.bindings()
    cls = getattr(types, f"AutogradCall_{case}")
    call = cls() if payload is None else cls(payload)
    return _host.from_value(_host.call("autograd", call))


class no_grad:  # noqa: N801 (torch's name)
    """`with no_grad():` ops record no gradient."""

    def __enter__(self):
        self._prev = _autograd("SetGradEnabled", False)
        return self

    def __exit__(self, *exc):
        _autograd("SetGradEnabled", bool(self._prev))
        return False
