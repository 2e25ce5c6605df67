//! What travels: PyTorch's dtype names, the one-dtype check collectives
//! make, and complex tensors as their real view.

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::reduce_op::is_complex;

/// PyTorch's name for a dtype (`torch.float32`).
pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Uint8 => "torch.uint8",
        Kind::Int8 => "torch.int8",
        Kind::Int16 => "torch.int16",
        Kind::Int => "torch.int32",
        Kind::Int64 => "torch.int64",
        Kind::Half => "torch.float16",
        Kind::Float => "torch.float32",
        Kind::Double => "torch.float64",
        Kind::ComplexHalf => "torch.complex32",
        Kind::ComplexFloat => "torch.complex64",
        Kind::ComplexDouble => "torch.complex128",
        Kind::Bool => "torch.bool",
        Kind::BFloat16 => "torch.bfloat16",
        _ => "torch.<other>",
    }
}

/// The real dtype a complex dtype travels as (PyTorch views complex tensors
/// as real before the dtype check and the wire).
fn as_real(kind: Kind) -> Kind {
    match kind {
        Kind::ComplexHalf => Kind::Half,
        Kind::ComplexFloat => Kind::Float,
        Kind::ComplexDouble => Kind::Double,
        other => other,
    }
}

/// PyTorch's `_ensure_all_tensors_same_dtype`.
pub(super) fn ensure_same_dtype<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<()> {
    let mut first: Option<Kind> = None;
    for t in tensors {
        let kind = as_real(t.kind());
        match first {
            None => first = Some(kind),
            Some(f) if f != kind => {
                return Err(Error::InvalidArgument(format!(
                    "Invalid usage of tensors with different dtypesFound {} and  {}",
                    dtype_name(f),
                    dtype_name(kind)
                )));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

pub(super) fn shallow(tensors: &[Tensor]) -> Vec<Tensor> {
    tensors.iter().map(Tensor::shallow_clone).collect()
}

/// Complex tensors as their real view (what travels).
pub(super) fn real_view(t: &Tensor) -> Result<Tensor> {
    if is_complex(t.kind()) {
        t.f_view_as_real()
            .map_err(|e| Error::Runtime(format!("view_as_real: {e}")))
    } else {
        Ok(t.shallow_clone())
    }
}
