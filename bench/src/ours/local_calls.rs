//! The local wasm call rows: a plugin's function called in this process,
//! through the host's real plugin path, with no network.

use std::time::Instant;

use anyhow::{Result, bail};
use wasmrpc::{RpcAgent, args};

use super::{Config, timed};
use crate::progress::Progress;
use crate::rows::{Results, Side};
use crate::stats::Stat;
use crate::worker;

/// The wasm function of the local-call rows: `echo(data)` of the seed
/// functions' plugin, called with 16 bytes.
const LOCAL_ECHO: &str = "seed_fns::echo";

/// The local wasm call rows, on this process's worker, through the host's
/// real plugin path ([`RpcAgent::call_local`]: the agent's registry, the
/// per-call guest host, argument conversion) with no network:
/// - warm: a 16-byte echo on a pooled instance of the loaded plugin;
/// - cold, module cache hit: a fresh runtime whose disk cache holds the
///   compiled module; load, register, first call;
/// - cold, no module cache: a fresh runtime that compiles; load, register,
///   first call.
pub(super) async fn local_wasm_calls(
    cfg: &Config,
    agent: &RpcAgent,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let rows = [
        "wasm_local_warm",
        "wasm_local_cold_cached",
        "wasm_local_cold_uncached",
    ];
    if !rows.iter().any(|r| cfg.wanted(r)) {
        return Ok(());
    }
    let (bytes, host) = crate::worker::plugin_and_hosts(wasmrpc_plugins::SEED_FNS)?;
    let cache = tempfile::tempdir()?;
    // Fills the disk cache the cached cold row reads.
    let warm_host = host(Some(cache.path().to_path_buf()))?;
    warm_host.register(
        &worker::load_plugin(&warm_host, &bytes).await?,
        agent.registry(),
    );
    let echo = || agent.call_local(LOCAL_ECHO, args![wasmrpc::Value::Bytes(vec![7; 16])]);
    if echo().await?.value != wasmrpc::Value::Bytes(vec![7; 16]) {
        bail!("{LOCAL_ECHO} returned something else than its 16 bytes");
    }
    if cfg.wanted("wasm_local_warm") {
        progress.set("wasmrpc: local wasm call, warm");
        let n = cfg.n(20_000, 200_000);
        let s = timed(n, n / 10, echo).await?;
        res.set(Side::Ours, "wasm_local_warm", Stat::latencies(&s));
    }
    for (row, cached) in [
        ("wasm_local_cold_cached", true),
        ("wasm_local_cold_uncached", false),
    ] {
        if !cfg.wanted(row) {
            continue;
        }
        progress.set(&format!("wasmrpc: local wasm call, {}", &row[11..]));
        let n = cfg.n(5, 20);
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let dir = cached.then(|| cache.path().to_path_buf());
            let t = Instant::now();
            let fresh = host(dir)?;
            fresh.register(
                &worker::load_plugin(&fresh, &bytes).await?,
                agent.registry(),
            );
            echo().await?;
            samples.push(t.elapsed());
        }
        res.set(Side::Ours, row, Stat::latencies(&samples));
    }
    // Later rows call through the worker's own plugin host again.
    warm_host.register(
        &worker::load_plugin(&warm_host, &bytes).await?,
        agent.registry(),
    );
    Ok(())
}
