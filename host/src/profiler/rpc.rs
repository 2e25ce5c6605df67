//! The profiler on the agent ([`Profiler`], an extension): a call made in
//! a profiling scope is recorded under its RPC key and carries the key and
//! the scope's [`ProfilerConfig`] as a field ([`CallField`]); its callee
//! serves it in a scope of its own with that config and sends back its
//! events ([`ProfiledEvent`]) as a field of the response, merged under the
//! key; a worker's server process global profilers record every call it
//! serves.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use futures::FutureExt;
use serde::{Deserialize, Serialize};

use super::{
    CURRENT, Event, GLOBAL_ENABLED, ProfilerConfig, REMOTE_OP_STR, Recorder, Recording,
    RpcExecMode, ServerProfilers, build_rpc_profiling_key, current,
};
use crate::agent::{
    CallKind, CallScope, Dest, Extension, FunctionRegistry, IncomingCall, IncomingReply,
    OutgoingCall, RpcAgent, Run, ServeScope,
};
use crate::{Future, Result};

/// The name of the profiler's fields.
const FEATURE: &str = "profiler";

/// What a profiled call carries to its callee: its RPC key (for a reader
/// of the traffic; the events come back by request id) and the caller's
/// scope config, which the callee's scope takes (PyTorch sends its
/// `ProfilerConfig` with the request the same way).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CallField {
    key: String,
    config: ProfilerConfig,
}

/// A range a callee profiled while serving a call made inside the
/// caller's profiling scope, sent back with the response. Times are
/// microseconds since the callee received the call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfiledEvent {
    /// The event's name on the callee (its function, a nested RPC's key,
    /// ...), without the caller's key.
    pub name: String,
    /// The rank it ran on.
    pub worker: u32,
    /// Start.
    pub start_us: u64,
    /// End.
    pub end_us: u64,
    /// An op's input shapes ([`Event::input_shapes`]).
    pub input_shapes: Vec<Vec<i64>>,
    /// An op's CPU memory ([`Event::cpu_memory_usage`]).
    pub cpu_memory_usage: i64,
}

/// The RPC being started on this thread inside a profiling scope, for
/// the agent's call path to pick up (`outgoing`).
struct Outgoing {
    recorder: Arc<Recorder>,
    index: usize,
    key: String,
    start_us: u64,
    pending: Arc<Pending>,
    /// The futures still to complete before the RPC's event ends: the
    /// caller's (what [`rpc`]'s `done` gives) and the request's, which
    /// differ for a `remote()` to self (the value exists before the
    /// response with the callee's events arrives).
    unfinished: AtomicUsize,
    /// Whether the request's part ended: its response's events arrived
    /// (before its future completes, so a caller woken by the future finds
    /// the event ended), or its future completed without them (an error).
    request_ended: AtomicBool,
    /// Completes once the event has ended and the callee's events are in.
    recorded: Future,
}

impl Outgoing {
    /// Opens the event of an RPC of `function` from `agent` to `dst`; it
    /// ends once [`completed`](Self::completed) as often as futures were
    /// given (one to start with).
    fn open(
        agent: &RpcAgent,
        recorder: Arc<Recorder>,
        mode: RpcExecMode,
        function: &str,
        dst: &str,
    ) -> Arc<Self> {
        let key = build_rpc_profiling_key(mode, function, agent.name(), dst);
        let index = recorder.open(key.clone());
        let start_us = recorder.lock()[index].start_us;
        Arc::new(Outgoing {
            recorder,
            index,
            key,
            start_us,
            pending: agent.state::<Pending>(),
            unfinished: AtomicUsize::new(1),
            request_ended: AtomicBool::new(false),
            recorded: Future::new(),
        })
    }

    /// The request's part of the RPC ended (at most once counted).
    fn request_done(self: &Arc<Self>) {
        if !self.request_ended.swap(true, Ordering::AcqRel) {
            self.completed();
        }
    }

    /// One of the futures the RPC waits for completed; after the last, the
    /// RPC's event ends and events arriving later are dropped.
    fn completed(self: &Arc<Self>) {
        if self.unfinished.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        self.recorder.close(self.index);
        self.pending.lock().retain(|_, o| !Arc::ptr_eq(o, self));
        let _ = self.recorded.set_result(crate::Payload::none());
    }

    /// The key to send with request `id`; the response's events are merged
    /// under it ([`incoming`]).
    fn sent_as(self: &Arc<Self>, id: u64) -> String {
        self.pending.lock().insert(id, Arc::clone(self));
        self.key.clone()
    }

    /// The RPC's event lasts until `request` (the future of the request
    /// that carries the call) ends too: its response's events are merged,
    /// or it fails.
    fn until(self: &Arc<Self>, request: &Future) {
        self.unfinished.fetch_add(1, Ordering::AcqRel);
        self.ends_with(request);
    }

