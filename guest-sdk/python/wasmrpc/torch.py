"""`torch` for plugins: `from wasmrpc import torch`, then write PyTorch.

What it has, as real attributes:
- the classes and constants: `torch.Tensor`, `torch.Size`, `torch.dtype`,
  `torch.device`, and the dtypes `torch.float32` (`float`), `float64`
  (`double`), `float16` (`half`), `bfloat16`, `int64` (`long`), `int32`
  (`int`), `int16` (`short`), `int8`, `uint8`, `bool`;
- the submodules `torch.nn` (with `nn.functional`, `nn.init`),
  `torch.optim` (local optimizers, `optim.lr_scheduler`), `torch.futures`,
  `torch.autograd`, `torch.linalg` and `torch.fft` (`torch.linalg.norm` is
  `aten::linalg_norm`);
- grad mode: `no_grad`, `enable_grad`, `set_grad_enabled`,
  `is_grad_enabled`, `inference_mode`;
- factories taking sizes as varargs or a tuple and torch's keywords
  (`dtype`, `requires_grad`, `device="cpu"`): `zeros`, `ones`, `full`,
  `empty` (zeros: the worker never hands out uninitialized memory),
  `rand`, `randn`, `randint`, `randperm`, `arange`, `linspace`, `eye`, the
  `*_like` forms, `tensor`, `as_tensor`, `LongTensor`, `FloatTensor`, ...

Every other lowercase name is an aten op by that name, run in the worker
(`torch.cat`, `torch.matmul`, `torch.relu`, ...); the worker's op policy
decides whether it runs, and a name that is no op fails when called,
with the worker's error (the guest has no list of ops). A name that
cannot be an op (capitalized, or a torch submodule the kit lacks, such as
`torch.cuda` or `torch.distributed`) raises `AttributeError` at once,
naming what the kit has. Each op function also names its op for RPC:
`rpc_sync(dst, torch.add, args=(t, 1))` calls `aten::add` there.

`torch.manual_seed` raises `NotImplementedError`: the worker owns the
random generator and its policy refuses `aten::manual_seed`.
"""

import builtins as _builtins

from . import _dtypes, autograd, futures, nn, torch_optim as optim
from ._dtypes import Size, device, dtype
from .autograd import enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from .tensor import Tensor, op
from .tensor import tensor as _tensor

# This module defines `float`, `int` and `bool` (dtypes), as torch does:
# its own code uses these for Python's types.
_int, _float, _bool = _builtins.int, _builtins.float, _builtins.bool

__all__ = [
    "Size",
    "Tensor",
    "arange",
    "autograd",
    "device",
    "dtype",
    "enable_grad",
    "futures",
    "is_grad_enabled",
    "nn",
    "no_grad",
    "ones",
    "optim",
    "rand",
    "randn",
    "set_grad_enabled",
    "tensor",
    "zeros",
]


def _size(size):
    if len(size) == 1 and isinstance(size[0], (list, tuple)):
        return [_int(s) for s in size[0]]
    return [_int(s) for s in size]


def _options(kwargs, default_dtype=None):
    """Pops torch's factory keywords the kit handles itself: returns
    `(kwargs for the op, requires_grad)`."""
    requires_grad = kwargs.pop("requires_grad", False)
    _dtypes.check_device(kwargs.pop("device", None))
    kwargs.pop("pin_memory", None)
    layout = kwargs.pop("layout", None)
    if layout not in (None, "strided"):
        raise NotImplementedError("only strided tensors can be made in a plugin")
    if kwargs.pop("generator", None) is not None:
        raise NotImplementedError("the worker owns the random generator: a plugin cannot pass one")
    if kwargs.get("out") is not None:
        raise NotImplementedError("out= is not supported: assign the result")
    kwargs.pop("out", None)
    d = kwargs.get("dtype")
    if d is not None:
        kwargs["dtype"] = _dtypes.as_dtype(d)
    elif default_dtype is not None:
        kwargs["dtype"] = default_dtype
    return kwargs, requires_grad


def _made(t, requires_grad):
    return t.requires_grad_(True) if requires_grad else t


def _sized(name, default_dtype=None):
    def factory(*size, **kwargs):
        kwargs, rg = _options(kwargs, default_dtype)
        return _made(op(f"aten::{name}", _size(size), **kwargs), rg)

    factory.__name__ = name
    factory.__doc__ = f"`torch.{name}(2, 3)` or `torch.{name}((2, 3))`, with `dtype=`, `requires_grad=`."
    factory.__wasmrpc_name__ = f"aten::{name}"
    return factory


zeros = _sized("zeros")
ones = _sized("ones")
rand = _sized("rand")
randn = _sized("randn")
# The worker refuses uninitialized memory (`aten::empty`): zeros instead.
empty = _sized("zeros")
empty.__name__ = "empty"
empty.__doc__ = "`torch.empty`: zeros (the worker never hands out uninitialized memory)."


