//! `wasmrpc-upgrade-bench`: what upgrading and rolling back a plugin costs
//! the calls that run through the switch (issue 48).
//!
//! A group of three in-process workers (one process, loopback, no
//! credentials) accepts deployments; `plugins/hello` version A is deployed,
//! then `CALLERS` tasks call `hello::version_chain` in a loop (each call
//! runs on one worker and makes a nested call to another, as a call chain
//! does), while the bench deploys version B (stage everywhere, then
//! commit), waits, and rolls back to A. Version B is hello with its version
//! marker replaced (`upgrade_test` does the same).
//!
//! It prints, and writes as JSON lines to `target/bench/upgrade.jsonl`:
//! calls made and lost (must be 0), calls that saw two versions (must be
//! 0), the latency of calls before any switch (median, p99), of the calls
//! in flight or started within `WINDOW` of each switch (median, p99, max),
//! and the added latency: around-the-switch p99 minus baseline p99, in ms;
//! plus how long the deployment and the rollback took. Workers share the
//! process and the machine's cores with the callers: compare runs of one
//! machine only.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use wasmrpc::prelude::*;
use wasmrpc::{RpcAgent, RpcBackendOptions, args, init_rpc};

const WORLD: u32 = 3;
const CALLERS: usize = 6;
/// How far around a switch a call counts as "around the switch".
const WINDOW: Duration = Duration::from_millis(100);
/// How long the load runs before, between and after the switches.
const PHASE: Duration = Duration::from_millis(1500);

fn hello_version(marker: u8) -> Result<Vec<u8>> {
    let bytes = std::fs::read(wasmrpc_plugins::HELLO).context("the hello plugin was built")?;
    let old = b"hello-version-AAAAAAAAAAAAAAAAAA";
    let mut new = *old;
    new[14..].fill(marker);
    let mut out = bytes.clone();
    for i in 0..=bytes.len() - old.len() {
        if &bytes[i..i + old.len()] == old {
            out[i..i + old.len()].copy_from_slice(&new);
        }
    }
    ensure!(out != bytes || marker == b'A', "no version marker in hello");
    Ok(out)
}

