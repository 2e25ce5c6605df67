//! [`GuestHost`]: everything a guest may ask of the worker it runs on.
//!
//! The runtime owns the guest side of each request (decoding it, copying
//! bytes in and out of guest memory, tracking the locks a call holds); the
//! implementor owns what the request does: tensors, the network, RRefs,
//! futures, globals. The `wasmrpc` host crate implements it with the agent
//! and libtorch; the tests implement it with plain `Vec<f32>`s.
//!
//! # Handles
//!
//! Tensors, RRefs and futures are `u32` handles into tables the implementor
//! keeps (a [`Value::Tensor`]/[`Value::RRef`] holds one). The rule is
//! *requests borrow, outcomes move*:
//!
//! - a handle the guest names in a request, or puts in a value it sends
//!   (op arguments, RPC arguments, a global, a future's result), stays the
//!   guest's: an implementor that keeps the value resolves the handle to its
//!   object first;
//! - a handle the implementor returns (a reply, a value, call arguments
//!   passed to [`Runtime::call`](crate::Runtime::call)) is new and owned by
//!   the guest, which releases it with [`GuestHost::drop_handle`];
//! - a handle in a call's result (or the future an async function returns)
//!   moves to the caller of the runtime.

use async_trait::async_trait;
use std::time::Duration;
use wasmrpc_abi::protocol::{
    AutogradCall, CallArgs, DType, FileCall, HandleKind, LogLevel, Progress, TensorMeta,
};
use wasmrpc_abi::{ErrorKind, RemoteError, Value, WorkerInfo};

/// The result of a request: errors keep their Python kind and message and
/// reach the guest unchanged.
pub type HostResult<T> = Result<T, RemoteError>;

