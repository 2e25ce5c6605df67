//! `wasmrpc._native`: the extension module behind the `wasmrpc` Python
//! package, which gives a Python program `torch.distributed.rpc`'s API on
//! the wasmrpc host.
//!
//! A Python process that calls `wasmrpc.rpc.init_rpc` becomes a worker of
//! its group like any `wasmrpc worker`: the same rendezvous, credentials,
//! agent and wire. It calls functions by their registered names (plugin
//! functions, builtin ops) and serves only what its operator loads
//! (`plugins=` in its options, and the builtin ops its op policy allows);
//! it never runs code a peer sends.
//!
//! Tensors cross between Python and the host without copies: the module
//! links the very libtorch `import torch` loaded, and `tensor` hands the
//! same `TensorImpl` back and forth, so an autograd graph built in Python
//! and the distributed autograd functions the host records are one graph.
//!
//! The Python side (`python/wasmrpc/`) owns the API's shape (argument
//! names, defaults, `torch.futures.Future`, context managers); this crate
//! owns what crosses into the host. Modules:
//! - `worker`: the runtime, the agent, `init_rpc`/`shutdown`, `WorkerInfo`,
//!   host errors as Python exceptions;
//! - `rpc`: `rpc_sync`/`rpc_async`/`remote`;
//! - `rref`: `RRef`;
//! - `autograd`: distributed autograd and `DistributedOptimizer`;
//! - `plugin`: a plugin file's exports, for naming them from Python;
//! - `values`: Python values ⇄ the host's values;
//! - `tensor`: the tensor bridge (the crate's only `unsafe`).

use pyo3::prelude::*;

mod autograd;
mod plugin;
mod rpc;
mod rref;
mod tensor;
mod values;
mod worker;

/// The module Python imports as `wasmrpc._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<worker::PyWorkerInfo>()?;
    m.add_class::<rref::PyRRef>()?;
    m.add_class::<rref::PyRRefProxy>()?;
    m.add_class::<rref::PyRRefMethod>()?;
    m.add_class::<autograd::PyDistributedOptimizer>()?;
    m.add_function(wrap_pyfunction!(worker::init_rpc, m)?)?;
    m.add_function(wrap_pyfunction!(worker::shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(worker::get_worker_info, m)?)?;
    m.add_function(wrap_pyfunction!(worker::get_worker_infos, m)?)?;
    m.add_function(wrap_pyfunction!(worker::get_rpc_timeout, m)?)?;
    m.add_function(wrap_pyfunction!(worker::set_rpc_timeout, m)?)?;
    m.add_function(wrap_pyfunction!(plugin::plugin_exports, m)?)?;
    m.add_function(wrap_pyfunction!(rpc::rpc_sync, m)?)?;
    m.add_function(wrap_pyfunction!(rpc::rpc_async, m)?)?;
    m.add_function(wrap_pyfunction!(rpc::remote, m)?)?;
    m.add_function(wrap_pyfunction!(autograd::new_context, m)?)?;
    m.add_function(wrap_pyfunction!(autograd::release_context, m)?)?;
    m.add_function(wrap_pyfunction!(autograd::backward, m)?)?;
    m.add_function(wrap_pyfunction!(autograd::get_gradients, m)?)?;
    Ok(())
}
