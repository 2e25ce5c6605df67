//! Autograd inspection of tensors that ops produce: which node recorded them.
//!
//! Ops called through [`crate::Operator`] go through libtorch's dispatcher,
//! so autograd records them like any other call; this module only reads the
//! result (`grad_fn`). Building distributed-autograd nodes is left to the
//! host's `autograd` module.

use crate::ffi::{self, RawStr};
use std::ffi::c_void;
use tch::Tensor;

/// The name of the autograd node that produced `tensor` (Python's
/// `type(t.grad_fn).__name__`, e.g. `MulBackward0`), or `None` for a leaf,
/// a tensor that does not require grad, or one made under `no_grad`.
pub fn grad_fn_name(tensor: &Tensor) -> Option<String> {
    let mut name = RawStr {
        ptr: std::ptr::null(),
        len: 0,
    };
    // SAFETY: `as_ptr` is the live `at::Tensor*` behind `tensor`, borrowed for
    // the call; `name` is writable; the shim catches every exception.
    let status = unsafe { ffi::wrs_grad_fn_name(tensor.as_ptr().cast::<c_void>(), &mut name) };
    if status != 1 || name.ptr.is_null() {
        return None;
    }
    // SAFETY: on success the shim points `name` at its thread-local string,
    // valid until the next shim call on this thread.
    let bytes = unsafe { std::slice::from_raw_parts(name.ptr, name.len) };
    Some(String::from_utf8_lossy(bytes).into_owned())
}
