//! Builtin ops run locally for the tests (`op`, `add`), through the op shim
//! (`wasmrpc-torch-sys`): libtorch's operator registry, PyTorch's schema
//! matching and its error texts, called by aten name.
//!
//! Workers serve these names themselves (`wasmrpc::BuiltinOps`, through
//! each worker's op policy), so the seed tests that call them by RPC run
//! under the default op policy; [`OPS`] lists them for reference.

use wasmrpc::{Args, Error, Payload, Result, args};

/// The builtin ops the seed tests call by name.
pub const OPS: &[&str] = &[
    "aten::add",
    "aten::mul",
    "aten::sub",
    "aten::nonzero",
    "builtins.min",
];

/// Runs builtin `name` on `args` through the op shim.
///
/// # Errors
/// The op's error with PyTorch's kind and text (e.g. "Overloaded torch
/// operator invoked from Python failed to match any schema").
pub fn op(name: &str, args: &Args) -> Result<Payload> {
    let mut out = Vec::new();
    let value = wasmrpc_torch_sys::call_op_values(
        name,
        &args.positional,
        &args.kwargs,
        &mut |i| args.tensors.get(i as usize).map(|t| t.shallow_clone()),
        &mut |t| {
            out.push(t);
            (out.len() - 1) as u32
        },
    )
    .map_err(|e| Error::new(e.kind(), e.to_string()))?;
    Ok(Payload {
        value,
        tensors: out,
        rrefs: Vec::new(),
    })
}

/// `a + b` (`aten::add`), as Python's `+` on tensors and numbers.
///
/// # Errors
/// As [`op`].
pub fn add(a: &Payload, b: &Payload) -> Result<Payload> {
    op("aten::add", &args![a.clone(), b.clone()])
}
