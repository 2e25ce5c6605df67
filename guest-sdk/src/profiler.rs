//! Profiling ranges inside a plugin function (PyTorch's
//! `torch.autograd.profiler.record_function`): when the call runs in a
//! caller's profiling scope, the range is one of the callee's events sent
//! back to the caller, as are the ops and RPCs the function runs; when
//! nothing profiles the call, a range costs one host request and records
//! nothing.
//!
//! ```no_run
//! use wasmrpc_guest::{Result, Tensor, profiler::record_function};
//! fn forward(x: &Tensor) -> Result<Tensor> {
//!     record_function("##forward##", || x.relu()?.sigmoid())
//! }
//! ```

use crate::host;
use wasmrpc_abi::protocol::HostCall;

/// An open range; it closes when dropped ([`RecordFunction::enter`]).
#[must_use = "the range closes when the guard drops"]
pub struct RecordFunction {
    range: u32,
}

impl RecordFunction {
    /// Opens the range `name` now (`record_function(name).__enter__()`).
    /// A host that cannot record it records nothing.
    pub fn enter(name: &str) -> RecordFunction {
        let range = host::handle(&HostCall::RecordFunctionEnter(name.to_owned())).unwrap_or(0);
        RecordFunction { range }
    }
}

impl Drop for RecordFunction {
    fn drop(&mut self) {
        if self.range != 0 {
            let _ = host::unit(&HostCall::RecordFunctionExit(self.range));
        }
    }
}

/// Runs `body` as the range `name` (`with record_function(name): ...`).
pub fn record_function<R>(name: &str, body: impl FnOnce() -> R) -> R {
    let _range = RecordFunction::enter(name);
    body()
}