def _like(name):
    def factory(input, *args, **kwargs):  # noqa: A002 (torch's name)
        kwargs, rg = _options(kwargs)
        return _made(op(f"aten::{name}", input, *args, **kwargs), rg)

    factory.__name__ = name
    factory.__doc__ = f"`torch.{name}(t)`: of `t`'s size and dtype (or `dtype=`)."
    factory.__wasmrpc_name__ = f"aten::{name}"
    return factory


zeros_like = _like("zeros_like")
ones_like = _like("ones_like")
full_like = _like("full_like")
rand_like = _like("rand_like")
randn_like = _like("randn_like")
empty_like = _like("zeros_like")


def full(size, fill_value, **kwargs):
    """`torch.full((2, 3), 7.0)` (dtype from `fill_value` unless told, as torch)."""
    kwargs, rg = _options(kwargs)
    if "dtype" not in kwargs:
        kwargs["dtype"] = (
            _dtypes.bool_ if isinstance(fill_value, _bool)
            else _dtypes.int64 if isinstance(fill_value, _int)
            else _dtypes.float32
        )
    return _made(op("aten::full", _size((size,)), fill_value, **kwargs), rg)


def arange(start, end=None, step=1, **kwargs):
    """`torch.arange(5)`, `arange(1, 4)`, `arange(0, 1, 0.25)`."""
    kwargs, rg = _options(kwargs)
    if end is None:
        return _made(op("aten::arange", start, **kwargs), rg)
    return _made(op("aten::arange", start, end, step, **kwargs), rg)


def linspace(start, end, steps, **kwargs):
    """`steps` evenly spaced values from `start` to `end`."""
    kwargs, rg = _options(kwargs)
    return _made(op("aten::linspace", start, end, steps, **kwargs), rg)


def eye(n, m=None, **kwargs):
    """The identity matrix (`n` by `m`)."""
    kwargs, rg = _options(kwargs)
    if m is None:
        return _made(op("aten::eye", n, **kwargs), rg)
    return _made(op("aten::eye", n, m, **kwargs), rg)


def randint(*args, **kwargs):
    """`torch.randint(high, size)` or `randint(low, high, size)` (int64)."""
    kwargs, rg = _options(kwargs, _dtypes.int64)
    size = kwargs.pop("size", None)
    if size is None:
        *args, size = args
    return _made(op("aten::randint", *args, list(size), **kwargs), rg)


def randperm(n, **kwargs):
    """A random permutation of `0..n` (int64)."""
    kwargs, rg = _options(kwargs, _dtypes.int64)
    return _made(op("aten::randperm", n, **kwargs), rg)


def tensor(data, dtype=None, device=None, requires_grad=False, pin_memory=False):  # noqa: A002
    """`torch.tensor(data, dtype=...)`: a new tensor from a number or nested
    lists (dtype inferred as torch: bools, ints to int64, else float32)."""
    return _tensor(data, dtype=dtype, requires_grad=requires_grad, device=device)


tensor.__wasmrpc_name__ = "aten::tensor"


def as_tensor(data, dtype=None, device=None):
    """`data` itself if it is a tensor of `dtype`, else a new tensor."""
    if isinstance(data, Tensor):
        return data if dtype is None else data.to(dtype)
    return _tensor(data, dtype=dtype, device=device)


def _typed(name, d):
    def make(*data):
        """`torch.LongTensor([1, 2])` (the data) or `torch.LongTensor(2, 3)`
        (zeros of that size)."""
        if len(data) == 1 and isinstance(data[0], (list, tuple)):
            return _tensor(data[0], dtype=d)
        if len(data) == 1 and isinstance(data[0], Tensor):
            return data[0].to(d)
        return op("aten::zeros", _size(data), dtype=d)

    make.__name__ = name
    return make


FloatTensor = _typed("FloatTensor", _dtypes.float32)
DoubleTensor = _typed("DoubleTensor", _dtypes.float64)
HalfTensor = _typed("HalfTensor", _dtypes.float16)
LongTensor = _typed("LongTensor", _dtypes.int64)
IntTensor = _typed("IntTensor", _dtypes.int32)
ShortTensor = _typed("ShortTensor", _dtypes.int16)
CharTensor = _typed("CharTensor", _dtypes.int8)
ByteTensor = _typed("ByteTensor", _dtypes.uint8)
BoolTensor = _typed("BoolTensor", _dtypes.bool_)


def manual_seed(seed):
    """Raises `NotImplementedError`: the worker owns the random generator
    (its op policy refuses `aten::manual_seed`); a plugin cannot seed it."""
    raise NotImplementedError(
        "torch.manual_seed is not available in a wasmrpc plugin: the worker owns the random "
        "generator and its op policy refuses aten::manual_seed. For reproducible weights, pass "
        "them in (load_state_dict) or build them from data (torch.tensor)."
    )


seed = manual_seed


def is_tensor(obj):
    """Whether `obj` is a `Tensor`."""
    return isinstance(obj, Tensor)


def is_floating_point(t):
    """Whether `t`'s dtype is a floating point type."""
    return t.dtype.is_floating_point


