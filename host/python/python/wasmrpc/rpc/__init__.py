"""`torch.distributed.rpc` for a Python program, on the wasmrpc host.

The functions and classes keep PyTorch's names, arguments and errors:
`init_rpc`, `rpc_sync`, `rpc_async` (a `torch.futures.Future`), `remote`,
`RRef` (`to_here`, `local_value`, `owner`, and its `rpc_sync()` /
`rpc_async()` / `remote()` proxies), `get_worker_info`, `shutdown`,
`WorkerInfo`, `TensorPipeRpcBackendOptions`.

What differs, by design: the function a call runs is named, never sent.
It is given as

- a torch builtin (`torch.add`, `torch.ones`, `torch.Tensor.mul`), which
  runs as its `aten` op (PyTorch's own mapping);
- its registered name as a string: `"aten::add"`, or a plugin's
  `"plugin::function"`;
- an object carrying its registered name in `__wasmrpc_name__` with the
  plugin's namespace (what `wasmrpc.plugin_function` makes).

A Python function of the program is refused with a `TypeError`: it would
have to be pickled, and a worker runs no code a peer sends.
"""

import torch
import torch.jit._builtins

from .. import _futures, _native
from .._native import RRef, WorkerInfo
from ..distributed.autograd import _current_context_id

UNSET_RPC_TIMEOUT = -1.0
DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
DEFAULT_NUM_WORKER_THREADS = 16


class BackendType:
    """PyTorch's backend choice; wasmrpc has one backend, answering to
    PyTorch's name for it."""

    TENSORPIPE = "TENSORPIPE"


class TensorPipeRpcBackendOptions:
    """The options of `init_rpc` (PyTorch's names and defaults), with
    wasmrpc's own after the `*`:

    - `plugins`: wasm plugin files or folders this process serves (by
      default none: it serves only builtin ops);
    - `cluster_secret`: bytes every connection is authenticated with (by
      default the `WASMRPC_CLUSTER_SECRET` variable, as for `wasmrpc
      worker`; TLS comes from the `WASMRPC_TLS_*` variables);
    - `listen`: the address peers reach this process at
      (`"127.0.0.1:0"`: loopback, a free port);
    - `init_timeout`: how long to wait for the rest of the group, seconds.
    """

    def __init__(
        self,
        *,
        num_worker_threads=DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout=DEFAULT_RPC_TIMEOUT_SEC,
        init_method=DEFAULT_INIT_METHOD,
        device_maps=None,
        devices=None,
        _transports=None,
        _channels=None,
        plugins=(),
        cluster_secret=None,
        listen="127.0.0.1:0",
        init_timeout=300.0,
    ):
        if device_maps or devices:
            raise ValueError(
                "device_maps and devices are not available from a Python program yet: "
                "this process sends and receives CPU tensors"
            )
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        self.device_maps = {}
        self.devices = []
        self.plugins = [str(p) for p in plugins]
        self.cluster_secret = (
            cluster_secret.encode() if isinstance(cluster_secret, str) else cluster_secret
        )
        self.listen = listen
        self.init_timeout = init_timeout

    def set_device_map(self, to, device_map):
        raise ValueError("device maps are not available from a Python program yet")

    def set_devices(self, devices):
        raise ValueError("devices are not available from a Python program yet")


RpcBackendOptions = TensorPipeRpcBackendOptions


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
    """Starts this process's worker `name` and joins its group; with
    `world_size`, returns once every rank has joined."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, not {type(name).__name__}")
    if backend not in (None, BackendType.TENSORPIPE):
        raise ValueError(f"unknown backend {backend!r}: wasmrpc has BackendType.TENSORPIPE only")
    if rank is None:
        rank = -1
    if not isinstance(rank, int):
        raise TypeError(f"rank must be an int, not {type(rank).__name__}")
    if world_size is not None and not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, not {type(world_size).__name__}")
    options = rpc_backend_options if rpc_backend_options is not None else RpcBackendOptions()
    _native.init_rpc(
        name,
        rank,
        -1 if world_size is None else world_size,
        {
            "init_method": options.init_method,
            "rpc_timeout": float(options.rpc_timeout),
            "num_worker_threads": int(options.num_worker_threads),
            "init_timeout": float(getattr(options, "init_timeout", 300.0)),
            "plugins": list(getattr(options, "plugins", [])),
            "cluster_secret": getattr(options, "cluster_secret", None),
            "listen": getattr(options, "listen", "127.0.0.1:0"),
        },
    )


def shutdown(graceful=True, timeout=DEFAULT_SHUTDOWN_TIMEOUT):
    """Stops this worker; gracefully, once every worker of the group is
    done."""
    _native.shutdown(graceful, float(timeout))


def get_worker_info(worker_name=None):
    """The `WorkerInfo` of the worker named (or ranked) `worker_name`;
    this worker's without one."""
    return _native.get_worker_info(worker_name)


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
    return None if timeout is None or timeout == UNSET_RPC_TIMEOUT else float(timeout)


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs `func` on worker `to` and returns its result."""
    return _native.rpc_sync(
        to, _function_name(func), args, kwargs, _timeout(timeout), _current_context_id()
    )


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Starts `func` on worker `to`; returns a `torch.futures.Future` of
    its result."""
    return _native.rpc_async(
        to, _function_name(func), args, kwargs, _timeout(timeout), _current_context_id()
    )


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs `func` on worker `to`, keeps the result there, and returns an
    `RRef` to it at once."""
    return _native.remote(
        to, _function_name(func), args, kwargs, _timeout(timeout), _current_context_id()
    )


__all__ = [
    "BackendType",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
