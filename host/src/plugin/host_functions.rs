//! [`GuestCall`]: the worker's side of one plugin call, a
//! [`GuestHost`] over the agent.
//!
//! It owns the call's handle table ([`Handles`]) and the per-worker locks
//! the call holds; tensor ops go to `wasmrpc-torch-sys` on the blocking pool
//! (OPS-1), through the worker's op policy and the plugin's grant (POL-1,
//! GR-1), RPCs to the agent once the grant admits their target (GR-2),
//! globals and locks to the agent's
//! [`state`](super::state). Everything the guest still holds when the call
//! (and every `then` callback it chained) is over is released on drop.
//! RRef handles are [`crate::RRef`]s: `remote` and `rref_new` create them,
//! RRefs in arguments and results arrive as handles, and a handle passed to
//! a call forks the RRef as any host RRef does; proxies on RRef handles
//! (`rref_rpc_sync`, ...) are the host's [`crate::RRefProxy`], so a guest
//! calls methods of plugin objects as host code does.
//!
//! A `GuestCall` serves one call of a function, or one plugin object for
//! its whole life (`super::class`): then its handles and locks are the
//! object's, released when the object is disposed of.
//!
//! Autograd requests (local autograd, a distributed autograd context the
//! guest opens, the distributed optimizer) are in [`autograd`]; file
//! requests in the folders the operator granted the plugin, and tensor
//! files there, in [`files`].
//!
//! Profiling: a call served in a caller's profiling scope records its ops
//! (every aten op libtorch runs for them, nested ones included, through
//! `wasmrpc_torch_sys::record_ops`), the RPCs it makes and the
//! guest's `record_function` ranges in that scope (`crate::profiler`). The
//! scope is carried as a value ([`GuestCall::profiled_by`]), since `then`
//! callbacks run in tasks of their own and ops on the blocking pool.

mod autograd;
mod files;
mod rrefs;
mod tensors;

use tensors::{dtype_kind, elements, meta};

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tch::Tensor;

use crate::tensor::budget::CallBudget;
use wasmrpc_wasm::{
    AutogradCall, CallArgs, DType, ErrorKind, GuestHost, HandleKind, HostResult, LogLevel, Plugin,
    Progress, RemoteError, TensorMeta, Value, WorkerInfo,
};

use super::grant::PluginGrant;
use super::handles::Handles;
use super::state::{Globals, Locks, SharedFutures};
use crate::agent::{Future, RpcAgent};
use crate::error::Error;
use crate::ops::run_blocking;
use crate::profiler::{Range, Recording};
use crate::rref::{RRefProxy, RRefProxyMode, Remote};

/// The host side of one call of a plugin function on one worker.
pub(crate) struct GuestCall {
    agent: RpcAgent,
    plugin: Arc<Plugin>,
    namespace: String,
    /// What the plugin may do on this worker (its ops and RPC targets).
    grant: Arc<PluginGrant>,
    /// Its version's state scope, and what it calls its own functions by.
    scope: super::VersionScope,
    handles: Mutex<Handles>,
    held_locks: Mutex<Vec<String>>,
    autograd: autograd::GuestAutograd,
    /// The profiling scope the call is served in, if any.
    profiler: Option<Recording>,
    /// The guest's open `record_function` ranges; a range's id is its
    /// index plus one.
    ranges: Mutex<Vec<Option<Range>>>,
    /// What the tensors this call's ops and `tensor_new`s make are charged
    /// to: one budget for the whole call, under the worker's (BUDGET-1).
    budget: CallBudget,
}

impl Drop for GuestCall {
    fn drop(&mut self) {
        self.autograd.release(&self.agent);
        let held = std::mem::take(&mut *self.held_locks.lock().unwrap_or_else(|p| p.into_inner()));
        if !held.is_empty() {
            let locks = self.agent.state::<Locks>();
            for name in held {
                locks.release(&self.scope.state, &name);
            }
        }
    }
}

