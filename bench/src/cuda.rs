//! The GPU rows: a 64 MiB CUDA tensor echoed through a second worker
//! process on this host with the device map `cuda:0 -> cuda:0` (responses
//! come back through its inverse), beside torch's TensorPipe agent with the
//! same map: `cuda_echo_64m` with shared memory on (the storage crosses in
//! CUDA segments, SHM-6, as TensorPipe's CUDA IPC channel moves it), and
//! `cuda_echo_64m_host` with it off (through host memory and the socket,
//! the path between hosts). Every call is followed by a device
//! synchronisation on both sides, so a row times the data on the GPU, not a
//! call that only queued its copies. Without a GPU both sides report n/a.

use std::time::Duration;

use anyhow::{Result, bail};
use tch::Device;

use crate::ours::{Children, Config, echo, free_port, plain_worker_args};
use crate::progress::Progress;
use crate::rows::{Results, Side};
use crate::stats::Stat;
use crate::worker;

/// The rows this module measures: the name, and whether shared memory is
/// on.
pub(crate) const ROWS: [(&str, bool); 2] = [("cuda_echo_64m", true), ("cuda_echo_64m_host", false)];
const BYTES: usize = 64 << 20;

/// Measures the wanted [`ROWS`], each in a group of two of its own.
pub(crate) async fn cuda_rows(cfg: &Config, res: &mut Results, progress: &Progress) {
    for (row, shared_memory) in ROWS {
        if !cfg.wanted(row) {
            continue;
        }
        if wasmrpc::device::cuda_device_count() == 0 {
            res.na(Side::Ours, row, "n/a (no GPU)");
            continue;
        }
        match cuda_group(cfg, shared_memory, progress).await {
            Ok(stat) => res.set(Side::Ours, row, stat),
            Err(e) => res.na(Side::Ours, row, format!("n/a (failed: {e:#})")),
        }
    }
}

async fn cuda_group(cfg: &Config, shared_memory: bool, progress: &Progress) -> Result<Stat> {
    let how = if shared_memory {
        "shared memory on"
    } else {
        "through host memory"
    };
    progress.set(&format!(
        "wasmrpc: starting a group of 2 workers, device map cuda:0 -> cuda:0, {how}"
    ));
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let args = |r| {
        let mut args = plain_worker_args(cfg, &method, r, 2);
        if shared_memory {
            args.push("--shared-memory".into());
        }
        args
    };
    let children = Children::spawn(cfg, args, 1..2, false)?;
    let mut options = worker::options(None, shared_memory);
    options.set_device_map("worker1", [(0, 0)])?;
    let agent = worker::join_with(&method, 0, 2, &[], options).await?;
    progress.set(&format!(
        "wasmrpc: echo of a 64 MiB CUDA tensor, device map cuda:0 -> cuda:0, {how}"
    ));
    // As the torch side's echo_64m counts.
    let r = echo(cfg, &agent, Device::Cuda(0), BYTES, 5, 20).await;
    let in_segments = agent
        .get_debug_info()
        .get("agent.shared_memory_cuda_bytes_sent")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let s = agent.shutdown(true, Duration::ZERO).await;
    let stat = children.finish(r, s, Duration::from_secs(30)).await?;
    if shared_memory && in_segments == 0 {
        bail!("the echo did not go through CUDA segments");
    }
    if !shared_memory && in_segments != 0 {
        bail!("the echo went through CUDA segments with shared memory off");
    }
    Ok(stat)
}