/// What a guest may ask of the worker it runs on. Every method may wait
/// (on the network, a lock, a future): a waiting guest holds no thread.
#[async_trait]
pub trait GuestHost: Send + Sync + 'static {
    /// Runs an aten op by schema name (`"aten::add"`) on values holding
    /// tensor handles; returns its result with new handles.
    async fn op(&self, name: &str, args: CallArgs) -> HostResult<Value>;
    /// Creates a tensor from contiguous little-endian bytes.
    async fn tensor_new(&self, dtype: DType, shape: Vec<i64>, data: Vec<u8>) -> HostResult<u32>;
    /// A tensor's dtype, shape and `requires_grad`.
    async fn tensor_meta(&self, tensor: u32) -> HostResult<TensorMeta>;
    /// A tensor's metadata and contiguous little-endian elements.
    async fn tensor_data(&self, tensor: u32) -> HostResult<(TensorMeta, Vec<u8>)>;
    /// A second handle to the same object.
    async fn dup(&self, kind: HandleKind, handle: u32) -> HostResult<u32>;
    /// Releases a handle.
    async fn drop_handle(&self, kind: HandleKind, handle: u32) -> HostResult<()>;

    /// `rpc_sync(to, function, args)`: `function` is an aten op name or a
    /// registered plugin function.
    async fn rpc_sync(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<Value>;
    /// `rpc_async(...)`: returns a future handle.
    async fn rpc_async(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32>;
    /// `remote(...)`: returns an RRef handle.
    async fn remote(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32>;

    /// `rref.to_here()`.
    async fn rref_to_here(&self, rref: u32) -> HostResult<Value>;
    /// `rref.owner()`.
    async fn rref_owner(&self, rref: u32) -> HostResult<WorkerInfo>;
    /// `RRef(value)`: a local owner RRef.
    async fn rref_new(&self, value: Value) -> HostResult<u32>;

    // ---- RRef proxies and RRef state (plugin classes) --------------------
    // Kept together: a host without RRef proxies keeps the defaults, which
    // answer `NotImplementedError`.

    /// `rref.rpc_sync(timeout).method(*args)`: runs `method` on the value
    /// on its owner and waits for the result.
    async fn rref_rpc_sync(
        &self,
        rref: u32,
        method: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<Value> {
        let _ = (rref, args, timeout);
        Err(no_proxies(method))
    }
    /// `rref.rpc_async(timeout).method(*args)`: returns a future handle.
    async fn rref_rpc_async(
        &self,
        rref: u32,
        method: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32> {
        let _ = (rref, args, timeout);
        Err(no_proxies(method))
    }
    /// `rref.remote(timeout).method(*args)`: returns an RRef handle to the
    /// result, kept on the owner.
    async fn rref_remote(
        &self,
        rref: u32,
        method: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32> {
        let _ = (rref, args, timeout);
        Err(no_proxies(method))
    }
    /// `rref.is_owner()`.
    async fn rref_is_owner(&self, rref: u32) -> HostResult<bool> {
        let _ = rref;
        Err(RemoteError::new(
            ErrorKind::NotImplementedError,
            "this host does not track RRef ownership",
        ))
    }
    /// The id of the object `rref` holds when that object lives in the
    /// calling instance (a function running beside it), else `None`.
    async fn rref_local_object(&self, rref: u32) -> HostResult<Option<u32>> {
        let _ = rref;
        Ok(None)
    }
    /// Whether the owner-side `remote()` the running function serves keeps
    /// the guest's object `object` of class `class` (see
    /// [`HostCall::KeepObject`](wasmrpc_abi::protocol::HostCall::KeepObject)).
    async fn keep_object(&self, object: u32, class: &str) -> HostResult<bool> {
        let _ = (object, class);
        Ok(false)
    }
    /// `rref.to_here()` as a future handle (see
    /// [`HostCall::RRefFetch`](wasmrpc_abi::protocol::HostCall::RRefFetch)).
    async fn rref_fetch(&self, rref: u32) -> HostResult<u32> {
        let _ = rref;
        Err(RemoteError::new(
            ErrorKind::NotImplementedError,
            "this host does not fetch RRefs as futures",
        ))
    }
    /// `RRef(obj)` of the guest's object `object` of class `class`, made in
    /// place (see
    /// [`HostCall::RRefOfObject`](wasmrpc_abi::protocol::HostCall::RRefOfObject)):
    /// the new RRef's handle.
    async fn rref_of_object(&self, object: u32, class: &str) -> HostResult<u32> {
        let _ = (object, class);
        Err(RemoteError::new(
            ErrorKind::NotImplementedError,
            "this host keeps no objects in place",
        ))
    }
    /// `rref.confirmed_by_owner()`.
    async fn rref_confirmed_by_owner(&self, rref: u32) -> HostResult<bool> {
        let _ = rref;
        Err(RemoteError::new(
            ErrorKind::NotImplementedError,
            "this host does not track RRef confirmations",
        ))
    }
    // ---- end of RRef proxies and RRef state ------------------------------

    /// `Future()`: a new, unset future.
    async fn future_new(&self) -> HostResult<u32>;
    /// `fut.set_result(v)` / `fut.set_exception(e)`.
    async fn future_set(&self, future: u32, result: HostResult<Value>) -> HostResult<()>;
    /// `fut.wait()`: the value has new handles.
    async fn future_wait(&self, future: u32) -> HostResult<Value>;
    /// `fut.done()`.
    async fn future_done(&self, future: u32) -> HostResult<bool>;

    // --- Worker-wide named futures (examples' batching, issue 10) ---
    /// The per-worker future named `key`, created unset on first use; with
    /// `take`, the name is forgotten after this handle is made. The default
    /// says the host has none.
    async fn future_shared(&self, key: &str, take: bool) -> HostResult<u32> {
        let _ = take;
        Err(runtime_error(format!(
            "this host has no worker-wide futures (asked for `{key}`)"
        )))
    }
    // --- end of worker-wide named futures ---

    /// `get_worker_info(name)`; `None` for this worker.
    async fn worker_info(&self, name: Option<&str>) -> HostResult<WorkerInfo>;

    /// Reads a per-worker global (`Value::None` when unset).
    async fn global_get(&self, key: &str) -> HostResult<Value>;
    /// Writes a per-worker global; `Value::None` clears it.
    async fn global_set(&self, key: &str, value: Value) -> HostResult<()>;
    /// Takes the per-worker lock `key`, waiting until it is free.
    async fn lock(&self, key: &str) -> HostResult<()>;
    /// Releases the per-worker lock `key`.
    async fn unlock(&self, key: &str) -> HostResult<()>;

    /// Sleeps without holding a thread. The default uses tokio's timer.
    async fn sleep(&self, duration: Duration) -> HostResult<()> {
        tokio::time::sleep(duration).await;
        Ok(())
    }

    // --- Progress reports (issue 10: the demo's progress bars) ---
    /// A guest's progress report. The default logs it as a line with
    /// `tracing`.
    async fn progress(&self, report: Progress) -> HostResult<()> {
        tracing::info!(
            target: "wasmrpc::progress",
            "{} {}/{} {}",
            report.bar,
            report.position,
            report.total,
            report.message
        );
        Ok(())
    }
    // --- end of progress reports ---

    // --- Profiling ranges (`record_function`) ---
    /// Opens a user range `name` in the profiling scope of the call, if
    /// one profiles it; returns the range's id (never 0), or 0 when nothing
    /// is recorded. The default records nothing: a host without a profiler.
    async fn record_function_enter(&self, name: &str) -> HostResult<u32> {
        let _ = name;
        Ok(0)
    }
    /// Closes range `range` from
    /// [`record_function_enter`](Self::record_function_enter); 0 does
    /// nothing.
    async fn record_function_exit(&self, range: u32) -> HostResult<()> {
        let _ = range;
        Ok(())
    }
    // --- end of profiling ranges ---

    /// Logs a guest's line. The default uses `tracing`.
    async fn log(&self, level: LogLevel, message: &str) -> HostResult<()> {
        match level {
            LogLevel::Error => tracing::error!(target: "wasmrpc::guest", "{message}"),
            LogLevel::Warn => tracing::warn!(target: "wasmrpc::guest", "{message}"),
            LogLevel::Info => tracing::info!(target: "wasmrpc::guest", "{message}"),
            LogLevel::Debug => tracing::debug!(target: "wasmrpc::guest", "{message}"),
        }
        Ok(())
    }

    /// The folders the operator granted this plugin on this worker
    /// ([`crate::folders`]); `None` for none (the default). A component's
    /// instances see them as WASI preopens, and an instance made for one
    /// set of folders never serves a call with another.
    fn folders(&self) -> Option<std::sync::Arc<crate::Folders>> {
        None
    }

    /// Runs a file request in the plugin's granted folders ([`FileCall`]);
    /// replies as documented on each request. The default refuses every
    /// request (a host that grants no folders).
    async fn file(&self, call: FileCall) -> HostResult<Value> {
        Err(runtime_error(format!(
            "this host grants plugins no folders ({call:?})"
        )))
    }

    // ---- Autograd block: local autograd on handles, distributed autograd
    // contexts and the distributed optimizer. Keep these methods together.

    /// Runs an autograd request ([`AutogradCall`]); replies as documented
    /// on each request. The default refuses every request (a host without
    /// autograd).
    async fn autograd(&self, call: AutogradCall) -> HostResult<Value> {
        Err(runtime_error(format!(
            "this host does not support autograd requests ({call:?})"
        )))
    }
}

fn no_proxies(method: &str) -> RemoteError {
    RemoteError::new(
        ErrorKind::NotImplementedError,
        format!("RRef proxy call of {method}: this host does not serve RRef proxies"),
    )
}

/// A `RuntimeError` with `message`, for implementors.
pub fn runtime_error(message: impl Into<String>) -> RemoteError {
    RemoteError::new(ErrorKind::RuntimeError, message)
}