fn remote(e: Error) -> RemoteError {
    e.to_remote()
}

fn tch_error(e: tch::TchError) -> RemoteError {
    RemoteError::new(ErrorKind::RuntimeError, e.to_string())
}

fn bad_timeout(seconds: f64) -> RemoteError {
    RemoteError::new(
        ErrorKind::ValueError,
        format!("an RPC timeout must be a non-negative number of seconds, got {seconds}"),
    )
}

impl GuestCall {
    /// A call of a function of `plugin` (registered under `namespace`, with
    /// `grant`) on `agent`'s worker.
    pub(crate) fn new(
        agent: RpcAgent,
        plugin: Arc<Plugin>,
        namespace: String,
        grant: Arc<PluginGrant>,
        scope: super::VersionScope,
    ) -> GuestCall {
        GuestCall {
            budget: agent.tensor_budget().call(),
            agent,
            plugin,
            namespace,
            grant,
            scope,
            handles: Mutex::new(Handles::default()),
            held_locks: Mutex::new(Vec::new()),
            autograd: autograd::GuestAutograd::default(),
            profiler: None,
            ranges: Mutex::new(Vec::new()),
        }
    }

    /// The call records into `recording` (the scope it is served in), from
    /// wherever its requests run.
    pub(crate) fn profiled_by(mut self, recording: Option<Recording>) -> GuestCall {
        self.profiler = recording;
        self
    }

    /// Where the guest's requests record: the scope of the task that runs
    /// them (a plugin object's method served in a profiling scope), else
    /// the one the call was served in.
    fn recording(&self) -> Option<Recording> {
        Recording::active().or_else(|| self.profiler.clone())
    }

    /// Runs `body` (which may start RPCs) in the call's profiling scope.
    async fn in_scope_async<F: std::future::Future>(&self, body: F) -> F::Output {
        match self.recording() {
            Some(r) => r.scope(body).await,
            None => body.await,
        }
    }

    /// Runs `f` (which may start RPCs) in the call's profiling scope.
    fn in_scope<R>(&self, f: impl FnOnce() -> R) -> R {
        crate::profiler::sync_scope_opt(self.recording().as_ref(), f)
    }

    /// What the plugin may do on this worker.
    pub(crate) fn grant(&self) -> Arc<PluginGrant> {
        self.grant.clone()
    }

    /// The call's handle table.
    pub(crate) fn handles(&self) -> MutexGuard<'_, Handles> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registered name a guest means by `function`: a name of one of
    /// its own plugin's functions or classes without a namespace
    /// (`my_function`, `MyClass.my_static_method`, `MyClass`) is
    /// `namespace::function`, or for a deployed version
    /// `namespace@<sha256 prefix>::function` (a call chain stays on the
    /// version it started on, on every worker); anything else
    /// (`aten::add`, `other_plugin::f`, `builtins.min`) is as given.
    pub(crate) fn qualify(&self, function: &str) -> String {
        let manifest = self.plugin.manifest();
        if !function.contains("::")
            && (manifest.function(function).is_some() || manifest.constructor(function).is_some())
        {
            format!("{}::{function}", self.scope.calls)
        } else {
            function.to_owned()
        }
    }

    /// A proxy of the guest's RRef `rref` with its timeout in seconds.
    fn proxy(&self, rref: u32, timeout: Option<f64>, mode: RRefProxyMode) -> HostResult<RRefProxy> {
        let r = self.handles().rref(rref)?;
        let timeout = timeout
            .map(|s| Duration::try_from_secs_f64(s).map_err(|_| bad_timeout(s)))
            .transpose()?;
        Ok(match mode {
            RRefProxyMode::Sync => r.rpc_sync(&self.agent, timeout),
            RRefProxyMode::Async => r.rpc_async(&self.agent, timeout),
            RRefProxyMode::Remote => r.remote(&self.agent, timeout),
        })
    }

