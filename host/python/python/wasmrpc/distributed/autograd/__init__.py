"""Distributed autograd (`torch.distributed.autograd`).

```python
with dist_autograd.context() as context_id:
    loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
    dist_autograd.backward(context_id, [loss])
    grads = dist_autograd.get_gradients(context_id)   # {t1: ..., t2: ...}
```

Calls made in a context (from the thread that opened it) record send and
receive functions in it on every worker they reach; `backward` runs the
pass across all of them, and each worker keeps the gradients of its own
tensors in the context, never in `.grad`.
"""

import threading

from ... import _native

_current = threading.local()

ALREADY_HAVE_CONTEXT = "Already have an autograd context id for this thread."
NO_CURRENT_CONTEXT = (
    "Current thread doesn't have a valid autograd context. Please wrap your code using: "
    "`with torch.distributed.autograd.context() as context_id` to generate a valid context id."
)


def _current_context_id():
    """The id of this thread's context, or `None`."""
    return getattr(_current, "id", None)


class context:
    """A distributed autograd context for the `with` block: its id is what
    the block gets (`as context_id`); it is released on every worker when
    the block ends."""

    def __enter__(self):
        if _current_context_id() is not None:
            raise RuntimeError(ALREADY_HAVE_CONTEXT)
        self.autograd_context = _native.new_context()
        _current.id = self.autograd_context
        return self.autograd_context

    def __exit__(self, exc_type, exc, tb):
        _current.id = None
        _native.release_context(self.autograd_context)
        return False


def backward(context_id, roots, retain_graph=False):
    """Runs backward from the scalar tensors `roots` in context
    `context_id`, across every worker the context reached."""
    if (
        not isinstance(context_id, int)
        or isinstance(context_id, bool)
        or not isinstance(roots, (list, tuple))
        or not isinstance(retain_graph, bool)
    ):
        # PyTorch's binding refuses these with pybind11's text.
        raise TypeError(
            "backward(): incompatible function arguments. The following argument types are "
            "supported:\n    1. (context_id: int, roots: list[torch.Tensor], "
            f"retain_graph: bool = False) -> None\n\nInvoked with: {context_id!r}, {roots!r}"
        )
    _native.backward(context_id, list(roots), retain_graph)


def get_gradients(context_id):
    """The gradients context `context_id` accumulated on this worker: a dict
    from each tensor to its gradient."""
    return _native.get_gradients(context_id)


__all__ = ["backward", "context", "get_gradients"]
