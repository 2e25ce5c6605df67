"""`torch.nn.Module`, `Parameter` and the layers, containers and loss
modules of `torch.nn`, with torch's parameter names, shapes and default
initialisations (so `load_state_dict` takes a torch model's weights)."""

import math

from .. import _dtypes
from ..autograd import no_grad
from ..tensor import Tensor, op
from . import functional as F
from . import init


class Parameter(Tensor):
    """`nn.Parameter(t)`: a leaf tensor sharing `t`'s elements, with
    `requires_grad` (a `Module` attribute holding one is registered)."""

    __slots__ = ()

    def __new__(cls, data=None, requires_grad=True):
        if data is None:
            data = op("aten::zeros", [0])
        p = cls._steal(op("aten::detach", data))
        if requires_grad:
            p.requires_grad_(True)
        return p

    def __init__(self, data=None, requires_grad=True):
        pass  # made by __new__

    def __repr__(self):
        return "Parameter containing:\n" + Tensor.__repr__(self)


class Module:
    """The base of layers, as `torch.nn.Module`: attributes that are
    `Parameter`s, `Module`s and registered buffers are found by
    `parameters()`, `state_dict()`, `train()` ..."""

    training = True

    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    # ---- attributes --------------------------------------------------------

    def __setattr__(self, name, value):
        d = self.__dict__
        if "_parameters" not in d:
            raise AttributeError("cannot assign module attributes before Module.__init__() call")
        params, buffers, modules = d["_parameters"], d["_buffers"], d["_modules"]
        if isinstance(value, Parameter):
            d.pop(name, None)
            buffers.pop(name, None)
            modules.pop(name, None)
            params[name] = value
        elif isinstance(value, Module):
            d.pop(name, None)
            params.pop(name, None)
            buffers.pop(name, None)
            modules[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                    "(torch.nn.Parameter or None expected)"
                )
            params[name] = None
        elif name in buffers:
            buffers[name] = value
        elif name in modules and value is None:
            modules[name] = None
        else:
            modules.pop(name, None)
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        for table in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__.get(table, {}):
                del self.__dict__[table][name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name, param):
        """Registers `param` (a `Parameter` or `None`) as `name`."""
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter '{name}'")
        self.__dict__.pop(name, None)
        self._parameters[name] = param

    def register_buffer(self, name, tensor, persistent=True):
        """Registers a tensor that is state but not a parameter (running
        statistics); `persistent=False` keeps it out of `state_dict`."""
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer '{name}'")
        self.__dict__.pop(name, None)
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name, module):
        """Registers a child module."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self.__dict__.pop(name, None)
        self._modules[name] = module

    register_module = add_module

    def get_submodule(self, target):
        """The module at the dotted path `target`."""
        m = self
        for part in target.split(".") if target else []:
            m = m._modules[part]
        return m

    # ---- calling -----------------------------------------------------------

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required "forward" function')

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ---- walking -----------------------------------------------------------

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        """`(name, module)` for this module and every descendant."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is None:
                continue
            yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def modules(self):
        """This module and every descendant."""
        for _, m in self.named_modules():
            yield m

    def named_children(self):
        """`(name, module)` for each direct child."""
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self):
        """The direct children."""
        for _, m in self.named_children():
            yield m

    def _named(self, table, prefix, recurse, remove_duplicate=True):
        seen = set()
        mods = self.named_modules(prefix=prefix) if recurse else [(prefix, self)]
        for mprefix, m in mods:
            for name, t in m.__dict__[table].items():
                if t is None or (remove_duplicate and id(t) in seen):
                    continue
                seen.add(id(t))
                yield (f"{mprefix}.{name}" if mprefix else name), t

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """`(dotted name, Parameter)`, each parameter once."""
        return self._named("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse=True):
        """Every `Parameter`, once each (what an optimizer takes)."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        """`(dotted name, buffer)`."""
        return self._named("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse=True):
        """Every buffer."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn):
        """Calls `fn` on every descendant, then on this module; returns it."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ---- modes, gradients, devices -----------------------------------------

    def train(self, mode=True):
        """Training mode (dropout drops, batch norm updates its statistics)."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        """`train(False)`."""
        return self.train(False)

    def requires_grad_(self, requires_grad=True):
        """Sets `requires_grad` of every parameter."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none=True):
        """Clears every parameter's gradient (to `None` by default, as torch)."""
        for p in self.parameters():
            _zero_grad(p, set_to_none)

    def to(self, *args, **kwargs):
        """A no-op for the CPU (the only device); a dtype is refused."""
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, _dtypes.dtype) and a is not _dtypes.float32:
                raise NotImplementedError("Module.to(dtype) is not supported: build the model in float32")
            if not isinstance(a, (_dtypes.dtype, bool)):
                _dtypes.check_device(a)
        return self

    def cpu(self):
        """`self`."""
        return self

    def float(self):  # noqa: A003
        """`self` (parameters are float32)."""
        return self

    def type(self, dst_type):  # noqa: A003
        """Only float32 is supported."""
        return self.to(dst_type)

    # ---- state -------------------------------------------------------------

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """Parameters and persistent buffers by dotted name (detached unless
        `keep_vars`), in registration order."""
        out = {} if destination is None else destination
        for mprefix, m in self.named_modules(prefix=prefix.rstrip(".")):
            for table in ("_parameters", "_buffers"):
                for name, t in m.__dict__[table].items():
                    if t is None or (table == "_buffers" and name in m._non_persistent):
                        continue
                    key = f"{mprefix}.{name}" if mprefix else name
                    out[key] = t if keep_vars else op("aten::detach", t)
        return out

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Copies tensors into the parameters and buffers of the same
        names (shapes must match); with `strict`, missing or unexpected keys
        raise `RuntimeError`. Returns `(missing_keys, unexpected_keys)`."""
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        with no_grad():
            for k, dst in own.items():
                if k not in state_dict:
                    continue
                src = state_dict[k]
                if not isinstance(src, Tensor):
                    errors.append(f'While copying the parameter named "{k}", expected a Tensor, got {type(src).__name__}')
                    continue
                if tuple(src.shape) != tuple(dst.shape):
                    errors.append(
                        f"size mismatch for {k}: copying a param with shape {src.shape} from checkpoint, "
                        f"the shape in current model is {dst.shape}."
                    )
                    continue
                op("aten::copy_", dst, src)
        if strict:
            if unexpected:
                errors.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
            if missing:
                errors.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if errors:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors)
            )
        return _IncompatibleKeys(missing, unexpected)

    # ---- printing ----------------------------------------------------------

    def extra_repr(self):
        """The arguments shown in `repr`."""
        return ""

    def __repr__(self):
        lines = []
        for name, m in self._modules.items():
            child = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {child}")
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        body = "\n  ".join(([extra] if extra else []) + lines)
        return f"{type(self).__name__}(\n  {body}\n)"

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._parameters) | set(self._buffers) | set(self._modules))


class _IncompatibleKeys(tuple):
    """`(missing_keys, unexpected_keys)` with those names."""

    def __new__(cls, missing, unexpected):
        return tuple.__new__(cls, (missing, unexpected))

    missing_keys = property(lambda self: self[0])
    unexpected_keys = property(lambda self: self[1])

    def __repr__(self):
        if not self[0] and not self[1]:
            return "<All keys matched successfully>"
        return f"_IncompatibleKeys(missing_keys={self[0]}, unexpected_keys={self[1]})"


def _zero_grad(p, set_to_none):
    if set_to_none:
        p.grad = None
    else:
        g = p.grad
        if g is not None:
            with no_grad():
                op("aten::zero_", g)


# ---- containers --------------------------------------------------------------


class Sequential(Module):
    """Modules run in order: `Sequential(a, b)` or `Sequential(dict)`."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], dict):
            for k, m in args[0].items():
                self.add_module(k, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def forward(self, input):  # noqa: A002
        for m in self._modules.values():
            input = m(input)
        return input

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return Sequential(*mods[idx])
        return mods[idx]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module):
        """Adds `module` at the end."""
        self.add_module(str(len(self)), module)
        return self