    fn start_rpc(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<Future> {
        let function = self.qualify(function);
        // GR-2: before anything is sent.
        self.grant
            .admit_call(&function, self.agent.name())
            .map_err(remote)?;
        let args = self.handles().borrow_args(args)?;
        let timeout = match timeout {
            None => None,
            Some(s) => Some(Duration::try_from_secs_f64(s).map_err(|_| bad_timeout(s))?),
        };
        // DA-3: a call made inside the guest's own context carries it.
        Ok(self.in_scope(|| {
            crate::dist_autograd::sync_scope(self.autograd.context(), || match timeout {
                None => self.agent.rpc_async(to, &function, args),
                Some(t) => self.agent.rpc_async_with_timeout(to, &function, args, t),
            })
        }))
    }
}

#[async_trait]
impl GuestHost for GuestCall {
    async fn op(&self, name: &str, args: CallArgs) -> HostResult<Value> {
        self.run_op(name, args).await
    }

    async fn tensor_new(&self, dtype: DType, shape: Vec<i64>, data: Vec<u8>) -> HostResult<u32> {
        let what = format!("a new tensor of plugin {}", self.namespace);
        let (t, refused) = self.budget.run(&what, || {
            Tensor::f_from_data_size(&data, &shape, dtype_kind(dtype))
        });
        if let Some(e) = refused {
            return Err(remote(e));
        }
        let t = t.map_err(tch_error)?;
        Ok(self.handles().insert_tensor(t))
    }

    async fn tensor_meta(&self, tensor: u32) -> HostResult<TensorMeta> {
        meta(&self.handles().tensor(tensor)?)
    }

    async fn tensor_data(&self, tensor: u32) -> HostResult<(TensorMeta, Vec<u8>)> {
        let t = self.handles().tensor(tensor)?;
        let m = meta(&t)?;
        let dtype = m.dtype;
        let bytes = run_blocking(move || elements(&t, dtype))
            .await
            .map_err(remote)?
            .map_err(tch_error)?;
        Ok((m, bytes))
    }

    async fn dup(&self, kind: HandleKind, handle: u32) -> HostResult<u32> {
        self.handles().dup(kind, handle)
    }

    async fn drop_handle(&self, kind: HandleKind, handle: u32) -> HostResult<()> {
        self.handles().release(kind, handle)
    }