def get_default_dtype():
    """`torch.float32` (the only default the kit has)."""
    return _dtypes.float32


def set_default_dtype(d):
    """Accepts only `torch.float32` (the kit's fixed default)."""
    if _dtypes.as_dtype(d) is not _dtypes.float32:
        raise NotImplementedError("the kit's default dtype is float32 and cannot change")


def numel(t):
    """The number of elements of `t`."""
    return t.numel()


class _Prefixed:
    """`torch.linalg` / `torch.fft`: `torch.linalg.norm` is the aten op
    `linalg_norm`."""

    def __init__(self, name):
        self._prefix = name

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _op_function(f"{self._prefix}_{name}")

    def __repr__(self):
        return f"<wasmrpc torch.{self._prefix}: aten::{self._prefix}_* ops>"


linalg = _Prefixed("linalg")
fft = _Prefixed("fft")


class _Accelerator:
    """`torch.accelerator`: a plugin's tensors live on the worker's CPU, so
    there is none (`is_available()` is `False`), and code that asks first,
    as PyTorch's examples do, takes its CPU path."""

    @staticmethod
    def is_available():
        """`False`: no accelerator is in a plugin's reach."""
        return False

    @staticmethod
    def current_accelerator(check_available=False):
        """`None`, as torch answers without an accelerator."""
        if check_available:
            raise RuntimeError("no accelerator is available to a plugin: tensors live on the worker's CPU")
        return None

    @staticmethod
    def device_count():
        """0."""
        return 0


accelerator = _Accelerator()


def _op_function(name):
    def fn(*args, **kwargs):
        return op(f"aten::{name}", *args, **kwargs)

    fn.__name__ = name
    fn.__doc__ = f"The aten op `aten::{name}`, run in the worker."
    fn.__wasmrpc_name__ = f"aten::{name}"
    return fn


# torch's names the kit does not have, and why (AttributeError says so).
_MISSING = {
    "cuda": "tensors live on the worker's CPU",
    "mps": "tensors live on the worker's CPU",
    "distributed": "use wasmrpc.rpc, wasmrpc.dist_autograd and wasmrpc.optim",
    "save": "torch.save writes a pickle: use wasmrpc.save (safetensors)",
    "load": "torch.load reads a pickle: use wasmrpc.load",
    "from_numpy": "a plugin has no NumPy: use torch.tensor(list)",
    "jit": "no TorchScript in a plugin",
    "compile": "no compiler in a plugin",
    "utils": "no torch.utils (data loaders, checkpointing) in a plugin",
    "backends": "the worker picks its backends",
    "hub": "a plugin has no network",
    "onnx": "no exporters in a plugin",
    "fx": "no graph tracing in a plugin",
    "library": "a plugin cannot register ops",
    "multiprocessing": "a plugin has no processes",
    "testing": "no torch.testing in a plugin",
    "special": "no torch.special namespace (call its aten ops by name: torch.special_erf...)",
    "set_num_threads": "the worker owns its threads",
    "get_num_threads": "the worker owns its threads",
    "use_deterministic_algorithms": "the worker owns its settings",
    "initial_seed": "the worker owns the random generator",
    "set_rng_state": "the worker owns the random generator",
    "get_rng_state": "the worker owns the random generator",
}

_HAS = (
    "it has Tensor, Size, dtype, device, the dtypes (float32, long, ...), nn, optim, futures, "
    "autograd, linalg, fft, accelerator (none: is_available() is False), no_grad, enable_grad, set_grad_enabled, is_grad_enabled, the "
    "factories (zeros, ones, full, empty, rand, randn, randint, randperm, arange, linspace, eye, "
    "*_like, tensor, as_tensor, LongTensor, FloatTensor, ...), and any aten op by its lowercase "
    "name (torch.cat, torch.relu, ...)"
)

_LOWER = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def _plausible_op(name):
    """The rule for op-by-name: a lowercase identifier (letters, digits,
    underscores) starting with a letter, as every aten op's name is."""
    return _bool(name) and "a" <= name[0] <= "z" and all(c in _LOWER for c in name)


def __getattr__(name):
    if name in _MISSING:
        raise AttributeError(f"wasmrpc's torch has no attribute '{name}' ({_MISSING[name]}); {_HAS}")
    if not _plausible_op(name):
        raise AttributeError(f"wasmrpc's torch has no attribute '{name}'; {_HAS}")
    fn = _op_function(name)
    globals()[name] = fn  # made once per name
    return fn


# The dtypes, last: from here on `float`, `int` and `bool` in this module
# are torch's.
float32 = float = _dtypes.float32  # noqa: A001
float64 = double = _dtypes.float64
float16 = half = _dtypes.float16
bfloat16 = _dtypes.bfloat16
int64 = long = _dtypes.int64
int32 = int = _dtypes.int32  # noqa: A001
int16 = short = _dtypes.int16
int8 = _dtypes.int8
uint8 = _dtypes.uint8
bool = _dtypes.bool_  # noqa: A001
