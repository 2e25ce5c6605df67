//! Our side: groups of worker processes measured from rank 0, which is this
//! process (as on the torch side, where rank 0 of the spawned group
//! measures). The callees are `wasmrpc-bench worker` processes.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::ChildStdin;
use std::time::{Duration, Instant};
use wasmrpc::prelude::*;

use anyhow::{Context, Result, bail};
use tch::{Device, Kind, Tensor};
use wasmrpc::{Payload, RpcAgent, args};

use crate::progress::Progress;
use crate::rows::{Results, Side, wanted};
use crate::stats::Stat;
use crate::worker::{self, ECHO, LOAD, NOOP, off_runtime};

mod autograd;
pub(crate) use autograd::{StepPhases, autograd_step, forward_in_context};
mod floors;
pub(crate) use floors::{as_printed, median_round};
mod local_calls;
mod processes;
mod python_noop;
mod variants;

pub(crate) use processes::{
    Children, free_port, plain_worker_args, rss_mib, worker_args, worker_args_serving,
};
pub(crate) use variants::{
    METRICS_ROWS, SAMPLED_ROWS, TLS_ROWS, TRACED_ROWS, metrics_rows, tls_rows, traced_rows,
};

/// What our side needs to know.
pub(crate) struct Config {
    /// Fewer repetitions.
    pub(crate) quick: bool,
    /// `--only` filters.
    pub(crate) only: Vec<String>,
    /// Calls before the second memory reading.
    pub(crate) memory_calls: u64,
    /// Tokio threads of each worker process and of this process.
    pub(crate) threads: usize,
    /// Where worker processes' stderr goes.
    pub(crate) log: PathBuf,
}

impl Config {
    pub(crate) fn wanted(&self, id: &str) -> bool {
        wanted(&self.only, id)
    }

    pub(crate) fn n(&self, quick: usize, full: usize) -> usize {
        if self.quick { quick } else { full }
    }
}

pub(crate) async fn timed<F, Fut>(n: usize, warmup: usize, mut call: F) -> Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = wasmrpc::Result<Payload>>,
{
    for _ in 0..warmup {
        call().await?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        call().await?;
        samples.push(t.elapsed());
    }
    Ok(samples)
}

/// `n` calls of `call` (after `warmup`), each right after an untimed call
/// of `before`: `call` as it runs when a round trip has just left this
/// thread's caches cold, the regime a callee woken for each call is in.
/// Run beside a block of `call` alone, it shows what that regime adds to a
/// function's own work (an `aten::add` took 13-19 µs after a no-op's round
/// trip against 5 µs after itself, 2026-11-30).
pub(crate) async fn timed_after<B, BFut, F, Fut>(
    n: usize,
    warmup: usize,
    mut before: B,
    mut call: F,
) -> Result<Vec<Duration>>
where
    B: FnMut() -> BFut,
    BFut: std::future::Future<Output = wasmrpc::Result<Payload>>,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = wasmrpc::Result<Payload>>,
{
    let mut samples = Vec::with_capacity(n);
    for i in 0..warmup + n {
        before().await?;
        let t = Instant::now();
        call().await?;
        if i >= warmup {
            samples.push(t.elapsed());
        }
    }
    Ok(samples)
}

/// `n` no-op calls to `dst` with `window` in flight; returns the time taken.
pub(crate) async fn windowed(
    agent: &RpcAgent,
    dst: &str,
    n: u64,
    window: usize,
) -> Result<Duration> {
    let start = Instant::now();
    let mut queue = VecDeque::with_capacity(window);
    for i in 0..n {
        queue.push_back(agent.rpc_async(dst, NOOP, args![i as i64]));
        if queue.len() >= window
            && let Some(f) = queue.pop_front()
        {
            f.wait().await?;
        }
    }
    while let Some(f) = queue.pop_front() {
        f.wait().await?;
    }
    Ok(start.elapsed())
}

