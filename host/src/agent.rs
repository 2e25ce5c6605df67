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
//! `transport`, tensor encoding to `tensor`, the meaning of functions to
//! the [`FunctionRegistry`], and everything else to the features plugged
//! into it ([`Extension`]): it imports none of them.
//!
//! A call, followed through the files:
//! - `call`: every public way to call ends in [`RpcAgent::call`]; the
//!   features add their fields, the message is framed and sent, the call
//!   is pending until it ends;
//! - `serve`: on the callee, the frame becomes a call, run as its own task
//!   inside the features' scopes; its response goes back; on the caller,
//!   the response ends the pending call;
//! - `shutdown`: graceful shutdown and abort;
//! - `message`: the protocol; `extension`: the hooks; `registry`:
//!   functions by name; `rendezvous`: joining a group through the store;
//!   `all_gather`: the all-gathers behind barriers and shutdown; `future`:
//!   [`Future`]; `deadlines`: call timeouts; `options`:
//!   [`RpcBackendOptions`].
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
//! - AG-8: an all-gather's wait ends with an error when a peer it expects
//!   a message from (the leader's signal, a follower's report) is declared
//!   failed; and a peer so expected that closes its connection is declared
//!   failed even once this worker's shutdown began (when closes are
//!   otherwise peers finishing theirs), so a worker whose leader died in
//!   the middle of a graceful shutdown exits instead of waiting forever.

mod all_gather;
mod call;
mod current;
mod deadlines;
mod extension;
mod failures;
mod future;
pub(crate) mod message;
mod options;
mod registry;
mod rendezvous;
mod serve;
mod shutdown;
mod warn_limit;

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::Notify;

pub use call::CallOptions;
pub use current::{current_agent, reset_current_agent, set_current_agent};
pub use extension::{
    CallKind, CallScope, Extension, Extensions, HandleCodec, IncomingCall, IncomingReply, Inherit,
    OutgoingCall, Request, Run, ServeScope,
};
pub use failures::{FAILED_WORKERS, NEXT_FAILURE, RESTART_COUNT, WorkerFailure};
pub use future::{
    FUTURE_PICKLE, Future, collect_all, collected_futures, wait_all, wait_all_blocking,
    wait_all_scope,
};
pub use message::{CALL, Field, Fields, Message, RESPONSE};
pub use options::{
    CLUSTER_SECRET_ENV, DEFAULT_BUSY_POLL, DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT, Dest, RpcBackendOptions, validate_worker_name, worker_info,
};
pub(crate) use registry::call_guarded;
pub use registry::{Builtins, CallContext, FunctionRegistry, FunctionResolver, RpcFunction};
pub(crate) use serve::AgentHandler;

use crate::abi::WorkerInfo;
use crate::error::{
    Error, Result, cannot_get_worker_info_message, unknown_worker_id_message,
    unknown_worker_name_message,
};
use crate::store::Store;
use crate::transport::{Handler, Transport};
use crate::value::Payload;

/// Names of the agent's own functions start with this prefix; they are
/// served by every agent and are not counted as user calls.
pub const INTERNAL_PREFIX: &str = "wasmrpc::";

/// A function every agent serves that does nothing (the seeds' `noop`,
/// used to probe whether a worker is alive).
pub const NOOP: &str = "wasmrpc::_noop";

/// A function every agent serves to its peers: its
/// [`get_debug_info`](RpcAgent::get_debug_info), a dict of str to str (what
/// a harness or an operator's tool reads of a worker in another process,
/// such as the tensor memory it holds).
pub const DEBUG_INFO: &str = "wasmrpc::_debug_info";

/// Registers the functions every agent serves its peers that belong to no
/// feature: [`NOOP`], [`DEBUG_INFO`], and the failures' ([`FAILED_WORKERS`],
/// [`NEXT_FAILURE`], [`RESTART_COUNT`]).
fn register_agent_functions(r: &FunctionRegistry) {
    failures::register_functions(r);
    r.register_native(NOOP, |_ctx, _args| async move { Ok(Payload::none()) });
    r.register_native(DEBUG_INFO, |ctx, _args| async move {
        let info = ctx.agent().get_debug_info();
        Ok(Payload::dict(
            info.into_iter()
                .map(|(k, v)| (Payload::from(k), Payload::from(v))),
        ))
    });
}

