//! A Python `torch.Tensor` ⇄ the `tch::Tensor` the host holds, through the
//! C++ bridge `thp.cpp`. Both directions share the tensor (its storage and
//! its autograd history): nothing is copied.
//!
//! This module owns the only `unsafe` of the crate.

use pyo3::ffi;
use pyo3::prelude::*;
use tch::Tensor;

unsafe extern "C" {
    fn wasmrpc_thp_unpack(obj: *mut ffi::PyObject) -> *mut torch_sys::C_tensor;
    fn wasmrpc_thp_wrap(t: *mut torch_sys::C_tensor) -> *mut ffi::PyObject;
}

/// The tensor `obj` is, if it is a `torch.Tensor` (or a subclass, such as
/// `nn.Parameter`).
pub(crate) fn from_python(obj: &Bound<'_, PyAny>) -> Option<Tensor> {
    // SAFETY: the GIL is held (`Bound`), and `wasmrpc_thp_unpack` returns
    // either null or a fresh heap `torch::Tensor` that we now own, which is
    // what `Tensor::from_ptr` takes over.
    let ptr = unsafe { wasmrpc_thp_unpack(obj.as_ptr()) };
    if ptr.is_null() {
        return None;
    }
    Some(unsafe { Tensor::from_ptr(ptr) })
}

/// The Python tensor of `t`: the very object Python holds for it when it
/// has one, else a new `torch.Tensor` sharing it.
pub(crate) fn to_python<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: the GIL is held (`py`); `wasmrpc_thp_wrap` only reads the
    // tensor (the mutable pointer is the C API's type) and returns a new
    // reference, or null with a Python error set.
    unsafe {
        let obj = wasmrpc_thp_wrap(t.as_ptr() as *mut torch_sys::C_tensor);
        Bound::from_owned_ptr_or_err(py, obj)
    }
}
