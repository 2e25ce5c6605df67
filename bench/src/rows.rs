//! The rows of the table: what each measures, its unit, which way is
//! better, and which torch and limit measurements it is compared with.

use std::collections::BTreeMap;

use crate::stats::Stat;

/// How a row's numbers read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// A latency in microseconds (median and p99).
    Micros,
    /// Calls per second.
    Rate,
    /// Mebibytes of resident memory.
    Mib,
    /// Gigabytes per second (10^9 bytes).
    GigabytesPerSec,
}

impl Unit {
    /// The unit's name in JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Unit::Micros => "us",
            Unit::Rate => "calls/s",
            Unit::Mib => "MiB",
            Unit::GigabytesPerSec => "GB/s",
        }
    }

    /// Whether a smaller number is better.
    pub(crate) fn lower_is_better(self) -> bool {
        matches!(self, Unit::Micros | Unit::Mib)
    }
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    /// Stable id: the JSON key, the `--only` filter, the torch script's row.
    pub(crate) id: &'static str,
    /// What the row measures, as printed.
    pub(crate) title: &'static str,
    /// Its unit.
    pub(crate) unit: Unit,
    /// The torch script's row it is compared with.
    pub(crate) torch: Option<&'static str>,
    /// The limit it is compared with.
    pub(crate) limit: Option<&'static str>,
    /// Payload bytes one way, for echo rows (shown as GB/s too, and plotted).
    pub(crate) bytes: Option<u64>,
    /// Whether wasmrpc has a number here (false for rows of the limits only).
    pub(crate) ours: bool,
}

const fn row(
    id: &'static str,
    title: &'static str,
    unit: Unit,
    torch: Option<&'static str>,
    limit: Option<&'static str>,
    bytes: Option<u64>,
) -> Row {
    Row {
        id,
        title,
        unit,
        torch,
        limit,
        bytes,
        ours: true,
    }
}

/// Payload of the small calls, for the plot: one int argument.
pub(crate) const SMALL_CALL_BYTES: u64 = 8;

/// Every row, in the order they are printed.
#[rustfmt::skip]
pub(crate) const ROWS: &[Row] = &[
    row("rtt_noop_native", "round trip, no-op(int), native fn [torch: Python fn]", Unit::Micros, Some("rtt_noop"), Some("raw_rtt"), None),
    row("rtt_noop_wasm", "round trip, no-op(int), wasm fn [torch: Python fn]", Unit::Micros, Some("rtt_noop"), Some("raw_rtt"), None),
    row("rtt_noop_py", "round trip, no-op(int), Python plugin fn [torch: Python fn]", Unit::Micros, Some("rtt_noop"), Some("raw_rtt"), None),
    row("rtt_add_wasm", "round trip, a + b of 4 floats, Rust plugin fn [torch: Python fn]", Unit::Micros, Some("rtt_py_add"), None, None),
    row("rtt_add_py", "round trip, a + b of 4 floats, Python plugin fn [torch: Python fn]", Unit::Micros, Some("rtt_py_add"), None, None),
    row("rtt_aten_add", "round trip, aten::add, two 4-element tensors", Unit::Micros, Some("rtt_aten_add"), Some("raw_rtt"), None),
    row("async_128", "async calls/s, 128 in flight", Unit::Rate, Some("async_128"), None, None),
    row("echo_4k", "echo a 4 KiB tensor", Unit::Micros, Some("echo_4k"), Some("raw_echo_4k"), Some(4 << 10)),
    row("echo_1m", "echo a 1 MiB tensor", Unit::Micros, Some("echo_1m"), Some("raw_echo_1m"), Some(1 << 20)),
    row("echo_64m", "echo a 64 MiB tensor", Unit::Micros, Some("echo_64m"), Some("raw_echo_64m"), Some(64 << 20)),
    row("shm_echo_4k", "echo a 4 KiB tensor, same host, shared memory on", Unit::Micros, Some("echo_4k"), None, Some(4 << 10)),
    row("shm_echo_1m", "echo a 1 MiB tensor, same host, shared memory on", Unit::Micros, Some("echo_1m"), None, Some(1 << 20)),
    row("shm_echo_64m", "echo a 64 MiB tensor, same host, shared memory on", Unit::Micros, Some("echo_64m"), Some("shm_bound_64m"), Some(64 << 20)),
    row("shm_echo_1g", "echo a 1 GiB tensor, same host, shared memory on", Unit::Micros, None, None, Some(1 << 30)),
    row("rtt_noop_native_tls", "round trip, no-op(int), native fn, TLS", Unit::Micros, None, None, None),
    row("async_128_tls", "async calls/s, 128 in flight, TLS", Unit::Rate, None, None, None),
    row("echo_64m_tls", "echo a 64 MiB tensor, TLS", Unit::Micros, None, None, Some(64 << 20)),
    row("rtt_noop_native_metrics", "round trip, no-op(int), native fn, metrics on", Unit::Micros, None, None, None),
    row("async_128_metrics", "async calls/s, 128 in flight, metrics on", Unit::Rate, None, None, None),
    row("rtt_noop_native_traced", "round trip, no-op(int), native fn, metrics+spans", Unit::Micros, None, None, None),
    row("async_128_traced", "async calls/s, 128 in flight, metrics+spans", Unit::Rate, None, None, None),
    row("async_128_traced_1pct", "async calls/s, 128 in flight, metrics+1% spans", Unit::Rate, None, None, None),
    row("cuda_echo_64m", "echo a 64 MiB CUDA tensor, device map cuda:0 -> cuda:0, same host, shared memory on", Unit::Micros, Some("cuda_echo_64m"), None, Some(64 << 20)),
    row("cuda_echo_64m_host", "echo a 64 MiB CUDA tensor, device map cuda:0 -> cuda:0, through host memory", Unit::Micros, Some("cuda_echo_64m"), None, Some(64 << 20)),
    row("py_rtt_aten_add", "round trip from a Python program, aten::add, two 4-element tensors [torch: from Python too]", Unit::Micros, Some("rtt_aten_add"), Some("raw_rtt"), None),
    row("py_echo_64m", "echo a 64 MiB tensor from a Python program, same host [torch: from Python too]", Unit::Micros, Some("echo_64m"), None, Some(64 << 20)),
    row("remote_to_here", "remote() + to_here(), no-op(int)", Unit::Micros, Some("remote_to_here"), None, None),
    row("dist_autograd_16", "dist autograd step, remote 16x16 matmul", Unit::Micros, Some("dist_autograd_16"), Some("step_floor_16"), None),
    row("dist_autograd_256", "dist autograd step, remote 256x256 matmul", Unit::Micros, Some("dist_autograd_256"), Some("step_floor_256"), None),
    row("init_w2", "init_rpc + graceful shutdown, world 2", Unit::Micros, Some("init_w2"), None, None),
    row("init_w4", "init_rpc + graceful shutdown, world 4", Unit::Micros, Some("init_w4"), None, None),
    row("init_w8", "init_rpc + graceful shutdown, world 8", Unit::Micros, Some("init_w8"), None, None),
    row("all_to_all_w4", "all-to-all calls/s in total, world 4", Unit::Rate, Some("all_to_all_w4"), None, None),
    row("all_to_all_w8", "all-to-all calls/s in total, world 8", Unit::Rate, Some("all_to_all_w8"), None, None),
    row("wasm_local_warm", "local wasm call, warm instance", Unit::Micros, None, None, None),
    row("wasm_local_cold_cached", "local wasm call, cold, module cache hit", Unit::Micros, None, None, None),
    row("wasm_local_cold_uncached", "local wasm call, cold, no module cache", Unit::Micros, None, None, None),
    row("py_cold_cached", "Python plugin cold start + first call, module cache hit", Unit::Micros, None, None, None),
    row("py_cold_uncached", "Python plugin cold start + first call, compiling", Unit::Micros, None, None, None),
    Row { ours: false, ..row("shm_bound_64m", "two overlapped copies of 64 MiB each way (limit only: shared memory's bound, SHM-1)", Unit::Micros, None, Some("shm_bound_64m"), Some(64 << 20)) },
    Row { ours: false, ..row("memcpy_64m", "memcpy of 64 MiB (limit only)", Unit::GigabytesPerSec, None, Some("memcpy_64m"), None) },
    row("rss_idle", "resident memory, idle worker", Unit::Mib, Some("rss_idle"), None, None),
    row("rss_after_calls", "resident memory, worker after N calls", Unit::Mib, Some("rss_after_calls"), None, None),
    row("rss_idle_compiled", "resident memory, idle worker that compiled its plugins (empty module cache) [torch: idle worker]", Unit::Mib, Some("rss_idle"), None, None),
];

