"""`wasmrpc.rpc` from Python processes: calls of builtins, futures, RRefs
and their proxies, errors with PyTorch's classes and texts, and what a
Python process refuses to send."""

import pytest
import torch

from groups import run_group
from wasmrpc import rpc


def _init(rank, world_size, init_method, **extra):
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method, **extra),
    )


def _builtin_calls(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    peer = f"worker{(rank + 1) % world_size}"
    t = torch.ones(2, 3)
    assert torch.equal(rpc.rpc_sync(peer, torch.add, args=(t, 1)), t + 1)
    # A keyword argument, a string name, a rank and a WorkerInfo as the
    # destination.
    assert torch.equal(rpc.rpc_sync(peer, torch.add, args=(t, t), kwargs={"alpha": 3}), t * 4)
    assert torch.equal(rpc.rpc_sync((rank + 1) % world_size, "aten::mul", args=(t, 2)), t * 2)
    info = rpc.get_worker_info(peer)
    assert (info.name, info.id) == (peer, (rank + 1) % world_size)
    assert rpc.rpc_sync(info, torch.add, args=(2, 3)) == 5
    # Factories with sizes, a dtype and keyword arguments.
    z = rpc.rpc_sync(peer, torch.zeros, args=((2, 2),), kwargs={"dtype": torch.float64})
    assert z.dtype == torch.float64 and z.shape == (2, 2)
    # Several results in a tuple (torch.split).
    parts = rpc.rpc_sync(peer, torch.split, args=(torch.arange(6), 2))
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    rpc.shutdown()


def test_builtins_run_on_a_peer_as_their_aten_ops():
    run_group(_builtin_calls, 2)


def _futures(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    peer = f"worker{(rank + 1) % world_size}"
    futs = [rpc.rpc_async(peer, torch.add, args=(torch.ones(2), i)) for i in range(10)]
    assert all(isinstance(f, torch.futures.Future) for f in futs)
    values = torch.futures.wait_all(futs)
    assert [v[0].item() for v in values] == [1.0 + i for i in range(10)]
    chained = rpc.rpc_async(peer, torch.add, args=(1, 1)).then(lambda f: f.wait() * 10)
    assert chained.wait() == 20
    failing = rpc.rpc_async(peer, torch.add, args=(torch.ones(2), "x"))
    with pytest.raises(RuntimeError, match="failed to match any schema"):
        failing.wait()
    rpc.shutdown()


def test_rpc_async_returns_torch_futures():
    run_group(_futures, 2)


def _rrefs(rank, world_size, init_method):
    _init(rank, world_size, init_method)
    peer = f"worker{(rank + 1) % world_size}"
    r = rpc.remote(peer, torch.add, args=(torch.ones(2, 2), 4))
    assert not r.is_owner()
    assert r.owner() == rpc.get_worker_info(peer)
    assert r.owner_name() == peer
    assert torch.equal(r.to_here(), torch.full((2, 2), 5.0))
    # The proxies run tensor methods on the owner.
    assert r.rpc_sync().sum().item() == 20.0
    assert r.rpc_async().mul(2).wait()[0, 0].item() == 10.0
    assert torch.equal(r.remote().neg().to_here(), torch.full((2, 2), -5.0))
    with pytest.raises(RuntimeError, match=r"can't call localValue\(\) on user WorkerInfo"):
        r.local_value()
    # An RRef owned here holds the tensor itself, not a copy.
    t = torch.arange(4.0)
    mine = rpc.RRef(t)
    assert mine.is_owner() and mine.local_value() is t
    # An RRef as an argument: the owner hands its value to the op.
    total = rpc.rpc_sync(peer, "aten::add", args=(r.to_here(), 1))
    assert total[0, 0].item() == 6.0
    rpc.shutdown()


def test_remote_and_rrefs_behave_as_pytorchs():
    run_group(_rrefs, 2)


def _errors(rank, world_size, init_method):
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.rpc_sync("worker1", torch.add, args=(1, 1))
    _init(rank, world_size, init_method)
    with pytest.raises(RuntimeError, match="already initialized"):
        _init(rank, world_size, init_method)
    peer = f"worker{(rank + 1) % world_size}"
    # The op's own error, with PyTorch's text, as RuntimeError.
    with pytest.raises(RuntimeError, match="Overloaded torch operator invoked from Python failed"):
        rpc.rpc_sync(peer, torch.add, args=())
    with pytest.raises(RuntimeError, match="name:nobody, could not find destination"):
        rpc.rpc_sync("nobody", torch.add, args=(1, 1))
    # Nothing is pickled: a Python function, a lambda, an object.
    with pytest.raises(TypeError, match="never pickled code"):
        rpc.rpc_sync(peer, lambda x: x, args=(1,))
    with pytest.raises(TypeError, match="cannot send a value of type builtins.object"):
        rpc.rpc_sync(peer, torch.add, args=(object(), 1))
    with pytest.raises(OverflowError, match="does not fit in 64 bits"):
        rpc.rpc_sync(peer, torch.add, args=(2**70, 1))
    with pytest.raises(TypeError, match="args must be a tuple or a list"):
        rpc.rpc_sync(peer, torch.add, args=5)
    # Hostile values: a list containing itself, nesting past the limit, a
    # dict with a key that is not a string as kwargs.
    looped = []
    looped.append(looped)
    with pytest.raises(ValueError, match="nested more than 100 containers deep"):
        rpc.rpc_sync(peer, torch.add, args=(looped, 1))
    deep = 1
    for _ in range(150):
        deep = [deep]
    with pytest.raises(ValueError, match="nested more than 100 containers deep"):
        rpc.rpc_sync(peer, "aten::add", args=(deep, 1))
    with pytest.raises(TypeError, match="kwargs keys must be strings"):
        rpc.rpc_sync(peer, torch.add, args=(1, 1), kwargs={1: 2})
    # A function nobody registered.
    with pytest.raises(RuntimeError, match="no_such_plugin::f"):
        rpc.rpc_sync(peer, "no_such_plugin::f", args=())
    # A timeout, raised as PyTorch raises it.
    with pytest.raises(TypeError):
        rpc.init_rpc(5)
    rpc.shutdown()
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        rpc.get_worker_info()


def test_errors_are_pytorchs_classes_and_texts():
    run_group(_errors, 2)


def _bad_names(rank, world_size, init_method):
    with pytest.raises(RuntimeError, match="Worker name must match"):
        _init_named("abc*", rank, world_size, init_method)


def _init_named(name, rank, world_size, init_method):
    rpc.init_rpc(
        name,
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, init_timeout=5
        ),
    )


def test_an_invalid_worker_name_is_refused_before_joining():
    run_group(_bad_names, 1)


def _bad_options(rank, world_size, init_method):
    def init(**extra):
        rpc.init_rpc(
            "worker0",
            rank=0,
            world_size=1,
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=init_method, init_timeout=5, **extra
            ),
        )

    with pytest.raises(ValueError, match="listen address"):
        init(listen="not an address")
    with pytest.raises(RuntimeError, match="cannot load the plugins in /no/such/plugin.wasm"):
        init(plugins=["/no/such/plugin.wasm"])
    with pytest.raises(ValueError, match="device_maps and devices are not available"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"worker1": {0: 0}})
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout="soon")
    # None of these left a worker behind: a good init still works.
    init()
    assert rpc.get_worker_info().name == "worker0"
    rpc.shutdown()


def test_bad_options_are_refused_and_leave_nothing_behind():
    run_group(_bad_options, 1)
