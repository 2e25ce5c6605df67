"""The options of `init_rpc`: `RpcBackendOptions` (the base any backend's
options derive from, as in PyTorch) and `TensorPipeRpcBackendOptions`
(PyTorch's names and defaults, plus wasmrpc's own after them)."""

import numbers

from . import constants


def _seconds(name, value):
    # PyTorch's options are a pybind11 class: a value of another type is
    # refused with pybind11's text.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            "__init__(): incompatible constructor arguments. The following argument types "
            f"are supported: {name}: float (seconds). Invoked with: {value!r}"
        )
    return float(value)


class RpcBackendOptions:
    """What every backend's options have: the default call timeout (in
    seconds) and how workers find each other."""

    def __init__(
        self,
        rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
        init_method=constants.DEFAULT_INIT_METHOD,
    ):
        self.rpc_timeout = _seconds("rpc_timeout", rpc_timeout)
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """The options of wasmrpc's backend, under PyTorch's name for its
    default backend's (`num_worker_threads`, `rpc_timeout`, `init_method`;
    `_transports` and `_channels` are taken and ignored), with wasmrpc's
    own:

    - `plugins`: wasm plugin files or folders this process serves (by
      default none: it serves only builtin ops);
    - `cluster_secret`: bytes every connection is authenticated with (by
      default the `WASMRPC_CLUSTER_SECRET` variable, as for `wasmrpc
      worker`; TLS comes from the `WASMRPC_TLS_*` variables);
    - `listen`: the address peers reach this process at (`"127.0.0.1:0"`:
      loopback, a free port);
    - `init_timeout`: how long to wait for the rest of the group, seconds.

    `device_maps` and `devices` are refused: a Python process sends and
    receives CPU tensors (GPU tensors between workers are the `wasmrpc
    worker`'s)."""

    def __init__(
        self,
        *,
        num_worker_threads=constants.DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
        init_method=constants.DEFAULT_INIT_METHOD,
        device_maps=None,
        devices=None,
        _transports=None,
        _channels=None,
        plugins=(),
        cluster_secret=None,
        listen="127.0.0.1:0",
        init_timeout=300.0,
    ):
        super().__init__(rpc_timeout, init_method)
        if device_maps or devices:
            raise ValueError(
                "device_maps and devices are not available from a Python program: this "
                "process sends and receives CPU tensors"
            )
        self.num_worker_threads = num_worker_threads
        self.device_maps = {}
        self.devices = []
        self.plugins = [str(p) for p in plugins]
        self.cluster_secret = (
            cluster_secret.encode() if isinstance(cluster_secret, str) else cluster_secret
        )
        self.listen = listen
        self.init_timeout = _seconds("init_timeout", init_timeout)

    def set_device_map(self, to, device_map):
        """Refused: a Python process keeps its tensors on the CPU."""
        raise ValueError("device maps are not available from a Python program")

    def set_devices(self, devices):
        """Refused: a Python process keeps its tensors on the CPU."""
        raise ValueError("devices are not available from a Python program")
