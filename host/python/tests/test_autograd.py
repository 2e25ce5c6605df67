"""Distributed autograd and the distributed optimizer from Python: the
host's send and receive functions join the graph Python built, gradients
land in the context (never in `.grad`), and `DistributedOptimizer` steps
parameters where they live."""

import pytest
import torch

from groups import run_group
from wasmrpc import rpc
from wasmrpc.distributed import autograd as dist_autograd
from wasmrpc.distributed.optim import DistributedOptimizer


def _init(rank, world_size, init_method):
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method),
    )


def _one_graph(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    peer = f"worker{(rank + 1) % world_size}"
    a = torch.rand(3, 3, requires_grad=True)
    b = torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        # Local ops before and after the remote one: one graph.
        y = rpc.rpc_sync(peer, torch.matmul, args=(a * 2, b))
        loss = y.sigmoid().sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
    # The same pass done locally gives the same gradients.
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.matmul(a2 * 2, b2).sigmoid().sum().backward()
    assert torch.allclose(grads[a], a2.grad) and torch.allclose(grads[b], b2.grad)
    assert a.grad is None and b.grad is None
    rpc.shutdown()


def test_remote_ops_join_the_local_autograd_graph():
    run_group(_one_graph, 2)


def _context_errors(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    with dist_autograd.context():
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
            with dist_autograd.context():
                pass
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        dist_autograd.backward(100, [torch.ones(1, requires_grad=True).sum()])
    with dist_autograd.context() as context_id:
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(context_id, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(context_id, [torch.ones(1)])
        with pytest.raises(TypeError, match="roots must be tensors"):
            dist_autograd.backward(context_id, [1])
    rpc.shutdown()


def test_context_and_backward_errors_are_pytorchs():
    run_group(_context_errors, 1)


def _optimizer(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    if rank == 0:
        peer = "worker1"
        w = torch.ones(4, requires_grad=True)
        x = torch.arange(4.0)
        opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(w)], lr=0.5)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(peer, torch.mul, args=(w, x)).sum()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        # d loss / d w = x, so one step moves w by -0.5 x, in place.
        assert torch.allclose(w.detach(), torch.ones(4) - 0.5 * x)
        with pytest.raises(ValueError, match="SGD and torch.optim.Adam"):
            DistributedOptimizer(torch.optim.RMSprop, [rpc.RRef(w)], lr=0.1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
            DistributedOptimizer(torch.optim.SGD, [rpc.RRef(w)], lr=0.1, foo=1)
    rpc.shutdown()


def test_distributed_optimizer_steps_parameters_where_they_live():
    run_group(_optimizer, 2)