    /// The request's part ends when `request` completes, if its response's
    /// events did not end it first.
    fn ends_with(self: &Arc<Self>, request: &Future) {
        let this = Arc::clone(self);
        request.add_done_callback(move |_| this.request_done());
    }
}

/// The agent's calls waiting for their callee's events, by request id.
#[derive(Default)]
struct Pending(Mutex<HashMap<u64, Arc<Outgoing>>>);

impl Pending {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<Outgoing>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

thread_local! {
    static OUTGOING: RefCell<Option<Arc<Outgoing>>> = const { RefCell::new(None) };
}

/// Called by the agent for each RPC it starts (`rpc_sync`, `rpc_async`,
/// `remote`): inside a profiling scope, records the call under its key
/// from now until both the future `done` gives and the request that
/// `make` sends (it carries the key) complete. Returns what `make` made
/// and, in a scope, a future that completes once the event is recorded
/// with the callee's events (PyTorch's `_get_profiling_future()`).
/// Unresolvable destinations are not recorded (the call fails at once
/// anyway).
pub(crate) fn rpc<T>(
    agent: &RpcAgent,
    mode: RpcExecMode,
    to: &Dest,
    function: &str,
    make: impl FnOnce() -> T,
    done: impl FnOnce(&T) -> Option<Future>,
) -> (T, Option<Future>) {
    let Some(recorder) = current() else {
        return (make(), None);
    };
    let Ok(dst) = agent.resolve(to.clone()) else {
        return (make(), None);
    };
    let out = Outgoing::open(agent, recorder, mode, function, &dst.name);
    let recorded = out.recorded.clone();
    let previous = OUTGOING.with(|o| o.borrow_mut().replace(Arc::clone(&out)));
    let made = make();
    OUTGOING.with(|o| *o.borrow_mut() = previous);
    match done(&made) {
        Some(fut) => fut.add_done_callback(move |_| out.completed()),
        None => out.completed(),
    }
    (made, Some(recorded))
}

/// The profiled RPC the agent is sending now, taken once (by the request
/// that carries the user's call, not by later internal ones).
fn outgoing() -> Option<Arc<Outgoing>> {
    OUTGOING.with(|o| o.borrow_mut().take())
}

/// Merges the callee's events for request `id` into the scope that made
/// it, named `<key>#remote_op: <event>` and placed from the RPC's start.
fn incoming(agent: &RpcAgent, id: u64, events: Vec<ProfiledEvent>) {
    let Some(out) = agent.state::<Pending>().lock().remove(&id) else {
        return;
    };
    {
        let mut recorded = out.recorder.lock();
        for e in events {
            recorded.push(Event {
                name: format!("{}{REMOTE_OP_STR}{}", out.key, e.name),
                worker: e.worker,
                start_us: out.start_us + e.start_us,
                end_us: Some(out.start_us + e.end_us),
                input_shapes: e.input_shapes,
                cpu_memory_usage: e.cpu_memory_usage,
            });
        }
    }
    // The response is in: the request's part ends now, before the agent
    // completes the call's future.
    out.request_done();
}

/// How the caller profiles a served call.
#[derive(Clone, Copy)]
struct ServedProfile {
    /// The caller's scope config.
    config: ProfilerConfig,
    /// The function is a builtin op: the ops libtorch runs for it stand for
    /// the call's own event.
    ops_stand_for_call: bool,
}

/// Serves a call named `name` ([`IncomingCall::runs`]): when the caller
/// profiles it (`profiled`), in a scope of its own with the caller's
/// config and one event for the call itself (for a builtin op, the ops it
/// ran instead), returning every event recorded, for the response; and
/// with one event in each server process global profiler enabled on this
/// worker, unless it is one of the agent's internal calls.
async fn serve<F: std::future::Future>(
    agent: &RpcAgent,
    name: String,
    profiled: Option<ServedProfile>,
    call: F,
) -> (F::Output, Option<Vec<ProfiledEvent>>) {
    // One atomic load while no worker of the process has a global profiler.
    let global = if GLOBAL_ENABLED.load(Ordering::Acquire) > 0
        && !name.starts_with(crate::agent::INTERNAL_PREFIX)
    {
        let recorders = agent.state::<ServerProfilers>().lock().clone();
        recorders
            .into_iter()
            .map(|r| Recording(r).range(name.clone()))
            .collect()
    } else {
        Vec::new()
    };
    let out = if let Some(profiled) = profiled {
        let (out, events) = serve_profiled(agent, name, profiled, call).await;
        (out, Some(events))
    } else {
        (call.await, None)
    };
    drop(global);
    out
}

async fn serve_profiled<F: std::future::Future>(
    agent: &RpcAgent,
    name: String,
    profiled: ServedProfile,
    call: F,
) -> (F::Output, Vec<ProfiledEvent>) {
    let recorder = Recorder::new(agent.rank(), profiled.config);
    let out = if profiled.ops_stand_for_call {
        let start = Instant::now();
        let out = CURRENT.scope(Arc::clone(&recorder), call).await;
        if recorder.lock().is_empty() {
            // No op went through libtorch's dispatcher (a Python builtin
            // such as `builtins.min`, or a refused call): the call is its
            // one event.
            Recording(Arc::clone(&recorder)).add(name, start, Instant::now());
        }
        out
    } else {
        let index = recorder.open(name);
        let out = CURRENT.scope(Arc::clone(&recorder), call).await;
        recorder.close(index);
        out
    };
    let now = recorder.now_us();
    let events = std::mem::take(&mut *recorder.lock())
        .into_iter()
        .map(|e| ProfiledEvent {
            name: e.name,
            worker: e.worker,
            start_us: e.start_us,
            end_us: e.end_us.unwrap_or(now),
            input_shapes: e.input_shapes,
            cpu_memory_usage: e.cpu_memory_usage,
        })
        .collect();
    (out, events)
}

/// The profiler on the agent.
pub(crate) struct Profiler;

/// A profiled RPC's request: it carries the RPC's key, and the RPC's event
/// lasts until its response's events are in or it fails (for a `remote()`,
/// also until the RRef's creation completes: `rpc`).
struct Sent {
    out: Arc<Outgoing>,
    user_call: bool,
}

impl CallScope for Sent {
    fn field(&mut self, id: u64) -> Option<Vec<u8>> {
        let field = CallField {
            key: self.out.sent_as(id),
            config: self.out.recorder.config,
        };
        // Encoding a string and two flags cannot fail; were it to, the
        // callee would profile with the default config.
        Some(crate::abi::encode(&field).unwrap_or_default())
    }

