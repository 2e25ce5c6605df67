//! The torch side: runs `bench/torch_rpc_bench.py` with the set-up's
//! interpreter and reads its JSON lines.

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

/// What the script is told.
pub(crate) struct TorchRun<'a> {
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

/// Runs the script; every torch row it does not report is `n/a` with the
/// reason.
pub(crate) fn run(t: &TorchRun<'_>, res: &mut Results, progress: &Progress) {
    if let Err(e) = run_script(t, res, progress) {
        let why = format!("n/a (torch side failed: {e:#})");
        for row in ROWS {
            if let Some(key) = row.torch
                && wanted(t.only, row.id)
            {
                res.na(Side::Torch, key, &why);
            }
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
    // The script's rows are the torch keys of the selected rows.
    let keys: Vec<&str> = ROWS
        .iter()
        .filter(|r| wanted(t.only, r.id))
        .filter_map(|r| r.torch)
        .collect();
    if keys.is_empty() {
        return Ok(());
    }
    if !t.only.is_empty() {
        for k in &keys {
            cmd.arg("--only").arg(k);
        }
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
            res.note(Side::Torch, "version", v);
        } else if let Some(row) = j.get("row").and_then(Json::as_str) {
            if let Some(na) = j.get("na").and_then(Json::as_str) {
                res.na(Side::Torch, row, format!("n/a ({na})"));
                continue;
            }
            let median = j.get("median").and_then(Json::as_f64);
            let n = j.get("n").and_then(Json::as_u64).unwrap_or(0);
            if let Some(median) = median {
                let p99 = j.get("p99").and_then(Json::as_f64);
                res.set(Side::Torch, row, Stat { median, p99, n });
            }
            if let Some(calls) = j.get("calls").and_then(Json::as_u64) {
                res.note(Side::Torch, row, format!("N={calls}"));
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
