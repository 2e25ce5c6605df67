//! [`ReduceOp`]: how a reducing collective combines the ranks' tensors.
//!
//! PyTorch has two types, `ReduceOp.RedOpType` (the plain members `SUM`,
//! `AVG`, ...) and `ReduceOp` (a member, or `PREMUL_SUM` with its scale);
//! `ReduceOp(op)` wraps a member. Here [`RedOpType`] and [`ReduceOp`] play
//! those parts; what Python checks with `isinstance(op, ReduceOp)` the type
//! system guarantees. Equality between the two is symmetric in Rust: PyTorch's
//! asymmetry (`op != ReduceOp(op)`, because `RedOpType.__eq__` is not
//! overloaded) is a Python artefact and is not reproduced.
//!
//! This module owns the reduction arithmetic the CPU backend applies; it does
//! not move data.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// A plain reduction member (`ReduceOp.RedOpType`). Serde is its
/// `pickle` (a member round-trips to itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RedOpType {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks.
    Avg,
    /// Element-wise product.
    Product,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Bitwise and.
    Band,
    /// Bitwise or.
    Bor,
    /// Bitwise xor.
    Bxor,
    /// Sum after multiplying each rank's input by a scale (NCCL's
    /// `PREMUL_SUM`).
    PremulSum,
}

/// A reduction: a [`RedOpType`], or `PREMUL_SUM` with its scale. Serde is
/// its `pickle` (the scale travels with a `PREMUL_SUM`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks.
    Avg,
    /// Element-wise product.
    Product,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Bitwise and.
    Band,
    /// Bitwise or.
    Bor,
    /// Bitwise xor.
    Bxor,
    /// Sum of each input multiplied by the scale.
    PremulSum(f64),
}

impl ReduceOp {
    /// `ReduceOp.SUM`.
    pub const SUM: ReduceOp = ReduceOp::Sum;
    /// `ReduceOp.AVG`.
    pub const AVG: ReduceOp = ReduceOp::Avg;
    /// `ReduceOp.PRODUCT`.
    pub const PRODUCT: ReduceOp = ReduceOp::Product;
    /// `ReduceOp.MIN`.
    pub const MIN: ReduceOp = ReduceOp::Min;
    /// `ReduceOp.MAX`.
    pub const MAX: ReduceOp = ReduceOp::Max;
    /// `ReduceOp.BAND`.
    pub const BAND: ReduceOp = ReduceOp::Band;
    /// `ReduceOp.BOR`.
    pub const BOR: ReduceOp = ReduceOp::Bor;
    /// `ReduceOp.BXOR`.
    pub const BXOR: ReduceOp = ReduceOp::Bxor;

    /// The member this op is (`op.op` in Python's `ReduceOp`).
    pub fn op_type(&self) -> RedOpType {
        match self {
            ReduceOp::Sum => RedOpType::Sum,
            ReduceOp::Avg => RedOpType::Avg,
            ReduceOp::Product => RedOpType::Product,
            ReduceOp::Min => RedOpType::Min,
            ReduceOp::Max => RedOpType::Max,
            ReduceOp::Band => RedOpType::Band,
            ReduceOp::Bor => RedOpType::Bor,
            ReduceOp::Bxor => RedOpType::Bxor,
            ReduceOp::PremulSum(_) => RedOpType::PremulSum,
        }
    }

    /// Prepares one rank's contribution (the scale of `PREMUL_SUM`).
    pub(crate) fn prepare(&self, t: Tensor) -> Result<Tensor, tch::TchError> {
        match self {
            ReduceOp::PremulSum(scale) => t.f_mul_scalar(*scale),
            _ => Ok(t),
        }
    }

    /// Folds `next` into `acc`.
    pub(crate) fn combine(&self, acc: &Tensor, next: &Tensor) -> Result<Tensor, tch::TchError> {
        match self {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PremulSum(_) => acc.f_add(next),
            ReduceOp::Product => acc.f_mul(next),
            ReduceOp::Min => acc.f_minimum(next),
            ReduceOp::Max => acc.f_maximum(next),
            ReduceOp::Band => acc.f_bitwise_and_tensor(next),
            ReduceOp::Bor => acc.f_bitwise_or_tensor(next),
            ReduceOp::Bxor => acc.f_bitwise_xor_tensor(next),
        }
    }

    /// Finishes a reduction over `ranks` contributions (the division of
    /// `AVG`; integer tensors divide with truncation, as PyTorch's gloo does
    /// not support AVG on them).
    pub(crate) fn finish(&self, acc: Tensor, ranks: usize) -> Result<Tensor, tch::TchError> {
        match self {
            ReduceOp::Avg if acc.is_floating_point() || is_complex(acc.kind()) => {
                acc.f_div_scalar(ranks as f64)
            }
            ReduceOp::Avg => acc.f_div_scalar_mode(ranks as i64, "trunc"),
            _ => Ok(acc),
        }
    }
}

pub(crate) fn is_complex(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::ComplexHalf | Kind::ComplexFloat | Kind::ComplexDouble
    )
}

impl From<RedOpType> for ReduceOp {
    /// `ReduceOp(op)`. `PremulSum` without a scale becomes a scale of 1.
    fn from(op: RedOpType) -> Self {
        match op {
            RedOpType::Sum => ReduceOp::Sum,
            RedOpType::Avg => ReduceOp::Avg,
            RedOpType::Product => ReduceOp::Product,
            RedOpType::Min => ReduceOp::Min,
            RedOpType::Max => ReduceOp::Max,
            RedOpType::Band => ReduceOp::Band,
            RedOpType::Bor => ReduceOp::Bor,
            RedOpType::Bxor => ReduceOp::Bxor,
            RedOpType::PremulSum => ReduceOp::PremulSum(1.0),
        }
    }
}

impl PartialEq<RedOpType> for ReduceOp {
    fn eq(&self, other: &RedOpType) -> bool {
        self.op_type() == *other && !matches!(self, ReduceOp::PremulSum(_))
    }
}

impl PartialEq<ReduceOp> for RedOpType {
    fn eq(&self, other: &ReduceOp) -> bool {
        other == self
    }
}

/// The scale of a `PREMUL_SUM`: a number or a one-element tensor.
pub trait PremulScale {
    /// The scale as a number.
    fn scale(&self) -> f64;
}

impl PremulScale for f64 {
    fn scale(&self) -> f64 {
        *self
    }
}

impl PremulScale for Tensor {
    fn scale(&self) -> f64 {
        self.double_value(&[])
    }
}

/// `dist._make_nccl_premul_sum(scale)`: a `PREMUL_SUM` reduction. A tensor
/// scale is read once, here (PyTorch keeps the tensor; a later in-place
/// change of it does not reach this op).
pub fn make_nccl_premul_sum(scale: &impl PremulScale) -> ReduceOp {
    ReduceOp::PremulSum(scale.scale())
}
