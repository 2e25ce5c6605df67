"""`Tensor`: a handle to a tensor that lives in the worker (libtorch); every
operator and method runs there as an aten op, under the worker's op
policy, recorded by autograd."""

import struct

from . import _dtypes, _host, _scope
from .autograd import _autograd, no_grad

# Element types by the world's `dtype` case.
_DTYPES = _dtypes.BY_WIT


def op(name, *args, **kwargs):
    """Runs the aten op `name` (`"aten::add"`) on the worker; returns its
    result (tensors as `Tensor`s)."""
    nodes = _host.call("op", name, _host.call_args(args, kwargs))
    return _host.from_value(nodes)


class Tensor:
    """A tensor of the worker, by handle. Operators (`a + b`, `a @ b`, ...)
    and methods (`a.sum()`, `a.relu()`, any `aten::` op by its name: `a.t()`,
    `a.view(2, 3)`) run in the host."""

    __slots__ = ("_h", "_scope", "__weakref__")

    def __init__(self, *data):
        """`Tensor([[1., 2.], [3., 4.]])`: a float32 tensor from nested
        lists of numbers; `Tensor(2, 3)`: a float32 tensor of that size
        (zeros: the worker never hands out uninitialized memory)."""
        if len(data) == 1 and isinstance(data[0], (list, tuple)):
            t = tensor(data[0], dtype=_dtypes.float32)
        elif all(isinstance(d, int) and not isinstance(d, bool) for d in data):
            t = op("aten::zeros", list(data), dtype=_dtypes.float32)
        elif len(data) == 1 and isinstance(data[0], Tensor):
            t = data[0].float()
        else:
            raise TypeError(f"Tensor(...) takes nested lists or sizes, not {data!r}")
        self._h, self._scope = t._h, t._scope
        t._h = None

    @classmethod
    def _steal(cls, other):
        """An object of `cls` owning `other`'s handle (`other` is left
        released): how a `Parameter` wraps a fresh tensor."""
        t = object.__new__(cls)
        t._h, t._scope = other._h, other._scope
        other._h = None
        return t

    @classmethod
    def _own(cls, handle):
        t = object.__new__(cls)
        t._h = handle
        t._scope = _scope.current
        return t

    def _handle(self):
        if self._h is None:
            raise RuntimeError("this tensor was released")
        if self._scope is not None and not self._scope.alive:
            raise RuntimeError(
                "this tensor belongs to a call that has ended (keep tensors across calls "
                "with set_global, or in a @remote_class object)"
            )
        return self._h

    def _moved_handle(self):
        _, types = _host.bindings()
        return _host.call("dup", types.HandleKind.TENSOR, self._handle())

    def __del__(self):
        h, scope = getattr(self, "_h", None), getattr(self, "_scope", None)
        if h is not None and scope is not None and scope.alive:
            self._h = None
            try:
                _, types = _host.bindings()
                _host.call("drop_handle", types.HandleKind.TENSOR, h)
            except Exception:  # noqa: BLE001 (nothing to tell: the call may be ending)
                pass


    # ---- metadata and data -------------------------------------------------

    def _meta(self):
        return _host.call("tensor_info", self._handle())

    @property
    def shape(self):
        """The sizes, as a `torch.Size` (a tuple)."""
        return _dtypes.Size(self._meta().shape)

    def size(self, dim=None):
        """`size()` (a `torch.Size`) or `size(dim)`."""
        shape = self.shape
        return shape if dim is None else shape[dim]

    def dim(self):
        """The number of dimensions."""
        return len(self.shape)

    ndim = property(dim, doc="The number of dimensions.")

    def numel(self):
        """The number of elements."""
        return self.shape.numel()

    nelement = numel

    @property
    def dtype(self):
        """The element type: `torch.float32`, ... (equal to its name, as
        `t.dtype == "float32"`)."""
        return _DTYPES[self._meta().dtype.name]

    @property
    def device(self):
        """`device(type='cpu')`: the worker's tensors are on its CPU."""
        return _dtypes.CPU

    is_cuda = False

    def is_floating_point(self):
        """Whether the element type is a floating point type."""
        return self.dtype.is_floating_point

    def element_size(self):
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def requires_grad(self):
        """Whether autograd records ops on it."""
        return self._meta().requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        self.requires_grad_(value)

    def tolist(self):
        """The elements as nested lists of Python numbers."""
        meta, data = _host.call("tensor_read", self._handle())
        fmt = _DTYPES[meta.dtype.name].fmt
        if fmt is None or fmt == "e":
            return self.to(_dtypes.float32).tolist()
        n = len(data) // struct.calcsize(fmt)
        flat = list(struct.unpack("<" + fmt * n, data))

        def nest(items, shape):
            if not shape:
                return items[0]
            if len(shape) == 1:
                return items
            step = len(items) // shape[0] if shape[0] else 0
            return [nest(items[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]

        return nest(flat, list(meta.shape))

    def item(self):
        """The one element as a Python number."""
        if self.numel() != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
        v = self.tolist()
        while isinstance(v, list):
            v = v[0]
        return v

    def __repr__(self):
        try:
            d = self.dtype
            extra = "" if d in (_dtypes.float32, _dtypes.int64, _dtypes.bool_) else f", dtype={d!r}"
            return f"tensor({self.tolist()!r}{extra})"
        except Exception:  # noqa: BLE001 (repr must not raise)
            return "tensor(<released>)"

    # ---- conversions -------------------------------------------------------

    def to(self, *args, **kwargs):
        """`to(torch.long)`, `to(dtype=...)`, `to(other)` (its dtype),
        `to("cpu")` / `to(device, dtype)`: a copy only when the dtype
        changes (a device other than the CPU raises)."""
        target = kwargs.pop("dtype", None)
        _dtypes.check_device(kwargs.pop("device", None))
        kwargs.pop("non_blocking", None)
        copy = kwargs.pop("copy", False)
        if kwargs:
            raise TypeError(f"to() got unexpected keyword arguments {sorted(kwargs)}")
        for a in args:
            if isinstance(a, Tensor):
                target = a.dtype
            elif isinstance(a, (_dtypes.dtype, type)) or (
                isinstance(a, str) and a in _dtypes.BY_NAME
            ):
                target = _dtypes.as_dtype(a)
            else:
                _dtypes.check_device(a)
        if target is None or (not copy and _dtypes.as_dtype(target) is self.dtype):
            return op("aten::clone", self) if copy else self
        return op("aten::to", self, _dtypes.as_dtype(target), False, bool(copy))

    def type(self, dtype=None):  # noqa: A003 (torch's name)
        """`type()`: `"torch.FloatTensor"`...; `type(torch.long)`: `to`."""
        if dtype is None:
            return _TYPE_NAMES.get(self.dtype.name, f"torch.{self.dtype.name}")
        return self.to(dtype)

    def float(self):  # noqa: A003
        """`to(torch.float32)`."""
        return self.to(_dtypes.float32)

    def double(self):
        """`to(torch.float64)`."""
        return self.to(_dtypes.float64)

    def half(self):
        """`to(torch.float16)`."""
        return self.to(_dtypes.float16)

    def long(self):
        """`to(torch.int64)`."""
        return self.to(_dtypes.int64)

    def int(self):  # noqa: A003
        """`to(torch.int32)`."""
        return self.to(_dtypes.int32)

    def bool(self):  # noqa: A003
        """`to(torch.bool)`."""
        return self.to(_dtypes.bool_)

    def cpu(self):
        """`self`: the worker's tensors are on its CPU."""
        return self

    def cuda(self, *args, **kwargs):
        """Raises: no GPU is reachable from a plugin."""
        raise RuntimeError("cuda is not available in a wasmrpc plugin: tensors live on the worker's CPU")

    def numpy(self):
        """Raises: a plugin has no NumPy (use `tolist()`)."""
        raise RuntimeError("a wasmrpc plugin has no NumPy: use tolist()")

    def __bool__(self):
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return bool(self.item())

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.is_floating_point or self.numel() != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    # ---- operators ---------------------------------------------------------

    def __add__(self, other):
        return op("aten::add", self, other)

    def __radd__(self, other):
        return op("aten::add", self, other)

    def __sub__(self, other):
        return op("aten::sub", self, other)

    def __rsub__(self, other):
        return op("aten::rsub", self, other)

    def __mul__(self, other):
        return op("aten::mul", self, other)

    def __rmul__(self, other):
        return op("aten::mul", self, other)

    def __truediv__(self, other):
        return op("aten::div", self, other)

    def __rtruediv__(self, other):
        # As torch's own `__rtruediv__`: `other * self.reciprocal()`.
        return op("aten::mul", op("aten::reciprocal", self), other)

    def __floordiv__(self, other):
        return op("aten::floor_divide", self, other)

    def __rfloordiv__(self, other):
        return op("aten::floor_divide", op("aten::full_like", self, other), self)

    def __mod__(self, other):
        return op("aten::remainder", self, other)

    def __matmul__(self, other):
        return op("aten::matmul", self, other)

    def __rmatmul__(self, other):
        return op("aten::matmul", other, self)

    def __neg__(self):
        return op("aten::neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return op("aten::abs", self)

    def __invert__(self):
        return op("aten::bitwise_not", self)

    def __and__(self, other):
        return op("aten::bitwise_and", self, other)

    __rand__ = __and__

    def __or__(self, other):
        return op("aten::bitwise_or", self, other)

    __ror__ = __or__

    def __xor__(self, other):
        return op("aten::bitwise_xor", self, other)

    __rxor__ = __xor__

    def __pow__(self, exponent):
        return op("aten::pow", self, exponent)

    def __rpow__(self, base):
        return op("aten::pow", base, self)

    def __iadd__(self, other):
        return op("aten::add_", self, other)

    def __isub__(self, other):
        return op("aten::sub_", self, other)

    def __imul__(self, other):
        return op("aten::mul_", self, other)

    def __itruediv__(self, other):
        return op("aten::div_", self, other)

    def __eq__(self, other):
        return op("aten::eq", self, other)

    def __ne__(self, other):
        return op("aten::ne", self, other)

    def __lt__(self, other):
        return op("aten::lt", self, other)

    def __le__(self, other):
        return op("aten::le", self, other)

    def __gt__(self, other):
        return op("aten::gt", self, other)

    def __ge__(self, other):
        return op("aten::ge", self, other)

    def __hash__(self):
        # By object, as torch: `==` is elementwise, so a tensor is a dict key
        # only by identity.
        return id(self)

    def __len__(self):
        shape = self.shape
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def __iter__(self):
        for i in range(len(self)):
            yield op("aten::select", self, 0, i)

    # ---- indexing ----------------------------------------------------------

    def __getitem__(self, index):
        view, advanced = _basic_index(self, index)
        if advanced is None:
            return view
        return op("aten::index", view, advanced)

    def __setitem__(self, index, value):
        view, advanced = _basic_index(self, index)
        if advanced is not None:
            if not isinstance(value, Tensor):
                value = tensor(value, dtype=self.dtype)
            op("aten::index_put_", view, advanced, value, False)
        elif isinstance(value, Tensor):
            op("aten::copy_", view, value)
        else:
            op("aten::fill_", view, value)

    @property
    def T(self):  # noqa: N802 (torch's name)
        """The dimensions reversed (`t()` for a matrix)."""
        n = self.dim()
        return self if n < 2 else op("aten::permute", self, list(range(n - 1, -1, -1)))

    @property
    def mT(self):  # noqa: N802 (torch's name)
        """The last two dimensions swapped."""
        return op("aten::transpose", self, -2, -1)

    # ---- methods -----------------------------------------------------------

    def add(self, other, alpha=1):
        """`self + alpha * other`."""
        if alpha == 1:
            return op("aten::add", self, other)
        return op("aten::add", self, other, alpha=alpha)

    def view(self, *shape):
        """`view(2, 3)`, `view((2, 3))` or `view(torch.long)` (a dtype)."""
        if len(shape) == 1 and isinstance(shape[0], _dtypes.dtype):
            return op("aten::view", self, shape[0])
        return op("aten::view", self, _sizes(shape))

    def reshape(self, *shape):
        """`reshape(2, 3)` or `reshape((2, 3))`."""
        return op("aten::reshape", self, _sizes(shape))

    def permute(self, *dims):
        """`permute(1, 0)` or `permute((1, 0))`."""
        return op("aten::permute", self, _sizes(dims))

    def expand(self, *sizes):
        """`expand(4, -1)` or `expand((4, -1))`."""
        return op("aten::expand", self, _sizes(sizes))

    def repeat(self, *sizes):
        """`repeat(2, 1)` or `repeat((2, 1))`."""
        return op("aten::repeat", self, _sizes(sizes))

    def tile(self, *sizes):
        """`tile(2, 1)` or `tile((2, 1))`."""
        return op("aten::tile", self, _sizes(sizes))

    def flip(self, *dims):
        """`flip(0)` or `flip((0, 1))`."""
        return op("aten::flip", self, _sizes(dims))

    def new_zeros(self, *size, **kwargs):
        """Zeros of this dtype."""
        kwargs.setdefault("dtype", self.dtype)
        return op("aten::zeros", _sizes(size), **kwargs)

    def new_ones(self, *size, **kwargs):
        """Ones of this dtype."""
        kwargs.setdefault("dtype", self.dtype)
        return op("aten::ones", _sizes(size), **kwargs)

    def new_full(self, size, fill_value, **kwargs):
        """`fill_value` everywhere, of this dtype."""
        kwargs.setdefault("dtype", self.dtype)
        return op("aten::full", list(size), fill_value, **kwargs)

    def new_tensor(self, data, dtype=None):
        """A tensor from nested lists, of this dtype unless told."""
        return tensor(data, dtype=dtype or self.dtype)

    def requires_grad_(self, requires_grad=True):
        """Sets `requires_grad` in place; returns `self`."""
        _autograd("SetRequiresGrad", (self._handle(), bool(requires_grad)))
        return self

    @property
    def grad(self):
        """The gradient local autograd accumulated, or `None`; assigning a
        tensor or `None` sets it (the `set-grad` host call)."""
        return _autograd("Grad", self._handle())

    @grad.setter
    def grad(self, value):
        _host.call("set_grad", self._handle(), None if value is None else value._handle())

    @property
    def data(self):
        """The same elements, outside autograd (`detach()`)."""
        return op("aten::detach", self)

    @data.setter
    def data(self, value):
        # torch swaps the storage; the kit copies into it (same shape only).
        with no_grad():
            op("aten::copy_", self, value)

    def backward(self, gradient=None, retain_graph=None, create_graph=False):
        """Local autograd from this scalar (the host's `Backward` request
        takes no gradient argument: a non-scalar is reduced as
        `(self * gradient).sum()` first, which gives the same gradients)."""
        if create_graph:
            raise NotImplementedError("backward(create_graph=True) is not supported by the worker")
        root = self if gradient is None else op("aten::sum", op("aten::mul", self, gradient))
        _autograd("Backward", root._handle())

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def method(*args, **kwargs):
            return op(f"aten::{name}", self, *args, **kwargs)

        method.__name__ = name
        return method


# `Tensor.type()` names, as torch prints them.
_TYPE_NAMES = {
    "float32": "torch.FloatTensor",
    "float64": "torch.DoubleTensor",
    "float16": "torch.HalfTensor",
    "bfloat16": "torch.BFloat16Tensor",
    "int64": "torch.LongTensor",
    "int32": "torch.IntTensor",
    "int16": "torch.ShortTensor",
    "int8": "torch.CharTensor",
    "uint8": "torch.ByteTensor",
    "bool": "torch.BoolTensor",
}


def _sizes(sizes):
    """`(2, 3)` or `((2, 3),)` or `([2, 3],)` as a list."""
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    return [int(s) for s in sizes]


def _basic_index(t, index):
    """Applies the basic part of `t[index]` (ints by `select`, slices by
    `slice`, `None` by `unsqueeze`, `...`), which gives a view of `t`, and
    returns it with the advanced part (tensors, lists, bool masks) as the
    `Tensor?[]` that `aten::index` / `index_put_` take for the view, or
    `None` when there is none. Ints are applied by `select` before the
    advanced part, as torch does."""
    if not isinstance(index, tuple):
        index = (index,)
    index = tuple(
        tensor(i, dtype=_dtypes.bool_ if _all_bools(i) else _dtypes.int64)
        if isinstance(i, list)
        else i
        for i in index
    )
    # How many dims of `t` the entries consume, to expand `...`.
    consumed = 0
    for i in index:
        if isinstance(i, Tensor):
            consumed += i.dim() if i.dtype in (_dtypes.bool_, _dtypes.uint8) else 1
        elif i is not None and i is not Ellipsis and not isinstance(i, bool):
            consumed += 1
    ndim = t.dim()
    if consumed > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim}")
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    view, dim, advanced, any_advanced = t, 0, [], False
    for i in index:
        if i is Ellipsis:
            skip = ndim - consumed
            advanced.extend([None] * skip)
            dim += skip
        elif i is None:
            view = op("aten::unsqueeze", view, dim)
            advanced.append(None)
            dim += 1
        elif isinstance(i, bool):
            # `t[True]` adds a dim (torch: as `None`); `t[False]` an empty one.
            view = op("aten::unsqueeze", view, dim)
            if not i:
                view = op("aten::slice", view, dim, 0, 0, 1)
            advanced.append(None)
            dim += 1
        elif isinstance(i, int):
            view = op("aten::select", view, dim, int(i))
        elif isinstance(i, slice):
            step = 1 if i.step is None else int(i.step)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            start = None if i.start is None else int(i.start)
            stop = None if i.stop is None else int(i.stop)
            if (start, stop, step) != (None, None, 1):
                view = op("aten::slice", view, dim, start, stop, step)
            advanced.append(None)
            dim += 1
        elif isinstance(i, Tensor):
            advanced.append(i)
            any_advanced = True
            dim += i.dim() if i.dtype in (_dtypes.bool_, _dtypes.uint8) else 1
        else:
            raise IndexError(
                f"only integers, slices, ellipsis, None, tensors and lists are valid indices "
                f"(got {type(i).__name__})"
            )
    if not any_advanced:
        return view, None
    while advanced and advanced[-1] is None:
        advanced.pop()
    return view, advanced


def _all_bools(data):
    flat = []
    _flatten(data, flat)
    return bool(flat) and all(isinstance(x, bool) for x in flat)


def _flatten(x, out):
    if isinstance(x, (list, tuple)):
        for y in x:
            _flatten(y, out)
    elif isinstance(x, Tensor):
        out.extend(_flatten_list(x.tolist()))
    else:
        out.append(x)


def _flatten_list(v):
    out = []
    _flatten(v, out)
    return out


def tensor(data, dtype=None, requires_grad=False, device=None):
    """`torch.tensor(data, dtype=None)`: a tensor from a number or nested
    lists of numbers. Without `dtype`, as torch infers it: all bools give
    `torch.bool`, all ints `torch.int64`, else `torch.float32`. A `Tensor`
    is copied."""
    _dtypes.check_device(device)
    if isinstance(data, Tensor):
        out = op("aten::clone", op("aten::detach", data))
        if dtype is not None:
            out = out.to(dtype)
        return out.requires_grad_(True) if requires_grad else out
    shape = []
    probe = data
    while isinstance(probe, (list, tuple)):
        shape.append(len(probe))
        probe = probe[0] if probe else 0
    flat = []
    _flatten(data, flat)
    if dtype is None:
        if flat and all(isinstance(x, bool) for x in flat):
            dtype = _dtypes.bool_
        elif flat and all(isinstance(x, int) for x in flat):
            dtype = _dtypes.int64
        else:
            dtype = _dtypes.float32
    d = _dtypes.as_dtype(dtype)
    if d.fmt is None or d.fmt == "e":
        # No struct format for bfloat16 (and float16 needs rounding rules
        # the host applies): build float32 and convert there.
        return tensor(data, dtype=_dtypes.float32).to(d)
    if d.is_floating_point:
        flat = [float(x) for x in flat]
    elif d is _dtypes.bool_:
        flat = [bool(x) for x in flat]
    else:
        flat = [int(x) for x in flat]
    _, types = _host.bindings()
    raw = struct.pack("<" + d.fmt * len(flat), *flat)
    out = Tensor._own(_host.call("tensor_new", getattr(types.Dtype, d.wit), shape, raw))
    return out.requires_grad_(True) if requires_grad else out
