//! The RPC agent: one worker's membership in a group, its calls to peers,
//! the functions it serves, and shutdown.
//!
//! An [`RpcAgent`] is an object, not a process-wide singleton: a process may
//! run several (the test harness runs whole groups in one process). A
//! process-wide "current agent" exists for convenience ([`current_agent`]).
//!
//! What it owns: the worker table (from rendezvous, and from membership
//! updates in dynamic groups), the pending calls and their timeouts, the
//! callee tasks, the all-gather states behind `_all_gather`, `_barrier`,
//! `_wait_all_workers` and graceful shutdown, and per-worker state for
//! functions ([`RpcAgent::state`]). It leaves bytes and sockets to
//! `transport`, tensor encoding to `tensor`, and the meaning of functions to
//! the [`FunctionRegistry`].
//!
//! Invariants:
//! - AG-1: callee work never runs on a connection's reader: every call runs
//!   as its own task, so calls to self and nested calls back to the caller
//!   cannot deadlock.
//! - AG-2: a call's timeout is fixed when the call is made (`_set_rpc_timeout`
//!   later does not change it); zero means none.
//! - AG-3: every pending call ends exactly once: with its response, its
//!   timeout, the failure of the connection it was sent on (naming the peer),
//!   or the local shutdown.
//! - AG-4: a callee's response is queued before its task stops counting as
//!   active, so a graceful shutdown that waits for active tasks flushes every
//!   response.
//! - AG-5: graceful shutdown of a static group is PyTorch's: an all-gather
//!   led by the lexicographically smallest name, then a join that repeats
//!   all-gathers of (idle, user calls made + received) until two
//!   consecutive rounds find every worker idle with unchanged counts, so
//!   fire-and-forget chains drain.
//! - AG-6: all-gathers of one name set are matched by sequence id, so every
//!   participant makes them in the same order (see `all_gather`).
//! - AG-7: a function never runs before the callee's rendezvous has filled
//!   its worker table, so nested calls made by early arrivals find their
//!   destinations.

mod all_gather;
mod current;
mod deadlines;
mod future;
mod options;
mod registry;
mod rendezvous;

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tch::Tensor;
use tokio::sync::Notify;

pub use current::{current_agent, reset_current_agent, set_current_agent};
pub use future::{
    Future, collect_all, collected_futures, wait_all, wait_all_blocking, wait_all_scope,
};
pub use options::{
    CLUSTER_SECRET_ENV, DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT, Dest,
    RpcBackendOptions, validate_worker_name, worker_info,
};
pub(crate) use registry::call_guarded;
pub use registry::{CallContext, FunctionRegistry, FunctionResolver, RpcFunction};

use crate::abi::{ErrorKind, WorkerInfo};
use crate::device::MapDirection;
use crate::error::{
    Error, Result, cannot_get_worker_info_message, rpc_timeout_message, unknown_function_message,
    unknown_worker_id_message, unknown_worker_name_message,
};
use crate::store::Store;
use crate::transport::{AutogradEnvelope, Connection, Handler, Message, OutFrame, Transport};
use crate::value::{Args, Payload};

/// Names of the agent's own functions start with this prefix; they are
/// served by every agent and are not counted as user calls.
pub const INTERNAL_PREFIX: &str = "wasmrpc::";

/// A function every agent serves that does nothing (the seeds' `noop`,
/// used to probe whether a worker is alive).
pub const NOOP: &str = "wasmrpc::_noop";

/// A call's positional and keyword values, as sent.
type WireArgs = (Vec<crate::abi::Value>, Vec<(String, crate::abi::Value)>);

const RUNNING: u8 = 0;
const STOPPING: u8 = 1;
const STOPPED: u8 = 2;

struct Pending {
    future: Future,
    peer: String,
    function: String,
    conn: u64,
    user: bool,
    /// When the call times out, and its timeout (for the error).
    deadline: Option<(tokio::time::Instant, Duration)>,
}

#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub(crate) info: WorkerInfo,
    pub(crate) addr: SocketAddr,
}

pub(crate) struct AgentInner {
    info: WorkerInfo,
    options: RpcBackendOptions,
    store: Arc<dyn Store>,
    static_group: bool,
    member_slot: AtomicU64,
    runtime: tokio::runtime::Handle,
    transport: std::sync::OnceLock<Arc<Transport>>,
    handler: std::sync::OnceLock<Arc<dyn Handler>>,
    workers: RwLock<BTreeMap<String, Member>>,
    pending: Mutex<HashMap<u64, Pending>>,
    deadlines: Arc<deadlines::Deadlines>,
    next_id: AtomicU64,
    timeout_ms: AtomicU64,
    state: AtomicU8,
    user_sent: AtomicU64,
    user_received: AtomicU64,
    user_pending: AtomicUsize,
    user_active: AtomicUsize,
    active: AtomicUsize,
    quiet: Notify,
    ready: std::sync::atomic::AtomicBool,
    ready_notify: Notify,
    gather: all_gather::GatherStates,
    internal: FunctionRegistry,
    worker_state: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    debug_sources: Mutex<Vec<DebugInfoSource>>,
    shutdown_hooks: Mutex<Vec<ShutdownHook>>,
    /// What the tensors this worker makes for its peers and plugins may
    /// hold (`crate::tensor::budget`).
    tensor_budget: crate::tensor::budget::WorkerBudget,
}

/// The error of a call whose frame could not be sent.
fn send_failure(e: Error, function: &str, peer: &str) -> Error {
    e.context_line(format!("sending a call of {function} to worker {peer}"))
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        self.deadlines.stop();
    }
}