/// The rows measured in a group of two: rank 0 here, rank 1 a process.
pub(crate) async fn main_group(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    progress.set("wasmrpc: starting a group of 2 workers");
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let children = Children::spawn(cfg, |r| worker_args(cfg, &method, r, 2), 1..2, false)?;
    let pid = children.procs[0].id();
    let agent = worker::join(&method, 0, 2, &[], None, false).await?;
    let r = measure(cfg, &agent, pid, res, progress).await;
    progress.set("wasmrpc: graceful shutdown of the group of 2");
    let s = agent.shutdown(true, Duration::ZERO).await;
    children.finish(r, s, Duration::from_secs(30)).await?;
    if cfg.wanted("rtt_noop_py") {
        python_noop::python_noop(cfg, res, progress).await?;
    }
    if cfg.wanted("rss_idle_compiled")
        && let Err(e) = idle_after_compiling(cfg, res, progress).await
    {
        res.na(
            Side::Ours,
            "rss_idle_compiled",
            format!("n/a (failed: {e:#})"),
        );
    }
    Ok(())
}

/// `rss_idle` for a worker that compiled its plugins, as every worker of
/// a machine's first start does: the same group, its worker given an empty
/// module cache of its own.
async fn idle_after_compiling(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    progress.set("wasmrpc: a worker that compiles its plugins (an empty module cache)");
    let cache = tempfile::tempdir()?;
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let children = Children::spawn_with_env(
        cfg,
        |r| worker_args(cfg, &method, r, 2),
        1..2,
        false,
        |_| {
            Ok(vec![(
                wasmrpc::CACHE_DIR_ENV,
                cache.path().display().to_string(),
            )])
        },
    )?;
    let pid = children.procs[0].id();
    let agent = worker::join(&method, 0, 2, &[], None, false).await?;
    let r = async {
        for i in 0..50 {
            agent.rpc_sync("worker1", NOOP, args![i]).await?;
        }
        progress.set("wasmrpc: resident memory of the idle worker that compiled");
        res.set(
            Side::Ours,
            "rss_idle_compiled",
            Stat::value(rss_mib(pid)?, 1),
        );
        anyhow::Ok(())
    }
    .await;
    let s = agent.shutdown(true, Duration::ZERO).await;
    children.finish(r, s, Duration::from_secs(30)).await
}

async fn measure(
    cfg: &Config,
    agent: &RpcAgent,
    pid: u32,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let dst = "worker1";
    for i in 0..50 {
        agent.rpc_sync(dst, NOOP, args![i]).await?;
    }

    if cfg.wanted("rss_idle") || cfg.wanted("rss_after_calls") {
        progress.set("wasmrpc: resident memory of the idle worker");
        res.set(Side::Ours, "rss_idle", Stat::value(rss_mib(pid)?, 1));
        let n = cfg.memory_calls;
        progress.set(&format!("wasmrpc: {n} calls, then resident memory again"));
        let took = windowed(agent, dst, n, 128).await?;
        res.set(Side::Ours, "rss_after_calls", Stat::value(rss_mib(pid)?, n));
        res.note(
            Side::Ours,
            "rss_after_calls",
            format!("N={n} ({:.0} calls/s)", n as f64 / took.as_secs_f64()),
        );
    }

    if cfg.wanted("rtt_noop_native") || cfg.wanted("rtt_aten_add") {
        floors::small_calls(cfg, agent, res, progress).await?;
    }
    if cfg.wanted("rtt_noop_wasm") {
        progress.set("wasmrpc: round trip of a no-op (wasm function)");
        let call = || agent.rpc_sync(dst, worker::WASM_IDENTITY, args![1]);
        match call().await {
            Err(e) => res.na(
                Side::Ours,
                "rtt_noop_wasm",
                format!("n/a (not available: {})", e.message()),
            ),
            Ok(p) => {
                if p.as_int()? != 1 {
                    bail!("{} returned {p:?}", worker::WASM_IDENTITY);
                }
                let n = cfg.n(500, 5000);
                let s = timed(n, n / 10, call).await?;
                res.set(Side::Ours, "rtt_noop_wasm", Stat::latencies(&s));
            }
        }
    }

    plugin_round_trips(cfg, agent, res, progress).await?;

    if cfg.wanted("async_128") {
        progress.set("wasmrpc: async calls with 128 in flight");
        res.set(Side::Ours, "async_128", async_128(cfg, agent).await?);
    }

    for &(key, size, nq, nf) in crate::limit::ECHO {
        let row = &key["raw_".len()..];
        if !cfg.wanted(row) {
            continue;
        }
        progress.set(&format!("wasmrpc: echo of a {size} B tensor"));
        res.set(
            Side::Ours,
            row,
            echo(cfg, agent, Device::Cpu, size, nq, nf).await?,
        );
    }

    local_calls::local_wasm_calls(cfg, agent, res, progress).await?;
    crate::python::cold_starts(cfg, agent, res, progress).await?;

    if cfg.wanted("remote_to_here") {
        progress.set("wasmrpc: remote() + to_here()");
        let n = cfg.n(300, 2000);
        let s = timed(n, n / 10, || async {
            agent
                .remote(dst, NOOP, args![1])?
                .to_here(agent, None)
                .await
        })
        .await?;
        res.set(Side::Ours, "remote_to_here", Stat::latencies(&s));
    }

    autograd::steps(cfg, agent, res, progress).await?;
    Ok(())
}

