"""`torch.dtype`, `torch.Size` and `torch.device` for the kit.

A dtype travels to aten ops as its libtorch `ScalarType` code (an int: the
host converts ints to `ScalarType` where a schema takes one), and to
`tensor-new` as the world's `dtype` enum. A dtype object compares equal to
its name (`t.dtype == "float32"`) so plugins written when `.dtype` was a
string keep working.
"""


class dtype:  # noqa: N801 (torch's name)
    """An element type: `torch.float32`, `torch.long`, ... One object per
    type, so `torch.float32 is torch.float`."""

    __slots__ = ("name", "code", "wit", "fmt", "itemsize", "is_floating_point", "is_signed")

    def __init__(self, name, code, wit, fmt, itemsize, floating, signed):
        self.name = name
        self.code = code  # libtorch ScalarType
        self.wit = wit  # the world's `dtype` case (None: no such case)
        self.fmt = fmt  # struct format of one element (None: none fits)
        self.itemsize = itemsize
        self.is_floating_point = floating
        self.is_signed = signed

    def __repr__(self):
        return f"torch.{self.name}"

    def __eq__(self, other):
        if isinstance(other, str):
            return other in (self.name, f"torch.{self.name}") or _ALIASES.get(other) is self
        return self is other

    def __hash__(self):
        return hash(self.name)

    def __reduce__(self):  # no pickle: dtypes are singletons, never serialized
        raise TypeError("a dtype is not pickled")


uint8 = dtype("uint8", 0, "UINT8", "B", 1, False, False)
int8 = dtype("int8", 1, "INT8", "b", 1, False, True)
int16 = dtype("int16", 2, "INT16", "h", 2, False, True)
int32 = dtype("int32", 3, "INT32", "i", 4, False, True)
int64 = dtype("int64", 4, "INT64", "q", 8, False, True)
float16 = dtype("float16", 5, "FLOAT16", "e", 2, True, True)
float32 = dtype("float32", 6, "FLOAT32", "f", 4, True, True)
float64 = dtype("float64", 7, "FLOAT64", "d", 8, True, True)
bool_ = dtype("bool", 11, "BOOLEAN", "?", 1, False, False)
bfloat16 = dtype("bfloat16", 15, "BFLOAT16", None, 2, True, True)

ALL = (uint8, int8, int16, int32, int64, float16, float32, float64, bool_, bfloat16)

# torch's other names for the same objects.
_ALIASES = {
    "float": float32,
    "double": float64,
    "half": float16,
    "long": int64,
    "int": int32,
    "short": int16,
    "bool": bool_,
}

BY_NAME = {d.name: d for d in ALL}
BY_NAME.update(_ALIASES)
BY_WIT = {d.wit: d for d in ALL}
BY_CODE = {d.code: d for d in ALL}


def as_dtype(value):
    """A dtype object from a dtype, its name (`"float32"`, `"long"`), a
    `ScalarType` code or a Python type (`float`, `int`, `bool`)."""
    if value is None or isinstance(value, dtype):
        return value
    if isinstance(value, str):
        d = BY_NAME.get(value[6:] if value.startswith("torch.") else value)
    elif value is float:
        d = float32
    elif value is int:
        d = int64
    elif value is bool:
        d = bool_
    elif isinstance(value, int):
        d = BY_CODE.get(value)
    else:
        d = None
    if d is None:
        raise TypeError(f"not a dtype the kit knows: {value!r} (one of {', '.join(x.name for x in ALL)})")
    return d


class Size(tuple):
    """`torch.Size`: a tuple of sizes."""

    __slots__ = ()

    def numel(self):
        """The number of elements of a tensor of this size."""
        n = 1
        for s in self:
            n *= s
        return n

    def __repr__(self):
        return f"torch.Size({list(self)!r})"

    def __getitem__(self, index):
        out = tuple.__getitem__(self, index)
        return Size(out) if isinstance(index, slice) else out


class device:  # noqa: N801 (torch's name)
    """`torch.device("cpu")`: the worker's tensors are on its CPU, the only
    device the kit knows."""

    __slots__ = ("type", "index")

    def __init__(self, type="cpu", index=None):  # noqa: A002 (torch's name)
        if isinstance(type, device):
            type, index = type.type, type.index
        if ":" in str(type):
            type, index = str(type).split(":", 1)
            index = int(index)
        if type != "cpu":
            raise RuntimeError(
                f"device {type!r} is not available in a wasmrpc plugin: tensors live on the "
                "worker's CPU"
            )
        self.type = type
        self.index = index

    def __eq__(self, other):
        if isinstance(other, str):
            other = device(other)
        return isinstance(other, device) and other.type == self.type

    def __hash__(self):
        return hash(self.type)

    def __repr__(self):
        return f"device(type='{self.type}')"

    def __str__(self):
        return self.type


CPU = device("cpu")


def check_device(value):
    """Accepts `None`, `"cpu"` or a cpu `device`; raises for anything else."""
    if value is not None:
        device(value)
