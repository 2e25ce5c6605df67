"""The kit's PyTorch surface on the real wasm path (served as
`torch_api_py::NAME`): each function runs a layer, loss or optimizer the
way PyTorch code does (`from wasmrpc import torch`; `nn`, `F`, `optim` as
usual) on weights and inputs the caller passes, and returns what a test
compares with torch on the same weights: outputs and gradients.

The same cases run in pure Python against a fake host in
`guest-sdk/python/tests/test_torch_api.py`; this plugin is for the Rust
tests that will run them through a worker. `supervision` is the kit's
view of the group's failures (`wasmrpc.rpc`).
"""

from wasmrpc import remote, rpc, torch

nn = torch.nn
F = torch.nn.functional
optim = torch.optim


def _grads(module):
    return {name: p.grad for name, p in module.named_parameters()}


@remote
def linear_forward_backward(weight, bias, x):
    """`nn.Linear` with the caller's `weight` `(out, in)` and `bias`:
    `(y, {"weight": dL/dW, "bias": dL/db})` for `L = (y ** 2).sum()`."""
    out_f, in_f = weight.shape
    layer = nn.Linear(in_f, out_f)
    layer.load_state_dict({"weight": weight, "bias": bias})
    y = layer(x)
    (y**2).sum().backward()
    return y.detach(), _grads(layer)


@remote
def conv2d_forward_backward(weight, bias, x, stride=1, padding=0):
    """`nn.Conv2d` with the caller's weights: `(y, grads)` for `(y ** 2).sum()`."""
    out_c, in_c, kh, kw = weight.shape
    layer = nn.Conv2d(in_c, out_c, (kh, kw), stride=stride, padding=padding)
    layer.load_state_dict({"weight": weight, "bias": bias})
    y = layer(x)
    (y**2).sum().backward()
    return y.detach(), _grads(layer)


@remote
def lstm_forward(state, x, hidden_size, num_layers=1, batch_first=False, bidirectional=False):
    """`nn.LSTM` loaded with the caller's `state` (torch's parameter names):
    `(output, h_n, c_n, grads)`, gradients of `(output ** 2).sum()`."""
    input_size = x.shape[-1]
    lstm = nn.LSTM(input_size, hidden_size, num_layers=num_layers, batch_first=batch_first,
                   bidirectional=bidirectional)
    lstm.load_state_dict(state)
    output, (h, c) = lstm(x)
    (output**2).sum().backward()
    return output.detach(), h.detach(), c.detach(), _grads(lstm)


@remote
def gru_forward(state, x, hidden_size, num_layers=1, batch_first=False):
    """`nn.GRU` loaded with `state`: `(output, h_n, grads)`."""
    gru = nn.GRU(x.shape[-1], hidden_size, num_layers=num_layers, batch_first=batch_first)
    gru.load_state_dict(state)
    output, h = gru(x)
    (output**2).sum().backward()
    return output.detach(), h.detach(), _grads(gru)


@remote
def embedding_layernorm(weight, indices, ln_weight, ln_bias):
    """`nn.Embedding` then `nn.LayerNorm`: `(y, grads)`."""
    emb = nn.Embedding(weight.shape[0], weight.shape[1])
    ln = nn.LayerNorm(weight.shape[1])
    model = nn.Sequential(emb, ln)
    model.load_state_dict({"0.weight": weight, "1.weight": ln_weight, "1.bias": ln_bias})
    y = model(indices)
    (y**2).sum().backward()
    return y.detach(), _grads(model)


@remote
def batchnorm1d_train(x):
    """`nn.BatchNorm1d` (default init) on one training batch, then eval:
    `(train output, eval output, running_mean, running_var)`."""
    bn = nn.BatchNorm1d(x.shape[1])
    y = bn(x)
    bn.eval()
    return y.detach(), bn(x).detach(), bn.running_mean, bn.running_var


@remote
def losses(logits, target, a, b):
    """`(cross_entropy, dL/dlogits, mse_loss, l1_loss)`."""
    logits = logits.detach().requires_grad_(True)
    ce = F.cross_entropy(logits, target)
    ce.backward()
    return ce.detach(), logits.grad, F.mse_loss(a, b), F.l1_loss(a, b)


@remote
def optimizer_steps(kind, params, grads, lr, steps=5, momentum=0.0, weight_decay=0.0):
    """`steps` steps of `optim.SGD` (`kind="sgd"`, with `momentum`),
    `"adam"` or `"adamw"` on copies of `params`, each step with the same
    `grads` (lists of tensors); returns the parameters after."""
    ps = [nn.Parameter(p) for p in params]
    if kind == "sgd":
        opt = optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=weight_decay)
    elif kind == "adam":
        opt = optim.Adam(ps, lr=lr, weight_decay=weight_decay)
    elif kind == "adamw":
        opt = optim.AdamW(ps, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {kind}")
    for _ in range(steps):
        opt.zero_grad()
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


class Net(nn.Module):
    """The issue's MLP, written as PyTorch code."""

    def __init__(self, features, hidden, classes):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


@remote
def train_mlp(x, y, epochs=20, lr=0.1, batch_size=16, hidden=32):
    """Trains `Net` on `(x, y)` (class indices) with SGD and momentum, as
    PyTorch code does; returns `(per-epoch mean losses, final accuracy)`."""
    classes = int(y.max().item()) + 1
    model = Net(x.shape[1], hidden, classes)
    opt = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    n = x.shape[0]
    losses = []
    for _ in range(epochs):
        model.train()
        total, count = 0.0, 0
        for i in range(0, n, batch_size):
            xb, yb = x[i : i + batch_size], y[i : i + batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
            count += 1
        losses.append(total / count)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return losses, accuracy


@remote
def indexing(t, idx, mask):
    """Indexing and assignment as torch code writes them, for comparison:
    `(t[0], t[:, 1], t[..., -1], t[None].shape, t[idx], t[mask], a copy of t
    with t[idx] = 0 and t[:, 0] = -1)`."""
    u = t.clone()
    u[idx] = 0.0
    u[:, 0] = -1.0
    return t[0], t[:, 1], t[..., -1], list(t[None].shape), t[idx], t[mask], u


@remote
def dist_train_resuming(params, inputs, lr, momentum, state):
    """Distributed training as `torch.distributed.optim` code writes it:
    for each input, in a distributed autograd context, the loss
    `sum_p sum(optim::forward(p, x))` (run by each parameter's owner), the
    backward pass and a `DistributedOptimizer` step (SGD with `momentum`),
    the optimizer first loading `state` (an earlier call's, or `None`).
    Returns the optimizer's state after the steps."""
    from wasmrpc import dist_autograd, rpc
    from wasmrpc.optim import SGD, DistributedOptimizer

    opt = DistributedOptimizer(SGD(lr, momentum=momentum), params)
    if state is not None:
        opt.load_state_dict(state)
    for x in inputs:
        with dist_autograd.context() as ctx:
            loss = None
            for p in params:
                s = rpc.rpc_sync(p.owner(), "optim::forward", args=(p, x)).sum()
                loss = s if loss is None else loss + s
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
    return opt.state_dict()


@remote
def supervision(known):
    """Waits for the next failure of a worker not in `known`, then answers
    `[restart count, failures declared so far, that failure]`."""
    nxt = rpc.next_worker_failure(known).wait()
    return [rpc.restart_count(), rpc.failed_workers(), nxt]
