"""A parameter server and its trainers, in Python: PyTorch's "Implementing
a Parameter Server Using Distributed RPC Framework" tutorial on a linear
model, as a wasmrpc Python plugin (served as `ps_trainer_py::NAME`).

worker0 runs `run(trainers, steps, lr)`: it makes a `ParameterServer` object
(the model's weight and bias) in an RRef it owns, and has every trainer
(worker1..) run `train` at once on its shard of the data. A trainer gets
RRefs to the parameters, makes a `DistributedOptimizer` over them, and for
each step, in a distributed autograd context, runs the forward pass on the
parameter server through the RRef, computes the mean squared error where
it is, runs the backward pass across workers and steps the optimizer (which
updates the parameters on the server). `run` returns every trainer's losses
and the learned parameters.

    wasmrpc launch --nproc 3 --plugins target/wasm-plugins/python \\
        --entry ps_trainer_py::run -- 2 40 0.25

The data: `y = x @ [2, -3, 0.5, 1] + 0.25` on points from a seeded
generator, so every run learns the same thing and no worker reads a file.
"""

from wasmrpc import RRef, dist_autograd, remote, remote_class, rpc, torch
from wasmrpc.optim import SGD, DistributedOptimizer

FEATURES = 4
TRUE_W = [2.0, -3.0, 0.5, 1.0]
TRUE_B = 0.25


def shard(rank, trainers, rows=64):
    """Trainer `rank`'s points: `(x, y)` as nested lists."""
    state = 12345 + 7919 * rank
    xs, ys = [], []
    for _ in range(rows):
        row = []
        for _ in range(FEATURES):
            state = (1103515245 * state + 12345) % (1 << 31)
            row.append(state / (1 << 31) * 2 - 1)
        xs.append(row)
        ys.append([sum(w * v for w, v in zip(TRUE_W, row)) + TRUE_B])
    return xs, ys


@remote_class
class ParameterServer:
    """The model's parameters, on the worker that owns this object."""

    def __init__(self, features):
        self.w = torch.zeros(features, 1).requires_grad_(True)
        self.b = torch.zeros(1).requires_grad_(True)

    def forward(self, x):
        return x @ self.w + self.b

    def parameter_rrefs(self):
        return [RRef(self.w), RRef(self.b)]

    def parameters(self):
        return (self.w.detach(), self.b.detach())


@remote
def train(ps_rref, rank, trainers, steps, lr):
    """One trainer: `steps` distributed SGD steps on its shard; returns its
    losses."""
    xs, ys = shard(rank, trainers)
    x, y = torch.tensor(xs), torch.tensor(ys)
    opt = DistributedOptimizer(SGD(lr), ps_rref.rpc_sync().parameter_rrefs())
    losses = []
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            pred = ps_rref.rpc_sync().forward(x)
            loss = ((pred - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
    return losses


@remote
def run(trainers, steps=40, lr=0.25):
    """The driver, on the parameter server: trains, returns `(losses of
    each trainer, learned weight, learned bias)`."""
    me = rpc.get_worker_info().name
    ps_rref = rpc.remote(me, ParameterServer, args=(FEATURES,))
    futs = [
        rpc.rpc_async(f"worker{k}", train, args=(ps_rref, k, trainers, steps, lr))
        for k in range(1, trainers + 1)
    ]
    losses = [f.wait() for f in futs]
    w, b = ps_rref.rpc_sync().parameters()
    return (losses, w.tolist(), b.tolist())
