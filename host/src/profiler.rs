//! The RPC profiler: a profiling scope records one event per RPC made
//! inside it (`rpc_sync`, `rpc_async`, `remote`), named by the PyTorch RPC
//! profiling key `rpc_<mode>#<function>(<caller> -> <callee>)`, the user
//! ranges opened with [`record_function`], and the callee's events for each
//! call ("remote events"), named `<key>#remote_op: <callee event>` with the
//! callee's rank; the events export to Chrome trace JSON
//! ([`Profile::export_chrome_trace`]).
//!
//! ```no_run
//! # async fn demo(agent: wasmrpc::RpcAgent) -> wasmrpc::Result<()> {
//! use wasmrpc::profiler::{profile, record_function};
//! let (result, events) = profile(&agent, async {
//!     record_function("forward", agent.rpc_sync("worker1", "aten::add", wasmrpc::args![1, 2])).await
//! })
//! .await;
//! result?;
//! events.export_chrome_trace("/tmp/trace.json")?;
//! # Ok(()) }
//! ```
//!
//! What is recorded:
//! - on the caller, each RPC from its start until both its future and the
//!   request carrying it completed (so a `remote()` to self, whose value
//!   exists before the response, still gets its callee's events;
//!   [`crate::RRef::get_profiling_future`] completes then), and every
//!   [`record_function`] range;
//! - on the callee of a profiled call: the call itself (named by the
//!   function, or for a `remote()` the function it runs); inside a plugin
//!   function, every aten op libtorch runs for it, nested ops included
//!   (`aten::relu` and its `aten::clamp_min`), the RPCs it makes (with
//!   their own remote events, so they nest) and the guest's
//!   `record_function` ranges (`crate::plugin::host_functions`); the RPCs a native
//!   function makes;
//! - a distributed backward called in a scope:
//!   [`DIST_AUTOGRAD_BACKWARD_PROFILING_KEY`] around the whole pass, and on
//!   this worker one event per firing of a send function
//!   (`...::SendRpcBackward`) and of a recv function
//!   (`...::RecvRpcBackward`) (`crate::dist_autograd::engine`);
//! - in a server process global profiler
//!   ([`enable_server_process_global_profiler`]), one event per user call
//!   the worker serves, whoever calls.
//!
//! Owns: the scope (a tokio task-local, so it follows the profiled future,
//! not the thread; [`Recording`] carries it as a value to the tasks and
//! threads that work for it), events, keys, the callee-side scope of a
//! profiled call and merging the callee's events (`rpc`, where this module
//! plugs into the agent as the `Profiler` extension: a call made in a
//! scope carries its key as a field, the callee runs it in a scope of its
//! own and returns its events as a field of the response), export. The
//! events' wire form ([`ProfiledEvent`]) is this module's. Outside a scope nothing is recorded and
//! the hot paths only check for a scope (no lock, no allocation).
//!
//! With [`ProfilerConfig`] ([`profile_with`], PyTorch's `record_shapes`
//! and `profile_memory`), each op event also carries its input shapes
//! ([`Event::input_shapes`]) and the CPU memory it allocated
//! ([`Event::cpu_memory_usage`]); a profiled call carries the config to its
//! callee, whose op events come back with them.
//!
//! A builtin op (`aten::add`) called in a scope, by RPC or locally, is
//! listed as the ops libtorch runs for it (the op itself, with its nested
//! ops), not as a call: on the callee of a profiled builtin call these
//! stand for the call's own event (which is listed only if no op went
//! through libtorch's dispatcher).
//!
//! Not done yet: the ops a native function runs are not listed one by one,
//! nor are a served call's ops and nested RPCs in a server process global
//! profiler (only the call); events carry no device (CUDA) times, so
//! `use_cuda` profiling is not available. Spawned tasks leave the scope, as
//! they leave a task-local, unless given a [`Recording`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

mod profile;
mod range;
mod rpc;

pub use profile::Profile;
pub use range::{END_CALLBACKS_ONCE, RecordFunction};
use serde::{Deserialize, Serialize};

