"""`torch.nn.functional` for plugins: each function is the aten op torch's
own calls (`F.linear` is `aten::linear`, `F.cross_entropy` is
`aten::cross_entropy_loss`, ...), run in the worker, so results and
gradients are libtorch's."""

from .. import _dtypes
from ..tensor import Tensor, op

# aten's `Reduction` enum.
_REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def _reduction(reduction, size_average=None, reduce=None):
    """The aten code of `reduction` (and of torch's deprecated
    `size_average` / `reduce` flags, as torch reads them)."""
    if size_average is not None or reduce is not None:
        size_average = True if size_average is None else size_average
        reduce = True if reduce is None else reduce
        reduction = ("mean" if size_average else "sum") if reduce else "none"
    if reduction not in _REDUCTION:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return _REDUCTION[reduction]


def _tuple(value, n):
    """`3` as `[3, 3]` (for `n == 2`); a sequence as a list."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)] * n


# ---- activations -------------------------------------------------------------


def relu(input, inplace=False):  # noqa: A002 (torch's names throughout)
    """`max(x, 0)`."""
    return op("aten::relu_" if inplace else "aten::relu", input)


def relu6(input, inplace=False):  # noqa: A002
    """`min(max(x, 0), 6)`."""
    return op("aten::hardtanh", input, 0.0, 6.0)


def leaky_relu(input, negative_slope=0.01, inplace=False):  # noqa: A002
    """`x` where positive, `negative_slope * x` elsewhere."""
    return op("aten::leaky_relu_" if inplace else "aten::leaky_relu", input, negative_slope)


def elu(input, alpha=1.0, inplace=False):  # noqa: A002
    """ELU."""
    return op("aten::elu", input, alpha)


def selu(input, inplace=False):  # noqa: A002
    """SELU."""
    return op("aten::selu", input)


def gelu(input, approximate="none"):  # noqa: A002
    """GELU (`approximate="tanh"` for the tanh form)."""
    return op("aten::gelu", input, approximate=approximate)


def silu(input, inplace=False):  # noqa: A002
    """`x * sigmoid(x)`."""
    return op("aten::silu", input)


def mish(input, inplace=False):  # noqa: A002
    """Mish."""
    return op("aten::mish", input)


def softplus(input, beta=1.0, threshold=20.0):  # noqa: A002
    """Softplus."""
    return op("aten::softplus", input, beta, threshold)


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):  # noqa: A002
    """`clamp(x, min_val, max_val)`."""
    return op("aten::hardtanh", input, min_val, max_val)


def tanh(input):  # noqa: A002
    """tanh."""
    return op("aten::tanh", input)


def sigmoid(input):  # noqa: A002
    """The logistic function."""
    return op("aten::sigmoid", input)


def logsigmoid(input):  # noqa: A002
    """`log(sigmoid(x))`."""
    return op("aten::log_sigmoid", input)


def _softmax_dim(ndim):
    # torch's rule for a missing `dim` (deprecated there, kept for ports).
    return 0 if ndim in (0, 1, 3) else 1


def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002
    """Softmax along `dim`."""
    if dim is None:
        dim = _softmax_dim(input.dim())
    return op("aten::softmax", input, dim, _dtypes.as_dtype(dtype))


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002
    """`log(softmax(x))`, computed stably."""
    if dim is None:
        dim = _softmax_dim(input.dim())
    return op("aten::log_softmax", input, dim, _dtypes.as_dtype(dtype))


def softmin(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002
    """`softmax(-x)`."""
    return softmax(-input, dim, dtype=dtype)


# ---- dropout -----------------------------------------------------------------


def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002
    """Zeroes elements with probability `p` and scales the rest by
    `1/(1-p)` when `training` (the worker's generator); identity otherwise."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    return op("aten::dropout_" if inplace else "aten::dropout", input, float(p), True)


def dropout2d(input, p=0.5, training=True, inplace=False):  # noqa: A002
    """Zeroes whole channels with probability `p` and scales the rest by
    `1/(1-p)` when `training`; identity otherwise (`aten::feature_dropout`,
    as torch's `dropout2d`)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    name = "aten::feature_dropout_" if inplace else "aten::feature_dropout"
    return op(name, input, float(p), True)


# ---- linear, convolution, pooling --------------------------------------------


def linear(input, weight, bias=None):  # noqa: A002
    """`x @ weight.T + bias`."""
    return op("aten::linear", input, weight, bias)


def bilinear(input1, input2, weight, bias=None):
    """`x1 @ weight @ x2 + bias` per output feature."""
    return op("aten::bilinear", input1, input2, weight, bias)


def _conv(name, n, input, weight, bias, stride, padding, dilation, groups):  # noqa: A002
    if isinstance(padding, str):
        # `padding="same"` / `"valid"`: aten's `.padding` overload takes the string.
        return op(f"aten::{name}", input, weight, bias, _tuple(stride, n), padding, _tuple(dilation, n), groups)
    return op(
        f"aten::{name}", input, weight, bias, _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n), groups
    )


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """1-d convolution."""
    return _conv("conv1d", 1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """2-d convolution."""
    return _conv("conv2d", 2, input, weight, bias, stride, padding, dilation, groups)


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):  # noqa: A002,E501
    """1-d max pooling."""
    if return_indices:
        raise NotImplementedError("max_pool1d(return_indices=True) is not supported")
    stride = kernel_size if stride is None else stride
    return op("aten::max_pool1d", input, _tuple(kernel_size, 1), _tuple(stride, 1), _tuple(padding, 1),
              _tuple(dilation, 1), bool(ceil_mode))


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):  # noqa: A002,E501
    """2-d max pooling (`stride` defaults to `kernel_size`)."""
    if return_indices:
        raise NotImplementedError("max_pool2d(return_indices=True) is not supported")
    stride = kernel_size if stride is None else stride
    return op("aten::max_pool2d", input, _tuple(kernel_size, 2), _tuple(stride, 2), _tuple(padding, 2),
              _tuple(dilation, 2), bool(ceil_mode))


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,  # noqa: A002
               divisor_override=None):
    """2-d average pooling."""
    stride = kernel_size if stride is None else stride
    return op("aten::avg_pool2d", input, _tuple(kernel_size, 2), _tuple(stride, 2), _tuple(padding, 2),
              bool(ceil_mode), bool(count_include_pad), divisor_override)


def adaptive_avg_pool2d(input, output_size):  # noqa: A002
    """Average pooling to `output_size`."""
    return op("aten::adaptive_avg_pool2d", input, _tuple(output_size, 2))


def pad(input, pad, mode="constant", value=None):  # noqa: A002
    """Pads the last dimensions (`pad` lists before/after pairs from the last)."""
    return op("aten::pad", input, [int(p) for p in pad], mode, value)


# ---- normalization, embeddings -----------------------------------------------


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,  # noqa: A002
               momentum=0.1, eps=1e-5):
    """Batch normalization; in training, updates `running_mean` and
    `running_var` in place (in the worker, as torch)."""
    return op("aten::batch_norm", input, weight, bias, running_mean, running_var, bool(training),
              float(momentum), float(eps), False)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # noqa: A002
    """Normalizes over the last `len(normalized_shape)` dimensions."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return op("aten::layer_norm", input, [int(s) for s in normalized_shape], weight, bias, float(eps))


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):  # noqa: A002
    """Group normalization."""
    return op("aten::group_norm", input, num_groups, weight, bias, float(eps))