class ModuleList(Module):
    """A list of modules, registered as children."""

    def __init__(self, modules=None):
        super().__init__()
        for m in modules or ():
            self.append(m)

    def append(self, module):
        """Adds `module` at the end."""
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules):
        """Adds each of `modules`."""
        for m in modules:
            self.append(m)
        return self

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return ModuleList(mods[idx])
        return mods[idx]

    def __setitem__(self, idx, module):
        key = list(self._modules)[idx]
        self.add_module(key, module)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleDict(Module):
    """A dict of modules, registered as children."""

    def __init__(self, modules=None):
        super().__init__()
        if modules:
            self.update(modules)

    def __getitem__(self, key):
        return self._modules[key]

    def __setitem__(self, key, module):
        self.add_module(key, module)

    def __delitem__(self, key):
        del self._modules[key]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key):
        return key in self._modules

    def keys(self):
        """The names."""
        return self._modules.keys()

    def values(self):
        """The modules."""
        return self._modules.values()

    def items(self):
        """`(name, module)` pairs."""
        return self._modules.items()

    def update(self, modules):
        """Adds `modules` (a dict or `(name, module)` pairs)."""
        items = modules.items() if isinstance(modules, (dict, ModuleDict)) else modules
        for k, m in items:
            self.add_module(k, m)


