"""`Tensor`: a handle to a tensor that lives in the worker (libtorch); every
operator and method runs there as an aten op, under the worker's op
policy, recorded by autograd."""

import struct

from . import _host, _scope

# Element types, as `torch.float32` ... name them.
_DTYPES = {
    "FLOAT32": "float32",
    "FLOAT64": "float64",
    "FLOAT16": "float16",
    "BFLOAT16": "bfloat16",
    "INT64": "int64",
    "INT32": "int32",
    "INT16": "int16",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOLEAN": "bool",
}


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

    def __init__(self, data):
        """`Tensor([[1., 2.], [3., 4.]])`: a float32 tensor from nested
        lists of numbers (as `torch.tensor`)."""
        t = tensor(data)
        self._h, self._scope = t._h, t._scope
        t._h = None

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
        """The sizes, as a tuple."""
        return tuple(self._meta().shape)

    def size(self, dim=None):
        """`size()` or `size(dim)`."""
        shape = self.shape
        return shape if dim is None else shape[dim]

    def dim(self):
        """The number of dimensions."""
        return len(self.shape)

    def numel(self):
        """The number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def dtype(self):
        """The element type's name (`"float32"`)."""
        return _DTYPES[self._meta().dtype.name]

    @property
    def requires_grad(self):
        """Whether autograd records ops on it."""
        return self._meta().requires_grad

    def tolist(self):
        """The elements as nested lists of Python numbers."""
        meta, data = _host.call("tensor_read", self._handle())
        fmt = {
            "FLOAT32": "f",
            "FLOAT64": "d",
            "INT64": "q",
            "INT32": "i",
            "INT16": "h",
            "INT8": "b",
            "UINT8": "B",
            "BOOLEAN": "?",
        }.get(meta.dtype.name)
        if fmt is None:
            return self.to(dtype=6).tolist()  # float32 (ScalarType 6)
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
            return f"tensor({self.tolist()!r})"
        except Exception:  # noqa: BLE001 (repr must not raise)
            return "tensor(<released>)"

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

    def __matmul__(self, other):
        return op("aten::matmul", self, other)

    def __neg__(self):
        return op("aten::neg", self)

    def __pow__(self, exponent):
        return op("aten::pow", self, exponent)

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

    def __hash__(self):
        return hash(("tensor", self._h))

    def __getitem__(self, index):
        if isinstance(index, int):
            return op("aten::select", self, 0, index)
        raise TypeError("only integer indexing is supported on a wasmrpc Tensor")

    def __len__(self):
        return self.shape[0]

    # ---- methods -----------------------------------------------------------

    def add(self, other, alpha=1):
        """`self + alpha * other`."""
        if alpha == 1:
            return op("aten::add", self, other)
        return op("aten::add", self, other, alpha=alpha)

    def view(self, *shape):
        """`view(2, 3)` or `view((2, 3))`."""
        if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
            shape = shape[0]
        return op("aten::view", self, list(shape))

    def reshape(self, *shape):
        """`reshape(2, 3)` or `reshape((2, 3))`."""
        if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
            shape = shape[0]
        return op("aten::reshape", self, list(shape))

    def requires_grad_(self, requires_grad=True):
        """Sets `requires_grad` in place; returns `self`."""
        from .autograd import _autograd

        _autograd("SetRequiresGrad", (self._handle(), bool(requires_grad)))
        return self

    @property
    def grad(self):
        """The gradient local autograd accumulated, or `None`."""
        from .autograd import _autograd

        return _autograd("Grad", self._handle())

    def backward(self):
        """Local autograd from this scalar."""
        from .autograd import _autograd

        _autograd("Backward", self._handle())

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def method(*args, **kwargs):
            return op(f"aten::{name}", self, *args, **kwargs)

        method.__name__ = name
        return method


def tensor(data, dtype=None):
    """A tensor from nested lists of numbers: float32 unless `dtype` is
    `"float64"`, `"int64"` or `"bool"`."""
    shape = []
    probe = data
    while isinstance(probe, (list, tuple)):
        shape.append(len(probe))
        probe = probe[0] if probe else 0
    flat = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        else:
            flat.append(x)

    walk(data)
    if dtype is None:
        dtype = "bool" if flat and all(isinstance(x, bool) for x in flat) else "float32"
    fmt, kind = {
        "float32": ("f", "FLOAT32"),
        "float64": ("d", "FLOAT64"),
        "int64": ("q", "INT64"),
        "bool": ("?", "BOOLEAN"),
    }[dtype]
    _, types = _host.bindings()
    raw = struct.pack("<" + fmt * len(flat), *flat)
    return Tensor._own(_host.call("tensor_new", getattr(types.Dtype, kind), shape, raw))