/// One call: when it started and ended (since the bench began), and what
/// it answered.
struct Call {
    start: Duration,
    end: Duration,
    answer: wasmrpc::Result<String>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn latencies_ms<'a>(calls: impl Iterator<Item = &'a Call>) -> Vec<f64> {
    let mut v: Vec<f64> = calls
        .map(|c| (c.end - c.start).as_secs_f64() * 1e3)
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

async fn start() -> Result<Vec<RpcAgent>> {
    let store: Arc<dyn wasmrpc::store::Store> = Arc::new(wasmrpc::store::HashStore::new());
    let tasks: Vec<_> = (0..WORLD)
        .map(|rank| {
            let store = store.clone();
            tokio::spawn(async move {
                let o = RpcBackendOptions {
                    accept_plugin_deployment: true,
                    ..RpcBackendOptions::default()
                };
                init_rpc(&format!("worker{rank}"), Some(rank), Some(WORLD), store, o).await
            })
        })
        .collect();
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await??);
    }
    Ok(agents)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let agents = start().await?;
    let (a, b) = (hello_version(b'A')?, hello_version(b'B')?);
    agents[0].deploy_plugin(&a).await?.check()?;
    let began = Instant::now();
    let stopping = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..CALLERS)
        .map(|i| {
            let from = agents[i % 3].clone();
            let dst = format!("worker{}", (i + 1) % 3);
            let on = format!("worker{}", (i + 2) % 3);
            let stopping = stopping.clone();
            tokio::spawn(async move {
                let mut calls = Vec::new();
                while !stopping.load(Ordering::SeqCst) {
                    let start = began.elapsed();
                    let answer = from
                        .rpc_sync(
                            dst.as_str(),
                            "hello::version_chain",
                            args![on.clone(), 0.0f64],
                        )
                        .await
                        .and_then(|p| p.as_str().map(str::to_string));
                    calls.push(Call {
                        start,
                        end: began.elapsed(),
                        answer,
                    });
                }
                calls
            })
        })
        .collect();
    tokio::time::sleep(PHASE).await;
    let deploy_at = began.elapsed();
    let t = Instant::now();
    agents[1].deploy_plugin(&b).await?.check()?;
    let deploy_took = t.elapsed();
    let committed_at = began.elapsed();
    tokio::time::sleep(PHASE).await;
    let rollback_at = began.elapsed();
    let t = Instant::now();
    agents[2]
        .rollback_plugin("hello", &agents[2].get_worker_infos())
        .await?
        .check()?;
    let rollback_took = t.elapsed();
    let rolled_back_at = began.elapsed();
    tokio::time::sleep(PHASE).await;
    stopping.store(true, Ordering::SeqCst);
    let mut calls = Vec::new();
    for task in load {
        calls.extend(task.await?);
    }
    let lost = calls.iter().filter(|c| c.answer.is_err()).count();
    let mixed = calls
        .iter()
        .filter(|c| {
            c.answer
                .as_ref()
                .is_ok_and(|s| s.split_once(' ').is_none_or(|(x, y)| x != y))
        })
        .count();
    if let Some(e) = calls.iter().find_map(|c| c.answer.as_ref().err()) {
        eprintln!("a lost call: {e}");
    }
    let near =
        |c: &Call, from: Duration, to: Duration| c.end + WINDOW >= from && c.start <= to + WINDOW;
    let baseline = latencies_ms(calls.iter().filter(|c| c.end < deploy_at));
    let upgrade = latencies_ms(calls.iter().filter(|c| near(c, deploy_at, committed_at)));
    let rollback = latencies_ms(
        calls
            .iter()
            .filter(|c| near(c, rollback_at, rolled_back_at)),
    );
    let (b50, b99) = (percentile(&baseline, 0.5), percentile(&baseline, 0.99));
    println!(
        "{} calls by {CALLERS} callers over {:.1} s: {lost} lost, {mixed} saw two versions",
        calls.len(),
        began.elapsed().as_secs_f64()
    );
    println!(
        "baseline (before any switch, {} calls): median {b50:.3} ms, p99 {b99:.3} ms",
        baseline.len()
    );
    let mut rows = vec![serde_json::json!({
        "row": "upgrade_calls", "calls": calls.len(), "lost": lost, "mixed": mixed,
        "baseline_median_ms": b50, "baseline_p99_ms": b99,
    })];
    for (what, lat, took) in [
        ("upgrade", &upgrade, deploy_took),
        ("rollback", &rollback, rollback_took),
    ] {
        let (m, p99, max) = (
            percentile(lat, 0.5),
            percentile(lat, 0.99),
            lat.last().copied().unwrap_or(f64::NAN),
        );
        println!(
            "{what}: took {:.1} ms; {} calls within {} ms of it: median {m:.3} ms, p99 {p99:.3} \
             ms, max {max:.3} ms; added p99 latency {:.3} ms, added max {:.3} ms",
            took.as_secs_f64() * 1e3,
            lat.len(),
            WINDOW.as_millis(),
            p99 - b99,
            max - b99
        );
        rows.push(serde_json::json!({
            "row": format!("{what}_switch"), "took_ms": took.as_secs_f64() * 1e3,
            "calls_around": lat.len(), "median_ms": m, "p99_ms": p99, "max_ms": max,
            "added_p99_ms": p99 - b99, "added_max_ms": max - b99,
        }));
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    if std::fs::create_dir_all(&dir).is_ok() {
        let lines: Vec<String> = rows.iter().map(ToString::to_string).collect();
        let _ = std::fs::write(dir.join("upgrade.jsonl"), lines.join("\n") + "\n");
    }
    // A static group's graceful shutdown waits for every member: all at once.
    let stopping: Vec<_> = agents
        .into_iter()
        .map(|a| tokio::spawn(async move { a.shutdown(true, Duration::ZERO).await }))
        .collect();
    for s in stopping {
        s.await??;
    }
    ensure!(lost == 0 && mixed == 0, "{lost} calls lost, {mixed} mixed");
    Ok(())
}