class ParameterList(Module):
    """A list of parameters, registered."""

    def __init__(self, values=None):
        super().__init__()
        for v in values or ():
            self.append(v)

    def append(self, value):
        """Adds `value` (made a `Parameter`)."""
        if not isinstance(value, Parameter):
            value = Parameter(value)
        self.register_parameter(str(len(self._parameters)), value)
        return self

    def __getitem__(self, idx):
        return list(self._parameters.values())[idx]

    def __len__(self):
        return len(self._parameters)

    def __iter__(self):
        return iter(self._parameters.values())


# ---- layers ------------------------------------------------------------------


def _param(*size):
    return Parameter(op("aten::zeros", list(size)))


class Identity(Module):
    """Returns its input."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input):  # noqa: A002
        return input


class Linear(Module):
    """`y = x @ weight.T + bias`; weight `(out, in)`, torch's init
    (kaiming uniform with `a=sqrt(5)`, bias U(±1/sqrt(in)))."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        if bias:
            self.bias = _param(out_features)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """torch's default initialisation."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):  # noqa: A002
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _ConvNd(Module):
    _N = 2

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if padding_mode != "zeros":
            raise NotImplementedError("only padding_mode='zeros' is supported")
        if in_channels % groups or out_channels % groups:
            raise ValueError("in_channels and out_channels must be divisible by groups")
        n = self._N
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = tuple(F._tuple(kernel_size, n))
        self.stride = tuple(F._tuple(stride, n))
        self.padding = padding if isinstance(padding, str) else tuple(F._tuple(padding, n))
        self.dilation = tuple(F._tuple(dilation, n))
        self.groups = groups
        self.weight = _param(out_channels, in_channels // groups, *self.kernel_size)
        if bias:
            self.bias = _param(out_channels)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    reset_parameters = Linear.reset_parameters

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}")


class Conv1d(_ConvNd):
    """1-d convolution over `(N, C, L)`."""

    _N = 1

    def forward(self, input):  # noqa: A002
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv2d(_ConvNd):
    """2-d convolution over `(N, C, H, W)`."""

    _N = 2

    def forward(self, input):  # noqa: A002
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class MaxPool2d(Module):
    """2-d max pooling."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.return_indices, self.ceil_mode = dilation, return_indices, ceil_mode

    def forward(self, input):  # noqa: A002
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                            self.return_indices)


class AvgPool2d(Module):
    """2-d average pooling."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        super().__init__()
        self.args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

    def forward(self, input):  # noqa: A002
        return F.avg_pool2d(input, *self.args)


class AdaptiveAvgPool2d(Module):
    """Average pooling to a fixed output size."""

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, input):  # noqa: A002
        return F.adaptive_avg_pool2d(input, self.output_size)


class Flatten(Module):
    """Flattens dims `start_dim..end_dim` (from 1 by default)."""

    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input):  # noqa: A002
        return op("aten::flatten", input, self.start_dim, self.end_dim)


class Unflatten(Module):
    """Splits dim `dim` into `unflattened_size`."""

    def __init__(self, dim, unflattened_size):
        super().__init__()
        self.dim, self.unflattened_size = dim, list(unflattened_size)

    def forward(self, input):  # noqa: A002
        return op("aten::unflatten", input, self.dim, self.unflattened_size)


def _activation(name, fn, *params):
    """A module class calling `fn(input, *its arguments)`."""

    def __init__(self, *args, **kwargs):
        Module.__init__(self)
        values = dict(zip(params, args))
        values.update(kwargs)
        values.pop("inplace", None)
        for k in params:
            if k in values:
                object.__setattr__(self, k, values[k])
        object.__setattr__(self, "_args", {k: values[k] for k in params if k in values})

    def forward(self, input):  # noqa: A002
        return fn(input, **self._args)

    def extra_repr(self):
        return ", ".join(f"{k}={v}" for k, v in self._args.items())

    cls = type(name, (Module,), {"__init__": __init__, "forward": forward, "extra_repr": extra_repr,
                                 "__doc__": f"`F.{fn.__name__}` as a module."})
    cls.__module__ = __name__
    return cls


ReLU = _activation("ReLU", F.relu, "inplace")
ReLU6 = _activation("ReLU6", F.relu6, "inplace")
LeakyReLU = _activation("LeakyReLU", F.leaky_relu, "negative_slope", "inplace")
ELU = _activation("ELU", F.elu, "alpha", "inplace")
SELU = _activation("SELU", F.selu, "inplace")
GELU = _activation("GELU", F.gelu, "approximate")
SiLU = _activation("SiLU", F.silu, "inplace")
Mish = _activation("Mish", F.mish, "inplace")
Softplus = _activation("Softplus", F.softplus, "beta", "threshold")
Hardtanh = _activation("Hardtanh", F.hardtanh, "min_val", "max_val", "inplace")
Tanh = _activation("Tanh", F.tanh)
Sigmoid = _activation("Sigmoid", F.sigmoid)
LogSigmoid = _activation("LogSigmoid", F.logsigmoid)
Softmax = _activation("Softmax", F.softmax, "dim")
LogSoftmax = _activation("LogSoftmax", F.log_softmax, "dim")
Softmin = _activation("Softmin", F.softmin, "dim")


class Dropout(Module):
    """Zeroes elements with probability `p` in training; identity in eval."""

    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input):  # noqa: A002
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"


class Dropout2d(Dropout):
    """Zeroes whole channels with probability `p` in training; identity in
    eval."""

    def forward(self, input):  # noqa: A002
        return F.dropout2d(input, self.p, self.training, self.inplace)


class Embedding(Module):
    """A lookup table: `weight[(num_embeddings, embedding_dim)]` from N(0, 1),
    the `padding_idx` row zero."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None and padding_idx < 0:
            padding_idx = num_embeddings + padding_idx
        self.padding_idx, self.max_norm, self.scale_grad_by_freq = padding_idx, max_norm, scale_grad_by_freq
        if _weight is None:
            self.weight = _param(num_embeddings, embedding_dim)
            self.reset_parameters()
        else:
            self.weight = Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self):
        """N(0, 1), the padding row zero."""
        init.normal_(self.weight)
        if self.padding_idx is not None:
            with no_grad():
                op("aten::fill_", op("aten::select", self.weight, 0, self.padding_idx), 0.0)

    def forward(self, input):  # noqa: A002
        return F.embedding(input, self.weight, self.padding_idx, self.max_norm, 2.0, self.scale_grad_by_freq)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None):
        """An embedding holding `embeddings`."""
        rows, dim = embeddings.shape
        return cls(rows, dim, padding_idx=padding_idx, _weight=embeddings, _freeze=freeze)


