//! Metrics: what a worker does, in Prometheus' text format, for the
//! operator's dashboards and alerts.
//!
//! Off by default. With [`RpcBackendOptions::metrics_addr`](crate::RpcBackendOptions::metrics_addr)
//! (`wasmrpc worker --metrics-addr HOST:PORT`) the agent gets the
//! [`Metrics`] extension, which counts every call this worker serves and
//! makes, and [`http`] serves `GET /metrics` on that address. What is
//! exported:
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `wasmrpc_calls_served_total` | counter | `caller`, `function`, `outcome` | calls this worker ran for peers (and itself); `outcome` is `ok` or the error's Python kind (`RuntimeError`, `TimeoutError`, ...) |
//! | `wasmrpc_call_serve_seconds` | histogram | `caller`, `function` | how long serving them took, from the function's start to its result |
//! | `wasmrpc_calls_made_total` | counter | `peer`, `function`, `kind`, `outcome` | calls this worker made (`kind`: `sync`, `async`, `remote`, `internal`) |
//! | `wasmrpc_call_seconds` | histogram | `peer`, `function` | their round trips, from leaving to the response |
//! | `wasmrpc_peer_failures_total` | counter | `peer` | peers this worker declared failed |
//! | `wasmrpc_bytes_sent_total`, `wasmrpc_bytes_received_total` | counter | `peer`, `channel` | bytes of frames to and from each peer, by channel (`tcp`, `tls`; `shm`: storages sent in shared memory), from `RpcAgent::traffic` |
//! | `wasmrpc_frames_sent_total`, `wasmrpc_frames_received_total` | counter | `peer`, `channel` | frames (messages and heartbeats) to and from each peer |
//! | `wasmrpc_connections_refused_total` | counter | `reason` | connections refused before their first frame: `tls`, `handshake`, `certificate_name`, `timeout`, `displaced` |
//! | `wasmrpc_worker_info` | info | `name`, `rank` | which worker this is |
//! | `wasmrpc_<debug info key>` | gauge | | every number of `get_debug_info` (the agent's and each feature's): `wasmrpc_agent_num_pending_requests`, `wasmrpc_agent_num_connections`, `wasmrpc_agent_tensor_memory_bytes`, `wasmrpc_agent_tensor_memory_limit_bytes`, `wasmrpc_agent_busy_poll_back_offs` (BUSY-8), `wasmrpc_rref_num_owner_rrefs`, `wasmrpc_num_autograd_contexts`, the plugins' `wasmrpc_agent_plugin_served`, `_calls_in_flight`, `_objects`, `_idle_instances`, `_compiled_here`, ... |
//!
//! Invariants:
//! - MET-1: no argument value, result or error message is ever exported:
//!   labels are worker names, function names, call kinds and error kinds.
//! - MET-2: label sets stay bounded whatever peers send: only calls of
//!   names this worker resolves are served (registered functions and
//!   libtorch's ops; a name it cannot resolve is refused before serving
//!   and counted in `wasmrpc_agent_unknown_function_calls`), and a pinned
//!   name (`hello@<sha256 prefix>::greet`) counts under its plugin's name
//!   with `@` (`hello@::greet`), so made-up names add no series.
//! - MET-3: with metrics off, no extension is installed: calls pay nothing.
//! - MET-7: a call that succeeds builds no label and allocates nothing for
//!   its series: the series of each (worker, function) pair are made once
//!   and kept ([`CallMetrics`]' caches, bounded as MET-2 bounds the labels);
//!   only a failed call looks its outcome's series up by label.
//!
//! What it leaves to others: the numbers of `get_debug_info` are the
//! agent's and the features' own ([`crate::RpcAgent::get_debug_info`]);
//! this module only exports them.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::agent::{
    CallKind, CallScope, Extension, Future, IncomingCall, OutgoingCall, Run, ServeScope,
};
use crate::{RpcAgent, abi};

pub mod http;

pub use http::{Endpoint, MetricsServer, serve};

/// The families of call metrics [`render`] exports (a family with no
/// sample yet, e.g. no peer failed, is left out of a scrape).
pub const CALL_FAMILIES: &[&str] = &[
    "wasmrpc_calls_served",
    "wasmrpc_call_serve_seconds",
    "wasmrpc_calls_made",
    "wasmrpc_call_seconds",
    "wasmrpc_peer_failures",
    "wasmrpc_worker",
    "wasmrpc_bytes_sent",
    "wasmrpc_bytes_received",
    "wasmrpc_frames_sent",
    "wasmrpc_frames_received",
    "wasmrpc_connections_refused",
];