use crate::abi::Value;
use crate::agent::{Dest, RpcAgent};
use crate::{Error, Result};

pub use rpc::ProfiledEvent;
pub(crate) use rpc::{Profiler, rpc};

/// Separates an RPC key from the name of a remote event
/// (`<key>#remote_op: <op>`, PyTorch's `REMOTE_OP_STR`).
pub const REMOTE_OP_STR: &str = "#remote_op: ";

/// How an RPC was made: the `mode` of its profiling key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RpcExecMode {
    /// `rpc_sync`.
    Sync,
    /// `rpc_async`.
    Async,
    /// `remote`.
    Remote,
}

impl RpcExecMode {
    /// The mode as it appears in keys: `sync`, `async`, `remote`.
    pub fn value(self) -> &'static str {
        match self {
            RpcExecMode::Sync => "sync",
            RpcExecMode::Async => "async",
            RpcExecMode::Remote => "remote",
        }
    }
}

/// PyTorch's `_build_rpc_profiling_key`:
/// `rpc_<mode>#<function>(<src> -> <dst>)`.
pub fn build_rpc_profiling_key(mode: RpcExecMode, function: &str, src: &str, dst: &str) -> String {
    format!("rpc_{}#{function}({src} -> {dst})", mode.value())
}

/// What a profiling scope records besides names and times (PyTorch's
/// `ProfilerConfig`): it travels with every call made in the scope, so the
/// callee records its events the same way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfilerConfig {
    /// Record each op's input shapes ([`Event::input_shapes`]; PyTorch's
    /// `record_shapes`).
    pub record_shapes: bool,
    /// Record the CPU memory each op allocates ([`Event::cpu_memory_usage`];
    /// PyTorch's `profile_memory`).
    pub profile_memory: bool,
}

impl ProfilerConfig {
    /// What libtorch's op recording must collect for this config.
    pub(crate) fn record_options(self) -> wasmrpc_torch_sys::RecordOptions {
        wasmrpc_torch_sys::RecordOptions {
            shapes: self.record_shapes,
            memory: self.profile_memory,
        }
    }
}

/// One profiled range.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// The event's name: an RPC key or a [`record_function`] name.
    pub name: String,
    /// The rank of the worker it ran on (PyTorch's `node_id`).
    pub worker: u32,
    /// Start, in microseconds since the scope began.
    pub start_us: u64,
    /// End, in microseconds since the scope began; `None` while running
    /// (an RPC still in flight when the scope closed).
    pub end_us: Option<u64>,
    /// For an aten op recorded with [`ProfilerConfig::record_shapes`], the
    /// shape of each of its inputs: a tensor's sizes, `[]` for anything else
    /// (PyTorch's `input_shapes`: `aten::add(ones(100), ones(100))` has
    /// `[[100], [100], []]`). Empty otherwise.
    pub input_shapes: Vec<Vec<i64>>,
    /// For an aten op recorded with [`ProfilerConfig::profile_memory`], the
    /// CPU memory it allocated minus what it freed, in bytes, its nested ops
    /// included (PyTorch's `cpu_memory_usage`). 0 otherwise.
    pub cpu_memory_usage: i64,
}

impl Event {
    /// How long the range ran, in microseconds (PyTorch's
    /// `cpu_time_total` of one event); `None` while running.
    pub fn duration_us(&self) -> Option<u64> {
        self.end_us.map(|end| end.saturating_sub(self.start_us))
    }

    /// Whether `self` starts no later and ends no earlier than `other`.
    pub fn encloses(&self, other: &Event) -> bool {
        match (self.end_us, other.end_us) {
            (Some(a), Some(b)) => self.start_us <= other.start_us && a >= b,
            _ => false,
        }
    }
}

pub(crate) struct Recorder {
    epoch: Instant,
    worker: u32,
    config: ProfilerConfig,
    events: Mutex<Vec<Event>>,
}

