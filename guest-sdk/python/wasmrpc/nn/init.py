"""`torch.nn.init` for plugins: the same formulas as torch's (fans, gains,
bounds), filling tensors in place in the worker with its generator
(`aten::uniform_`, `aten::normal_`, `aten::fill_`) under `no_grad`."""

import math

from ..autograd import no_grad
from ..tensor import op


def calculate_gain(nonlinearity, param=None):
    """torch's recommended gain for `nonlinearity`."""
    linear_fns = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                  "conv_transpose3d")
    if nonlinearity in linear_fns or nonlinearity == "sigmoid":
        return 1
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        negative_slope = 0.01 if param is None else param
        return math.sqrt(2.0 / (1 + negative_slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def _calculate_fan_in_and_fan_out(tensor):
    shape = tensor.shape
    if len(shape) < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions")
    receptive = 1
    for s in shape[2:]:
        receptive *= s
    return shape[1] * receptive, shape[0] * receptive


def _calculate_correct_fan(tensor, mode):
    mode = mode.lower()
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode} not supported, please use one of fan_in, fan_out")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor, a=0.0, b=1.0, generator=None):
    """Fills `tensor` from U(a, b)."""
    _no_generator(generator)
    with no_grad():
        return op("aten::uniform_", tensor, float(a), float(b))


def normal_(tensor, mean=0.0, std=1.0, generator=None):
    """Fills `tensor` from N(mean, std²)."""
    _no_generator(generator)
    with no_grad():
        return op("aten::normal_", tensor, float(mean), float(std))


def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """N(mean, std²) truncated to [a, b], by torch's inverse-CDF method."""
    _no_generator(generator)

    def norm_cdf(x):
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    lo, hi = norm_cdf((a - mean) / std), norm_cdf((b - mean) / std)
    with no_grad():
        op("aten::uniform_", tensor, 2 * lo - 1, 2 * hi - 1)
        op("aten::erfinv_", tensor)
        op("aten::mul_", tensor, std * math.sqrt(2.0))
        op("aten::add_", tensor, mean)
        return op("aten::clamp_", tensor, a, b)


def constant_(tensor, val):
    """Fills `tensor` with `val`."""
    with no_grad():
        return op("aten::fill_", tensor, val)


def ones_(tensor):
    """Fills `tensor` with ones."""
    return constant_(tensor, 1.0)


def zeros_(tensor):
    """Fills `tensor` with zeros."""
    with no_grad():
        return op("aten::zero_", tensor)


def xavier_uniform_(tensor, gain=1.0, generator=None):
    """Glorot uniform: U(-a, a), `a = gain * sqrt(6 / (fan_in + fan_out))`."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    a = math.sqrt(3.0) * std
    return uniform_(tensor, -a, a, generator)


def xavier_normal_(tensor, gain=1.0, generator=None):
    """Glorot normal: N(0, std²), `std = gain * sqrt(2 / (fan_in + fan_out))`."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = gain * math.sqrt(2.0 / float(fan_in + fan_out))
    return normal_(tensor, 0.0, std, generator)


def kaiming_uniform_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """He uniform: U(-bound, bound), `bound = gain * sqrt(3 / fan)`."""
    fan = _calculate_correct_fan(tensor, mode)
    gain = calculate_gain(nonlinearity, a)
    bound = math.sqrt(3.0) * gain / math.sqrt(fan)
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None):
    """He normal: N(0, std²), `std = gain / sqrt(fan)`."""
    fan = _calculate_correct_fan(tensor, mode)
    std = calculate_gain(nonlinearity, a) / math.sqrt(fan)
    return normal_(tensor, 0.0, std, generator)


def _no_generator(generator):
    if generator is not None:
        raise NotImplementedError("the worker owns the random generator: a plugin cannot pass one")


_calculate_fan_in_and_fan_out.__doc__ = "`(fan_in, fan_out)` of a weight, as torch counts them."