def normalize(input, p=2.0, dim=1, eps=1e-12):  # noqa: A002
    """`x / max(norm_p(x, dim), eps)`, as torch computes it."""
    norm = op("aten::norm", input, p, [dim], True)
    return input / op("aten::expand_as", op("aten::clamp_min", norm, eps), input)


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,  # noqa: A002
              sparse=False):
    """Rows of `weight` at the indices `input`; the row `padding_idx` gets
    no gradient."""
    if max_norm is not None:
        raise NotImplementedError("embedding(max_norm=...) is not supported")
    if sparse:
        raise NotImplementedError("sparse embedding gradients are not supported")
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:
        padding_idx = weight.size(0) + padding_idx
    return op("aten::embedding", weight, input, padding_idx, bool(scale_grad_by_freq), False)


def one_hot(tensor, num_classes=-1):
    """`[..., num_classes]` int64 one-hot rows of the int64 `tensor`."""
    return op("aten::one_hot", tensor, num_classes)


# ---- losses ------------------------------------------------------------------


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,  # noqa: A002
                  reduction="mean", label_smoothing=0.0):
    """Cross entropy of logits `input` and class indices (or probabilities)
    `target`."""
    return op("aten::cross_entropy_loss", input, target, weight, _reduction(reduction, size_average, reduce),
              ignore_index, float(label_smoothing))


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,  # noqa: A002
             reduction="mean"):
    """Negative log likelihood of log-probabilities `input`."""
    return op("aten::nll_loss_nd", input, target, weight, _reduction(reduction, size_average, reduce),
              ignore_index)


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):  # noqa: A002
    """Mean squared error."""
    if weight is not None:
        raise NotImplementedError("mse_loss(weight=...) is not supported")
    return op("aten::mse_loss", input, target, _reduction(reduction, size_average, reduce))


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):  # noqa: A002
    """Mean absolute error."""
    if weight is not None:
        raise NotImplementedError("l1_loss(weight=...) is not supported")
    return op("aten::l1_loss", input, target, _reduction(reduction, size_average, reduce))


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):  # noqa: A002
    """Smooth L1 (Huber with `beta`)."""
    return op("aten::smooth_l1_loss", input, target, _reduction(reduction, size_average, reduce), float(beta))


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):  # noqa: A002
    """Huber loss."""
    return op("aten::huber_loss", input, target, _reduction(reduction), float(delta))


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None,  # noqa: A002
                         reduction="mean"):
    """Binary cross entropy of probabilities `input`."""
    return op("aten::binary_cross_entropy", input, target, weight, _reduction(reduction, size_average, reduce))


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,  # noqa: A002
                                     reduction="mean", pos_weight=None):
    """Binary cross entropy of logits `input` (stable)."""
    return op("aten::binary_cross_entropy_with_logits", input, target, weight, pos_weight,
              _reduction(reduction, size_average, reduce))


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):  # noqa: A002
    """KL divergence (`input` log-probabilities); `"batchmean"` as torch."""
    if reduction == "batchmean":
        return op("aten::kl_div", input, target, 2, bool(log_target)) / input.size(0)
    return op("aten::kl_div", input, target, _reduction(reduction, size_average, reduce), bool(log_target))


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("Tensor", "op")]
