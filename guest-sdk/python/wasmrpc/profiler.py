"""Profiling ranges: `with record_function("##forward##"):` names the ops
and RPCs inside it in the caller's profile (when a caller profiles the
call; otherwise it records nothing)."""

from . import _host


class record_function:  # noqa: N801 (torch's name)
    """A named range around the ops and RPCs it encloses."""

    def __init__(self, name):
        self._name = name
        self._range = 0

    def __enter__(self):
        self._range = _host.call("record_function_enter", str(self._name))
        return self

    def __exit__(self, *exc):
        _host.call("record_function_exit", self._range)
        return False
