//! Builtin ops by their aten schema name, through libtorch's own operator
//! registry: the callee side of PyTorch RPC's builtin calls
//! (`rpc_sync("worker1", torch.add, args=(t1, t2))`) and the tensor-op host
//! import of wasm guests.
//!
//! ```no_run
//! use wasmrpc_torch_sys::{call_op, OpValue};
//! use tch::Tensor;
//!
//! let a = OpValue::Tensor(Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu)));
//! // `add.Scalar` is the overload that accepts a tensor and an int.
//! let out = call_op("aten::add", &[a, OpValue::Int(1)], &[("alpha".into(), OpValue::Int(2))])?;
//! let sum = out[0].as_tensor().expect("add returns a tensor");
//! assert_eq!(sum.double_value(&[0, 0]), 3.0);
//! # Ok::<(), wasmrpc_torch_sys::OpError>(())
//! ```
//!
//! # Core concepts
//!
//! - [`OpValue`]: an argument or a result (`None`, scalars, strings, tensors,
//!   lists, tuples, dtypes, devices). It owns its tensors; calls borrow
//!   arguments, so a caller keeps them. Converting to a schema's types
//!   follows PyTorch RPC's Python conversion (`toIValue`).
//! - [`Operator`]: a name resolved once into all its overloads (`aten::add`
//!   has 16). Cheap to clone, `Send + Sync`; resolved names are cached for
//!   the life of the process, so the hot path is one read-locked hash lookup.
//!   A call matches the arguments against each overload in PyTorch RPC's
//!   order (dispatcher ops first) and runs the first that accepts them.
//! - [`call_op`] / [`call_method`]: the same by name; `call_op` also serves
//!   the Python builtins the seeds call ([`BUILTINS`]).
//! - [`OpGate`]: a check asked before a by-name call runs the op its name
//!   resolved to ([`call_op_gated`], [`call_method_gated`],
//!   [`call_method_values_gated`]), with the resolved [`Operator`] (so every
//!   spelling of a name reaches the gate as the registry's one name) and the
//!   arguments; the host's op policy is one. [`AdmitAll`] admits anything,
//!   for the host's own calls.
//! - [`OpError`]: the Python exception class ([`OpError::kind`]) and
//!   PyTorch's message: [`NO_MATCHING_SCHEMA`] with every schema tried,
//!   libtorch's own text when an op raises, `Unknown builtin op: aten::foo`.
//! - [`grad_fn_name`], [`GradFn`]: which autograd node recorded a result
//!   (`MulBackward0`) and the graph behind it (`next_functions`, an
//!   `AccumulateGrad`'s variable), as the distributed-autograd seeds inspect;
//!   [`grad`]: `torch.autograd.grad` with explicit seeds, for pushing
//!   gradients that arrive over RPC through the local graph.
//! - [`call_op_abi`], [`call_op_values`], [`call_method_values`],
//!   [`op_value_from_abi`], [`op_value_into_abi`]: the same over
//!   [`wasmrpc_abi::Value`]s whose tensors live in the caller's table: the
//!   callee side of a builtin RPC (and of an RRef proxy's tensor method) and
//!   the guests' `HostCall::Op`, in one call each;
//!   `RemoteError::from(OpError)` gives what crosses back.
//!
//! Calls run on the caller's thread, with its grad mode; any number run at
//! once. No C++ exception crosses into Rust: the shim catches everything.
//!
//! # Names
//!
//! `aten::add` and any other registered `namespace::name`;
//! `torch.ops.aten.add` (PyTorch RPC's wire form); a bare name (`view`,
//! `size`, `sum`, `to`, `add`) is a tensor method, `aten::<name>`, and
//! [`call_method`] falls back to `prim::<name>` for tensor properties
//! (`dtype`, `device`, `is_sparse`, `requires_grad`, `is_cuda`).
//! Python-only methods that have no operator of their own (`Tensor.float()`,
//! `.double()`, `.long()`, `.int()`, `.half()`, `.bool()`, `.tolist()`,
//! `.type()`, `.numpy()`, `.register_hook()`, `__setitem__`) do not resolve;
//! use their op (`to` with a dtype, `index_put_`, ...).
//!
//! # Where matching differs from PyTorch RPC
//!
//! - `None`, and an undefined tch tensor, never match a plain `Tensor`
//!   parameter (PyTorch passes an undefined tensor, which most kernels then
//!   reject); both match `Tensor?` as None.
//! - Only `Bool` matches a `bool` parameter (pybind11 would also take an
//!   `int` there).
//! - One `int` broadcasts to an optional fixed-size list too (`int[1]? dim`,
//!   so `sum(t, 0)` works), where PyTorch's conversion drops the size.
//! - The no-match text lists every overload tried, dispatcher and
//!   TorchScript-only alike; PyTorch RPC lists only the TorchScript-only
//!   ones (its second, failing, pass).
//! - An op's own error is its message without the C++ backtrace that
//!   PyTorch RPC appends (`Exception raised from ...`).
//! - Outputs of complex scalars, dicts and objects are
//!   [`OpError::Internal`] (no [`OpValue`] for them); operators that need a
//!   TorchScript graph node or count their varargs are not callable by name
//!   (`prim::isinstance`, `aten::format`): they report `Unknown builtin op`.
//!
//! # Safety
//!
//! The C++ shim (`shim/`, its C API in `ops.h`) is reached only through
//! the private `ffi` module; every `unsafe` block states its contract. Arguments that a peer
//! or a guest controls are bounded before they reach C++: names are checked
//! for plausibility (the registry interns every name it looks up) and lists
//! nest at most [`MAX_NESTING`] deep.

mod autograd;
mod budget;
mod builtin;
mod convert;
pub mod cuda;
pub mod cuda_stream;
mod error;
mod ffi;
mod op;
mod profile;
pub mod recycle;
mod value;

pub use autograd::{
    GradFn, GradOptions, HookResult, TensorHook, backward, engine_bypasses, grad, grad_fn_name,
    register_hook, set_engine_bypass, set_grad,
};
pub use budget::{BudgetRefusal, MemoryBudget};
pub use builtin::BUILTINS;
pub use convert::{
    call_method_values, call_method_values_gated, call_op_abi, call_op_values, device_string,
    op_value_from_abi, op_value_into_abi,
};
pub use error::{NO_MATCHING_SCHEMA, OpError};
pub use op::{
    Admission, AdmitAll, OpGate, Operator, Target, WIRE_PREFIX, call_method, call_method_gated,
    call_op, call_op_gated, qualified_name, registered_ops, schemas,
};
pub use profile::{OpEvent, RecordOptions, record_ops};
pub use value::{MAX_NESTING, OpValue, kind_code, kind_of_code};
pub use wasmrpc_abi::ErrorKind;

/// Whether libtorch's CUDA side (`libtorch_cuda.so`) is loaded in this
/// process and in effect, loading it first where [`cuda::load`] decides to.
/// Without it no CUDA device is ever seen, GPU or not.
pub fn libtorch_has_cuda() -> bool {
    cuda::is_loaded()
}