const RUNNING: u8 = 0;
const STOPPING: u8 = 1;
const STOPPED: u8 = 2;

struct Pending {
    future: Future,
    peer: String,
    function: String,
    conn: u64,
    /// The call counts as work in progress on its connection until it ends
    /// (TR-10); none while the connection is being dialled.
    work: Option<crate::transport::Work>,
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
    /// Calls refused because this worker has no function of their name.
    unknown_function_calls: AtomicU64,
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
    /// The features plugged into this agent, in order.
    extensions: Extensions,
    /// How often each peer's calls may put a WARN line in the log.
    warn_limit: warn_limit::WarnLimiter,
    /// The peers declared failed (`failures`).
    failures: failures::Failures,
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

/// Starts a worker with the features `extensions` plugs in, and no other,
/// and joins its group; `wasmrpc::init_rpc` gives it all of this crate's
/// (and documents the group rules and errors).
///
/// # Errors
/// As `wasmrpc::init_rpc`.
pub async fn init_rpc_with(
    name: &str,
    rank: Option<u32>,
    world_size: Option<u32>,
    store: Arc<dyn Store>,
    options: RpcBackendOptions,
    extensions: Extensions,
) -> Result<RpcAgent> {
    // A worker that should see a GPU and cannot (CUDA forced or a device
    // present, but libtorch's CUDA library did not load) fails here.
    crate::device::load_cuda()?;
    rendezvous::init(name, rank, world_size, store, options, extensions).await
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
    /// (`INTERNAL_PREFIX`) or the registry's, else what the features'
    /// resolvers answer for a name nobody registered (a plugin's pinned
    /// versions, `hello@<sha256 prefix>::greet`), resolvers that the
    /// features add with their internal functions
    /// ([`Extension::register`]).
    pub(crate) fn lookup_function(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        if name.starts_with(INTERNAL_PREFIX) {
            self.inner.internal.get(name)
        } else {
            self.registry()
                .get(name)
                .or_else(|| self.inner.internal.resolve(name))
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

    /// What this worker exchanged with each peer since it started, by
    /// channel (`crate::transport`'s TRAFFIC-1: totals never go down).
    pub fn traffic(&self) -> Vec<crate::transport::PeerTraffic> {
        self.inner
            .transport
            .get()
            .map_or_else(Vec::new, |t| t.traffic())
    }

    /// Connections this worker refused since it started, by reason (every
    /// reason, zeros included).
    pub fn refused_connections(&self) -> Vec<(crate::transport::RefusalReason, u64)> {
        self.inner
            .transport
            .get()
            .map_or_else(Vec::new, |t| t.refusals())
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
        m.insert(
            "agent.unknown_function_calls".into(),
            i.unknown_function_calls.load(Ordering::Acquire).to_string(),
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
            "agent.refused_connections".into(),
            i.transport
                .get()
                .map_or(0, |t| t.refused_connections())
                .to_string(),
        );
        m.insert(
            "agent.busy_poll_back_offs".into(),
            crate::transport::busy_poll_back_offs().to_string(),
        );
        let (links, shared, cuda) = i.transport.get().map_or((0, 0, 0), |t| t.shared_memory());
        m.insert("agent.shared_memory_links".into(), links.to_string());
        m.insert("agent.shared_memory_bytes_sent".into(), shared.to_string());
        m.insert(
            "agent.shared_memory_cuda_bytes_sent".into(),
            cuda.to_string(),
        );
        let (used, limit) = self.tensor_memory_in_use();
        m.insert("agent.tensor_memory_bytes".into(), used.to_string());
        m.insert("agent.tensor_memory_limit_bytes".into(), limit.to_string());
        m.insert(
            "agent.rpc_timeout_ms".into(),
            i.timeout_ms.load(Ordering::Acquire).to_string(),
        );
        let sources: Vec<DebugInfoSource> = i
            .debug_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for extension in i.extensions.iter() {
            m.extend(extension.debug_info(self));
        }
        for source in sources {
            m.extend(source());
        }
        m
    }

    /// Adds entries to [`get_debug_info`](Self::get_debug_info), beside
    /// those of the features ([`Extension::debug_info`]).
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
}
