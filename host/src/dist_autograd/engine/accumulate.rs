//! How a leaf's first gradient in a pass is kept: libtorch's
//! `AccumulateGrad` rule. The gradient's buffer is taken as it is (stolen,
//! no copy) when nothing else of the pass holds it and it is laid out as the
//! leaf is; otherwise the leaf gets a copy laid out as the leaf
//! (`clone_obey_contract`). The seeds observe it through `data_ptr`
//! (`test_no_grad_copy`, `test_grad_copy_sparse_indices_extra_ref`).

use std::collections::HashMap;

use tch::Tensor;

use crate::error::Result;
use crate::tensor::impl_id;

/// `acc + g`, or `g` for the first.
pub(super) fn add_grad(acc: Option<Tensor>, g: Tensor) -> Result<Tensor> {
    match acc {
        None => Ok(g),
        Some(a) => Ok(a.f_add(&g)?),
    }
}

/// How many of `grads` are each tensor: a tensor a custom backward
/// returned for two inputs is held twice (libtorch's `use_count() > 1`).
pub(super) fn holders<'a>(grads: impl Iterator<Item = &'a Tensor>) -> HashMap<usize, usize> {
    let mut n = HashMap::new();
    for g in grads {
        *n.entry(impl_id(g)).or_insert(0) += 1;
    }
    n
}

/// libtorch's `obeys_layout_contract`: a dense leaf's gradient has the
/// leaf's strides (but along dimensions of size 1), any other leaf's is
/// contiguous; a sparse gradient has no layout to obey.
fn obeys_layout_contract(grad: &Tensor, leaf: &Tensor) -> bool {
    if grad.is_sparse() || leaf.is_sparse() {
        return false;
    }
    if leaf.is_contiguous() {
        let (size, want, got) = (leaf.size(), leaf.stride(), grad.stride());
        got.len() == want.len()
            && size
                .iter()
                .zip(want.iter().zip(&got))
                .all(|(&n, (w, g))| n == 1 || w == g)
    } else {
        grad.is_contiguous()
    }
}

/// The gradient `leaf` keeps when `grad` is its first in the pass: `grad`
/// itself unless it is `shared` (held for another leaf too) or, dense,
/// breaks the layout contract; then a copy, with the leaf's strides when
/// the leaf is dense.
pub(super) fn first_grad(leaf: &Tensor, grad: Tensor, shared: bool) -> Result<Tensor> {
    if grad.is_sparse() {
        if !shared {
            return Ok(grad);
        }
        let mut copy = grad.f_zeros_like()?;
        copy.f_copy_(&grad)?;
        return Ok(copy);
    }
    if !shared && obeys_layout_contract(&grad, leaf) {
        return Ok(grad);
    }
    let options = (grad.kind(), grad.device());
    let mut copy = if leaf.is_contiguous() && !leaf.is_sparse() {
        Tensor::f_empty_strided(leaf.size(), leaf.stride(), options)?
    } else {
        Tensor::f_empty(grad.size(), options)?
    };
    copy.f_copy_(&grad)?;
    Ok(copy)
}
