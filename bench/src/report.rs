//! The table, the ratios, the targets, the JSON lines and the
//! comparison with a baseline run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value as Json, json};

use crate::rows::{Outcome, ROWS, Results, Row, Side, Unit, wanted};
use crate::stats::{CpuTicks, Stat, fmt_steal, steal_between};

/// How much better wasmrpc is than torch: > 1 is better (time or memory of
/// torch over ours; rate of ours over torch's).
pub(crate) fn vs_torch(row: &Row, res: &Results) -> Option<f64> {
    let ours = res.stat(Side::Ours, row.id)?.median;
    let torch = res.stat(Side::Torch, row.torch?)?.median;
    Some(if row.unit.lower_is_better() {
        torch / ours
    } else {
        ours / torch
    })
}

/// The fraction of the limit's performance wasmrpc reaches: the limit's
/// time over ours, or our rate over the limit's (1 = at the limit).
pub(crate) fn of_limit(row: &Row, res: &Results) -> Option<f64> {
    let ours = res.stat(Side::Ours, row.id)?.median;
    let limit = res.stat(Side::Limit, row.limit?)?.median;
    Some(if row.unit.lower_is_better() {
        limit / ours
    } else {
        ours / limit
    })
}

pub(crate) fn fmt_micros(us: f64) -> String {
    if us < 1000.0 {
        format!("{us:.1} µs")
    } else if us < 1e6 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

/// A byte count in KiB from 1 KiB on, else in bytes.
pub(crate) fn fmt_bytes(bytes: usize) -> String {
    if bytes >= 1 << 10 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

fn fmt_rate(r: f64) -> String {
    let whole = format!("{:.0}", r);
    let mut out = String::new();
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out + "/s"
}

/// A cell: median / p99 for latencies (and GB/s for echo rows).
fn cell(row: &Row, stat: Stat) -> String {
    match row.unit {
        Unit::Micros => {
            let mut s = fmt_micros(stat.median);
            if let Some(p99) = stat.p99
                && stat.n > 1
            {
                s = format!("{s} / {}", fmt_micros(p99));
            }
            if let Some(bytes) = row.bytes {
                let _ = write!(s, " ({:.2} GB/s)", bytes as f64 / (stat.median * 1e3));
            }
            s
        }
        Unit::Rate => fmt_rate(stat.median),
        Unit::Mib => format!("{:.1} MiB", stat.median),
        Unit::GigabytesPerSec => format!("{:.2} GB/s", stat.median),
    }
}

fn side_cell(row: &Row, res: &Results, side: Side, key: Option<&str>) -> String {
    let Some(key) = key else {
        return "-".into();
    };
    let mut s = match res.get(side, key) {
        Some(Outcome::Measured(stat)) => cell(row, *stat),
        Some(Outcome::Na(why)) => why.replace('\n', " / "),
        None => "n/a (not measured in this run)".into(),
    };
    if let Some(note) = res.note_of(side, key) {
        let _ = write!(s, " {note}");
    }
    s
}

fn ratio_cell(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

/// One row of the baseline file: our median and the two ratios.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BaselineRow {
    ours: Option<f64>,
    vs_torch: Option<f64>,
    of_limit: Option<f64>,
}

/// Reads a JSON-lines file written by an earlier run.
pub(crate) fn read_baseline(path: &Path) -> Result<BTreeMap<String, BaselineRow>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the baseline {}", path.display()))?;
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let j: Json = serde_json::from_str(line)
            .with_context(|| format!("{} is not JSON lines", path.display()))?;
        let Some(id) = j.get("row").and_then(Json::as_str) else {
            continue;
        };
        out.insert(
            id.to_string(),
            BaselineRow {
                ours: j.pointer("/wasmrpc/median").and_then(Json::as_f64),
                vs_torch: j.get("vs_torch").and_then(Json::as_f64),
                of_limit: j.get("of_limit").and_then(Json::as_f64),
            },
        );
    }
    Ok(out)
}

