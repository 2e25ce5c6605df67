//! The guide's benchmark figures: `docs/src/benchmarks/results.md`, the one
//! file in the repository that holds measured numbers of the benchmarks,
//! those of the latest full run of each.
//!
//! The file has one section per bench between the markers
//! `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, each replaced whole
//! by the run that owns it, after that run succeeded:
//! - `rpc`, from `target/bench/latest.jsonl` (the JSON lines `wasmrpc-bench`
//!   writes), after a full `cargo xtask bench`;
//! - `collectives`, from `target/bench/collectives.md` (the table the
//!   collectives bench writes), after a full `cargo xtask bench
//!   collectives`;
//! - `upgrade`, from `target/bench/upgrade.jsonl` (the JSON lines
//!   `wasmrpc-upgrade-bench` writes), after `cargo xtask bench upgrade`.
//!
//! A full run measures every row with the default settings. A run that
//! leaves rows out or changes what is measured (`--quick`, `--only`,
//! `--no-torch`, `--busy-poll-us`, ...) is an experiment, and leaves the
//! file as it is.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::Value as Json;

/// The guide's page of figures, from the repository root.
pub(crate) const RESULTS: &str = "docs/src/benchmarks/results.md";

/// Flags of `wasmrpc-bench` that change how a run is recorded, not what it
/// measures; each takes a value.
const SUITE_FLAGS: &[&str] = &["--baseline", "--json", "--plot", "--python", "--nice"];

/// Flags of the collectives bench that keep a run full; each takes a value.
const COLLECTIVES_FLAGS: &[&str] = &["--python", "--rounds"];

/// `Ok` when `args` make a full run of `wasmrpc-bench`, else why not.
pub(crate) fn records_suite(args: &[String]) -> std::result::Result<(), String> {
    full_run(args, SUITE_FLAGS)
}

/// `Ok` when `args` (after `collectives`) make a full run of the
/// collectives bench, else why not.
pub(crate) fn records_collectives(args: &[String]) -> std::result::Result<(), String> {
    full_run(args, COLLECTIVES_FLAGS)
}

fn full_run(args: &[String], allowed: &[&str]) -> std::result::Result<(), String> {
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let flag = arg.split_once('=').map_or(arg.as_str(), |(f, _)| f);
        if !allowed.contains(&flag) {
            return Err(format!("not a full run: {arg}"));
        }
        if !arg.contains('=') {
            args.next();
        }
    }
    Ok(())
}

/// Writes the latest run of `wasmrpc-bench` into the guide's `rpc`
/// section.
pub(crate) fn record_suite(root: &Path) -> Result<()> {
    let jsonl = root.join("target").join("bench").join("latest.jsonl");
    let text = std::fs::read_to_string(&jsonl)
        .with_context(|| format!("reading the run's results, {}", jsonl.display()))?;
    let body = render_suite(&text, &machine())?;
    write_section(root, "rpc", &body)
}

/// Writes the latest run of the collectives bench into the guide's
/// `collectives` section.
pub(crate) fn record_collectives(root: &Path) -> Result<()> {
    let table = root.join("target").join("bench").join("collectives.md");
    let text = std::fs::read_to_string(&table)
        .with_context(|| format!("reading the run's table, {}", table.display()))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = format!(
        "Measured on {} by `cargo xtask bench collectives`: {}.\n\n{}",
        utc_date(now),
        machine(),
        text.trim()
    );
    write_section(root, "collectives", &body)
}

/// Writes the latest run of the upgrade bench into the guide's `upgrade`
/// section.
pub(crate) fn record_upgrade(root: &Path) -> Result<()> {
    let jsonl = root.join("target").join("bench").join("upgrade.jsonl");
    let text = std::fs::read_to_string(&jsonl)
        .with_context(|| format!("reading the run's results, {}", jsonl.display()))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = render_upgrade(&text, &format!("{}: {}", utc_date(now), machine()))?;
    write_section(root, "upgrade", &body)
}

