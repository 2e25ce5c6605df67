"""Progress reports: `report(bar, position, total, message)` becomes a
structured event of the worker, which `wasmrpc launch` draws as a progress
bar per worker and task."""

from . import _host


def report(bar, position, total=0, message=""):
    """`position` of `total` steps (0: unknown) of task `bar` are done."""
    _host.call("progress", str(bar), int(position), int(total), str(message))