fn baseline_cell(row: &Row, res: &Results, base: Option<&BaselineRow>) -> String {
    let Some(b) = base else {
        return "-".into();
    };
    let mut parts = Vec::new();
    if let (Some(then), Some(now)) = (b.ours, res.stat(Side::Ours, row.id)) {
        let change = (now.median / then - 1.0) * 100.0;
        let better = if row.unit.lower_is_better() {
            change < 0.0
        } else {
            change > 0.0
        };
        parts.push(format!(
            "ours {change:+.0}%{}",
            if change.abs() < 1.0 {
                ""
            } else if better {
                " (better)"
            } else {
                " (worse)"
            }
        ));
    }
    if let Some(v) = b.vs_torch {
        parts.push(format!("vs torch was {v:.2}x"));
    }
    if let Some(v) = b.of_limit {
        parts.push(format!("of limit was {v:.2}x"));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

/// The table as text.
pub(crate) fn table(
    res: &Results,
    only: &[String],
    baseline: Option<&BTreeMap<String, BaselineRow>>,
) -> String {
    let mut header = vec![
        "measurement",
        "wasmrpc (median / p99)",
        "torch.distributed.rpc",
        "limit",
        "vs torch",
        "of limit",
    ];
    if baseline.is_some() {
        header.push("vs baseline");
    }
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for row in ROWS.iter().filter(|r| wanted(only, r.id)) {
        let mut l = vec![
            row.title.to_string(),
            side_cell(row, res, Side::Ours, row.ours.then_some(row.id)),
            side_cell(row, res, Side::Torch, row.torch),
            side_cell(row, res, Side::Limit, row.limit),
            ratio_cell(vs_torch(row, res)),
            ratio_cell(of_limit(row, res)),
        ];
        if let Some(b) = baseline {
            l.push(baseline_cell(row, res, b.get(row.id)));
        }
        lines.push(l);
    }
    let widths: Vec<usize> = (0..lines[0].len())
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        let cells: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            let _ = writeln!(out, "|-{}-|", rule.join("-|-"));
        }
    }
    out.push_str(
        "\nvs torch: how many times better than torch.distributed.rpc (its time or memory over ours, or our rate over its).\n\
         of limit: the fraction of the raw limit reached (the limit's time over ours; 1.00x = at the limit).\n\
         Echo GB/s: payload bytes one way over the median round trip. Latencies: median / p99.\n",
    );
    out
}