/// The upgrade bench's table from its JSON lines; `when` is the caption's
/// date and machine.
pub(crate) fn render_upgrade(jsonl: &str, when: &str) -> Result<String> {
    let rows: Vec<Json> = jsonl
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<std::result::Result<_, _>>()
        .context("the upgrade bench's results are not JSON lines")?;
    let row = |name: &str| {
        rows.iter()
            .find(|r| r.get("row").and_then(Json::as_str) == Some(name))
            .with_context(|| format!("the upgrade bench's results have no `{name}` row"))
    };
    let num = |row: &Json, key: &str| -> Result<f64> {
        row.get(key)
            .and_then(Json::as_f64)
            .with_context(|| format!("the upgrade bench's row has no `{key}`"))
    };
    let calls = row("upgrade_calls")?;
    let mut out = format!(
        "Measured on {when}, by `cargo xtask bench upgrade`: {:.0} calls of a two-worker call \
         chain, {:.0} lost, {:.0} that saw two versions; before any switch median {:.3} ms, p99 \
         {:.3} ms.\n\n\
         | switch | took | calls within 100 ms of it | median | p99 | max | added p99 | added max |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
        num(calls, "calls")?,
        num(calls, "lost")?,
        num(calls, "mixed")?,
        num(calls, "baseline_median_ms")?,
        num(calls, "baseline_p99_ms")?,
    );
    for name in ["upgrade", "rollback"] {
        let r = row(&format!("{name}_switch"))?;
        let _ = writeln!(
            out,
            "| {name} | {:.1} ms | {:.0} | {:.3} ms | {:.3} ms | {:.3} ms | {:+.3} ms | {:+.3} ms |",
            num(r, "took_ms")?,
            num(r, "calls_around")?,
            num(r, "median_ms")?,
            num(r, "p99_ms")?,
            num(r, "max_ms")?,
            num(r, "added_p99_ms")?,
            num(r, "added_max_ms")?,
        );
    }
    Ok(out)
}

fn write_section(root: &Path, name: &str, body: &str) -> Result<()> {
    let path = root.join(RESULTS);
    let doc =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc = replace_section(&doc, name, body)?;
    std::fs::write(&path, doc).with_context(|| format!("writing {}", path.display()))?;
    println!("bench: the guide's table is updated ({RESULTS}, section {name}): commit it");
    Ok(())
}

/// `doc` with the text between the markers of section `name` replaced by
/// `body`.
fn replace_section(doc: &str, name: &str, body: &str) -> Result<String> {
    let begin = format!("<!-- bench:{name} -->");
    let end = format!("<!-- /bench:{name} -->");
    let (Some(b), Some(e)) = (doc.find(&begin), doc.find(&end)) else {
        bail!("{RESULTS} has no section `{begin}` ... `{end}`");
    };
    if e < b {
        bail!("{RESULTS}: `{end}` comes before `{begin}`");
    }
    Ok(format!(
        "{}\n{}\n{}",
        &doc[..b + begin.len()],
        body.trim_end(),
        &doc[e..]
    ))
}

/// This machine, as the table's caption names it: its cores and CPU model.
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "CPU model unknown".into());
    format!("{cores} cores ({model})")
}