/// Round trips to plugin functions on `worker1`: a tensor add in the Rust
/// and in the Python seed plugin (torch's row: a Python function `a + b`).
/// The Python no-op has a group of its own (`python_noop`).
async fn plugin_round_trips(
    cfg: &Config,
    agent: &RpcAgent,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let dst = "worker1";
    for (row, function, what) in [
        ("rtt_add_wasm", "seed_fns::my_tensor_function", "Rust"),
        ("rtt_add_py", "seed_fns_py::my_tensor_function", "Python"),
    ] {
        if !cfg.wanted(row) {
            continue;
        }
        progress.set(&format!(
            "wasmrpc: round trip of a tensor add ({what} plugin function)"
        ));
        let (a, b) = (
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
        );
        let call = || agent.rpc_sync(dst, function, args![a.shallow_clone(), b.shallow_clone()]);
        let sum = call().await?.as_tensor()?;
        if sum.double_value(&[0]) != 2.0 {
            bail!("{function} returned {sum}");
        }
        let n = cfg.n(500, 5000);
        let s = timed(n, n / 10, call).await?;
        res.set(Side::Ours, row, Stat::latencies(&s));
    }
    Ok(())
}

/// Round trips of a no-op to `worker1`.
pub(super) async fn rtt_noop(cfg: &Config, agent: &RpcAgent) -> Result<Stat> {
    let n = cfg.n(500, 5000);
    let s = timed(n, n / 10, || agent.rpc_sync("worker1", NOOP, args![1])).await?;
    Ok(Stat::latencies(&s))
}

