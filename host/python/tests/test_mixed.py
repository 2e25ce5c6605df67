"""A Python process in a group of `wasmrpc worker`s: it calls the wasm
plugins they serve, serves the plugins its own options load, and runs no
code a peer names unless a plugin it loaded registered it."""

import re

import pytest
import torch

import wasmrpc
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
        # Its functions and classes, named from its file.
        seed = wasmrpc.plugin(plugin("seed_fns_py"))
        assert seed.namespace == "seed_fns_py"
        assert rpc.rpc_sync("worker1", seed.my_function, args=(1, 2, 3)) == 6
        # PyTorch's tutorial idiom: a method passed by reference, run on the
        # owner beside its object (`_call_method(method, rref)`).
        acc = rpc.remote("worker1", seed.Accumulator, args=(10,))
        assert rpc.rpc_sync("worker1", seed._call_method, args=(seed.Accumulator.add, acc, 5)) == 15
        assert rpc.rpc_sync("worker1", seed._call_method, args=(seed.Accumulator.get, acc)) == 15
        # A plugin's module by value cannot be rebuilt here; its state can.
        with pytest.raises(TypeError, match="cannot rebuild a plugin's module classes"):
            rpc.rpc_sync("worker1", seed.a_linear_layer)
        state = rpc.rpc_sync("worker1", seed.a_linear_layer_state)
        assert sorted(state) == ["bias", "weight"] and state["weight"].shape == (2, 3)
        # A reference comes back as one, equal to the name it stands for.
        assert rpc.rpc_sync("worker1", seed.my_function_ref) == seed.my_function
        # A torch builtin as an argument travels as its aten name too.
        ones = rpc.remote("worker1", torch.ones, args=((2,),))
        got = rpc.rpc_sync("worker1", seed._call_method, args=(torch.add, ones, 1))
        assert torch.equal(got, torch.full((2,), 2.0))
        # What the plugin does not export, and what may not travel.
        with pytest.raises(AttributeError, match="exports no 'nothing_here'; it has: .*my_function"):
            seed.nothing_here
        with pytest.raises(AttributeError, match="has no method 'nope'; it has: add, get"):
            seed.Accumulator.nope
        with pytest.raises(TypeError, match="cannot send the function .*_local over RPC"):
            def _local(x):
                return x
            rpc.rpc_sync("worker1", seed._call_method, args=(_local, acc))
        with pytest.raises(TypeError, match="runs on a worker that serves it"):
            seed.my_function(1, 2, 3)
        with pytest.raises(ValueError, match="is not a wasmrpc plugin"):
            wasmrpc.plugin(__file__)
        with pytest.raises(OSError, match="cannot read /no/such.wasm"):
            wasmrpc.plugin("/no/such.wasm")
    rpc.shutdown()


def test_a_python_process_serves_the_plugins_its_options_load():
    run_group(_serving, 2)


# worker1's refusal, or the traces of a worker1 that exited first: its end
# of the handshake reset or closed, or its port closed.
_REFUSED_OR_GONE = (
    r"did not prove that it holds the cluster secret"
    r"|handshake of worker driver: handshake: "
    r"|cannot connect to worker worker1 at \S+: Connection refused"
)


def _secret_driver(secret):
    def driver(rank, world_size, init_method):
        rpc.init_rpc(
            "driver",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=init_method, cluster_secret=secret
            ),
        )
        if secret == "the group's":
            assert rpc.rpc_sync("worker1", torch.add, args=(1, 2)) == 3
            rpc.shutdown()
            return
        # A peer that cannot prove the secret gets no call through, either way.
        # worker1 enters its graceful shutdown as soon as it is up, and its
        # report to the leader (this driver) is refused at once, so it may
        # exit before it answers this call's handshake (a race CI met).
        with pytest.raises(RuntimeError) as refused:
            rpc.rpc_sync("worker1", torch.add, args=(1, 2))
        assert re.search(_REFUSED_OR_GONE, str(refused.value)), str(refused.value)
        rpc.shutdown(graceful=False)

    return driver


def _driver_with_the_groups_secret(rank, world_size, init_method):
    _secret_driver("the group's")(rank, world_size, init_method)


def _driver_with_another_secret(rank, world_size, init_method):
    _secret_driver("another")(rank, world_size, init_method)


def test_a_python_process_holds_the_groups_secret_or_gets_nothing_through():
    secret = {"WASMRPC_CLUSTER_SECRET": "the group's"}
    run_group(_driver_with_the_groups_secret, 2, native_ranks=(1,), native_env=secret)
    # With another secret, the native worker refuses the driver too: its own
    # graceful shutdown cannot reach it, and its log says it refused it, as
    # the acceptor of the driver's call or as the dialer of its report.
    refused_by_worker = (
        r"(?s)wasmrpc worker rank 1 exited 1.*"
        r"(refused connection|worker driver did not prove that it holds the cluster secret)"
    )
    with pytest.raises(AssertionError, match=refused_by_worker) as failed:
        run_group(_driver_with_another_secret, 2, native_ranks=(1,), native_env=secret, timeout=60)
    # The driver itself saw the refusal it expected.
    assert "rank 0:" not in str(failed.value)

