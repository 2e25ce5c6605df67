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
- an object whose `__wasmrpc_name__` is such a registered name.

A Python function of the program is refused with a `TypeError`: it would
have to be pickled, and a worker runs no code a peer sends.
"""

from . import api, backend_registry, constants, options  # noqa: F401
from .api import (
    RRef,
    WorkerInfo,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .backend_registry import BackendType
from .constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
)
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = [
    "BackendType",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
