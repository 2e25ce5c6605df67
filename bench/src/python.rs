//! The Python plugin's cold-start rows: a fresh plugin host loads the
//! Python seed plugin (`plugins/python/seed-fns-py`, a component of ~19 MB),
//! registers it and makes the first call, on this process's worker with no
//! network ([`RpcAgent::call_local`]), with the compiled component in the
//! module cache (`py_cold_cached`) and without (`py_cold_uncached`: wasmtime
//! compiles it).

use std::time::Instant;

use anyhow::{Result, bail};
use wasmrpc::{RpcAgent, args};

use crate::ours::Config;
use crate::progress::Progress;
use crate::rows::{Results, Side};
use crate::stats::Stat;

/// The function the first call runs.
const FIRST_CALL: &str = "seed_fns_py::light_rpc";

/// Measures the selected cold-start rows.
pub(crate) async fn cold_starts(
    cfg: &Config,
    agent: &RpcAgent,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    if !cfg.wanted("py_cold_cached") && !cfg.wanted("py_cold_uncached") {
        return Ok(());
    }
    let (bytes, host) = crate::worker::plugin_and_hosts(wasmrpc_plugins::SEED_FNS_PY)?;
    let cache = tempfile::tempdir()?;
    // Fills the cache the cached row reads (one compilation, not timed).
    progress.set("wasmrpc: compiling the Python plugin once for the cache");
    let warm = host(Some(cache.path().to_path_buf()))?;
    drop(crate::worker::load_plugin(&warm, &bytes).await?);
    for (row, cached, quick, full) in [
        ("py_cold_cached", true, 5, 20),
        ("py_cold_uncached", false, 1, 3),
    ] {
        if !cfg.wanted(row) {
            continue;
        }
        progress.set(&format!("wasmrpc: Python plugin cold start, {}", &row[8..]));
        let mut samples = Vec::new();
        for _ in 0..cfg.n(quick, full) {
            let dir = cached.then(|| cache.path().to_path_buf());
            let t = Instant::now();
            let fresh = host(dir)?;
            fresh.register(
                &crate::worker::load_plugin(&fresh, &bytes).await?,
                agent.registry(),
            );
            let first = agent.call_local(FIRST_CALL, args![]).await?;
            samples.push(t.elapsed());
            if first.as_int()? != 0 {
                bail!("{FIRST_CALL} returned {first:?}");
            }
        }
        res.set(Side::Ours, row, Stat::latencies(&samples));
    }
    Ok(())
}