/// The feature: counts calls served and made, and peer failures, into the
/// agent's [`CallMetrics`]. One per agent ([`Metrics::default`]).
#[derive(Default)]
pub struct Metrics {
    /// The agent's [`CallMetrics`], looked up once (the agent's state map
    /// is behind a lock every call would otherwise take).
    calls: std::sync::OnceLock<Arc<CallMetrics>>,
}

impl Metrics {
    fn calls(&self, agent: &RpcAgent) -> &Arc<CallMetrics> {
        self.calls.get_or_init(|| agent.state::<CallMetrics>())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServedLabels {
    caller: String,
    function: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServedTimeLabels {
    caller: String,
    function: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MadeLabels {
    peer: String,
    function: String,
    kind: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MadeTimeLabels {
    peer: String,
    function: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
}

fn latency_histogram() -> Histogram {
    // 10 µs to about 84 s, doubling.
    Histogram::new(exponential_buckets(1e-5, 2.0, 24))
}

/// One agent's counters (agent state, made on first use).
pub struct CallMetrics {
    served: Family<ServedLabels, Counter>,
    serve_seconds: Family<ServedTimeLabels, Histogram, fn() -> Histogram>,
    made: Family<MadeLabels, Counter>,
    call_seconds: Family<MadeTimeLabels, Histogram, fn() -> Histogram>,
    peer_failures: Family<PeerLabels, Counter>,
    /// The series of each (caller, function) served and (peer, function)
    /// called, made once (MET-7).
    served_series: SeriesCache<ServedSeries>,
    made_series: SeriesCache<MadeSeries>,
}

impl Default for CallMetrics {
    fn default() -> Self {
        CallMetrics {
            served: Family::default(),
            serve_seconds: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            made: Family::default(),
            call_seconds: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            peer_failures: Family::default(),
            served_series: SeriesCache::default(),
            made_series: SeriesCache::default(),
        }
    }
}

/// Series by worker name, then function label, looked up by `&str` (no
/// allocation once the pair was seen).
struct SeriesCache<T>(RwLock<HashMap<String, HashMap<String, Arc<T>>>>);

impl<T> Default for SeriesCache<T> {
    fn default() -> Self {
        SeriesCache(RwLock::default())
    }
}

impl<T> SeriesCache<T> {
    /// The series of (`worker`, `function`), made by `make` the first time.
    fn get(&self, worker: &str, function: &str, make: impl FnOnce() -> T) -> Arc<T> {
        let found = self
            .0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(worker)
            .and_then(|by_function| by_function.get(function))
            .cloned();
        if let Some(series) = found {
            return series;
        }
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(worker.to_owned())
            .or_default()
            .entry(function.to_owned())
            .or_insert_with(|| Arc::new(make()))
            .clone()
    }
}

/// What a served call updates: its latency, and its count when it succeeds.
struct ServedSeries {
    caller: String,
    function: String,
    seconds: Histogram,
    ok: Counter,
}

/// What a call made updates: its latency, and its count, by kind, when it
/// succeeds.
struct MadeSeries {
    peer: String,
    function: String,
    seconds: Histogram,
    /// By [`kind_index`], made on first use (a kind never used exports no
    /// series).
    ok: [std::sync::OnceLock<Counter>; 4],
}

/// `hello@<prefix>::greet` as `hello@::greet`; other names as they are.
fn pinned_label(name: &str) -> String {
    match name.split_once("::") {
        Some((left, function)) => match left.split_once('@') {
            Some((namespace, _)) => format!("{namespace}@::{function}"),
            None => name.to_owned(),
        },
        None => name.to_owned(),
    }
}

fn outcome_label(outcome: Option<std::result::Result<(), abi::ErrorKind>>) -> String {
    match outcome {
        Some(Ok(())) => "ok".into(),
        Some(Err(kind)) => kind.python_name().into(),
        None => "unfinished".into(),
    }
}

fn kind_index(kind: CallKind) -> usize {
    match kind {
        CallKind::Sync => 0,
        CallKind::Async => 1,
        CallKind::Remote => 2,
        CallKind::Internal => 3,
    }
}

/// The function label of `name` ([`pinned_label`]), without allocating for
/// a name that is not pinned.
fn function_label(name: &str) -> std::borrow::Cow<'_, str> {
    if name.contains('@') {
        std::borrow::Cow::Owned(pinned_label(name))
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

struct MadeCall {
    metrics: Arc<CallMetrics>,
    series: Arc<MadeSeries>,
    kind: CallKind,
    started: Instant,
}

impl CallScope for MadeCall {
    fn field(&mut self, _id: u64) -> Option<Vec<u8>> {
        None
    }

    fn sent(self: Box<Self>, call: &Future) {
        call.add_done_callback(move |done| {
            let MadeCall {
                metrics,
                series,
                kind,
                started,
            } = *self;
            series.seconds.observe(started.elapsed().as_secs_f64());
            match done.outcome() {
                // MET-7: a call that succeeds builds no label.
                Some(Ok(())) => series.ok[kind_index(kind)]
                    .get_or_init(|| {
                        metrics
                            .made
                            .get_or_create(&MadeLabels {
                                peer: series.peer.clone(),
                                function: series.function.clone(),
                                kind: kind.name().into(),
                                outcome: outcome_label(Some(Ok(()))),
                            })
                            .clone()
                    })
                    .inc(),
                outcome => metrics
                    .made
                    .get_or_create(&MadeLabels {
                        peer: series.peer.clone(),
                        function: series.function.clone(),
                        kind: kind.name().into(),
                        outcome: outcome_label(outcome),
                    })
                    .inc(),
            };
        });
    }
}

struct ServedCall {
    metrics: Arc<CallMetrics>,
    series: Arc<ServedSeries>,
}

impl ServeScope for ServedCall {
    fn wrap(&mut self, run: Run) -> Run {
        let (metrics, series) = (self.metrics.clone(), self.series.clone());
        Box::pin(async move {
            let started = Instant::now();
            let result = run.await;
            series.seconds.observe(started.elapsed().as_secs_f64());
            match &result {
                Ok(_) => {
                    series.ok.inc();
                }
                Err(e) => {
                    metrics
                        .served
                        .get_or_create(&ServedLabels {
                            caller: series.caller.clone(),
                            function: series.function.clone(),
                            outcome: outcome_label(Some(Err(e.kind()))),
                        })
                        .inc();
                }
            }
            result
        })
    }
}

impl Extension for Metrics {
    fn name(&self) -> &'static str {
        "metrics"
    }

    fn on_call(&self, call: &OutgoingCall<'_>) -> Option<Box<dyn CallScope>> {
        let metrics = self.calls(call.agent).clone();
        let (peer, function) = (&call.to.name, function_label(call.function));
        let series = metrics.made_series.get(peer, &function, || MadeSeries {
            peer: peer.clone(),
            function: function.to_string(),
            seconds: metrics
                .call_seconds
                .get_or_create(&MadeTimeLabels {
                    peer: peer.clone(),
                    function: function.to_string(),
                })
                .clone(),
            ok: Default::default(),
        });
        Some(Box::new(MadeCall {
            metrics,
            series,
            kind: call.kind,
            started: Instant::now(),
        }))
    }

    fn on_serve(&self, call: &IncomingCall<'_>) -> Option<Box<dyn ServeScope>> {
        let metrics = self.calls(call.agent).clone();
        let (caller, function) = (&call.caller.name, function_label(call.function));
        let series = metrics
            .served_series
            .get(caller, &function, || ServedSeries {
                caller: caller.clone(),
                function: function.to_string(),
                seconds: metrics
                    .serve_seconds
                    .get_or_create(&ServedTimeLabels {
                        caller: caller.clone(),
                        function: function.to_string(),
                    })
                    .clone(),
                ok: metrics
                    .served
                    .get_or_create(&ServedLabels {
                        caller: caller.clone(),
                        function: function.to_string(),
                        outcome: outcome_label(Some(Ok(()))),
                    })
                    .clone(),
            });
        Some(Box::new(ServedCall { metrics, series }))
    }

    fn worker_failed(&self, agent: &RpcAgent, failed: &abi::WorkerInfo, _cause: &str) {
        agent
            .state::<CallMetrics>()
            .peer_failures
            .get_or_create(&PeerLabels {
                peer: failed.name.clone(),
            })
            .inc();
    }

    fn stopped(&self, agent: &RpcAgent) -> crate::Result<()> {
        agent.state::<http::Endpoint>().stop();
        Ok(())
    }
}

/// `agent`'s metrics in Prometheus' text format (what `GET /metrics`
/// answers): the call counters, then every number of `get_debug_info` as
/// a gauge.
pub fn render(agent: &RpcAgent) -> String {
    let metrics = agent.state::<CallMetrics>();
    let mut registry = Registry::with_prefix("wasmrpc");
    registry.register(
        "calls_served",
        "Calls this worker served, by caller, function and outcome (ok or the error's kind)",
        metrics.served.clone(),
    );
    registry.register(
        "call_serve_seconds",
        "How long serving a call took, by caller and function",
        metrics.serve_seconds.clone(),
    );
    registry.register(
        "calls_made",
        "Calls this worker made, by peer, function, kind and outcome",
        metrics.made.clone(),
    );
    registry.register(
        "call_seconds",
        "Round trips of the calls this worker made, by peer and function",
        metrics.call_seconds.clone(),
    );
    registry.register(
        "peer_failures",
        "Peers this worker declared failed",
        metrics.peer_failures.clone(),
    );
    register_traffic(&mut registry, agent);
    let me = agent.get_worker_info(None).ok();
    registry.register(
        "worker",
        "This worker's name and rank",
        prometheus_client::metrics::info::Info::new(vec![
            ("name", agent.name().to_owned()),
            ("rank", me.map_or_else(|| "?".into(), |w| w.id.to_string())),
        ]),
    );
    for (key, value) in agent.get_debug_info() {
        let Ok(number) = value.trim().parse::<f64>() else {
            continue;
        };
        let gauge = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        gauge.set(number);
        registry.register(metric_name(&key), format!("get_debug_info's {key}"), gauge);
    }
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrafficLabels {
    peer: String,
    channel: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    reason: &'static str,
}

/// The transport's totals (`RpcAgent::traffic`, `refused_connections`) as
/// counters, read at the scrape.
fn register_traffic(registry: &mut Registry, agent: &RpcAgent) {
    let family = Family::<TrafficLabels, Counter>::default;
    let (bytes_sent, bytes_received, frames_sent, frames_received) =
        (family(), family(), family(), family());
    for t in agent.traffic() {
        let labels = TrafficLabels {
            peer: t.peer.clone(),
            channel: t.channel.as_str(),
        };
        bytes_sent.get_or_create(&labels).inc_by(t.bytes_sent);
        frames_sent.get_or_create(&labels).inc_by(t.frames_sent);
        if t.channel != crate::transport::Channel::SharedMemory {
            bytes_received
                .get_or_create(&labels)
                .inc_by(t.bytes_received);
            frames_received
                .get_or_create(&labels)
                .inc_by(t.frames_received);
        }
    }
    for (name, help, metric) in [
        (
            "bytes_sent",
            "Bytes sent to each peer, by channel",
            bytes_sent,
        ),
        (
            "bytes_received",
            "Bytes received from each peer, by channel",
            bytes_received,
        ),
        (
            "frames_sent",
            "Frames sent to each peer, by channel",
            frames_sent,
        ),
        (
            "frames_received",
            "Frames received from each peer, by channel",
            frames_received,
        ),
    ] {
        registry.register(name, help, metric);
    }
    let refused = Family::<RefusalLabels, Counter>::default();
    for (reason, n) in agent.refused_connections() {
        refused
            .get_or_create(&RefusalLabels {
                reason: reason.as_str(),
            })
            .inc_by(n);
    }
    registry.register(
        "connections_refused",
        "Connections refused before their first frame, by reason",
        refused,
    );
}

/// A `get_debug_info` key as a metric name (after the `wasmrpc_` prefix):
/// anything but ASCII letters and digits becomes `_`.
fn metric_name(key: &str) -> String {
    key.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_names_and_debug_keys_become_bounded_labels_and_valid_names() {
        assert_eq!(pinned_label("hello@0123abcd::greet"), "hello@::greet");
        assert_eq!(pinned_label("hello::greet"), "hello::greet");
        assert_eq!(pinned_label("aten::add"), "aten::add");
        assert_eq!(
            metric_name("agent.num_pending_requests"),
            "agent_num_pending_requests"
        );
        assert_eq!(metric_name("rref.num-owner rrefs"), "rref_num_owner_rrefs");
    }
}