type DebugInfoSource = Arc<dyn Fn() -> BTreeMap<String, String> + Send + Sync>;

/// A step of graceful shutdown, run after the all-gather and before the join
/// (where PyTorch deletes user RRefs).
pub type ShutdownHook = Arc<
    dyn Fn(RpcAgent) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>
        + Send
        + Sync,
>;

/// Options of one call ([`RpcAgent::rpc_async_with`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallOptions {
    /// The call's timeout: `None` for the agent's default, zero for none.
    pub timeout: Option<Duration>,
    /// The distributed-autograd envelope to send with the call.
    pub autograd: Option<AutogradEnvelope>,
}

/// One worker of an RPC group. Cheap to clone; clones are the same agent.
#[derive(Clone)]
pub struct RpcAgent {
    inner: Arc<AgentInner>,
}

impl std::fmt::Debug for RpcAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcAgent")
            .field("worker", &self.inner.info)
            .finish()
    }
}

impl PartialEq for RpcAgent {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Starts a worker and joins its group (`init_rpc`).
///
/// With `world_size`, the group is static: every rank `0..world_size` must
/// join, and this returns once all have. Without it, the group is dynamic:
/// the worker joins whoever is there and announces itself to them. `rank`
/// may be omitted only with the `env://` init method and a `RANK` variable.
/// Rendezvous costs each worker a constant number of store round trips.
///
/// # Errors
/// - `RuntimeError` "Worker name must match ..." for an invalid name;
/// - `ValueError` "... rank parameter missing" / "... environment variable
///   RANK expected ..." without a rank;
/// - `RuntimeError` "... is not unique" if two workers share a name, "... is
///   already initialized ..." if the rank joined twice, and the mixed-group
///   text if static and dynamic workers meet;
/// - store errors (e.g. a rendezvous timeout), as `RuntimeError`.
pub async fn init_rpc(
    name: &str,
    rank: Option<u32>,
    world_size: Option<u32>,
    store: Arc<dyn Store>,
    options: RpcBackendOptions,
) -> Result<RpcAgent> {
    rendezvous::init(name, rank, world_size, store, options).await
}

fn store_err(e: crate::store::Error) -> Error {
    Error::runtime(e.to_string())
}

impl RpcAgent {
    pub(crate) fn from_inner(inner: Arc<AgentInner>) -> Self {
        RpcAgent { inner }
    }

    /// A weak reference (RRef handles hold these, so they do not keep a
    /// stopped agent alive).
    pub(crate) fn downgrade(&self) -> std::sync::Weak<AgentInner> {
        Arc::downgrade(&self.inner)
    }

    /// The function a call of `name` runs: the agent's own functions
    /// (`INTERNAL_PREFIX`) or the registry's.
    pub(crate) fn lookup_function(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        if name.starts_with(INTERNAL_PREFIX) {
            self.inner.internal.get(name)
        } else {
            self.registry().get(name)
        }
    }

    /// The runtime the agent runs on.
    pub(crate) fn runtime_handle(&self) -> tokio::runtime::Handle {
        self.inner.runtime.clone()
    }

    /// This worker's identity.
    pub fn info(&self) -> &WorkerInfo {
        &self.inner.info
    }

    /// This worker's name.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.inner.info.id
    }

