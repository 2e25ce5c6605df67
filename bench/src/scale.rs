//! `wasmrpc-bench scale`: what a group costs as it grows, measured with
//! in-process workers sharing one tokio runtime (as the issue allows), so a
//! few hundred fit on a small machine.
//!
//! For each world size: the wall time of a concurrent `init_rpc` of every
//! worker through a real TCP store (rank 0 hosts it), the resident memory
//! each worker adds once joined (no connection open yet: connections are
//! lazy), an all-to-all round (every worker calls every other once, which
//! opens one connection per pair), the memory that adds per connection,
//! and a concurrent graceful shutdown. The output ends with a linear
//! extrapolation to 1,000 workers.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::future::try_join_all;
use wasmrpc::{RpcAgent, args};

use crate::worker::{self, NOOP};

/// One world size's measurements.
#[derive(Debug, Clone, Copy)]
struct Point {
    world: u32,
    init: Duration,
    rss_per_worker_mib: f64,
    all_to_all: Duration,
    rss_per_connection_kib: f64,
    shutdown: Duration,
}

fn rss_mib() -> Result<f64> {
    crate::ours::rss_mib(std::process::id())
}

async fn measure(world: u32) -> Result<Point> {
    let port = crate::ours::free_port()?;
    let method = format!("tcp://127.0.0.1:{port}");
    let before = rss_mib()?;
    let start = Instant::now();
    let agents: Vec<RpcAgent> =
        try_join_all((0..world).map(|rank| worker::join(&method, rank, world, &[], None, false)))
            .await?;
    let init = start.elapsed();
    let joined = rss_mib()?;

    let start = Instant::now();
    try_join_all(agents.iter().map(|a| {
        let peers: Vec<u32> = (0..world).filter(|r| *r != a.rank()).collect();
        async move {
            try_join_all(peers.iter().map(|p| a.rpc_sync(*p, NOOP, args![1]))).await?;
            anyhow::Ok(())
        }
    }))
    .await
    .context("all-to-all round")?;
    let all_to_all = start.elapsed();
    let connected = rss_mib()?;
    let connections = f64::from(world) * f64::from(world - 1) / 2.0;

    let start = Instant::now();
    try_join_all(
        agents
            .iter()
            .map(|a| a.shutdown(true, Duration::from_secs(60))),
    )
    .await
    .context("graceful shutdown")?;
    let shutdown = start.elapsed();
    Ok(Point {
        world,
        init,
        rss_per_worker_mib: (joined - before) / f64::from(world),
        all_to_all,
        rss_per_connection_kib: (connected - joined) * 1024.0 / connections.max(1.0),
        shutdown,
    })
}

/// Measures one world size in this process and prints it as one line of
/// numbers (the parent's input).
pub(crate) fn run_one(world: u32, threads: usize) -> Result<()> {
    anyhow::ensure!(world >= 2, "world sizes start at 2, not {world}");
    let rt = worker::runtime(threads)?;
    let p = rt.block_on(measure(world))?;
    println!(
        "{} {} {} {} {} {}",
        p.world,
        p.init.as_secs_f64(),
        p.rss_per_worker_mib,
        p.all_to_all.as_secs_f64(),
        p.rss_per_connection_kib,
        p.shutdown.as_secs_f64()
    );
    Ok(())
}

/// Measures `world` in a fresh process, so that memory freed by a smaller
/// group measured before does not hide what this one allocates.
fn measure_in_child(world: u32, threads: usize) -> Result<Point> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["scale", "--one", "--threads", &threads.to_string()])
        .args(["--worlds", &world.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("starting the measuring process")?;
    anyhow::ensure!(out.status.success(), "the measuring process failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("unreadable measurement: {text}"))?;
    anyhow::ensure!(v.len() == 6, "unreadable measurement: {text}");
    Ok(Point {
        world,
        init: Duration::from_secs_f64(v[1]),
        rss_per_worker_mib: v[2],
        all_to_all: Duration::from_secs_f64(v[3]),
        rss_per_connection_kib: v[4],
        shutdown: Duration::from_secs_f64(v[5]),
    })
}

/// Runs the scale measurements for each of `worlds` (each in its own
/// process) and prints a table and the extrapolation to 1,000 workers.
pub(crate) fn run(worlds: &[u32], threads: usize) -> Result<()> {
    let mut points = Vec::new();
    println!(
        "| world | init_rpc, all workers | RSS per joined worker | all-to-all round | RSS per connection | graceful shutdown |"
    );
    println!("|---|---|---|---|---|---|");
    for &world in worlds {
        anyhow::ensure!(world >= 2, "world sizes start at 2, not {world}");
        eprintln!("[scale] world {world}");
        let p = measure_in_child(world, threads).with_context(|| format!("world {world}"))?;
        println!(
            "| {} | {:.1} ms | {:.2} MiB | {:.1} ms | {:.1} KiB | {:.1} ms |",
            p.world,
            p.init.as_secs_f64() * 1e3,
            p.rss_per_worker_mib,
            p.all_to_all.as_secs_f64() * 1e3,
            p.rss_per_connection_kib,
            p.shutdown.as_secs_f64() * 1e3,
        );
        points.push(p);
    }
    if let (Some(first), Some(last)) = (points.first(), points.last())
        && last.world > first.world
    {
        let per = |a: Duration, b: Duration| {
            (b.as_secs_f64() - a.as_secs_f64()) / f64::from(last.world - first.world)
        };
        let init_per_worker = per(first.init, last.init);
        let shutdown_per_worker = per(first.shutdown, last.shutdown);
        let n = 1000.0;
        println!();
        println!(
            "Extrapolated to 1,000 workers (linear in the world size from worlds {} and {}, this machine: {} cores):",
            first.world,
            last.world,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        println!(
            "  init_rpc of every worker: {:.2} s ({:.2} ms per added worker, mostly the shared store's round trips)",
            last.init.as_secs_f64() + init_per_worker * (n - f64::from(last.world)),
            init_per_worker * 1e3
        );
        println!(
            "  graceful shutdown: {:.2} s",
            last.shutdown.as_secs_f64() + shutdown_per_worker * (n - f64::from(last.world))
        );
        println!(
            "  memory per worker before any call: {:.2} MiB in-process (each separate process adds its own libtorch and wasmtime on top: see the bench's rss_idle row)",
            last.rss_per_worker_mib
        );
        println!(
            "  memory of a full mesh (every pair connected once): {:.0} MiB per worker for 999 connections ({:.1} KiB each)",
            999.0 * last.rss_per_connection_kib / 1024.0,
            last.rss_per_connection_kib
        );
    }
    Ok(())
}
