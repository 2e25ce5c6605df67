"""A Python process in a group of `wasmrpc worker`s: it calls the wasm
plugins they serve, serves the plugins its own options load, and runs no
code a peer names unless a plugin it loaded registered it."""

import pytest
import torch

from groups import plugin, run_group
from wasmrpc import rpc


def _driver(rank, world_size, init_method):
    rpc.init_rpc(
        "driver",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method),
    )
    a, b = torch.rand(3), torch.rand(3)
    # A Rust plugin's function on a native worker, and a builtin there.
    assert torch.allclose(rpc.rpc_sync("worker1", "seed_fns::my_tensor_function", args=(a, b)), a + b)
    assert rpc.rpc_sync("worker1", "seed_fns::my_function", args=(1, 2, 3)) == 6
    with pytest.raises(ValueError, match="Expected error"):
        rpc.rpc_sync("worker1", "seed_fns::raise_func")
    # A plugin this process does not load is not served here.
    with pytest.raises(RuntimeError, match="seed_fns::identity"):
        rpc.rpc_sync("driver", "seed_fns::identity", args=(1,))
    rpc.shutdown()


def test_a_python_driver_calls_plugins_on_native_workers():
    run_group(
        _driver,
        2,
        native_ranks=(1,),
        native_args=("--plugins", plugin("seed_fns")),
    )


def _serving(rank, world_size, init_method):
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=init_method, plugins=[plugin("seed_fns_py")] if rank == 1 else []
        ),
    )
    if rank == 0:
        # The Python plugin runs sandboxed in the other Python process.
        t = rpc.rpc_sync("worker1", "seed_fns_py::my_py_add", args=(torch.ones(2), torch.ones(2)))
        assert torch.equal(t, torch.full((2,), 2.0))
    rpc.shutdown()


def test_a_python_process_serves_the_plugins_its_options_load():
    run_group(_serving, 2)
