//! The rows measured by Python scripts, which write one JSON line per row:
//! the torch side (`bench/torch_rpc_bench.py`, torch.distributed.rpc) and
//! wasmrpc called from a Python program (`bench/wasmrpc_python_bench.py`,
//! through the `wasmrpc` package), each run with the set-up's interpreter.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::Value as Json;

use crate::progress::Progress;
use crate::rows::{ROWS, Results, Side, wanted};
use crate::stats::Stat;

/// The interpreter: `--python`, else `$WASMRPC_ENV/venv/bin/python` (cargo
/// sets `WASMRPC_ENV` for processes it runs), else the checkout's
/// `.wasmrpc-env/venv/bin/python`.
pub(crate) fn interpreter(flag: Option<PathBuf>, root: &Path) -> PathBuf {
    flag.unwrap_or_else(|| {
        let env = std::env::var_os("WASMRPC_ENV")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".wasmrpc-env"));
        env.join("venv").join("bin").join("python")
    })
}

/// A script run: what it is told, and which side its rows are.
pub(crate) struct TorchRun<'a> {
    /// Whose rows the script measures (`Side::Torch` for torch's script).
    pub(crate) side: Side,
    /// The rows it is asked for (each side's keys of the selected rows).
    pub(crate) keys: Vec<&'static str>,
    /// Prepended to its `PYTHONPATH` (where the `wasmrpc` package is).
    pub(crate) pythonpath: Option<&'a Path>,
    /// The interpreter.
    pub(crate) python: &'a Path,
    /// The script.
    pub(crate) script: &'a Path,
    /// Fewer repetitions.
    pub(crate) quick: bool,
    /// `--only` filters.
    pub(crate) only: &'a [String],
    /// Calls before the second memory reading.
    pub(crate) memory_calls: u64,
    /// Where its stderr goes.
    pub(crate) log: &'a Path,
}

/// The torch keys of the selected rows (what torch's script is asked for).
pub(crate) fn torch_keys(only: &[String]) -> Vec<&'static str> {
    ROWS.iter()
        .filter(|r| wanted(only, r.id))
        .filter_map(|r| r.torch)
        .collect()
}

/// Runs the script; every row it was asked for and does not report is
/// `n/a` with the reason.
pub(crate) fn run(t: &TorchRun<'_>, res: &mut Results, progress: &Progress) {
    if let Err(e) = run_script(t, res, progress) {
        let who = match t.side {
            Side::Torch => "torch side",
            _ => "Python script",
        };
        let why = format!("n/a ({who} failed: {e:#})");
        for key in &t.keys {
            res.na(t.side, key, &why);
        }
    }
}

fn run_script(t: &TorchRun<'_>, res: &mut Results, progress: &Progress) -> Result<()> {
    if !t.python.exists() {
        bail!(
            "no interpreter at {} (run `cargo xtask setup`, or pass --python)",
            t.python.display()
        );
    }
    let log = std::fs::File::create(t.log)?;
    let mut cmd = Command::new(t.python);
    cmd.arg(t.script)
        .arg("--memory-calls")
        .arg(t.memory_calls.to_string());
    if t.quick {
        cmd.arg("--quick");
    }
    if t.keys.is_empty() {
        return Ok(());
    }
    if !t.only.is_empty() {
        for k in &t.keys {
            cmd.arg("--only").arg(k);
        }
    }
    if let Some(dir) = t.pythonpath {
        let mut path = std::ffi::OsString::from(dir);
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("PYTHONPATH", path);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(log)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("could not start {}", t.python.display()))?;
    let stdout = child.stdout.take().context("script stdout")?;
    let mut error = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(j) = serde_json::from_str::<Json>(&line) else {
            continue;
        };
        if let Some(p) = j.get("progress").and_then(Json::as_str) {
            progress.set(p);
        } else if let Some(e) = j.get("error").and_then(Json::as_str) {
            error = Some(e.to_string());
        } else if let Some(v) = j.get("torch_version").and_then(Json::as_str) {
            res.note(t.side, "version", v);
        } else if let Some(row) = j.get("row").and_then(Json::as_str) {
            if let Some(na) = j.get("na").and_then(Json::as_str) {
                res.na(t.side, row, format!("n/a ({na})"));
                continue;
            }
            let median = j.get("median").and_then(Json::as_f64);
            let n = j.get("n").and_then(Json::as_u64).unwrap_or(0);
            if let Some(median) = median {
                let p99 = j.get("p99").and_then(Json::as_f64);
                res.set(t.side, row, Stat { median, p99, n });
            }
            if let Some(calls) = j.get("calls").and_then(Json::as_u64) {
                res.note(t.side, row, format!("N={calls}"));
            }
        }
    }
    let status = child.wait()?;
    if let Some(e) = error {
        bail!("the script raised {e} (log: {})", t.log.display());
    }
    if !status.success() {
        bail!("the script exited with {status} (log: {})", t.log.display());
    }
    Ok(())
}
