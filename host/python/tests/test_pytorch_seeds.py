"""PyTorch's own RPC and distributed autograd test methods, their bodies as
PyTorch wrote them, run on four Python processes with `wasmrpc` in place
of `torch.distributed.rpc` (see `seed_fixture.py`).

`SEEDS` lists every seed method whose body calls only builtins and
tensors: those marked `RUNS` must pass on every rank; each other one says
why it does not run here. The count of each is printed at the end of the
session and is what the guide reports.
"""

import multiprocessing
import os
import tempfile
import traceback

import pytest

import seed_fixture

WORLD_SIZE = 4
RUNS = "runs"
# Why a candidate does not run, in a word the table below repeats.
DAMAGED = "the seed text is damaged here"
SPARSE = "sparse COO tensors do not cross from a Python process yet"
NO_DECORATOR = DAMAGED + ": its @dist_init decorator is missing"
PYTHON_HOOKS = (
    "the host's distributed backward pass does not run hooks Python registers on a tensor "
    "or an autograd node (register_hook); it runs the hooks of its own registry"
)

RPC = "rpc_test.py.txt"
AUTOGRAD = "dist_autograd_test.py.txt"

# (seed file, suite, method, RUNS or why not)
SEEDS = [
    (RPC, "RpcTest", "test_worker_id", RUNS),
    (RPC, "RpcTest", "test_self_add", RUNS),
    (RPC, "RpcTest", "test_send_to_rank", RUNS),
    (RPC, "RpcTest", "test_duplicate_name_2", RUNS),
    (RPC, "RpcTest", "test_reinit", RUNS),
    (RPC, "RpcTest", "test_invalid_names", RUNS),
    (RPC, "RpcTest", "test_add", RUNS),
    (RPC, "RpcTest", "test_add_with_id", RUNS),
    (RPC, "RpcTest", "test_scalar_add", RUNS),
    (RPC, "RpcTest", "test_async_add", RUNS),
    (RPC, "RpcTest", "test_nonzero", RUNS),
    (RPC, "RpcTest", "test_multi_rpc", RUNS),
    (RPC, "RpcTest", "test_shutdown_followed_by_rpc", RUNS),
    (RPC, "RpcTest", "test_builtin_remote_ret", DAMAGED + ": its helper's body is missing"),
    (RPC, "RpcTest", "test_builtin_remote_self", DAMAGED + ": its helper's body is missing"),
    (RPC, "RpcTest", "test_multi_builtin_remote_ret", DAMAGED + ": its helper is missing"),
    (RPC, "RpcTest", "test_local_rref_no_fork", RUNS),
    (RPC, "RpcTest", "test_local_value_not_on_owner", NO_DECORATOR),
    (RPC, "RpcTest", "test_owner_equality", RUNS),
    (RPC, "RpcTest", "test_local_shutdown", RUNS),
    (RPC, "RpcTest", "test_local_shutdown_with_rpc", RUNS),
    (RPC, "RpcTest", "test_set_and_get_default_rpc_timeout", RUNS),
    (RPC, "RpcTest", "test_dist_init_decorator", RUNS),
    (
        RPC,
        "RpcTest",
        "test_non_garbage_collected_user_rref_due_to_local_circular_dependency",
        RUNS,
    ),
    (RPC, "RpcTest", "test_rref_py_pickle_not_supported", RUNS),
    (RPC, "RpcTest", "test_callback_simple", RUNS),
    (RPC, "RpcTest", "test_callback_wrong_arg_num", RUNS),
    (RPC, "RpcTest", "test_callback_wrong_arg_type", RUNS),
    (RPC, "RpcTest", "test_callback_multi", RUNS),
    (RPC, "RpcTest", "test_callback_chain", RUNS),
    (RPC, "RpcTest", "test_callback_with_ret", RUNS),
    (RPC, "RpcTest", "test_add_done_callback", NO_DECORATOR),
    (RPC, "RpcTest", "test_mark_future_twice", RUNS),
    (RPC, "RpcTest", "test_future_done", RUNS),
    (RPC, "RpcTest", "test_init_pg_then_rpc", DAMAGED + ": a garbled decorator stack"),
    (RPC, "RpcTest", "test_init_rpc_then_pg", DAMAGED + ": the wrong decorator"),
    (RPC, "RpcTest", "test_wrong_types", RUNS),
    (RPC, "RpcTest", "test_cannot_infer_backend_from_options", RUNS),
    (RPC, "RpcTest", "test_owner_rref_backward", NO_DECORATOR),
    (RPC, "TensorPipeAgentRpcTest", "test_mismatched_type_for_options", RUNS),
    (
        RPC,
        "TensorPipeAgentRpcTest",
        "test_tensorpipe_set_default_timeout",
        DAMAGED + ": the method lost its class's indentation",
    ),
    (
        RPC,
        "TensorPipeAgentRpcTest",
        "test_tensorpipe_options_throw_on_timedelta_timeout",
        DAMAGED + ": the method lost its class's indentation",
    ),
    (RPC, "TensorPipeAgentRpcTest", "test_op_with_invalid_args", RUNS),
    (RPC, "TensorPipeAgentRpcTest", "test_send_to_rank_sparse", SPARSE),
    (RPC, "TensorPipeAgentRpcTest", "test_multi_rpc_sparse", SPARSE),
    (RPC, "TensorPipeAgentRpcTest", "test_builtin_remote_ret_sparse", SPARSE),
    (RPC, "TensorPipeAgentRpcTest", "test_builtin_remote_self_sparse", SPARSE),
    (RPC, "TensorPipeAgentRpcTest", "test_multi_builtin_remote_ret_sparse", SPARSE),
    (RPC, "TensorPipeAgentRpcTest", "test_dynamic_rpc_init_rpc", RUNS),
    (
        RPC,
        "TensorPipeAgentRpcTest",
        "test_dynamic_rpc_new_rank_can_communicated_with_existing_rank",
        RUNS,
    ),
    (
        RPC,
        "TensorPipeAgentRpcTest",
        "test_dynamic_rpc_existing_rank_can_communicate_with_new_rank",
        RUNS,
    ),
    (RPC, "TensorPipeAgentRpcTest", "test_dynamic_rpc_init_rpc_without_rank", RUNS),
    (RPC, "TensorPipeAgentRpcTest", "test_dynamic_and_static_init_rpc_together", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_nested_context", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_error_in_context", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_no_grad_on_tensor", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_simple", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_simple_self", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_multiple_round_trips", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_different_tensor_dims", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_unused_tensors", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_multiple_output_tensors", NO_DECORATOR),
    (AUTOGRAD, "DistAutogradTest", "test_backward_unused_send_function", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_autograd_engine_error", NO_DECORATOR),
    (AUTOGRAD, "DistAutogradTest", "test_backward_without_context", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_without_rpc", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_invalid_args", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_multiple_roots", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_different_dtypes", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_async_dist_autograd", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_accumulate_grads", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_multiple_backward", RUNS),
    (AUTOGRAD, "DistAutogradTest", "test_backward_verify_hooks", PYTHON_HOOKS),
    (AUTOGRAD, "DistAutogradTest", "test_no_grad_copy", NO_DECORATOR),
    (AUTOGRAD, "DistAutogradTest", "test_post_hooks", PYTHON_HOOKS),
    (AUTOGRAD, "DistAutogradTest", "test_grad_copy_sparse_indices_extra_ref", SPARSE),
    (AUTOGRAD, "TensorPipeAgentDistAutogradTest", "test_backward_no_grad_on_tensor_sparse", SPARSE),
    (
        AUTOGRAD,
        "TensorPipeAgentDistAutogradTest",
        "test_backward_no_grad_on_tensor_remote_sparse",
        SPARSE,
    ),
    (AUTOGRAD, "TensorPipeAgentDistAutogradTest", "test_backward_simple_sparse", SPARSE),
    (AUTOGRAD, "TensorPipeAgentDistAutogradTest", "test_backward_simple_self_sparse", SPARSE),
    (
        AUTOGRAD,
        "TensorPipeAgentDistAutogradTest",
        "test_backward_multiple_round_trips_sparse",
        SPARSE,
    ),
    (AUTOGRAD, "TensorPipeAgentDistAutogradTest", "test_backward_different_dtypes_sparse", SPARSE),
    (AUTOGRAD, "TensorPipeAgentDistAutogradTest", "test_multiple_backward_sparse", SPARSE),
]

# A seed method that has not finished on every rank by then fails (and the
# workers are started again for the next one).
TIMEOUT = 60


def seeds_dir():
    """`../shared/seeds` beside the repository (or `WASMRPC_SEEDS`)."""
    configured = os.environ.get("WASMRPC_SEEDS")
    if configured:
        return configured
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "..", "shared", "seeds"))


def _cleanup():
    """What a failed seed method may leave: a running worker, a context."""
    from wasmrpc import rpc
    from wasmrpc.distributed import autograd

    autograd._current.id = None
    # Each seed method ran in fresh processes under PyTorch: a process group
    # a method made is not the next one's.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        rpc.get_worker_info()
    except RuntimeError:
        return
    try:
        rpc.shutdown(graceful=False)
    except Exception:  # noqa: BLE001 (best effort before the next method)
        pass


def _serve(rank, world_size, conn):
    """One rank: runs the seed methods the parent sends, one at a time."""
    while True:
        job = conn.recv()
        if job is None:
            return
        path, suite, method, file_name, pg_file_name = job
        try:
            case = seed_fixture.test_case(
                path, suite, method, rank, world_size, file_name, pg_file_name
            )
            getattr(case, method)()
            conn.send(None)
        except BaseException:  # noqa: BLE001 (reported to the parent)
            conn.send(traceback.format_exc())
        _cleanup()


class Ranks:
    """`WORLD_SIZE` Python processes that run seed methods together."""

    def __init__(self):
        self.procs = []

    def start(self):
        ctx = multiprocessing.get_context("spawn")
        self.procs = []
        for rank in range(WORLD_SIZE):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, WORLD_SIZE, child), daemon=True)
            p.start()
            self.procs.append((p, parent))

    def stop(self):
        for p, conn in self.procs:
            try:
                conn.send(None)
            except OSError:
                pass
        for p, _ in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []

    def run(self, path, suite, method):
        if not self.procs or not all(p.is_alive() for p, _ in self.procs):
            self.stop()
            self.start()
        with tempfile.TemporaryDirectory() as tmp:
            job = (path, suite, method, os.path.join(tmp, "rpc"), os.path.join(tmp, "pg"))
            for _, conn in self.procs:
                conn.send(job)
            failures = []
            for rank, (p, conn) in enumerate(self.procs):
                if not conn.poll(TIMEOUT):
                    self.stop()
                    failures.append(f"rank {rank} did not finish within {TIMEOUT} s")
                    break
                error = conn.recv()
                if error:
                    failures.append(f"rank {rank}:\n{error}")
        if failures:
            # A method that failed on one rank may leave the others stuck:
            # start afresh.
            self.stop()
            raise AssertionError("\n".join(failures))


@pytest.fixture(scope="module")
def ranks():
    r = Ranks()
    yield r
    r.stop()


_OUTCOMES = {"passed": 0, "listed": 0}


@pytest.mark.parametrize(
    "seed,suite,method,status",
    SEEDS,
    ids=[f"{suite}::{method}" for _, suite, method, _ in SEEDS],
)
def test_seed_method(ranks, seed, suite, method, status):
    if status != RUNS:
        _OUTCOMES["listed"] += 1
        pytest.skip(f"not run: {status}")
    path = os.path.join(seeds_dir(), seed)
    assert os.path.exists(path), f"{path} is missing (the seeds sit beside the repository)"
    ranks.run(path, suite, method)
    _OUTCOMES["passed"] += 1


def test_the_seed_list_names_methods_of_the_seeds():
    """Every listed method exists in its seed file, in its suite (or, where
    the seed lost the method's indentation, as a function of the file)."""
    for seed, suite, method, _ in SEEDS:
        seed_file, _, _ = seed_fixture.load(os.path.join(seeds_dir(), seed))
        in_suite = method in seed_file.methods.get(suite, {})
        at_top = any(p.name == method for p in seed_file.top)
        assert in_suite or at_top, f"{seed}: no {suite}.{method}"