    fn sent(self: Box<Self>, call: &Future) {
        if self.user_call {
            // The user's future is the request's: the one part the event
            // was opened with.
            self.out.ends_with(call);
        } else {
            self.out.until(call);
        }
    }
}

/// A served call, profiled by its caller or by this worker's server
/// process global profilers: its events go back with the response.
struct Serving {
    agent: RpcAgent,
    name: String,
    profiled: Option<ServedProfile>,
    events: Arc<Mutex<Option<Vec<ProfiledEvent>>>>,
}

impl ServeScope for Serving {
    fn wrap(&mut self, run: Run) -> Run {
        let (agent, name, profiled) = (self.agent.clone(), self.name.clone(), self.profiled);
        let slot = Arc::clone(&self.events);
        async move {
            let (out, events) = serve(&agent, name, profiled, run).await;
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = events;
            out
        }
        .boxed()
    }

    fn reply_field(self: Box<Self>, _result: &Result<crate::Payload>) -> Option<Vec<u8>> {
        let events = self
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        crate::abi::encode(&events).ok()
    }
}

impl Extension for Profiler {
    fn name(&self) -> &'static str {
        FEATURE
    }

    fn register(&self, functions: &FunctionRegistry) {
        super::register(functions);
    }

    fn on_call(&self, call: &OutgoingCall<'_>) -> Option<Box<dyn CallScope>> {
        // A `remote()` opened its event itself (`rpc`), for the RRef's
        // creation to end it.
        if let Some(out) = outgoing() {
            return Some(Box::new(Sent {
                out,
                user_call: false,
            }));
        }
        let mode = match call.kind {
            CallKind::Sync => RpcExecMode::Sync,
            CallKind::Async => RpcExecMode::Async,
            CallKind::Remote | CallKind::Internal => return None,
        };
        let recorder = current()?;
        let out = Outgoing::open(call.agent, recorder, mode, call.function, &call.to.name);
        Some(Box::new(Sent {
            out,
            user_call: true,
        }))
    }

    fn on_serve(&self, call: &IncomingCall<'_>) -> Option<Box<dyn ServeScope>> {
        // One atomic load while no worker of the process has a global
        // profiler and the caller profiles nothing.
        if call.field.is_none() && GLOBAL_ENABLED.load(Ordering::Acquire) == 0 {
            return None;
        }
        // The callee's event is named after what the call runs: for a
        // `remote()`, the function it runs.
        let name = call.runs.to_string();
        let profiled = call.field.map(|field| {
            // A field this version cannot read still means "profiled": the
            // call is then profiled with the default config.
            let config = crate::abi::decode::<CallField>(field)
                .map(|f| f.config)
                .unwrap_or_default();
            let ops_stand_for_call = call
                .agent
                .registry()
                .get(&name)
                .is_some_and(|f| f.profiled_as_ops());
            ServedProfile {
                config,
                ops_stand_for_call,
            }
        });
        Some(Box::new(Serving {
            agent: call.agent.clone(),
            name,
            profiled,
            events: Arc::default(),
        }))
    }

    fn on_reply(&self, reply: &IncomingReply<'_>) {
        if let Ok(events) = crate::abi::decode::<Vec<ProfiledEvent>>(reply.field) {
            incoming(reply.agent, reply.id, events);
        }
    }
}