/// How a target is measured.
#[derive(Clone, Copy)]
enum Goal {
    /// The row at least this many times better than torch.
    VsTorch(f64),
    /// The row at least this fraction of its limit (1 = at the limit).
    OfLimit(f64),
    /// The row's median at most this many times that of another row of ours.
    Within(&'static str, f64),
    /// The row's payload over its median (GB/s) at least this fraction of
    /// a limit in GB/s.
    Throughput(&'static str, f64),
}

/// Issue 21's targets, in its order: `(what, row, goal)`.
#[rustfmt::skip]
const TARGETS: &[(&str, &str, Goal)] = &[
    ("small-call round trip >= 8x faster than torch", "rtt_noop_native", Goal::VsTorch(8.0)),
    ("small-call round trip <= 1.1x the raw TCP round trip", "rtt_noop_native", Goal::OfLimit(1.0 / 1.1)),
    ("wasm fn round trip <= 1.1x the native fn's", "rtt_noop_wasm", Goal::Within("rtt_noop_native", 1.1)),
    ("aten::add round trip <= 1.1x the native no-op's", "rtt_aten_add", Goal::Within("rtt_noop_native", 1.1)),
    ("async calls/s >= 25x torch's", "async_128", Goal::VsTorch(25.0)),
    ("64 MiB echo over TCP >= 0.85x raw TCP", "echo_64m", Goal::OfLimit(0.85)),
    ("64 MiB echo between workers on one host >= 0.5x memcpy", "shm_echo_64m", Goal::Throughput("memcpy_64m", 0.5)),
    ("remote()+to_here() >= 5x faster than torch", "remote_to_here", Goal::VsTorch(5.0)),
    ("dist autograd step (16x16) >= 5x faster than torch", "dist_autograd_16", Goal::VsTorch(5.0)),
    ("dist autograd step (256x256) >= 2x faster than torch", "dist_autograd_256", Goal::VsTorch(2.0)),
];

/// The targets, each met, missed (by how much) or not measured.
/// The TLS rows carry issue 20's cost targets in their own notes.
pub(crate) fn targets(res: &Results) -> String {
    let row = |id: &str| ROWS.iter().find(|r| r.id == id).copied();
    let median = |id: &str| res.stat(Side::Ours, id).map(|s| s.median);
    let mut out = String::from("Targets of issue 21 (ratios from this run):\n");
    for &(what, id, goal) in TARGETS {
        // `value` is better when higher, as `wanted` is.
        let (value, wanted, shown) = match goal {
            Goal::VsTorch(g) => {
                let v = row(id).and_then(|r| vs_torch(&r, res));
                (v, g, v.map(|v| format!("{v:.2}x")))
            }
            Goal::OfLimit(g) => {
                let v = row(id).and_then(|r| of_limit(&r, res));
                let shown = v.map(|v| match row(id) {
                    Some(r) if r.unit.lower_is_better() => {
                        format!("{v:.2}x of the limit ({:.2}x its time)", 1.0 / v)
                    }
                    _ => format!("{v:.2}x of the limit"),
                });
                (v, g, shown)
            }
            Goal::Within(base, times) => {
                let v = median(id).zip(median(base)).map(|(o, b)| b / o);
                (
                    v,
                    1.0 / times,
                    v.map(|v| format!("{:.2}x {base}'s time", 1.0 / v)),
                )
            }
            Goal::Throughput(limit, g) => {
                let rate = row(id)
                    .and_then(|r| r.bytes)
                    .zip(median(id))
                    .map(|(bytes, us)| bytes as f64 / (us * 1e3));
                let v = rate
                    .zip(res.stat(Side::Limit, limit))
                    .map(|(rate, l)| rate / l.median);
                let shown = rate
                    .zip(v)
                    .map(|(rate, v)| format!("{rate:.2} GB/s, {v:.2}x {limit}"));
                (v, g, shown)
            }
        };
        let ceiling = row(id).and_then(|r| ceiling(&r, goal, res));
        let line = match (value, shown) {
            (Some(v), Some(shown)) if v >= wanted => format!("  [ ok ] {what}: {shown}"),
            (Some(v), Some(shown)) => match ceiling {
                Some(c) if c < wanted => format!(
                    "  [MISS] {what}: {shown} (needs {:.2}x better; above even the row's limit in this run, which scores {c:.2}x)",
                    wanted / v
                ),
                Some(c) => format!(
                    "  [MISS] {what}: {shown} (needs {:.2}x better; the row's limit scores {c:.2}x)",
                    wanted / v
                ),
                None => format!("  [MISS] {what}: {shown} (needs {:.2}x better)", wanted / v),
            },
            _ => {
                let why = match res.get(Side::Ours, id) {
                    Some(Outcome::Na(w)) => w.clone(),
                    _ => "a side was not measured".into(),
                };
                format!("  [ -- ] {what}: not measured ({why})")
            }
        };
        let _ = writeln!(out, "{line}");
    }
    out
}

/// What a goal's measure would be if `row` took exactly its limit's time.
/// A limit is the least work of its kind (a raw TCP round trip that waits
/// in blocking reads, the shared-memory channel's copies), not a bound on
/// every design: a target above it asks for a different kind of work, or
/// a faster machine. `None` for goals whose measure does not follow from
/// the limit.
fn ceiling(row: &Row, goal: Goal, res: &Results) -> Option<f64> {
    let limit = res.stat(Side::Limit, row.limit?)?.median;
    match goal {
        Goal::VsTorch(_) if row.unit.lower_is_better() => {
            Some(res.stat(Side::Torch, row.torch?)?.median / limit)
        }
        Goal::Throughput(rate, _) if row.unit.lower_is_better() => {
            let gb_per_s = row.bytes? as f64 / (limit * 1e3);
            Some(gb_per_s / res.stat(Side::Limit, rate)?.median)
        }
        _ => None,
    }
}

fn stat_json(s: Option<&Outcome>) -> (Json, Json) {
    match s {
        Some(Outcome::Measured(s)) => (
            json!({"median": s.median, "p99": s.p99, "n": s.n}),
            Json::Null,
        ),
        Some(Outcome::Na(w)) => (Json::Null, Json::String(w.clone())),
        None => (Json::Null, Json::Null),
    }
}

/// The JSON lines of a run: one object per row.
pub(crate) fn json_lines(res: &Results, only: &[String], run: &Json) -> String {
    let mut out = String::new();
    for row in ROWS.iter().filter(|r| wanted(only, r.id)) {
        let (ours, ours_na) = stat_json(res.get(Side::Ours, row.id));
        let (torch, torch_na) = stat_json(row.torch.and_then(|k| res.get(Side::Torch, k)));
        let (limit, limit_na) = stat_json(row.limit.and_then(|k| res.get(Side::Limit, k)));
        let j = json!({
            "row": row.id,
            "title": row.title,
            "unit": row.unit.name(),
            "better": if row.unit.lower_is_better() { "lower" } else { "higher" },
            "bytes": row.bytes,
            "wasmrpc": ours,
            "wasmrpc_na": ours_na,
            "wasmrpc_note": res.note_of(Side::Ours, row.id),
            "torch": torch,
            "torch_na": torch_na,
            "torch_note": row.torch.and_then(|k| res.note_of(Side::Torch, k)),
            "limit": limit,
            "limit_na": limit_na,
            "vs_torch": vs_torch(row, res),
            "of_limit": of_limit(row, res),
            "run": run,
        });
        out.push_str(&j.to_string());
        out.push('\n');
    }
    out
}

/// The 1-, 5- and 15-minute load averages, as `/proc/loadavg` gives them.
pub(crate) fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The machine's load and the hypervisor's steal over a run: read when it
/// starts, and again each time a method is asked about its end.
pub(crate) struct MachineLoad {
    load_before: Option<String>,
    ticks_before: Option<CpuTicks>,
}

impl MachineLoad {
    /// The readings at the start of a run.
    pub(crate) fn start() -> Self {
        MachineLoad {
            load_before: load_average(),
            ticks_before: CpuTicks::now(),
        }
    }

    /// The load averages when the run started.
    pub(crate) fn load_before(&self) -> Option<&str> {
        self.load_before.as_deref()
    }

    /// The hypervisor's share of the CPUs' time since the start, in
    /// percent to one decimal.
    pub(crate) fn steal_percent(&self) -> Option<f64> {
        steal_between(self.ticks_before, CpuTicks::now())
            .map(|share| (share * 1000.0).round() / 10.0)
    }

    /// "load average ... before, ... after, the hypervisor's steal ...% of
    /// the CPUs' time", for the run's last line.
    pub(crate) fn summary(&self) -> String {
        format!(
            "load average {} before, {} after, the hypervisor's steal {} of the CPUs' time",
            self.load_before().unwrap_or("?"),
            load_average().as_deref().unwrap_or("?"),
            fmt_steal(self.ticks_before, CpuTicks::now()),
        )
    }

    /// [`busy_machine_note`] for the loads at the start and now.
    pub(crate) fn busy_note(&self) -> Option<String> {
        busy_machine_note(&[self.load_before(), load_average().as_deref()])
    }
}

/// A warning for a run whose 1-minute load (in any of `loads`, as
/// [`load_average`] gives them) exceeded the cores; `None` otherwise.
pub(crate) fn busy_machine_note(loads: &[Option<&str>]) -> Option<String> {
    let busiest = loads
        .iter()
        .flatten()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .fold(0.0, f64::max);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    (busiest > cores as f64).then(|| {
        format!(
            "Note: the machine was busy (1-minute load {busiest:.1} on {cores} cores): \
             latencies are noisy and small-call round trips can be bimodal; re-run when it is quiet, \
             or with --nice -10 (root) to shield the run."
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn results() -> Results {
        let mut r = Results::default();
        r.set(Side::Ours, "rtt_noop_native", Stat::value(20.0, 1));
        r.set(Side::Torch, "rtt_noop", Stat::value(200.0, 1));
        r.set(Side::Limit, "raw_rtt", Stat::value(5.0, 1));
        r.set(Side::Ours, "async_128", Stat::value(100_000.0, 1));
        r.set(Side::Torch, "async_128", Stat::value(4_000.0, 1));
        r.na(Side::Ours, "remote_to_here", "n/a (not implemented yet)");
        r
    }

    fn row(id: &str) -> Row {
        *ROWS.iter().find(|r| r.id == id).expect("a row")
    }

    #[test]
    fn ratios_read_as_better_than_torch_and_fraction_of_the_limit() {
        let r = results();
        assert_eq!(vs_torch(&row("rtt_noop_native"), &r), Some(10.0));
        assert_eq!(of_limit(&row("rtt_noop_native"), &r), Some(0.25));
        assert_eq!(vs_torch(&row("async_128"), &r), Some(25.0));
        assert_eq!(vs_torch(&row("remote_to_here"), &r), None);
    }

    #[test]
    fn targets_say_met_missed_and_not_measured() {
        let mut r = results();
        r.set(Side::Ours, "rtt_noop_wasm", Stat::value(21.0, 1));
        r.set(Side::Ours, "rtt_aten_add", Stat::value(30.0, 1));
        let t = targets(&r);
        assert!(t.contains("[MISS] small-call round trip <= 1.1x the raw TCP round trip: 0.25x of the limit (4.00x its time) (needs 3.64x better)"), "{t}");
        assert!(t.contains("[ ok ] small-call round trip >= 8x faster than torch: 10.00x"));
        assert!(
            t.contains(
                "[ ok ] wasm fn round trip <= 1.1x the native fn's: 1.05x rtt_noop_native's time"
            ),
            "{t}"
        );
        assert!(t.contains("[MISS] aten::add round trip <= 1.1x the native no-op's: 1.50x rtt_noop_native's time (needs 1.36x better)"), "{t}");
        assert!(t.contains("[ ok ] async calls/s >= 25x torch's: 25.00x"));
        assert!(t.contains("[ -- ] remote()+to_here() >= 5x faster than torch: not measured (n/a (not implemented yet))"));
        // 64 MiB in 20 ms: 3.36 GB/s, against memcpy at 12 GB/s.
        r.set(Side::Ours, "shm_echo_64m", Stat::value(20_000.0, 1));
        r.set(Side::Limit, "memcpy_64m", Stat::value(12.0, 1));
        let t = targets(&r);
        assert!(t.contains("[MISS] 64 MiB echo between workers on one host >= 0.5x memcpy: 3.36 GB/s, 0.28x memcpy_64m (needs 1.79x better)"), "{t}");
    }

    #[test]
    fn a_missed_target_says_what_the_rows_limit_would_score() {
        let mut r = results();
        // The shared-memory bound: 64 MiB there and back in 16 ms, 4.19
        // GB/s, 0.35x of a memcpy at 12 GB/s.
        r.set(Side::Ours, "shm_echo_64m", Stat::value(20_000.0, 1));
        r.set(Side::Limit, "memcpy_64m", Stat::value(12.0, 1));
        r.set(Side::Limit, "shm_bound_64m", Stat::value(16_000.0, 1));
        // A 256x256 step: ours 2 ms, torch 2.8 ms, its floor 1.6 ms.
        r.set(Side::Ours, "dist_autograd_256", Stat::value(2_000.0, 1));
        r.set(Side::Torch, "dist_autograd_256", Stat::value(2_800.0, 1));
        r.set(Side::Limit, "step_floor_256", Stat::value(1_600.0, 1));
        // A 16x16 step whose floor leaves room for the target.
        r.set(Side::Ours, "dist_autograd_16", Stat::value(400.0, 1));
        r.set(Side::Torch, "dist_autograd_16", Stat::value(1_000.0, 1));
        r.set(Side::Limit, "step_floor_16", Stat::value(100.0, 1));
        let t = targets(&r);
        assert!(t.contains("[MISS] 64 MiB echo between workers on one host >= 0.5x memcpy: 3.36 GB/s, 0.28x memcpy_64m (needs 1.79x better; above even the row's limit in this run, which scores 0.35x)"), "{t}");
        assert!(t.contains("[MISS] dist autograd step (256x256) >= 2x faster than torch: 1.40x (needs 1.43x better; above even the row's limit in this run, which scores 1.75x)"), "{t}");
        assert!(t.contains("[MISS] dist autograd step (16x16) >= 5x faster than torch: 2.50x (needs 2.00x better; the row's limit scores 10.00x)"), "{t}");
        // Targets whose measure does not follow from a limit say nothing more.
        assert!(t.contains("(4.00x its time) (needs 3.64x better)\n"), "{t}");
    }

    #[test]
    fn json_lines_read_back_as_a_baseline() {
        let r = results();
        let lines = json_lines(&r, &[], &json!({"quick": true}));
        assert_eq!(lines.lines().count(), ROWS.len());
        let dir = std::env::temp_dir().join(format!("wasmrpc-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("run.jsonl");
        std::fs::write(&path, &lines).expect("write");
        let base = read_baseline(&path).expect("reads");
        let rtt = base["rtt_noop_native"];
        assert_eq!(rtt.ours, Some(20.0));
        assert_eq!(rtt.vs_torch, Some(10.0));
        let cellt = baseline_cell(&row("rtt_noop_native"), &r, Some(&rtt));
        assert_eq!(cellt, "ours +0%, vs torch was 10.00x, of limit was 0.25x");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn cells_and_table() {
        assert_eq!(fmt_rate(1_234_567.4), "1,234,567/s");
        assert_eq!(fmt_micros(20.04), "20.0 µs");
        assert_eq!(fmt_micros(2_500.0), "2.50 ms");
        let t = table(&results(), &["rtt_noop_native".to_string()], None);
        assert!(t.contains("| round trip, no-op(int), native fn [torch: Python fn] | 20.0 µs"));
        assert!(t.contains("10.00x"));
    }
}
