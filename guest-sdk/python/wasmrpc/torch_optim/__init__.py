"""`torch.optim` for plugins: local optimizers over the plugin's own
parameters (`model.parameters()`), with torch's update formulas (its
single-tensor, `foreach=False` path) run as in-place aten ops in the
worker under `no_grad`.

This is what `wasmrpc.torch.optim` is. `wasmrpc.optim` stays the
*distributed* optimizer (`DistributedOptimizer(wasmrpc.optim.SGD(lr=...),
param_rrefs)`), whose optimizers run on the parameters' owners.
"""

import math

from ..autograd import no_grad
from ..tensor import Tensor, op
from . import lr_scheduler

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler"]


class Optimizer:
    """The base: param groups (each a dict with `params` and the
    hyperparameters, defaults filled in), per-parameter `state`,
    `zero_grad`, `state_dict` / `load_state_dict`."""

    def __init__(self, params, defaults):
        self.defaults = dict(defaults)
        self.state = {}  # id(param) -> dict
        self.param_groups = []
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts")
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    def add_param_group(self, group):
        """Adds a group (`{"params": [...], "lr": ...}`); missing
        hyperparameters come from the defaults."""
        group = dict(group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none=True):
        """Clears every gradient: to `None` (the default, as torch) or zeros."""
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                else:
                    grad = p.grad
                    if grad is not None:
                        with no_grad():
                            op("aten::zero_", grad)

    def _state(self, p):
        return self.state.setdefault(id(p), {})

    def step(self, closure=None):
        """One update of every parameter with a gradient; `closure`, if
        given, is called first (with grad enabled) and its loss returned."""
        loss = None
        if closure is not None:
            loss = closure()
        with no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if group.get("maximize"):
                        g = op("aten::neg", g)
                    self._update(p, g, group, self._state(p))
        return loss

    def state_dict(self):
        """`{"state": {index: {...}}, "param_groups": [{..., "params":
        [indices]}]}`, parameters numbered in group order, as torch."""
        index, groups, state = 0, [], {}
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                if id(p) in self.state:
                    state[index] = dict(self.state[id(p)])
                ids.append(index)
                index += 1
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = ids
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Takes back what `state_dict` gave (same groups and sizes)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        params = [p for g in self.param_groups for p in g["params"]]
        for own, saved in zip(self.param_groups, groups):
            if len(own["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size")
            own.update({k: v for k, v in saved.items() if k != "params"})
        self.state = {}
        for i, s in state_dict["state"].items():
            self.state[id(params[int(i)])] = dict(s)

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {k}: {g[k]}" for k in sorted(g) if k != "params")
        lines.append(")")
        return "\n".join(lines)


class SGD(Optimizer):
    """SGD with momentum, dampening, weight decay and Nesterov, as torch:
    `g += wd * p`; `buf = momentum * buf + (1 - dampening) * g` (first
    step: `buf = g`); `g = g + momentum * buf` (Nesterov) or `buf`;
    `p -= lr * g`."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))

    def _update(self, p, g, group, state):
        wd, momentum = group["weight_decay"], group["momentum"]
        if wd != 0:
            g = op("aten::add", g, p, alpha=wd)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = op("aten::clone", op("aten::detach", g))
                state["momentum_buffer"] = buf
            else:
                op("aten::mul_", buf, momentum)
                op("aten::add_", buf, g, alpha=1 - group["dampening"])
            g = op("aten::add", g, buf, alpha=momentum) if group["nesterov"] else buf
        op("aten::add_", p, g, alpha=-group["lr"])


class Adam(Optimizer):
    """Adam (and AMSGrad), as torch: `m = lerp(m, g, 1 - beta1)`, `v = beta2
    * v + (1 - beta2) * g * g`, `p -= lr / (1 - beta1^t) * m / (sqrt(v) /
    sqrt(1 - beta2^t) + eps)`; `weight_decay` adds `wd * p` to the
    gradient (L2)."""

    _DECOUPLED = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize))

    def _update(self, p, g, group, state):
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = op("aten::zeros_like", p)
            state["exp_avg_sq"] = op("aten::zeros_like", p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = op("aten::zeros_like", p)
        state["step"] += 1
        step = state["step"]
        if wd != 0:
            if self._DECOUPLED:
                op("aten::mul_", p, 1 - lr * wd)
            else:
                g = op("aten::add", g, p, alpha=wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        op("aten::lerp_", exp_avg, g, 1 - beta1)
        op("aten::mul_", exp_avg_sq, beta2)
        op("aten::addcmul_", exp_avg_sq, g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
        if group["amsgrad"]:
            top = state["max_exp_avg_sq"]
            op("aten::copy_", top, op("aten::maximum", top, exp_avg_sq))
            second = top
        else:
            second = exp_avg_sq
        denom = op("aten::add_", op("aten::div", op("aten::sqrt", second), bias_correction2_sqrt), eps)
        op("aten::addcdiv_", p, exp_avg, denom, value=-step_size)


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (`p *= 1 - lr * wd` before the
    Adam step; default `weight_decay=1e-2`), as torch."""

    _DECOUPLED = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