class _BatchNorm(Module):
    _DIMS = (2, 3)

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = Parameter(op("aten::ones", [num_features]))
            self.bias = _param(num_features)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", op("aten::zeros", [num_features]))
            self.register_buffer("running_var", op("aten::ones", [num_features]))
            self.register_buffer("num_batches_tracked", op("aten::zeros", [], dtype=_dtypes.int64))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def forward(self, input):  # noqa: A002
        if input.dim() not in self._DIMS:
            raise ValueError(f"expected {' or '.join(f'{d}D' for d in self._DIMS)} input (got {input.dim()}D input)")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            with no_grad():
                op("aten::add_", self.num_batches_tracked, 1)
            if self.momentum is None:  # a cumulative average, as torch
                factor = 1.0 / float(self.num_batches_tracked.item())
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        return F.batch_norm(
            input,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight, self.bias, use_batch, factor, self.eps,
        )

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}"


class BatchNorm1d(_BatchNorm):
    """Batch normalization over `(N, C)` or `(N, C, L)`."""

    _DIMS = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalization over `(N, C, H, W)`."""

    _DIMS = (4,)


class LayerNorm(Module):
    """Normalization over the last dims `normalized_shape`; weight ones,
    bias zeros."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = Parameter(op("aten::ones", list(self.normalized_shape)))
            if bias:
                self.bias = _param(*self.normalized_shape)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, input):  # noqa: A002
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


# ---- losses ------------------------------------------------------------------


class _Loss(Module):
    def __init__(self, size_average=None, reduce=None, reduction="mean"):
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = {0: "none", 1: "mean", 2: "sum"}[F._reduction("mean", size_average, reduce)]
        self.reduction = reduction


class CrossEntropyLoss(_Loss):
    """`F.cross_entropy` as a module."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                 label_smoothing=0.0):
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, input, target):  # noqa: A002
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class NLLLoss(_Loss):
    """`F.nll_loss` as a module."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index

    def forward(self, input, target):  # noqa: A002
        return F.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index,
                          reduction=self.reduction)


class MSELoss(_Loss):
    """`F.mse_loss` as a module."""

    def forward(self, input, target):  # noqa: A002
        return F.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    """`F.l1_loss` as a module."""

    def forward(self, input, target):  # noqa: A002
        return F.l1_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(_Loss):
    """`F.smooth_l1_loss` as a module."""

    def __init__(self, size_average=None, reduce=None, reduction="mean", beta=1.0):
        super().__init__(size_average, reduce, reduction)
        self.beta = beta

    def forward(self, input, target):  # noqa: A002
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class BCELoss(_Loss):
    """`F.binary_cross_entropy` as a module."""

    def __init__(self, weight=None, size_average=None, reduce=None, reduction="mean"):
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)

    def forward(self, input, target):  # noqa: A002
        return F.binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
    """`F.binary_cross_entropy_with_logits` as a module."""

    def __init__(self, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None):
        super().__init__(size_average, reduce, reduction)
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input, target):  # noqa: A002
        return F.binary_cross_entropy_with_logits(input, target, self.weight, reduction=self.reduction,
                                                  pos_weight=self.pos_weight)
