"""`torch.futures` for plugins: `Future`, `wait_all`, `collect_all`."""

from .rpc import Future

__all__ = ["Future", "collect_all", "wait_all"]


def wait_all(futures):
    """Waits for every future; returns their values in order (raises the
    first error, as torch)."""
    return [f.wait() for f in futures]


class _Collected:
    """What `collect_all` returns: a future-like object whose `wait()`
    waits for every future and returns the list of them (completed). It
    lives in this plugin only: it cannot be sent over RPC, returned from an
    `async_execution` function or chained with `then`."""

    def __init__(self, futures):
        self._futures = list(futures)

    def wait(self):
        """Waits for every future; returns them (each one's `wait()` then
        answers at once)."""
        for f in self._futures:
            try:
                f.wait()
            except Exception:  # noqa: BLE001 (torch: the error stays in its future)
                pass
        return list(self._futures)

    value = wait

    def done(self):
        """Whether every future completed."""
        return all(f.done() for f in self._futures)


def collect_all(futures):
    """A future-like object completed when every future is: its `wait()`
    returns the list of futures (see `_Collected` for what it cannot do)."""
    return _Collected(futures)