    async fn rpc_sync(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<Value> {
        let fut = self.start_rpc(to, function, args, timeout)?;
        let payload = fut.wait().await.map_err(remote)?;
        self.handles().import(payload)
    }

    async fn rpc_async(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32> {
        let fut = self.start_rpc(to, function, args, timeout)?;
        Ok(self.handles().insert_future(fut))
    }

    async fn remote(
        &self,
        to: &str,
        function: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32> {
        let function = self.qualify(function);
        // GR-2: before anything is sent.
        self.grant
            .admit_call(&function, self.agent.name())
            .map_err(remote)?;
        let args = self.handles().borrow_args(args)?;
        let timeout = match timeout {
            None => None,
            Some(s) => Some(Duration::try_from_secs_f64(s).map_err(|_| bad_timeout(s))?),
        };
        let rref = self
            .in_scope(|| {
                crate::dist_autograd::sync_scope(self.autograd.context(), || match timeout {
                    None => self.agent.remote(to, &function, args),
                    Some(t) => self.agent.remote_with_timeout(to, &function, args, t),
                })
            })
            .map_err(remote)?;
        Ok(self.handles().insert_rref(rref))
    }

    async fn rref_to_here(&self, rref: u32) -> HostResult<Value> {
        self.fetch_value(rref).await
    }

    async fn rref_fetch(&self, rref: u32) -> HostResult<u32> {
        self.fetch_future(rref)
    }

    async fn rref_owner(&self, rref: u32) -> HostResult<WorkerInfo> {
        Ok(self.handles().rref(rref)?.owner())
    }

    async fn rref_new(&self, value: Value) -> HostResult<u32> {
        let payload = self.handles().borrow_payload(value)?;
        let r = crate::rref::RRef::new(&self.agent, payload);
        Ok(self.handles().insert_rref(r))
    }

    // ---- RRef proxies and RRef state (plugin classes) --------------------

    async fn rref_rpc_sync(
        &self,
        rref: u32,
        method: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<Value> {
        let proxy = self.proxy(rref, timeout, RRefProxyMode::Sync)?;
        let args = self.handles().borrow_args(args)?;
        // DA-3: a proxy call made inside the guest's own context carries it.
        let call = crate::dist_autograd::scope(self.autograd.context(), proxy.call(method, args));
        let payload = self.in_scope_async(call).await.map_err(remote)?;
        self.handles().import(payload)
    }

    async fn rref_rpc_async(
        &self,
        rref: u32,
        method: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32> {
        let proxy = self.proxy(rref, timeout, RRefProxyMode::Async)?;
        let args = self.handles().borrow_args(args)?;
        let fut = self.in_scope(|| {
            crate::dist_autograd::sync_scope(self.autograd.context(), || {
                proxy.call_async(method, args)
            })
        });
        Ok(self.handles().insert_future(fut))
    }

    async fn rref_remote(
        &self,
        rref: u32,
        method: &str,
        args: CallArgs,
        timeout: Option<f64>,
    ) -> HostResult<u32> {
        let proxy = self.proxy(rref, timeout, RRefProxyMode::Remote)?;
        let args = self.handles().borrow_args(args)?;
        let call =
            crate::dist_autograd::scope(self.autograd.context(), proxy.call_remote(method, args));
        let r = self.in_scope_async(call).await.map_err(remote)?;
        Ok(self.handles().insert_rref(r))
    }

    async fn rref_is_owner(&self, rref: u32) -> HostResult<bool> {
        Ok(self.handles().rref(rref)?.is_owner())
    }

    async fn rref_local_object(&self, rref: u32) -> HostResult<Option<u32>> {
        Ok(super::class::PluginObject::local_to(
            &self.handles().rref(rref)?,
            self,
        ))
    }

    async fn keep_object(&self, object: u32, class: &str) -> HostResult<bool> {
        super::module::offer(&self.plugin, object, class)
    }

    async fn rref_of_object(&self, object: u32, class: &str) -> HostResult<u32> {
        let r = super::module::rref_in_place(&self.plugin, &self.agent, object, class)?;
        Ok(self.handles().insert_rref(r))
    }

    async fn rref_confirmed_by_owner(&self, rref: u32) -> HostResult<bool> {
        Ok(self.handles().rref(rref)?.confirmed_by_owner())
    }

    // ---- end of RRef proxies and RRef state ------------------------------

    async fn future_new(&self) -> HostResult<u32> {
        Ok(self.handles().insert_future(Future::new()))
    }

    async fn future_set(&self, future: u32, result: HostResult<Value>) -> HostResult<()> {
        let fut = self.handles().future(future)?;
        let result = match result {
            Ok(v) => Ok(self.handles().borrow_payload(v)?),
            Err(e) => Err(Error::from(e)),
        };
        fut.complete(result).map_err(remote)
    }

    async fn future_wait(&self, future: u32) -> HostResult<Value> {
        let fut = self.handles().future(future)?;
        let payload = fut.wait().await.map_err(remote)?;
        self.handles().import(payload)
    }

    async fn future_done(&self, future: u32) -> HostResult<bool> {
        Ok(self.handles().future(future)?.done())
    }

    // --- Worker-wide named futures (examples' batching, issue 10) ---
    async fn future_shared(&self, key: &str, take: bool) -> HostResult<u32> {
        let fut = self
            .agent
            .state::<SharedFutures>()
            .get(&self.scope.state, key, take);
        Ok(self.handles().insert_future(fut))
    }
    // --- end of worker-wide named futures ---

    async fn worker_info(&self, name: Option<&str>) -> HostResult<WorkerInfo> {
        self.agent.get_worker_info(name).map_err(remote)
    }

    async fn global_get(&self, key: &str) -> HostResult<Value> {
        match self.agent.state::<Globals>().get(&self.scope.state, key) {
            Some(p) => self.handles().import(p),
            None => Ok(Value::None),
        }
    }

    async fn global_set(&self, key: &str, value: Value) -> HostResult<()> {
        let value = match value {
            Value::None => None,
            v => Some(self.handles().borrow_payload(v)?),
        };
        self.agent
            .state::<Globals>()
            .set(&self.scope.state, key, value);
        Ok(())
    }

    async fn lock(&self, key: &str) -> HostResult<()> {
        self.agent
            .state::<Locks>()
            .acquire(&self.scope.state, key)
            .await;
        self.held_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key.to_owned());
        Ok(())
    }

    async fn unlock(&self, key: &str) -> HostResult<()> {
        let held = {
            let mut held = self.held_locks.lock().unwrap_or_else(|p| p.into_inner());
            held.iter().rposition(|k| k == key).map(|i| held.remove(i))
        };
        match held {
            Some(_) => {
                self.agent.state::<Locks>().release(&self.scope.state, key);
                Ok(())
            }
            None => Err(RemoteError::new(
                ErrorKind::RuntimeError,
                format!("lock `{key}` is not held by this call"),
            )),
        }
    }

    // --- Progress reports (issue 10: the demo's progress bars) ---
    async fn progress(&self, report: Progress) -> HostResult<()> {
        crate::progress::ProgressEvent {
            worker: self.agent.name().to_owned(),
            bar: report.bar,
            position: report.position,
            total: report.total,
            message: report.message,
        }
        .emit();
        Ok(())
    }
    // --- end of progress reports ---

    async fn log(&self, level: LogLevel, message: &str) -> HostResult<()> {
        let (worker, plugin) = (self.agent.name(), self.namespace.as_str());
        match level {
            LogLevel::Error => {
                tracing::error!(target: "wasmrpc::guest", %worker, %plugin, "{message}")
            }
            LogLevel::Warn => {
                tracing::warn!(target: "wasmrpc::guest", %worker, %plugin, "{message}")
            }
            LogLevel::Info => {
                tracing::info!(target: "wasmrpc::guest", %worker, %plugin, "{message}")
            }
            LogLevel::Debug => {
                tracing::debug!(target: "wasmrpc::guest", %worker, %plugin, "{message}")
            }
        }
        Ok(())
    }

    // ---- Profiling ranges (`record_function`).

    async fn record_function_enter(&self, name: &str) -> HostResult<u32> {
        let Some(recording) = self.recording() else {
            return Ok(0);
        };
        let mut ranges = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        ranges.push(Some(recording.range(name)));
        u32::try_from(ranges.len()).map_err(|_| {
            RemoteError::new(ErrorKind::RuntimeError, "too many record_function ranges")
        })
    }

    async fn record_function_exit(&self, range: u32) -> HostResult<()> {
        if range == 0 {
            return Ok(());
        }
        let closed = self
            .ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(range as usize - 1)
            .and_then(Option::take);
        match closed {
            Some(r) => {
                drop(r);
                Ok(())
            }
            None => Err(RemoteError::new(
                ErrorKind::RuntimeError,
                format!("record_function range {range} is not open in this call"),
            )),
        }
    }

    // ---- Autograd block (see `autograd`).

    async fn autograd(&self, call: AutogradCall) -> HostResult<Value> {
        self.run_autograd(call).await
    }

    fn folders(&self) -> Option<Arc<wasmrpc_wasm::Folders>> {
        self.granted_folders()
    }

    async fn file(&self, call: wasmrpc_wasm::FileCall) -> HostResult<Value> {
        self.run_file(call).await
    }
}
