"""`torch.distributed.rpc.constants`: the defaults, with PyTorch's values."""

DEFAULT_RPC_TIMEOUT_SEC = 60.0
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
DEFAULT_NUM_WORKER_THREADS = 16
