"""The distributed optimizer (`torch.distributed.optim`).

```python
opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.05)
with dist_autograd.context() as context_id:
    ...
    dist_autograd.backward(context_id, [loss])
    opt.step(context_id)
```

Each worker that owns some of the parameters runs a local optimizer over
them; `step` steps them all with one context's gradients. The optimizers
are `torch.optim.SGD` and `torch.optim.Adam` (with their hyper-parameters
by position or name); another class is refused.
"""

import torch

from ... import _native

# Each optimizer's hyper-parameters in the order its constructor takes
# them after `params`.
_POSITIONAL = {
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "Adam": ("lr", "betas", "eps", "weight_decay"),
}


def _kind(optimizer_class):
    for kind in _POSITIONAL:
        if optimizer_class is getattr(torch.optim, kind):
            return kind
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    raise ValueError(
        f"DistributedOptimizer runs torch.optim.SGD and torch.optim.Adam on the owners, not {name}"
    )


class DistributedOptimizer:
    """One optimizer over parameter RRefs owned by many workers."""

    def __init__(self, optimizer_class, params_rref, *args, **kwargs):
        kind = _kind(optimizer_class)
        names = _POSITIONAL[kind]
        if len(args) > len(names):
            raise TypeError(f"{kind} takes at most {len(names)} hyper-parameters by position")
        hyper = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in hyper:
                raise TypeError(f"{kind}.__init__() got multiple values for argument '{k}'")
            hyper[k] = v
        self._optimizer = _native.DistributedOptimizer(kind, list(params_rref), hyper)

    def step(self, context_id):
        """Steps every owner's parameters with context `context_id`'s
        gradients."""
        self._optimizer.step(context_id)


__all__ = ["DistributedOptimizer"]