/// The table of a run of `wasmrpc-bench` from its JSON lines, with a
/// caption saying when, where and how it ran.
pub(crate) fn render_suite(jsonl: &str, machine: &str) -> Result<String> {
    let rows: Vec<Json> = jsonl
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<std::result::Result<_, _>>()
        .context("the run's results are not JSON lines")?;
    let Some(run) = rows.first().and_then(|r| r.get("run")) else {
        bail!("the run's results hold no row");
    };
    let num = |key: &str| run.get(key).and_then(Json::as_f64);
    let text = |key: &str| run.get(key).and_then(Json::as_str).unwrap_or("?");
    let mut out = String::new();
    let _ = write!(
        out,
        "Measured on {} by `cargo xtask bench` ({:.0} s): {machine}; load average {} before \
         the run and {} after; torch {}; {} runtime threads and {} op thread(s) per worker of \
         ours",
        utc_date(num("unix_time").unwrap_or(0.0) as u64),
        num("elapsed_s").unwrap_or(0.0),
        text("load_average_before"),
        text("load_average_after"),
        text("torch_version"),
        num("worker_threads").map_or("?".into(), |n| format!("{n:.0}")),
        num("intra_op_threads").map_or("?".into(), |n| format!("{n:.0}")),
    );
    if let Some(n) = num("nice") {
        let _ = write!(out, ", niceness {n:.0}");
    }
    // Runs before 2026-12-07 did not record it.
    if let Some(steal) = num("steal_percent") {
        let _ = write!(
            out,
            "; the hypervisor took {steal:.1}% of the CPUs' time during the run (steal: every \
             row slows while it does, its floor too but not alike)"
        );
    }
    out.push_str(".\n\n");
    out.push_str(
        "| measurement | wasmrpc (median / p99) | torch.distributed.rpc | limit | vs torch | of limit |\n\
         |---|---|---|---|---:|---:|\n",
    );
    for row in &rows {
        let cells = [
            row.get("title")
                .and_then(Json::as_str)
                .unwrap_or("?")
                .to_string(),
            side(row, "wasmrpc"),
            side(row, "torch"),
            side(row, "limit"),
            ratio(row.get("vs_torch")),
            ratio(row.get("of_limit")),
        ];
        let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    Ok(out)
}

/// One side's cell of a row: its measure, why it has none, and its note.
fn side(row: &Json, side: &str) -> String {
    let mut cell = match (row.get(side), row.get(format!("{side}_na").as_str())) {
        (Some(stat), _) if stat.is_object() => measure(row, stat),
        (_, Some(Json::String(why))) => why.replace('\n', " / "),
        _ => "-".into(),
    };
    if let Some(note) = row
        .get(format!("{side}_note").as_str())
        .and_then(Json::as_str)
    {
        let _ = write!(cell, " {note}");
    }
    cell
}

/// A measure in its row's unit: latencies as median / p99 (and GB/s for
/// payloads), rates as calls per second, memory in MiB.
fn measure(row: &Json, stat: &Json) -> String {
    let median = stat
        .get("median")
        .and_then(Json::as_f64)
        .unwrap_or(f64::NAN);
    match row.get("unit").and_then(Json::as_str) {
        Some("us") => {
            let mut s = micros(median);
            let n = stat.get("n").and_then(Json::as_u64).unwrap_or(1);
            if let Some(p99) = stat.get("p99").and_then(Json::as_f64)
                && n > 1
            {
                let _ = write!(s, " / {}", micros(p99));
            }
            if let Some(bytes) = row.get("bytes").and_then(Json::as_f64) {
                let _ = write!(s, " ({:.2} GB/s)", bytes / (median * 1e3));
            }
            s
        }
        Some("calls/s") => rate(median),
        Some("MiB") => format!("{median:.1} MiB"),
        Some("GB/s") => format!("{median:.2} GB/s"),
        other => format!("{median} {}", other.unwrap_or("")),
    }
}

fn micros(us: f64) -> String {
    if us < 1000.0 {
        format!("{us:.1} µs")
    } else if us < 1e6 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

fn rate(r: f64) -> String {
    let whole = format!("{r:.0}");
    let mut out = String::new();
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out + "/s"
}

fn ratio(r: Option<&Json>) -> String {
    r.and_then(Json::as_f64)
        .map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

/// `secs` since the Unix epoch as `YYYY-MM-DD HH:MM UTC`.
fn utc_date(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let (hour, minute) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Howard Hinnant's days-to-civil, for the proleptic Gregorian calendar.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02} UTC")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn only_full_runs_are_recorded() {
        assert_eq!(records_suite(&[]), Ok(()));
        assert_eq!(
            records_suite(&args("--baseline target/bench/latest.jsonl --nice -10")),
            Ok(())
        );
        assert_eq!(records_suite(&args("--json=out.jsonl")), Ok(()));
        for partial in [
            "--quick",
            "--only echo",
            "--no-torch",
            "--busy-poll-us 0",
            "scale",
        ] {
            assert!(records_suite(&args(partial)).is_err(), "{partial}");
        }
        assert_eq!(records_collectives(&args("--rounds 3")), Ok(()));
        for partial in ["--quick", "--backend tcp", "--out x.md", "--world 8"] {
            assert!(records_collectives(&args(partial)).is_err(), "{partial}");
        }
    }

    #[test]
    fn a_section_is_replaced_whole() {
        let doc = "# Results\n\n<!-- bench:rpc -->\nold\ntable\n<!-- /bench:rpc -->\n\n\
                   <!-- bench:collectives -->\nkept\n<!-- /bench:collectives -->\n";
        let new = replace_section(doc, "rpc", "new table\n").expect("replaced");
        assert_eq!(
            new,
            "# Results\n\n<!-- bench:rpc -->\nnew table\n<!-- /bench:rpc -->\n\n\
             <!-- bench:collectives -->\nkept\n<!-- /bench:collectives -->\n"
        );
        assert!(replace_section(doc, "scale", "x").is_err());
    }

    #[test]
    fn a_run_renders_as_a_captioned_table() {
        let run = r#"{"unix_time":1795694400,"quick":false,"elapsed_s":412.4,"load_average_before":"1.10 0.90 0.80","load_average_after":"1.50 1.20 0.90","torch_version":"2.13.0","worker_threads":2,"intra_op_threads":1,"nice":null}"#;
        let jsonl = [
            format!(
                r#"{{"row":"rtt_noop_native","title":"round trip, no-op(int), native fn [torch: Python fn]","unit":"us","bytes":null,"wasmrpc":{{"median":61.2,"p99":140.0,"n":2000}},"wasmrpc_na":null,"wasmrpc_note":null,"torch":{{"median":263.0,"p99":400.0,"n":2000}},"torch_na":null,"torch_note":null,"limit":{{"median":52.0,"p99":90.0,"n":2000}},"limit_na":null,"vs_torch":4.297,"of_limit":0.85,"run":{run}}}"#
            ),
            format!(
                r#"{{"row":"echo_64m","title":"echo a 64 MiB tensor","unit":"us","bytes":67108864,"wasmrpc":{{"median":40000.0,"p99":null,"n":1}},"wasmrpc_na":null,"wasmrpc_note":null,"torch":null,"torch_na":"n/a (--no-torch)","torch_note":null,"limit":null,"limit_na":null,"vs_torch":null,"of_limit":null,"run":{run}}}"#
            ),
            format!(
                r#"{{"row":"async_128","title":"async calls/s, 128 in flight","unit":"calls/s","bytes":null,"wasmrpc":{{"median":123456.7,"p99":null,"n":3}},"wasmrpc_na":null,"wasmrpc_note":"(TLS: +4.8%)","torch":{{"median":5000.0,"p99":null,"n":3}},"torch_na":null,"torch_note":null,"limit":null,"limit_na":null,"vs_torch":24.69,"of_limit":null,"run":{run}}}"#
            ),
        ]
        .join("\n");
        let table = render_suite(&jsonl, "2 cores (Test CPU)").expect("renders");
        assert!(
            table.starts_with(
                "Measured on 2026-11-26 12:00 UTC by `cargo xtask bench` (412 s): 2 cores (Test \
                 CPU); load average 1.10 0.90 0.80 before the run and 1.50 1.20 0.90 after; torch \
                 2.13.0; 2 runtime threads and 1 op thread(s) per worker of ours.\n\n"
            ),
            "{table}"
        );
        assert!(table.contains(
            "| round trip, no-op(int), native fn [torch: Python fn] | 61.2 µs / 140.0 µs | \
             263.0 µs / 400.0 µs | 52.0 µs / 90.0 µs | 4.30x | 0.85x |\n"
        ));
        assert!(table.contains(
            "| echo a 64 MiB tensor | 40.00 ms (1.68 GB/s) | n/a (--no-torch) | - | - | - |\n"
        ));
        assert!(table.contains(
            "| async calls/s, 128 in flight | 123,457/s (TLS: +4.8%) | 5,000/s | - | 24.69x | - |\n"
        ));
        let stolen = jsonl.replace(r#""nice":null"#, r#""nice":null,"steal_percent":23.4"#);
        assert!(
            render_suite(&stolen, "2 cores (Test CPU)")
                .expect("renders")
                .contains(
                    "1 op thread(s) per worker of ours; the hypervisor took 23.4% of the CPUs' \
                     time during the run (steal: every row slows while it does, its floor too \
                     but not alike).\n\n"
                )
        );
        assert!(render_suite("", "m").is_err());
        assert!(render_suite("not json", "m").is_err());
    }

    #[test]
    fn dates_are_utc() {
        assert_eq!(utc_date(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc_date(951_782_400), "2000-02-29 00:00 UTC");
        assert_eq!(utc_date(1_795_694_400), "2026-11-26 12:00 UTC");
    }

    #[test]
    fn the_upgrade_table_shows_both_switches_and_refuses_a_partial_run() {
        let jsonl = r#"{"row":"upgrade_calls","calls":900,"lost":0,"mixed":0,"baseline_median_ms":1.5,"baseline_p99_ms":4.0}
{"row":"upgrade_switch","took_ms":30.5,"calls_around":80,"median_ms":1.6,"p99_ms":6.0,"max_ms":7.0,"added_p99_ms":2.0,"added_max_ms":3.0}
{"row":"rollback_switch","took_ms":12.0,"calls_around":70,"median_ms":1.5,"p99_ms":4.5,"max_ms":5.0,"added_p99_ms":0.5,"added_max_ms":1.0}
"#;
        let table = render_upgrade(jsonl, "today").expect("a table");
        assert!(table.contains("900 calls"), "{table}");
        assert!(table.contains("0 lost"), "{table}");
        assert!(
            table.contains("| upgrade | 30.5 ms | 80 | 1.600 ms | 6.000 ms | 7.000 ms | +2.000 ms | +3.000 ms |"),
            "{table}"
        );
        assert!(table.contains("| rollback | 12.0 ms |"), "{table}");
        let partial: String = jsonl.lines().take(2).collect::<Vec<_>>().join("\n");
        let err = render_upgrade(&partial, "today").expect_err("no rollback row");
        assert!(err.to_string().contains("rollback_switch"), "{err}");
    }
}
