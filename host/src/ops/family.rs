//! The op families a worker serves by default: named lists of ops that
//! compute on tensors (POL-2).
//!
//! What this module owns: [`Family`] and [`FAMILIES`], the curated lists
//! themselves, and nothing else. Every member must be a registered operator
//! that can be called by name, and the schemas of every overload the policy
//! lets through must be free of hazards: the registry walk in
//! `super::policy`'s tests checks both against the libtorch this host
//! links, so the lists hold no dead names and no unsafe op slips in with a
//! libtorch upgrade.
//!
//! What is left out on purpose, with the reason, where it is not obvious
//! from the policy's schema check (which refuses storages, streams, file
//! names, raw pointers, generators callers would pass and opaque types on
//! its own):
//! - uninitialized memory: `empty`, `empty_like`, `empty_strided`,
//!   `new_empty`, `resize_` hand back whatever the allocator held before,
//!   including other callers' data;
//! - raw views of storage: `as_strided`, `set_`, `unsafe_*`, `_unsafe_view`;
//! - sparse tensors built from caller indices: `sparse_coo_tensor` does not
//!   check its indices against the size (`to_dense` then writes out of
//!   bounds: a segfault, tried on libtorch 2.13), and `indices` returns the
//!   sparse tensor's own index storage, which in-place ops on an RRef could
//!   then corrupt the same way (tried too); sparse tensors arriving over the
//!   wire have their indices checked (`crate::tensor`);
//! - ops that take pivots or targets indexing memory with weaker checks in
//!   past libtorch releases: `lu_unpack`, `lu_solve`, `linalg_lu_solve`,
//!   `linalg_ldl_solve`, `max_unpool*`, `embedding_bag`,
//!   `multilabel_margin_loss`, `multi_margin_loss`;
//! - process-wide state: `manual_seed`, `seed`, `set_grad_enabled`,
//!   `backward`, `retain_grad`, `requires_grad_` (the host owns the
//!   generator and grad mode; plugins have their own autograd requests);
//! - TorchScript's list, dict and string builtins (`append`, `keys`,
//!   `format`, `warn`, `wait`, ...): no tensor computation.

/// A named group of ops the default policy serves (`@arithmetic` in
/// rules).
#[derive(Debug)]
pub struct Family {
    /// The family's name, without the `@` rules write before it.
    pub name: &'static str,
    /// What its ops do, one line.
    pub summary: &'static str,
    /// The namespace of its members: `aten`, or `builtins` for Python's.
    pub(crate) namespace: &'static str,
    /// Base names (no namespace, no overload).
    pub(crate) members: &'static [&'static str],
    /// Whether each member's in-place form (`add_` for `add`) belongs to the
    /// family too, where libtorch registers one.
    pub(crate) in_place: bool,
}

/// Families are equal when their names are: each name is defined once.
impl PartialEq for Family {
    fn eq(&self, other: &Family) -> bool {
        self.name == other.name
    }
}

impl Eq for Family {}

impl Family {
    /// Whether the op `base` of `namespace` is a member (an in-place form
    /// counts when the family takes them).
    pub fn contains(&self, namespace: &str, base: &str) -> bool {
        if namespace != self.namespace {
            return false;
        }
        if self.members.contains(&base) {
            return true;
        }
        self.in_place
            && base
                .strip_suffix('_')
                .is_some_and(|plain| !plain.ends_with('_') && self.members.contains(&plain))
    }

    /// Every member as the registry names it (`aten::add`,
    /// `builtins.min`), without in-place forms.
    pub fn member_names(&self) -> impl Iterator<Item = String> + '_ {
        self.members.iter().map(move |m| match self.namespace {
            "builtins" => format!("builtins.{m}"),
            ns => format!("{ns}::{m}"),
        })
    }
}

/// The family named `name` (without the `@`).
pub fn family(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.name == name)
}