impl Recorder {
    /// A scope of `worker` that begins now.
    fn new(worker: u32, config: ProfilerConfig) -> Arc<Recorder> {
        // Builtin calls in this scope report the ops they run to it.
        crate::ops::listen_for_ops(|| {
            Recording::active().map(|r| Arc::new(r) as Arc<dyn crate::ops::OpListener>)
        });
        Arc::new(Recorder {
            epoch: Instant::now(),
            worker,
            config,
            events: Mutex::new(Vec::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Event>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Opens an event and returns its index.
    fn open(&self, name: String) -> usize {
        let start_us = self.now_us();
        let mut events = self.lock();
        events.push(Event {
            name,
            worker: self.worker,
            start_us,
            end_us: None,
            input_shapes: Vec::new(),
            cpu_memory_usage: 0,
        });
        events.len() - 1
    }

    fn close(&self, index: usize) {
        let end = self.now_us();
        if let Some(e) = self.lock().get_mut(index) {
            e.end_us = Some(end);
        }
    }
}

tokio::task_local! {
    static CURRENT: Arc<Recorder>;
}

pub(crate) fn current() -> Option<Arc<Recorder>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// The name of the event wrapping a distributed backward pass on the
/// worker that called `backward` (PyTorch's
/// `kDistAutogradBackwardProfilingKey`).
pub const DIST_AUTOGRAD_BACKWARD_PROFILING_KEY: &str = "torch::distributed::autograd::backward";

/// The active profiling scope as a value, for work the scope's future hands
/// to other tasks or threads (the task-local does not follow them): taken
/// where the work starts, it records into that scope from anywhere, and
/// re-enters it around calls ([`Recording::sync_scope`],
/// [`Recording::scope`]) so the RPCs they make are profiled too. Without a
/// scope there is no `Recording`, so the hot path pays for an `Option`
/// check only.
#[derive(Clone)]
pub(crate) struct Recording(Arc<Recorder>);

impl Recording {
    /// The scope the current task runs in, if any.
    pub(crate) fn active() -> Option<Recording> {
        current().map(Recording)
    }

    /// Opens an event named `name` now; it ends when the [`Range`] drops.
    pub(crate) fn range(&self, name: impl Into<String>) -> Range {
        let index = self.0.open(name.into());
        Range {
            recorder: Arc::clone(&self.0),
            index,
        }
    }

    /// What the scope records besides names and times.
    pub(crate) fn config(&self) -> ProfilerConfig {
        self.0.config
    }

    fn us(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.0.epoch).as_micros()).unwrap_or(u64::MAX)
    }

    /// Records a range named `name` that ran from `start` to `end` (e.g.
    /// an op that ran on another thread).
    pub(crate) fn add(&self, name: String, start: Instant, end: Instant) {
        let event = Event {
            name,
            worker: self.0.worker,
            start_us: self.us(start),
            end_us: Some(self.us(end)),
            input_shapes: Vec::new(),
            cpu_memory_usage: 0,
        };
        self.0.lock().push(event);
    }

    /// Records the aten ops libtorch ran in a window
    /// (`wasmrpc_torch_sys::record_ops`, with [`Self::config`]'s options)
    /// that began at `start`.
    pub(crate) fn add_ops(&self, ops: Vec<wasmrpc_torch_sys::OpEvent>, start: Instant) {
        let at = |ns| self.us(start + std::time::Duration::from_nanos(ns));
        let events = ops.into_iter().map(|op| Event {
            start_us: at(op.start_ns),
            end_us: Some(at(op.end_ns)),
            name: op.name,
            worker: self.0.worker,
            input_shapes: op.input_shapes,
            cpu_memory_usage: op.cpu_memory_usage,
        });
        self.0.lock().extend(events);
    }

    /// Runs `f` inside this scope (for synchronous code, e.g. the call path
    /// of an RPC, which looks the scope up).
    pub(crate) fn sync_scope<R>(&self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(Arc::clone(&self.0), f)
    }

    /// Runs `body` inside this scope.
    pub(crate) async fn scope<F: std::future::Future>(&self, body: F) -> F::Output {
        CURRENT.scope(Arc::clone(&self.0), body).await
    }
}

impl crate::ops::OpListener for Recording {
    fn record_options(&self) -> wasmrpc_torch_sys::RecordOptions {
        self.config().record_options()
    }

    fn ops_ran(&self, start: Instant, ops: Vec<wasmrpc_torch_sys::OpEvent>) {
        self.add_ops(ops, start);
    }
}

/// Runs `f` in `recording`'s scope, or just runs it without one.
pub(crate) fn sync_scope_opt<R>(recording: Option<&Recording>, f: impl FnOnce() -> R) -> R {
    match recording {
        Some(r) => r.sync_scope(f),
        None => f(),
    }
}

/// An open event of a [`Recording`]; it ends when dropped.
pub(crate) struct Range {
    recorder: Arc<Recorder>,
    index: usize,
}

impl Drop for Range {
    fn drop(&mut self) {
        self.recorder.close(self.index);
    }
}

/// Runs `body` in a profiling scope on `agent`'s worker and returns its
/// output with the events recorded in it (PyTorch's `with _profile()`).
/// Scopes nest: an inner scope records into its own profile only.
pub async fn profile<F: std::future::Future>(agent: &RpcAgent, body: F) -> (F::Output, Profile) {
    profile_with(agent, ProfilerConfig::default(), body).await
}

/// [`profile`], recording what `config` asks for besides names and times
/// (PyTorch's `_profile(record_shapes=..., profile_memory=...)`), here and
/// on the callees of the calls made in the scope.
pub async fn profile_with<F: std::future::Future>(
    agent: &RpcAgent,
    config: ProfilerConfig,
    body: F,
) -> (F::Output, Profile) {
    let recorder = Recorder::new(agent.rank(), config);
    let out = CURRENT.scope(Arc::clone(&recorder), body).await;
    let mut events = std::mem::take(&mut *recorder.lock());
    events.sort_by_key(|e| e.start_us);
    (out, Profile { events })
}

/// Runs `body` as a user range named `name` in the enclosing profiling
/// scope (PyTorch's `record_function`); outside a scope it just runs it.
pub async fn record_function<F: std::future::Future>(name: &str, body: F) -> F::Output {
    let Some(recorder) = current() else {
        return body.await;
    };
    let index = recorder.open(name.to_string());
    let out = body.await;
    recorder.close(index);
    out
}

/// How many server process global profilers are enabled in this process,
/// on any worker: serving a call checks this before anything else.
pub(crate) static GLOBAL_ENABLED: AtomicUsize = AtomicUsize::new(0);

/// A worker's enabled server process global profilers, innermost last.
#[derive(Default)]
pub(crate) struct ServerProfilers(Mutex<Vec<Arc<Recorder>>>);

impl ServerProfilers {
    fn lock(&self) -> MutexGuard<'_, Vec<Arc<Recorder>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for ServerProfilers {
    /// A worker gone with profilers still enabled no longer counts.
    fn drop(&mut self) {
        let left = self.lock().len();
        GLOBAL_ENABLED.fetch_sub(left, Ordering::AcqRel);
    }
}

/// The internal function behind [`enable_server_process_global_profiler_on`].
pub const ENABLE_SERVER_PROCESS_GLOBAL_PROFILER: &str =
    "wasmrpc::_enable_server_process_global_profiler";
/// The internal function behind [`disable_server_process_global_profiler_on`].
pub const DISABLE_SERVER_PROCESS_GLOBAL_PROFILER: &str =
    "wasmrpc::_disable_server_process_global_profiler";

/// Starts a server process global profiler on `agent`'s worker
/// (PyTorch's `_enable_server_process_global_profiler`): until it is
/// disabled, it records one event for every call the worker serves, named
/// as the callee's event of a profiled call (the function, or for a
/// `remote()` the function it runs); the agent's internal calls are left
/// out. Profilers nest: each records what is served while it is enabled.
/// "Process" is the worker: several agents in one process (tests) each
/// have their own.
pub fn enable_server_process_global_profiler(agent: &RpcAgent) {
    let recorder = Recorder::new(agent.rank(), ProfilerConfig::default());
    agent.state::<ServerProfilers>().lock().push(recorder);
    GLOBAL_ENABLED.fetch_add(1, Ordering::AcqRel);
}

/// Stops the innermost server process global profiler of `agent`'s worker
/// and returns its events, in the order they started (PyTorch's
/// `_disable_server_process_global_profiler`).
///
/// # Errors
/// No server process global profiler is enabled on the worker.
pub fn disable_server_process_global_profiler(agent: &RpcAgent) -> Result<Profile> {
    let recorder = agent.state::<ServerProfilers>().lock().pop();
    let Some(recorder) = recorder else {
        return Err(Error::runtime(format!(
            "no server process global profiler is enabled on worker {}",
            agent.name()
        )));
    };
    GLOBAL_ENABLED.fetch_sub(1, Ordering::AcqRel);
    let mut events = std::mem::take(&mut *recorder.lock());
    events.sort_by_key(|e| e.start_us);
    Ok(Profile { events })
}

/// [`enable_server_process_global_profiler`] on worker `to`, by RPC (the
/// seeds' `rpc.remote(to, rpc._server_process_global_profile)` entered
/// there).
///
/// # Errors
/// The RPC's errors.
pub async fn enable_server_process_global_profiler_on(
    agent: &RpcAgent,
    to: impl Into<Dest>,
) -> Result<()> {
    agent
        .rpc_sync(
            to,
            ENABLE_SERVER_PROCESS_GLOBAL_PROFILER,
            crate::Args::new(),
        )
        .await
        .map(drop)
}

/// [`disable_server_process_global_profiler`] on worker `to`, by RPC; the
/// events keep that worker's rank and clock.
///
/// # Errors
/// The RPC's errors, and the callee's for no profiler enabled there.
pub async fn disable_server_process_global_profiler_on(
    agent: &RpcAgent,
    to: impl Into<Dest>,
) -> Result<Profile> {
    let p = agent
        .rpc_sync(
            to,
            DISABLE_SERVER_PROCESS_GLOBAL_PROFILER,
            crate::Args::new(),
        )
        .await?;
    let malformed = || Error::runtime("malformed server process global profiler events");
    let Value::List(items) = p.value else {
        return Err(malformed());
    };
    let events = items
        .into_iter()
        .map(|item| match item {
            Value::Tuple(fields) => match fields.as_slice() {
                [Value::Str(name), Value::Int(worker), Value::Int(start), end] => Ok(Event {
                    name: name.clone(),
                    worker: u32::try_from(*worker).map_err(|_| malformed())?,
                    start_us: u64::try_from(*start).map_err(|_| malformed())?,
                    end_us: match end {
                        Value::Int(e) => Some(u64::try_from(*e).map_err(|_| malformed())?),
                        _ => None,
                    },
                    // It records calls, not ops.
                    input_shapes: Vec::new(),
                    cpu_memory_usage: 0,
                }),
                _ => Err(malformed()),
            },
            _ => Err(malformed()),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Profile { events })
}

/// Registers the internal functions of this module on the agent.
pub(crate) fn register(r: &crate::agent::FunctionRegistry) {
    r.register_native(
        ENABLE_SERVER_PROCESS_GLOBAL_PROFILER,
        |ctx, _args| async move {
            enable_server_process_global_profiler(ctx.agent());
            Ok(crate::Payload::none())
        },
    );
    r.register_native(
        DISABLE_SERVER_PROCESS_GLOBAL_PROFILER,
        |ctx, _args| async move {
            let profile = disable_server_process_global_profiler(ctx.agent())?;
            let events = profile
                .events
                .into_iter()
                .map(|e| {
                    let int = |v: u64| Value::Int(i64::try_from(v).unwrap_or(i64::MAX));
                    Value::Tuple(vec![
                        Value::Str(e.name),
                        Value::Int(i64::from(e.worker)),
                        int(e.start_us),
                        e.end_us.map_or(Value::None, int),
                    ])
                })
                .collect();
            Ok(crate::Payload::from_value(Value::List(events)))
        },
    );
}
