"""`torch.distributed.optim.DistributedOptimizer` for plugins: local
optimizers on the owners of parameter RRefs, stepped with a distributed
autograd context's gradients."""

from . import _host
from .autograd import _autograd


class SGD:
    """`torch.optim.SGD`'s hyperparameters."""

    def __init__(self, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        self.config = ("sgd", float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov))


class Adam:
    """`torch.optim.Adam`'s hyperparameters."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.config = ("adam", float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay))


class DistributedOptimizer:
    """`DistributedOptimizer(SGD(lr=0.05), param_rrefs)`, or torch's form
    `DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)` (a
    `torch.optim` class named `SGD` or `Adam` and its hyperparameters);
    `step(context_id)` updates every owner's parameters with that
    context's gradients."""

    def __init__(self, optimizer, params, *args, **kwargs):
        if isinstance(optimizer, type):
            # torch's signature: the class and its arguments.
            configs = {"SGD": SGD, "Adam": Adam}
            if optimizer.__name__ not in configs:
                raise NotImplementedError(
                    f"DistributedOptimizer supports SGD and Adam, not {optimizer.__name__}"
                )
            optimizer = configs[optimizer.__name__](*args, **kwargs)
        elif args or kwargs:
            raise TypeError("hyperparameters go with an optimizer class, not an SGD(...) object")
        handles = [p._handle() for p in params]
        self._id = _autograd("OptimizerNew", (_host.value(optimizer.config), handles))

    def step(self, context_id):
        """Applies the gradients of distributed autograd context `context_id`."""
        _autograd("OptimizerStep", (self._id, context_id))

    def close(self):
        """Releases the owners' optimizer state (also done when the call ends)."""
        if self._id is not None:
            _autograd("OptimizerDrop", self._id)
            self._id = None
