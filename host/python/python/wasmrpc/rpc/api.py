"""`torch.distributed.rpc.api`: the module-level calls of this process's
worker."""

import torch
import torch.jit._builtins

from .. import _native
from .._native import RRef, WorkerInfo  # noqa: F401 (PyTorch's api module has them)
from . import constants
from .backend_registry import BackendType, construct_rpc_backend_options
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions

# Read and written by PyTorch's test fixture; RRef leaks are always
# reported at shutdown here.
_ignore_rref_leak = False


def _check_type(name, value, kind):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"Argument {name} must be of type {kind.__name__}.")


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
    """Starts this process's worker `name` and joins its group; with
    `world_size`, returns once every rank has joined. Errors as PyTorch's:
    `TypeError` for arguments of the wrong type, `RuntimeError` for a name
    taken or invalid, a second `init_rpc`, a failed rendezvous."""
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if backend is None and rpc_backend_options is not None:
        if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
            raise TypeError(f"Could not infer backend for options {rpc_backend_options}")
        backend = BackendType.TENSORPIPE
    if backend is None:
        backend = BackendType.TENSORPIPE
    if rpc_backend_options is None:
        rpc_backend_options = construct_rpc_backend_options(backend)
    if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
        raise TypeError(
            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. "
            f"Got {type(rpc_backend_options)}."
        )
    _check_type("name", name, str)
    if rank is None:
        rank = -1
    _check_type("rank", rank, int)
    if world_size is not None:
        _check_type("world_size", world_size, int)
    options = rpc_backend_options
    _native.init_rpc(
        name,
        rank,
        -1 if world_size is None else world_size,
        {
            "init_method": options.init_method,
            "rpc_timeout": float(options.rpc_timeout),
            "num_worker_threads": int(options.num_worker_threads),
            "init_timeout": float(options.init_timeout),
            "plugins": list(options.plugins),
            "cluster_secret": options.cluster_secret,
            "listen": options.listen,
        },
    )


def shutdown(graceful=True, timeout=constants.DEFAULT_SHUTDOWN_TIMEOUT):
    """Stops this worker; gracefully, once every worker of the group is
    done."""
    _native.shutdown(graceful, float(timeout))


def get_worker_info(worker_name=None):
    """The `WorkerInfo` of the worker named (or ranked) `worker_name`;
    this worker's without one."""
    return _native.get_worker_info(worker_name)


def get_rpc_timeout():
    """The default timeout of calls, in seconds (0: none)."""
    return _native.get_rpc_timeout()


def _set_rpc_timeout(seconds):
    """Sets the default timeout of calls, in seconds."""
    _native.set_rpc_timeout(float(seconds))


def _function_name(func):
    """The registered name a call of `func` runs."""
    if isinstance(func, str):
        return func
    named = getattr(func, "__wasmrpc_name__", None)
    if isinstance(named, str) and "::" in named:
        return named
    builtin = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return builtin
    what = getattr(func, "__qualname__", None) or type(func).__name__
    raise TypeError(
        f"cannot call {what} by RPC: wasmrpc runs functions by their registered names, "
        "never pickled code. Pass a torch builtin (torch.add), an op's name ('aten::add') or "
        "a plugin's function ('plugin::function')"
    )


def _timeout(timeout):
    return None if timeout is None or timeout == constants.UNSET_RPC_TIMEOUT else float(timeout)


def rpc_sync(to, func, args=None, kwargs=None, timeout=constants.UNSET_RPC_TIMEOUT):
    """Runs `func` on worker `to` and returns its result."""
    return _native.rpc_sync(to, _function_name(func), args, kwargs, _timeout(timeout))


def rpc_async(to, func, args=None, kwargs=None, timeout=constants.UNSET_RPC_TIMEOUT):
    """Starts `func` on worker `to`; returns a `torch.futures.Future` of
    its result."""
    return _native.rpc_async(to, _function_name(func), args, kwargs, _timeout(timeout))


def remote(to, func, args=None, kwargs=None, timeout=constants.UNSET_RPC_TIMEOUT):
    """Runs `func` on worker `to`, keeps the result there, and returns an
    `RRef` to it at once."""
    return _native.remote(to, _function_name(func), args, kwargs, _timeout(timeout))
