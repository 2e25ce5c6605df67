"""`torch.optim.lr_scheduler` for plugins: `StepLR`, `MultiStepLR`,
`ExponentialLR`, `LambdaLR`, with torch's closed forms (`step()` once per
epoch, after `optimizer.step()`)."""


class LRScheduler:
    """Sets each group's `lr` from its `initial_lr` and the epoch count."""

    def __init__(self, optimizer, last_epoch=-1):
        self.optimizer = optimizer
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def _lr(self, base_lr, epoch):
        raise NotImplementedError

    def get_last_lr(self):
        """The learning rates the last `step()` set."""
        return list(self._last_lr)

    def step(self, epoch=None):
        """Advances one epoch (or to `epoch`) and sets the learning rates."""
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self._lr(base, self.last_epoch)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self):
        """The scheduler's counters."""
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state):
        """Takes back `state_dict()`."""
        self.last_epoch = state["last_epoch"]
        self.base_lrs = list(state["base_lrs"])


class StepLR(LRScheduler):
    """`lr = base_lr * gamma ** (epoch // step_size)`."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def _lr(self, base_lr, epoch):
        return base_lr * self.gamma ** (epoch // self.step_size)


class MultiStepLR(LRScheduler):
    """`lr = base_lr * gamma ** (number of milestones <= epoch)`."""

    def __init__(self, optimizer, milestones, gamma=0.1, last_epoch=-1):
        self.milestones, self.gamma = sorted(milestones), gamma
        super().__init__(optimizer, last_epoch)

    def _lr(self, base_lr, epoch):
        return base_lr * self.gamma ** sum(1 for m in self.milestones if m <= epoch)


class ExponentialLR(LRScheduler):
    """`lr = base_lr * gamma ** epoch`."""

    def __init__(self, optimizer, gamma, last_epoch=-1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def _lr(self, base_lr, epoch):
        return base_lr * self.gamma**epoch


class LambdaLR(LRScheduler):
    """`lr = base_lr * lr_lambda(epoch)`."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        n = len(optimizer.param_groups)
        self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n
        self._i = 0
        super().__init__(optimizer, last_epoch)

    def step(self, epoch=None):
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        for g, base, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            g["lr"] = base * fn(self.last_epoch)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