    /// The address peers dial.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.transport.get().map(|t| t.local_addr())
    }

    /// The store the group met through.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The functions this worker serves.
    pub fn registry(&self) -> &Arc<FunctionRegistry> {
        &self.inner.options.registry
    }

    /// The options the agent was started with.
    pub fn options(&self) -> &RpcBackendOptions {
        &self.inner.options
    }

    /// This worker's tensor memory budget and the per-call budgets made
    /// under it.
    pub(crate) fn tensor_budget(&self) -> &crate::tensor::budget::WorkerBudget {
        &self.inner.tensor_budget
    }

    /// Bytes of CPU tensor memory charged to this worker's tensor memory
    /// budget now (what its peers' and plugins' ops and received messages
    /// hold), and the budget's limit.
    pub fn tensor_memory_in_use(&self) -> (u64, u64) {
        let budget = self.inner.tensor_budget.worker();
        (budget.used(), budget.limit())
    }

    /// Whether the group was initialised with a world size.
    pub fn is_static_group(&self) -> bool {
        self.inner.static_group
    }

    /// Whether the agent runs: true until shutdown completes (calls are
    /// still allowed while a graceful shutdown drains the group).
    pub fn is_running(&self) -> bool {
        self.inner.state.load(Ordering::Acquire) != STOPPED
    }

    fn require_running(&self) -> Result<()> {
        if self.is_running() {
            Ok(())
        } else {
            Err(Error::not_initialized())
        }
    }

    /// Per-worker state of type `T`, created on first use: the equivalent of
    /// a Python module's globals on this worker.
    pub fn state<T: Any + Send + Sync + Default>(&self) -> Arc<T> {
        let mut map = self
            .inner
            .worker_state
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let entry = map
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()));
        match entry.clone().downcast::<T>() {
            Ok(v) => v,
            Err(_) => {
                // Invariant: the map is keyed by the value's TypeId.
                let fresh = Arc::new(T::default());
                *entry = fresh.clone();
                fresh
            }
        }
    }

    /// A worker's info: this worker's with `None` (`get_worker_info`).
    ///
    /// # Errors
    /// `RuntimeError` "... could not find destination" for an unknown name,
    /// or "RPC has not been initialized ..." after shutdown.
    pub fn get_worker_info(&self, name: Option<&str>) -> Result<WorkerInfo> {
        self.require_running()?;
        match name {
            None => Ok(self.inner.info.clone()),
            Some(n) => self.member_by_name(n).map(|m| m.info),
        }
    }

    /// Every worker of the group, by rank (`get_worker_infos`).
    pub fn get_worker_infos(&self) -> Vec<WorkerInfo> {
        let mut v: Vec<WorkerInfo> = self.workers().into_iter().map(|m| m.info).collect();
        v.sort();
        v
    }

    pub(crate) fn workers(&self) -> Vec<Member> {
        self.inner
            .workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    fn member_by_name(&self, name: &str) -> Result<Member> {
        self.inner
            .workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::runtime(unknown_worker_name_message(name)))
    }

    /// Resolves a destination to a worker of the group (`_to_worker_info`).
    ///
    /// # Errors
    /// `RuntimeError` for unknown names and ranks; `ValueError` "Cannot get
    /// WorkerInfo from name ..." for anything that is not a name, a rank or a
    /// `WorkerInfo`.
    pub fn resolve(&self, to: impl Into<Dest>) -> Result<WorkerInfo> {
        match to.into() {
            Dest::Name(n) => self.member_by_name(&n).map(|m| m.info),
            Dest::Info(w) => self.member_by_name(&w.name).map(|m| m.info),
            Dest::Rank(r) => self
                .workers()
                .into_iter()
                .find(|m| i64::from(m.info.id) == r)
                .map(|m| m.info)
                .ok_or_else(|| Error::runtime(unknown_worker_id_message(r))),
            Dest::Invalid(s) => Err(Error::value(cannot_get_worker_info_message(&s))),
        }
    }

    /// The default timeout of calls (`get_rpc_timeout`); zero means none.
    pub fn get_rpc_timeout(&self) -> Duration {
        Duration::from_millis(self.inner.timeout_ms.load(Ordering::Acquire))
    }

    /// Changes the default timeout for calls made from now on
    /// (`_set_rpc_timeout`); zero means none.
    pub fn set_rpc_timeout(&self, timeout: Duration) {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let ms = if ms == 0 && !timeout.is_zero() { 1 } else { ms };
        self.inner.timeout_ms.store(ms, Ordering::Release);
    }

    /// Calls `function` on `to` and returns at once (`rpc_async`), with the
    /// default timeout as it is now.
    ///
    /// Argument tensors are not copied before they are sent: keep them
    /// unchanged until the future completes. Errors (unknown destination,
    /// agent shut down, remote failure, timeout) complete the future.
    pub fn rpc_async(&self, to: impl Into<Dest>, function: &str, args: Args) -> Future {
        self.profiled(
            crate::profiler::RpcExecMode::Async,
            to.into(),
            function,
            |to| self.call(to, function, args, None, true),
        )
    }

    /// Makes a call with `make` and reports it to an enclosing profiling
    /// scope (`crate::profiler`).
    fn profiled(
        &self,
        mode: crate::profiler::RpcExecMode,
        to: Dest,
        function: &str,
        make: impl FnOnce(Dest) -> Future,
    ) -> Future {
        crate::profiler::rpc(
            self,
            mode,
            &to,
            function,
            || make(to.clone()),
            |f| Some(f.clone()),
        )
        .0
    }

    /// [`rpc_async`](Self::rpc_async) with its own timeout; zero means none.
    pub fn rpc_async_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Future {
        self.profiled(
            crate::profiler::RpcExecMode::Async,
            to.into(),
            function,
            |to| self.call(to, function, args, Some(timeout), true),
        )
    }

    /// Calls `function` on `to` and waits for its result (`rpc_sync`).
    ///
    /// # Errors
    /// The callee's error with its kind and message, a timeout ("RPC ran for
    /// more than ..."), a failed connection (naming the worker), or the
    /// destination errors of [`resolve`](Self::resolve).
    pub async fn rpc_sync(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
    ) -> Result<Payload> {
        self.profiled(
            crate::profiler::RpcExecMode::Sync,
            to.into(),
            function,
            |to| self.call_inner(to, function, args, None, true, false),
        )
        .wait()
        .await
    }

    /// Runs the registered `function` on this worker, in the calling task,
    /// with nothing serialized: what a call from this worker to itself does
    /// once it has arrived (the caller is this worker). For embedders that
    /// run a plugin's function where they are, and for measuring a
    /// function's own cost apart from the network.
    ///
    /// # Errors
    /// "... is not registered on worker ..." for an unknown name, else the
    /// function's error (a panic becomes a `RuntimeError`).
    pub async fn call_local(&self, function: &str, args: Args) -> Result<Payload> {
        let f = self
            .registry()
            .get(function)
            .ok_or_else(|| Error::runtime(unknown_function_message(function, self.name())))?;
        let ctx = CallContext::new(
            self.clone(),
            self.info().clone(),
            function.to_string(),
            None,
        );
        registry::call_guarded(f, ctx, args).await
    }

    /// [`rpc_sync`](Self::rpc_sync) with its own timeout; zero means none.
    ///
    /// # Errors
    /// As [`rpc_sync`](Self::rpc_sync).
    pub async fn rpc_sync_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Result<Payload> {
        self.profiled(
            crate::profiler::RpcExecMode::Sync,
            to.into(),
            function,
            |to| self.call_inner(to, function, args, Some(timeout), true, false),
        )
        .wait()
        .await
    }

    pub(crate) fn call(
        &self,
        to: Dest,
        function: &str,
        args: Args,
        timeout: Option<Duration>,
        user: bool,
    ) -> Future {
        self.call_inner(to, function, args, timeout, user, user)
    }

    /// Makes a call; `collect` adds its future to an enclosing
    /// `wait_all_scope` (only `rpc_async` futures are collected).
    fn call_inner(
        &self,
        to: Dest,
        function: &str,
        args: Args,
        timeout: Option<Duration>,
        user: bool,
        collect: bool,
    ) -> Future {
        self.call_full(to, function, args, timeout, None, user, collect)
    }

    /// [`rpc_async`](Self::rpc_async) with every option: its own timeout
    /// (`None` for the default, zero for none) and a distributed-autograd
    /// envelope the callee sees in [`CallContext::autograd`].
    pub fn rpc_async_with(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        options: CallOptions,
    ) -> Future {
        self.call_full(
            to.into(),
            function,
            args,
            options.timeout,
            options.autograd,
            true,
            true,
        )
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "one private funnel for every kind of call"
    )]
    fn call_full(
        &self,
        to: Dest,
        function: &str,
        args: Args,
        timeout: Option<Duration>,
        autograd: Option<AutogradEnvelope>,
        user: bool,
        collect: bool,
    ) -> Future {
        // Calls to the agent's own functions are never user calls, whoever
        // makes them: both ends must agree for the join's counts (AG-5).
        let user = user && !function.starts_with(INTERNAL_PREFIX);
        let Args {
            positional,
            kwargs,
            tensors,
            rrefs,
        } = args;
        let (positional, kwargs) = if rrefs.is_empty() {
            (positional, kwargs)
        } else {
            match self.args_to_wire(&to, positional, kwargs, &rrefs) {
                Ok(pk) => pk,
                Err(e) => {
                    let fut = Future::new();
                    let _ =
                        fut.set_error(e.context_line(format!("sending RRefs to call {function}")));
                    return fut;
                }
            }
        };
        // Inside a distributed autograd context, the call may carry the
        // autograd envelope and record a send function (DA-3); an envelope
        // given explicitly wins.
        let internal_only = function.starts_with(INTERNAL_PREFIX)
            && function != crate::rref::REMOTE
            && function != crate::rref::FETCH
            && function != crate::rref::LOCAL_INVOKE;
        let autograd = if autograd.is_some() || internal_only {
            autograd
        } else {
            match &to {
                Dest::Invalid(_) => None,
                _ => self.resolve(to.clone()).ok().and_then(|dest| {
                    crate::dist_autograd::outgoing_call(self, dest.id, function, &tensors)
                }),
            }
        };
        // Inside a profiling scope, the call asks the callee for its events
        // (`crate::profiler`).
        let profiling = crate::profiler::outgoing();
        let build = |id| Message::Call {
            id,
            function: function.to_string(),
            args: positional,
            kwargs,
            autograd,
            profiling: profiling.as_ref().map(|p| p.sent_as(id)),
        };
        let fut = self.send_tracked(
            to,
            function,
            build,
            &tensors,
            timeout,
            user,
            collect,
            MapDirection::Request,
        );
        if let Some(p) = &profiling {
            p.until(&fut);
        }
        fut
    }

    /// Forks the RRefs of a call's arguments toward `to` (`crate::rref`).
    fn args_to_wire(
        &self,
        to: &Dest,
        positional: Vec<crate::abi::Value>,
        kwargs: Vec<(String, crate::abi::Value)>,
        rrefs: &[crate::rref::RRef],
    ) -> Result<WireArgs> {
        self.require_running()?;
        let dst = self.resolve(to.clone())?;
        let positional = positional
            .into_iter()
            .map(|v| crate::rref::to_wire(self, &dst, v, rrefs))
            .collect::<Result<Vec<_>>>()?;
        let kwargs = kwargs
            .into_iter()
            .map(|(k, v)| Ok((k, crate::rref::to_wire(self, &dst, v, rrefs)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok((positional, kwargs))
    }

    /// Sends a request of one of the reserved message kinds (RRef
    /// fork/accept/delete, autograd, profiling, plugin deployment) built by
    /// `build` from its request id, and returns the future of its reply:
    /// `Response` gives its value or error, `RRefAck` gives `None`,
    /// `ProfilingResponse` gives the list of events. A worker that does not
    /// handle the kind answers with a `NotImplementedError`. `timeout`:
    /// `None` for the default, zero for none.
    pub fn request(
        &self,
        to: impl Into<Dest>,
        build: impl FnOnce(u64) -> Message,
        tensors: &[Tensor],
        timeout: Option<Duration>,
    ) -> Future {
        self.request_mapped(to, build, tensors, timeout, MapDirection::Request)
    }

    /// [`request`](Self::request) whose tensors travel with the map
    /// `direction` names: gradients sent back toward the caller of a
    /// request use the inverse of that caller's map (`crate::dist_autograd`).
    pub(crate) fn request_mapped(
        &self,
        to: impl Into<Dest>,
        build: impl FnOnce(u64) -> Message,
        tensors: &[Tensor],
        timeout: Option<Duration>,
        direction: MapDirection,
    ) -> Future {
        self.send_tracked(
            to.into(),
            "a request",
            build,
            tensors,
            timeout,
            false,
            false,
            direction,
        )
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "one private funnel for every tracked message"
    )]
    fn send_tracked(
        &self,
        to: Dest,
        function: &str,
        build: impl FnOnce(u64) -> Message,
        tensors: &[Tensor],
        timeout: Option<Duration>,
        user: bool,
        collect: bool,
        direction: MapDirection,
    ) -> Future {
        let fut = Future::new();
        if collect && user {
            future::collect(&fut);
        }
        if let Err(e) = self.require_running() {
            let _ = fut.set_error(e);
            return fut;
        }
        let dest = match self.resolve(to) {
            Ok(d) => d,
            Err(e) => {
                let _ = fut.set_error(e);
                return fut;
            }
        };
        let timeout = timeout.unwrap_or_else(|| self.get_rpc_timeout());
        let inner = &self.inner;
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let devices = crate::device::devices_for(self, &dest.name, direction, tensors);
        let frame = match devices.and_then(|d| OutFrame::encode(build(id), tensors, &d)) {
            Ok(f) => f,
            Err(e) => {
                let _ = fut.set_error(
                    e.context_line(format!("encoding a call of {function} to {}", dest.name)),
                );
                return fut;
            }
        };
        // A peer already connected: the frame is sent from here (TR-5),
        // with no task to spawn; the pending entry knows its connection
        // before the frame leaves, so a close fails it.
        let deadline =
            (!timeout.is_zero()).then(|| (tokio::time::Instant::now() + timeout, timeout));
        let open = self
            .transport()
            .ok()
            .and_then(|t| t.open_connection(&dest.name).map(|c| (t, c)));
        inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id,
                Pending {
                    future: fut.clone(),
                    peer: dest.name.clone(),
                    function: function.to_string(),
                    conn: open.as_ref().map_or(0, |(_, c)| c.id),
                    user,
                    deadline,
                },
            );
        if let Some((at, _)) = deadline {
            inner.deadlines.insert(at, id);
        }
        if user {
            inner.user_sent.fetch_add(1, Ordering::AcqRel);
            inner.user_pending.fetch_add(1, Ordering::AcqRel);
        }
        let frame = match open {
            Some((transport, conn)) => match transport.send_now(&conn, frame) {
                Ok(Ok(())) => None,
                Ok(Err(e)) => {
                    self.finish(id, Err(send_failure(e, function, &dest.name)));
                    None
                }
                Err(frame) => Some(frame),
            },
            None => Some(frame),
        };
        if let Some(frame) = frame {
            // Dialing, or faults to apply: the send runs as its own task, to
            // completion even if the call times out first (the message still
            // reaches the callee, as in PyTorch).
            let sender = self.clone();
            let sent_function = function.to_string();
            let peer = dest.name.clone();
            inner.runtime.spawn(async move {
                if let Err(e) = sender.send_call(id, &peer, &sent_function, frame).await {
                    sender.finish(id, Err(send_failure(e, &sent_function, &peer)));
                }
            });
        }
        fut
    }

    async fn send_call(&self, id: u64, peer: &str, function: &str, frame: OutFrame) -> Result<()> {
        let transport = self.transport()?;
        let addr = self.member_by_name(peer)?.addr;
        let conn = transport.connection(peer, addr).await?;
        {
            let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            match pending.get_mut(&id) {
                Some(p) => p.conn = conn.id,
                None => return Ok(()),
            }
        }
        if conn.is_closed() {
            return Err(Error::runtime(format!(
                "connection to worker {peer} closed before the call was sent"
            )));
        }
        transport.send_on(&conn, frame, Some(function)).await
    }

    /// The cluster secret (for data the group signs, e.g. published
    /// plugin deployments).
    pub(crate) fn cluster_secret(&self) -> Result<Vec<u8>> {
        Ok(self.transport()?.secret().to_vec())
    }

    fn transport(&self) -> Result<Arc<Transport>> {
        self.inner
            .transport
            .get()
            .cloned()
            .ok_or_else(Error::not_initialized)
    }

    /// Ends pending call `id` (AG-3: only the first end counts).
    fn finish(&self, id: u64, result: Result<Payload>) {
        let p = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        if let Some(p) = p {
            if let Some((at, _)) = p.deadline {
                self.inner.deadlines.remove(at, id);
            }
            if p.user {
                self.inner.user_pending.fetch_sub(1, Ordering::AcqRel);
                self.inner.quiet.notify_waiters();
            }
            let _ = p.future.complete(result);
        }
    }

    /// The sweeper's side of [`deadlines`]: call `id` ran out of time.
    fn expire(&self, id: u64) {
        let error = {
            let pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.get(&id).and_then(|p| {
                let (_, timeout) = p.deadline?;
                Some(
                    Error::runtime(rpc_timeout_message(timeout.as_millis()))
                        .context_line(format!("calling {} on worker {}", p.function, p.peer)),
                )
            })
        };
        if let Some(e) = error {
            self.finish(id, Err(e));
        }
    }

    fn fail_pending_where(
        &self,
        pred: impl Fn(&Pending) -> bool,
        error: impl Fn(&Pending) -> Error,
    ) {
        let ids: Vec<u64> = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, p)| pred(p))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let e = self
                .inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&id)
                .map(&error);
            if let Some(e) = e {
                self.finish(id, Err(e));
            }
        }
    }

    /// Debug information (`get_debug_info`): `agent.*` keys.
    pub fn get_debug_info(&self) -> BTreeMap<String, String> {
        let i = &self.inner;
        let pending = i.pending.lock().unwrap_or_else(|p| p.into_inner()).len();
        let mut m = BTreeMap::new();
        m.insert(
            "agent.thread_pool_size".into(),
            i.options.num_worker_threads.to_string(),
        );
        m.insert("agent.num_pending_requests".into(), pending.to_string());
        m.insert("agent.client_active_calls".into(), pending.to_string());
        m.insert(
            "agent.server_active_calls".into(),
            i.active.load(Ordering::Acquire).to_string(),
        );
        m.insert(
            "agent.user_calls_sent".into(),
            i.user_sent.load(Ordering::Acquire).to_string(),
        );
        m.insert(
            "agent.user_calls_received".into(),
            i.user_received.load(Ordering::Acquire).to_string(),
        );
        m.insert("agent.num_workers".into(), self.workers().len().to_string());
        m.insert(
            "agent.num_connections".into(),
            i.transport
                .get()
                .map_or(0, |t| t.num_connections())
                .to_string(),
        );
        m.insert(
            "agent.rpc_timeout_ms".into(),
            i.timeout_ms.load(Ordering::Acquire).to_string(),
        );
        let sources: Vec<DebugInfoSource> = i
            .debug_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for source in sources {
            m.extend(source());
        }
        m
    }

    /// Adds entries to [`get_debug_info`](Self::get_debug_info), e.g. the
    /// RRef context's `rref.*` counters, which the test harness polls.
    pub fn add_debug_info_source(
        &self,
        source: impl Fn() -> BTreeMap<String, String> + Send + Sync + 'static,
    ) {
        self.inner
            .debug_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::new(source));
    }

    /// Adds a step to graceful shutdown of a static group, run after the
    /// all-gather and before the join, in the order added (PyTorch deletes
    /// user RRefs there). An error stops the shutdown's waiting (the agent
    /// still stops) and is returned by [`shutdown`](Self::shutdown).
    pub fn add_shutdown_hook(&self, hook: ShutdownHook) {
        self.inner
            .shutdown_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    async fn run_shutdown_hooks(&self) -> Result<()> {
        let hooks: Vec<ShutdownHook> = self
            .inner
            .shutdown_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for hook in hooks {
            hook(self.clone()).await?;
        }
        Ok(())
    }

    /// Waits until this worker has no pending user calls and runs no user
    /// function, or until `deadline`.
    async fn wait_quiet(&self, deadline: Option<tokio::time::Instant>) -> Result<()> {
        loop {
            let notified = self.inner.quiet.notified();
            if self.inner.user_pending.load(Ordering::Acquire) == 0
                && self.inner.user_active.load(Ordering::Acquire) == 0
            {
                return Ok(());
            }
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d, notified).await.is_err() {
                        return Err(Error::runtime(format!(
                            "worker {} still had {} pending calls and {} running functions at the join deadline",
                            self.name(),
                            self.inner.user_pending.load(Ordering::Acquire),
                            self.inner.user_active.load(Ordering::Acquire)
                        )));
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Shuts the worker down (`shutdown`). Graceful: waits for every worker
    /// of a static group (all-gather) and for all outstanding work in the
    /// group, including fire-and-forget chains (join); in a dynamic group,
    /// leaves the group after its own work is done. Not graceful: stops at
    /// once. Either way the agent then stops, pending calls fail, and the
    /// current agent is reset if it was this one. `timeout` zero means none.
    ///
    /// # Errors
    /// "RPC has not been initialized ..." if already shut down; a failed or
    /// timed-out all-gather or join (the agent stops anyway).
    pub async fn shutdown(&self, graceful: bool, timeout: Duration) -> Result<()> {
        if self
            .inner
            .state
            .compare_exchange(RUNNING, STOPPING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::not_initialized());
        }
        let r = if graceful {
            if self.inner.static_group {
                match self.wait_all_workers_inner(timeout).await {
                    Ok(()) => match self.run_shutdown_hooks().await {
                        Ok(()) => self.join(timeout).await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                }
            } else {
                rendezvous::leave(self, timeout).await
            }
        } else {
            Ok(())
        };
        self.finalize(graceful).await;
        // RREF-5: the leak check runs after the agent stopped.
        let leaks = crate::rref::context(self).destroy();
        r.and(leaks)
    }

    async fn finalize(&self, graceful: bool) {
        if graceful {
            // AG-4: let running callees queue their responses.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while self.inner.active.load(Ordering::Acquire) > 0
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        self.inner.state.store(STOPPED, Ordering::Release);
        if let Some(t) = self.inner.transport.get() {
            t.shutdown().await;
        }
        let name = self.name().to_string();
        self.fail_pending_where(
            |_| true,
            |p| {
                Error::runtime(format!(
                    "RPC agent of {name} shut down while a call of {} to {} was pending",
                    p.function, p.peer
                ))
            },
        );
        current::reset_if(self);
    }

    /// Stops the worker at once without telling anyone, as if its process
    /// died: connections are cut, pending calls fail. For failure tests.
    pub fn abort(&self) {
        self.inner.state.store(STOPPED, Ordering::Release);
        self.set_ready();
        if let Some(t) = self.inner.transport.get() {
            t.abort();
        }
        let name = self.name().to_string();
        self.fail_pending_where(
            |_| true,
            |p| {
                Error::runtime(format!(
                    "RPC agent of {name} aborted with a call to {} pending",
                    p.peer
                ))
            },
        );
        current::reset_if(self);
    }

    /// Marks rendezvous as done: calls that arrived early may run.
    pub(crate) fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
        self.inner.ready_notify.notify_waiters();
    }

    async fn wait_ready(&self) {
        loop {
            let notified = self.inner.ready_notify.notified();
            if self.inner.ready.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    fn handle_call(&self, conn: &Arc<Connection>, message: Message, tensors: Vec<Tensor>) {
        let Message::Call {
            id,
            function,
            args,
            kwargs,
            autograd,
            profiling,
        } = message
        else {
            return;
        };
        let internal = function.starts_with(INTERNAL_PREFIX);
        let inner = &self.inner;
        inner.active.fetch_add(1, Ordering::AcqRel);
        if !internal {
            inner.user_received.fetch_add(1, Ordering::AcqRel);
            inner.user_active.fetch_add(1, Ordering::AcqRel);
        }
        let this = self.clone();
        let conn = conn.clone();
        inner.runtime.spawn(async move {
            // AG-7: a call can arrive before this worker's `init_rpc` has
            // learnt the group; functions run once it has.
            this.wait_ready().await;
            let caller = WorkerInfo { id: conn.peer_rank, name: conn.peer.clone() };
            let args = this.args_from_wire(args, kwargs, tensors);
            if let Ok(a) = &args {
                // RREF-7: run the function once its argument RRefs are confirmed.
                crate::rref::wait_confirmed(&this, &a.rrefs).await;
            }
            let f = if internal { this.inner.internal.get(&function) } else { this.registry().get(&function) };
            // DA-3: the callee gets or creates the caller's context and
            // runs the function in it.
            let context_id = match (&autograd, &args) {
                (Some(e), Ok(a)) => Some(crate::dist_autograd::incoming_call(&this, e, &a.tensors)),
                _ => None,
            };
            let mut profiled = None;
            let served = crate::profiler::served_name(&function, &args);
            let result = match (f, args) {
                (_, Err(e)) => Err(e.context_line(format!("receiving RRefs from worker {}", conn.peer))),
                (Some(f), Ok(args)) => {
                    let ctx = CallContext::new(this.clone(), caller, function.clone(), autograd);
                    let call = crate::dist_autograd::scope(context_id, registry::call_guarded(f, ctx, args));
                    let (r, events) = crate::profiler::serve(&this, served, profiling.is_some(), call).await;
                    profiled = events;
                    r
                }
                (None, Ok(_)) => Err(Error::runtime(unknown_function_message(&function, this.name()))),
            };
            let reply_autograd = match (&result, context_id) {
                (Ok(p), Some(c)) => crate::dist_autograd::outgoing_response(&this, c, conn.peer_rank, &p.tensors),
                _ => None,
            };
            if let Err(e) = &result {
                tracing::warn!(worker = %this.name(), caller = %conn.peer, function = %function, "function raised {}: {}", e.kind(), e.message());
            }
            this.respond_profiled(&conn, id, result, reply_autograd, profiled).await;
            // AG-4: the response is queued; stop counting the task.
            if !internal {
                this.inner.user_active.fetch_sub(1, Ordering::AcqRel);
            }
            this.inner.active.fetch_sub(1, Ordering::AcqRel);
            this.inner.quiet.notify_waiters();
        });
    }

    /// Turns a received call's fork records into RRefs (`crate::rref`).
    fn args_from_wire(
        &self,
        positional: Vec<crate::abi::Value>,
        kwargs: Vec<(String, crate::abi::Value)>,
        tensors: Vec<Tensor>,
    ) -> Result<Args> {
        let mut rrefs = Vec::new();
        let positional = positional
            .into_iter()
            .map(|v| crate::rref::from_wire(self, v, &mut rrefs))
            .collect::<Result<Vec<_>>>()?;
        let kwargs = kwargs
            .into_iter()
            .map(|(k, v)| Ok((k, crate::rref::from_wire(self, v, &mut rrefs)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Args {
            positional,
            kwargs,
            tensors,
            rrefs,
        })
    }

    /// Sends `message` (an RRef acknowledgement) on `conn`.
    pub(crate) async fn reply(&self, conn: &Arc<Connection>, message: Message) {
        let Ok(frame) = OutFrame::encode(message, &[], &[]) else {
            return;
        };
        let Ok(transport) = self.transport() else {
            return;
        };
        if let Err(e) = transport.send_on(conn, frame, None).await {
            tracing::warn!(worker = %self.name(), peer = %conn.peer, "could not send a reply: {e}");
        }
    }

    /// Answers request `id` on `conn` with `error`.
    /// Runs the work of a reserved-kind request as its own task (AG-1),
    /// counted as active until its reply is queued (AG-4), and replies with
    /// its result.
    fn serve_request(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        work: impl std::future::Future<Output = Result<Payload>> + Send + 'static,
    ) {
        let (agent, conn) = (self.clone(), conn.clone());
        self.inner.active.fetch_add(1, Ordering::AcqRel);
        self.inner.runtime.clone().spawn(async move {
            let r = work.await;
            agent.respond(&conn, id, r, None).await;
            agent.inner.active.fetch_sub(1, Ordering::AcqRel);
            agent.inner.quiet.notify_waiters();
        });
    }

    pub(crate) async fn respond_error(&self, conn: &Arc<Connection>, id: u64, error: Error) {
        self.respond(conn, id, Err(error), None).await;
    }

    async fn respond(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        result: Result<Payload>,
        autograd: Option<crate::transport::AutogradEnvelope>,
    ) {
        self.respond_profiled(conn, id, result, autograd, None)
            .await;
    }

    /// [`respond`](Self::respond), with the callee's profiled events for a
    /// call that asked for them.
    async fn respond_profiled(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        result: Result<Payload>,
        autograd: Option<crate::transport::AutogradEnvelope>,
        profiled: Option<Vec<crate::transport::ProfiledEvent>>,
    ) {
        let Ok(transport) = self.transport() else {
            return;
        };
        let result = match result {
            Ok(p) if !p.rrefs.is_empty() => {
                let to = WorkerInfo {
                    id: conn.peer_rank,
                    name: conn.peer.clone(),
                };
                crate::rref::to_wire(self, &to, p.value, &p.rrefs)
                    .map(|value| Payload {
                        value,
                        tensors: p.tensors,
                        rrefs: Vec::new(),
                    })
                    .map_err(|e| e.context_line("sending the RRefs of a result"))
            }
            other => other,
        };
        let (result, tensors) = match result {
            Ok(p) => (Ok(p.value), p.tensors),
            Err(e) => (Err(e.to_remote()), Vec::new()),
        };
        let devices =
            crate::device::devices_for(self, &conn.peer, MapDirection::Response, &tensors);
        let sent = match devices.and_then(|d| {
            OutFrame::encode(
                Message::Response {
                    id,
                    result,
                    autograd,
                    profiled,
                },
                &tensors,
                &d,
            )
        }) {
            Ok(frame) => transport.send_on(conn, frame, None).await,
            Err(e) => Err(e.context_line("encoding the result")),
        };
        // A result that cannot be sent (too large, injected fault, ...) is
        // replaced by an error saying why, so the caller does not wait for
        // its timeout.
        if let Err(e) = sent {
            let e = e.context_line(format!("sending the result to worker {}", conn.peer));
            let message = Message::Response {
                id,
                result: Err(crate::abi::RemoteError::new(e.kind(), format!("{e}"))),
                autograd: None,
                profiled: None,
            };
            let retry = match OutFrame::encode(message, &[], &[]) {
                Ok(frame) => transport.send_on(conn, frame, None).await,
                Err(e) => Err(e),
            };
            if let Err(e) = retry {
                tracing::warn!(worker = %self.name(), peer = %conn.peer, "could not send a response: {e}");
            }
        }
    }
}

/// The transport's handler: forwards to the agent while it exists.
pub(crate) struct AgentHandler {
    pub(crate) agent: std::sync::Weak<AgentInner>,
}

impl Handler for AgentHandler {
    fn on_message(&self, conn: &Arc<Connection>, message: Message, tensors: Vec<Tensor>) {
        let Some(inner) = self.agent.upgrade() else {
            return;
        };
        let agent = RpcAgent::from_inner(inner);
        match message {
            Message::Call { .. } => agent.handle_call(conn, message, tensors),
            Message::Response {
                id,
                result,
                autograd,
                profiled,
            } => {
                if let (Some(env), Ok(_)) = (&autograd, &result) {
                    crate::dist_autograd::incoming_response(&agent, env, &tensors);
                }
                if let Some(events) = profiled {
                    crate::profiler::incoming(&agent, id, events);
                }
                let peer = conn.peer.clone();
                let function = agent
                    .inner
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&id)
                    .map(|p| p.function.clone());
                let Some(function) = function else { return };
                let r = match result {
                    Ok(value) => {
                        let mut rrefs = Vec::new();
                        crate::rref::from_wire(&agent, value, &mut rrefs)
                                .map(|value| Payload { value, tensors, rrefs })
                                .map_err(|e| e.context_line(format!("receiving the RRefs of the result of {function} from worker {peer}")))
                    }
                    Err(e) => {
                        Err(Error::from(e)
                            .context_line(format!("calling {function} on worker {peer}")))
                    }
                };
                agent.finish(id, r);
            }
            Message::RRefAck { id } => agent.finish(id, Ok(Payload::none())),
            Message::RRefFork { .. }
            | Message::RRefChildAccept { .. }
            | Message::RRefUserDelete { .. } => crate::rref::handle_message(&agent, conn, message),
            Message::ProfilingResponse { id, events } => agent.finish(
                id,
                Ok(Payload {
                    value: crate::abi::Value::List(events),
                    tensors,
                    rrefs: Vec::new(),
                }),
            ),
            Message::PropagateGradients { .. } | Message::CleanupAutogradContext { .. } => {
                let a = agent.clone();
                agent.serve_request(conn, message.id(), async move {
                    crate::dist_autograd::handle_request(&a, message, tensors).await
                });
            }
            Message::DeployPlugin { .. } => {
                let a = agent.clone();
                agent.serve_request(conn, message.id(), async move {
                    crate::plugin::deploy::handle_request(&a, message).await
                });
            }
            other => {
                let kind = other.kind();
                let id = other.id();
                let conn = conn.clone();
                let name = agent.name().to_string();
                agent.inner.runtime.clone().spawn(async move {
                    let e = Error::new(
                        ErrorKind::NotImplementedError,
                        format!("message kind {kind:?} is not handled by worker {name} yet"),
                    );
                    agent.respond(&conn, id, Err(e), None).await;
                });
            }
        }
    }

    fn on_over_budget(
        &self,
        conn: &Arc<Connection>,
        message: Message,
        refusal: wasmrpc_torch_sys::BudgetRefusal,
    ) {
        let Some(inner) = self.agent.upgrade() else {
            return;
        };
        let agent = RpcAgent::from_inner(inner);
        let what = match &message {
            Message::Call { function, .. } => {
                format!("a call of {function} from worker {}", conn.peer)
            }
            other => format!("a {:?} message from worker {}", other.kind(), conn.peer),
        };
        let error = crate::tensor::budget::refusal_error(agent.name(), &what, refusal, false);
        tracing::warn!(peer = %conn.peer, "{error}");
        let id = message.id();
        match message {
            // The reply to one of this worker's requests: its call fails.
            Message::Response { .. }
            | Message::ProfilingResponse { .. }
            | Message::RRefAck { .. } => {
                agent.finish(id, Err(error));
            }
            // A request: its sender gets the error as the answer.
            _ => {
                let conn = conn.clone();
                agent.inner.runtime.clone().spawn(async move {
                    agent.respond(&conn, id, Err(error), None).await;
                });
            }
        }
    }

    fn on_close(&self, conn: &Arc<Connection>, reason: &str) {
        let Some(inner) = self.agent.upgrade() else {
            return;
        };
        let agent = RpcAgent::from_inner(inner);
        let id = conn.id;
        let peer = conn.peer.clone();
        agent.fail_pending_where(
            |p| p.conn == id,
            |p| {
                Error::runtime(format!(
                    "connection to worker {peer} closed while a call of {} was pending: {reason}",
                    p.function
                ))
            },
        );
    }
}