/// No-op calls to `worker1` with 128 in flight, in calls per second.
pub(super) async fn async_128(cfg: &Config, agent: &RpcAgent) -> Result<Stat> {
    // Five blocks; the median block's rate, so a burst of other work on
    // the machine moves one block, not the result.
    let n = cfg.n(30_000, 200_000) as u64;
    windowed(agent, "worker1", n / 10, 128).await?;
    let mut rates = Vec::new();
    for _ in 0..5 {
        let took = windowed(agent, "worker1", n / 5, 128).await?;
        rates.push((n / 5) as f64 / took.as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(Stat::value(rates[2], n))
}

/// Echoes of a `size`-byte tensor on `device` through `worker1` (`nq` or
/// `nf` of them), after checking one comes back equal and on `device`. On a
/// GPU every call is followed by a device synchronisation, so a sample times
/// the data in place, not a call that only queued its copies.
pub(crate) async fn echo(
    cfg: &Config,
    agent: &RpcAgent,
    device: Device,
    size: usize,
    nq: usize,
    nf: usize,
) -> Result<Stat> {
    // Making and checking a tensor of up to 1 GiB takes seconds of CPU: off
    // the runtime, so the caller's heartbeats keep going out (LIVE-2).
    let t = off_runtime(move || Tensor::rand([(size / 4) as i64], (Kind::Float, device))).await?;
    let call = || async {
        let back = agent
            .rpc_sync("worker1", ECHO, args![t.shallow_clone()])
            .await;
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
        back
    };
    let back = call().await?.as_tensor()?;
    let (got, sent) = (back.shallow_clone(), t.shallow_clone());
    if back.device() != device || !off_runtime(move || got.equal(&sent)).await? {
        bail!(
            "echo of {size} bytes returned a different tensor (on {:?})",
            back.device()
        );
    }
    let n = cfg.n(nq, nf);
    let s = timed(n, (n / 10).max(1), call).await?;
    // Freeing a GiB of tensor memory takes a tenth of a second and more:
    // off the runtime too.
    off_runtime(move || drop((t, back))).await?;
    Ok(Stat::latencies(&s))
}

/// All-to-all: every worker of a group of `world` calls every other, 64
/// calls in flight per worker, for a few seconds; total calls per second.
pub(crate) async fn all_to_all(
    cfg: &Config,
    world: u32,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let row = format!("all_to_all_w{world}");
    let secs = if cfg.quick { 1.0 } else { 3.0 };
    progress.set(&format!("wasmrpc: all-to-all, world {world}, {secs:.0} s"));
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let children = Children::spawn(
        cfg,
        |r| worker_args(cfg, &method, r, world),
        1..world,
        false,
    )?;
    let agent = worker::join(&method, 0, world, &[], None, false).await?;
    let run = |secs: f64| {
        let agent = agent.clone();
        async move {
            let remote: Vec<_> = (1..world)
                .map(|r| agent.rpc_async(r, LOAD, args![secs, 64i64, world]))
                .collect();
            let local = worker::load(&agent, world, Duration::from_secs_f64(secs), 64).await?;
            let mut total = local.0;
            let mut longest = local.1.as_secs_f64();
            for p in wasmrpc::wait_all(&remote).await? {
                let items = p.items()?;
                total += items[0].as_int()? as u64;
                longest = longest.max(items[1].as_float()?);
            }
            anyhow::Ok((total, longest))
        }
    };
    let r = async {
        run(0.3).await?; // every connection opened and warm
        run(secs).await
    }
    .await;
    let s = agent.shutdown(true, Duration::ZERO).await;
    let (total, took) = children.finish(r, s, Duration::from_secs(30)).await?;
    res.set(Side::Ours, &row, Stat::value(total as f64 / took, total));
    Ok(())
}

/// `init_rpc` + graceful shutdown in a group of `world` fresh processes,
/// started together on cue; time from the first start to the last end.
pub(crate) fn init(cfg: &Config, world: u32, res: &mut Results, progress: &Progress) -> Result<()> {
    let reps = cfg.n(1, 3);
    progress.set(&format!(
        "wasmrpc: init_rpc + shutdown, world {world} ({reps} runs)"
    ));
    let methods: Vec<String> = (0..reps)
        .map(|_| free_port().map(|p| format!("tcp://127.0.0.1:{p}")))
        .collect::<Result<_>>()?;
    let list = methods.join(",");
    let mut children = Children::spawn(
        cfg,
        |r| {
            vec![
                "init-worker".into(),
                "--init-methods".into(),
                list.clone(),
                "--rank".into(),
                r.to_string(),
                "--world-size".into(),
                world.to_string(),
                "--threads".into(),
                cfg.threads.to_string(),
            ]
        },
        0..world,
        true,
    )?;
    let mut ios: Vec<(ChildStdin, BufReader<std::process::ChildStdout>)> = Vec::new();
    for c in &mut children.procs {
        let stdin = c.stdin.take().context("init worker stdin")?;
        let stdout = BufReader::new(c.stdout.take().context("init worker stdout")?);
        ios.push((stdin, stdout));
    }
    let read_line = |r: &mut BufReader<std::process::ChildStdout>| -> Result<String> {
        let mut l = String::new();
        if r.read_line(&mut l)? == 0 {
            bail!("an init worker exited early (see {})", cfg.log.display());
        }
        Ok(l)
    };
    for (_, out) in &mut ios {
        let l = read_line(out)?;
        if l.trim() != "ready" {
            bail!("init worker said {l:?}");
        }
    }
    let mut samples = Vec::new();
    for _ in 0..reps {
        for (inp, _) in &mut ios {
            inp.write_all(b"go\n")?;
            inp.flush()?;
        }
        let (mut first, mut last) = (u128::MAX, 0u128);
        for (_, out) in &mut ios {
            let l = read_line(out)?;
            let parts: Vec<u128> = l
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            if parts.len() != 2 {
                bail!("init worker said {l:?}");
            }
            first = first.min(parts[0]);
            last = last.max(parts[1]);
        }
        samples.push(Duration::from_micros((last - first) as u64));
    }
    drop(ios);
    for c in &mut children.procs {
        c.wait()?;
    }
    res.set(
        Side::Ours,
        &format!("init_w{world}"),
        Stat::latencies(&samples),
    );
    Ok(())
}

/// The path of the workspace root (where `target/` and `bench/` are).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}
