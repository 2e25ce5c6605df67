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

    def state_dict(self):
        """Every owner's state (momentum buffers, Adam's step counts and
        moments): a dict of owner name to a list with one entry per
        parameter, `None`, `("momentum", buffer)` or `("adam", step,
        exp_avg, exp_avg_sq)`; the tensors are copies, to save with the
        parameters (`wasmrpc.save`) and resume a job."""
        return _host.from_value(_host.call("optimizer_state", self._id))

    def load_state_dict(self, state):
        """Replaces every owner's state with what `state` (from
        `state_dict()` of an optimizer of the same kind over the same
        parameters) holds for it; a state that does not fit raises
        `ValueError` and changes nothing on that owner."""
        _host.call("optimizer_load_state", self._id, _host.value(state))

    def close(self):
        """Releases the owners' optimizer state (also done when the call ends)."""
        if self._id is not None:
            _autograd("OptimizerDrop", self._id)
            self._id = None
