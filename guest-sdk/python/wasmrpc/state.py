"""Per-worker state and services: globals shared by every instance of the
plugin on a worker (the seeds' module-level variables), named locks, sleep
(holding no thread) and logging."""

from . import _host


def get_global(key, default=None):
    """The worker's global `key`, or `default` when unset."""
    value = _host.from_value(_host.call("global_get", key))
    return default if value is None else value


def set_global(key, value):
    """Sets the worker's global `key` (`None` clears it); tensors in it are
    kept by the worker."""
    _host.call("global_set", key, _host.value(value))


class lock:  # noqa: N801 (used as `with lock("key"):`)
    """`with lock("key"):` holds the worker's lock `key` (released at the
    latest when the call ends)."""

    def __init__(self, key):
        self._key = key

    def __enter__(self):
        _host.call("lock", self._key)
        return self

    def __exit__(self, *exc):
        _host.call("unlock", self._key)
        return False


def sleep(seconds):
    """Sleeps without holding a thread of the worker."""
    _host.call("sleep", float(seconds))


def log(*parts, level="info"):
    """Logs a line on the worker (`print` in the seeds)."""
    _, types = _host.bindings()
    _host.call("log", getattr(types.LogLevel, level.upper()), " ".join(str(p) for p in parts))