/// Every family the default policy serves (POL-2).
pub static FAMILIES: &[Family] = &[
    Family {
        name: "arithmetic",
        summary: "elementwise math: + - * /, powers, exp and log, trigonometry, rounding, clamping",
        namespace: "aten",
        in_place: true,
        members: &[
            "abs", "absolute", "acos", "acosh", "add", "addcdiv", "addcmul", "angle", "arccos",
            "arccosh", "arcsin", "arcsinh", "arctan", "arctan2", "arctanh", "asin", "asinh",
            "atan", "atan2", "atanh", "bitwise_and", "bitwise_left_shift", "bitwise_not",
            "bitwise_or", "bitwise_right_shift", "bitwise_xor", "ceil", "clamp", "clamp_max",
            "clamp_min", "clip", "copysign", "cos", "cosh", "deg2rad", "digamma", "div",
            "divide", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "fix", "float_power",
            "floor", "floor_divide", "fmax", "fmin", "fmod", "frac", "frexp", "gcd", "heaviside",
            "hypot", "i0", "lcm", "ldexp", "lerp", "lgamma", "log", "log10", "log1p", "log2",
            "logaddexp", "logaddexp2", "logit", "maximum", "minimum", "mul", "multiply",
            "mvlgamma", "nan_to_num", "neg", "negative", "nextafter", "polygamma", "positive",
            "pow", "rad2deg", "reciprocal", "remainder", "round", "rsqrt", "rsub", "sgn",
            "sigmoid", "sign", "signbit", "sin", "sinc", "sinh", "sqrt", "square", "sub",
            "subtract", "tan", "tanh", "true_divide", "trunc", "xlogy",
        ],
    },
    Family {
        name: "comparison",
        summary: "comparisons, logical ops, tests for nan and inf, where",
        namespace: "aten",
        in_place: true,
        members: &[
            "allclose", "eq", "equal", "ge", "greater", "greater_equal", "gt", "isclose",
            "isfinite", "isin", "isinf", "isnan", "isneginf", "isposinf", "isreal", "le", "less",
            "less_equal", "logical_and", "logical_not", "logical_or", "logical_xor", "lt", "ne",
            "not_equal", "where",
        ],
    },
    Family {
        name: "reduction",
        summary: "sums, means, extrema, norms, statistics, cumulative ops, sorting and top-k",
        namespace: "aten",
        in_place: true,
        members: &[
            "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "argsort", "bincount",
            "count_nonzero", "cummax", "cummin", "cumprod", "cumsum", "diff", "dist", "histc",
            "kthvalue", "logcumsumexp", "logsumexp", "max", "mean", "median", "min", "mode",
            "msort", "nanmean", "nanmedian", "nanquantile", "nansum", "norm", "prod", "quantile",
            "renorm", "sort", "std", "std_mean", "sum", "topk", "unique_consecutive",
            "unique_dim", "var", "var_mean",
        ],
    },
    Family {
        name: "linalg",
        summary: "matrix products, decompositions, solvers, einsum, FFTs",
        namespace: "aten",
        in_place: true,
        members: &[
            "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "cdist", "chain_matmul",
            "cholesky", "cholesky_inverse", "cholesky_solve", "cross", "det", "dot", "einsum",
            "fft_fft", "fft_fft2", "fft_fftn", "fft_fftshift", "fft_hfft", "fft_ifft",
            "fft_ifft2", "fft_ifftn", "fft_ifftshift", "fft_ihfft", "fft_irfft", "fft_irfft2",
            "fft_irfftn", "fft_rfft", "fft_rfft2", "fft_rfftn", "frobenius_norm", "ger", "inner",
            "inverse", "kron", "linalg_cholesky", "linalg_cholesky_ex", "linalg_cond",
            "linalg_cross", "linalg_det", "linalg_diagonal", "linalg_eig", "linalg_eigh",
            "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_inv_ex", "linalg_lstsq",
            "linalg_lu", "linalg_lu_factor", "linalg_lu_factor_ex", "linalg_matmul",
            "linalg_matrix_exp", "linalg_matrix_norm", "linalg_matrix_power",
            "linalg_matrix_rank", "linalg_multi_dot", "linalg_norm", "linalg_pinv", "linalg_qr",
            "linalg_slogdet", "linalg_solve", "linalg_solve_ex", "linalg_solve_triangular",
            "linalg_svd", "linalg_svdvals", "linalg_tensorinv", "linalg_tensorsolve",
            "linalg_vander", "linalg_vecdot", "linalg_vector_norm", "logdet", "matmul",
            "matrix_exp", "matrix_power", "mm", "mv", "nuclear_norm", "outer", "pdist",
            "pinverse", "qr", "slogdet", "svd", "tensordot", "trace", "triangular_solve", "vdot",
        ],
    },
    Family {
        name: "shape",
        summary: "views, reshaping, joining and splitting, indexing, dtype and device moves, sizes",
        namespace: "aten",
        in_place: true,
        members: &[
            "adjoint", "argwhere", "atleast_1d", "atleast_2d", "atleast_3d", "block_diag",
            "broadcast_tensors", "broadcast_to", "can_cast", "cartesian_prod", "cat", "chunk",
            "clone", "column_stack", "combinations", "concat", "concatenate", "conj",
            "contiguous", "copy_", "detach", "diag", "diag_embed", "diagflat", "diagonal", "dim",
            "dsplit", "dstack", "expand", "expand_as", "fill", "flatten", "flip", "fliplr",
            "flipud", "gather", "hsplit", "hstack", "imag", "index", "index_add", "index_copy",
            "index_fill", "index_put", "index_select", "is_complex", "is_contiguous",
            "is_floating_point", "is_nonzero", "is_same_size", "is_signed", "item",
            "masked_fill", "masked_scatter", "masked_select", "meshgrid", "moveaxis", "movedim",
            "narrow", "nonzero", "numel", "permute", "promote_types", "ravel", "real", "repeat",
            "repeat_interleave", "reshape", "reshape_as", "resolve_conj", "resolve_neg",
            "result_type", "roll", "rot90", "row_stack", "scatter", "scatter_add",
            "scatter_reduce", "select", "size", "slice", "split", "split_with_sizes", "squeeze",
            "stack", "stride", "swapaxes", "swapdims", "t", "take", "take_along_dim",
            "tensor_split", "tile", "to", "transpose", "tril", "triu", "type_as", "unbind",
            "unflatten", "unfold", "unsqueeze", "view", "view_as", "view_as_complex",
            "view_as_real", "vsplit", "vstack", "zero",
        ],
    },
    Family {
        name: "nn",
        summary: "torch.nn.functional: activations, linear and convolution, pooling, \
                  normalization, dropout, embeddings, losses",
        namespace: "aten",
        in_place: true,
        members: &[
            "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
            "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "alpha_dropout",
            "avg_pool1d", "avg_pool2d", "avg_pool3d", "batch_norm", "bilinear",
            "binary_cross_entropy", "binary_cross_entropy_with_logits", "celu",
            "channel_shuffle", "constant_pad_nd", "conv1d", "conv2d", "conv3d",
            "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "cosine_embedding_loss",
            "cosine_similarity", "cross_entropy_loss", "dropout", "elu", "embedding",
            "feature_alpha_dropout", "feature_dropout", "gelu", "glu", "group_norm",
            "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "hinge_embedding_loss",
            "huber_loss", "instance_norm", "kl_div", "l1_loss", "layer_norm", "leaky_relu",
            "linear", "log_sigmoid", "log_softmax", "margin_ranking_loss", "max_pool1d",
            "max_pool2d", "max_pool3d", "mish", "mse_loss", "nll_loss", "nll_loss2d",
            "nll_loss_nd", "one_hot", "pad", "pairwise_distance", "pixel_shuffle",
            "pixel_unshuffle", "poisson_nll_loss", "prelu", "relu", "relu6", "rms_norm",
            "scaled_dot_product_attention", "selu", "silu", "smooth_l1_loss",
            "soft_margin_loss", "softmax", "softplus", "softshrink", "threshold",
            "triplet_margin_loss",
        ],
    },
    Family {
        name: "creation",
        summary: "new tensors from sizes and values: zeros, ones, full, arange, linspace, eye",
        namespace: "aten",
        in_place: false,
        members: &[
            "arange", "complex", "eye", "full", "full_like", "linspace", "logspace", "new_full",
            "new_ones", "new_zeros", "ones", "ones_like", "polar", "range", "scalar_tensor",
            "tril_indices", "triu_indices", "zeros", "zeros_like",
        ],
    },
    Family {
        name: "random",
        summary: "random sampling from the worker's own generator (callers cannot pass one)",
        namespace: "aten",
        in_place: true,
        members: &[
            "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
            "normal", "poisson", "rand", "rand_like", "randint", "randint_like", "randn",
            "randn_like", "random", "randperm", "uniform",
        ],
    },
    Family {
        name: "sparse",
        summary: "sparse COO tensors: to and from dense, coalescing, products",
        namespace: "aten",
        in_place: false,
        members: &[
            "coalesce", "dense_dim", "hspmm", "is_coalesced", "smm", "sparse_dim",
            "sparse_mask", "sspaddmm", "to_dense", "to_sparse", "values",
        ],
    },
    Family {
        name: "builtins",
        summary: "Python's builtins the seeds call: builtins.min, builtins.max",
        namespace: "builtins",
        in_place: false,
        members: &["max", "min"],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_forms_belong_to_families_that_take_them() {
        let arithmetic = family("arithmetic").unwrap();
        assert!(arithmetic.contains("aten", "add"));
        assert!(arithmetic.contains("aten", "add_"));
        assert!(!arithmetic.contains("aten", "add__"));
        assert!(!arithmetic.contains("prim", "add"));
        let creation = family("creation").unwrap();
        assert!(creation.contains("aten", "zeros"));
        assert!(!creation.contains("aten", "zeros_"));
        assert!(family("builtins").unwrap().contains("builtins", "min"));
        assert!(family("nope").is_none());
    }

    #[test]
    fn family_names_and_members_are_unique() {
        let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len());
        let mut members: Vec<String> = FAMILIES.iter().flat_map(Family::member_names).collect();
        let all = members.len();
        members.sort();
        members.dedup();
        assert_eq!(members.len(), all, "a member is listed in two families");
    }
}
