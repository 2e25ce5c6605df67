"""The `torch.futures.Future` an asynchronous call returns, and the
callback the extension completes it with (from a thread of its own)."""

import torch


def new():
    """A fresh future and its `done(ok, value)` callback: `value` is the
    result, or (with `ok` false) the exception to raise from `wait()`."""
    fut = torch.futures.Future()

    def done(ok, value):
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    return fut, done