/// Whether `id` passes the `--only` filters (substrings of row ids).
pub(crate) fn wanted(only: &[String], id: &str) -> bool {
    only.is_empty() || only.iter().any(|o| id.contains(o.as_str()))
}

/// A measurement, or why it could not be made.
#[derive(Clone, Debug)]
pub(crate) enum Outcome {
    /// Measured.
    Measured(Stat),
    /// Not measured, and why.
    Na(String),
}

/// Who measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Side {
    /// wasmrpc.
    Ours,
    /// torch.distributed.rpc.
    Torch,
    /// The machine's raw limits.
    Limit,
}

/// Every outcome of one run, by side and key.
#[derive(Default, Debug)]
pub(crate) struct Results {
    map: BTreeMap<(Side, String), Outcome>,
    /// Extra facts per side and key (e.g. the number of calls before the
    /// second memory reading).
    notes: BTreeMap<(Side, String), String>,
}

impl Results {
    /// Records a measurement.
    pub(crate) fn set(&mut self, side: Side, key: &str, stat: Stat) {
        self.map
            .insert((side, key.to_string()), Outcome::Measured(stat));
    }

    /// Records why a measurement was not made (unless it was made).
    pub(crate) fn na(&mut self, side: Side, key: &str, why: impl Into<String>) {
        self.map
            .entry((side, key.to_string()))
            .or_insert_with(|| Outcome::Na(why.into()));
    }

    /// Records a note.
    pub(crate) fn note(&mut self, side: Side, key: &str, note: impl Into<String>) {
        self.notes.insert((side, key.to_string()), note.into());
    }

    /// The outcome for `key`, if any was recorded.
    pub(crate) fn get(&self, side: Side, key: &str) -> Option<&Outcome> {
        self.map.get(&(side, key.to_string()))
    }

    /// The measured value for `key`.
    pub(crate) fn stat(&self, side: Side, key: &str) -> Option<Stat> {
        match self.get(side, key) {
            Some(Outcome::Measured(s)) => Some(*s),
            _ => None,
        }
    }

    /// The note for `key`.
    pub(crate) fn note_of(&self, side: Side, key: &str) -> Option<&str> {
        self.notes.get(&(side, key.to_string())).map(String::as_str)
    }
}
