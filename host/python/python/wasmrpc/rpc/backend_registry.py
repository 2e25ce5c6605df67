"""`torch.distributed.rpc.backend_registry`: wasmrpc has one backend, under
PyTorch's name for its default one."""

import enum

from . import constants
from .options import TensorPipeRpcBackendOptions

BackendType = enum.Enum("BackendType", ["TENSORPIPE"])


def construct_rpc_backend_options(
    backend,
    rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method=constants.DEFAULT_INIT_METHOD,
    **kwargs,
):
    """The options of `backend`, made with these values."""
    if backend is not BackendType.TENSORPIPE:
        raise TypeError(f"unknown backend {backend!r}")
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)
