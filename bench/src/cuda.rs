//! The GPU row: a 64 MiB CUDA tensor echoed through a second worker process
//! with the device map `cuda:0 -> cuda:0` (responses come back through its
//! inverse), beside torch's TensorPipe agent with the same map. Every call is
//! followed by a device synchronisation on both sides, so a row times the
//! data on the GPU, not a call that only queued its copies. Without a GPU
//! both sides report n/a.

use std::time::Duration;

use anyhow::Result;
use tch::Device;

use crate::ours::{Children, Config, echo, free_port, plain_worker_args};
use crate::progress::Progress;
use crate::rows::{Results, Side};
use crate::worker;

/// The row this module measures.
pub(crate) const ROW: &str = "cuda_echo_64m";
const BYTES: usize = 64 << 20;

/// Measures [`ROW`] in a group of two of its own.
pub(crate) async fn cuda_group(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    if wasmrpc::device::cuda_device_count() == 0 {
        res.na(Side::Ours, ROW, "n/a (no GPU)");
        return Ok(());
    }
    progress.set("wasmrpc: starting a group of 2 workers, device map cuda:0 -> cuda:0");
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let children = Children::spawn(cfg, |r| plain_worker_args(cfg, &method, r, 2), 1..2, false)?;
    let mut options = worker::options(None, false);
    options.set_device_map("worker1", [(0, 0)])?;
    let agent = worker::join_with(&method, 0, 2, &[], options).await?;
    progress.set("wasmrpc: echo of a 64 MiB CUDA tensor, device map cuda:0 -> cuda:0");
    // As the torch side's echo_64m counts.
    let r = echo(cfg, &agent, Device::Cuda(0), BYTES, 5, 20).await;
    let s = agent.shutdown(true, Duration::ZERO).await;
    children.wait(Duration::from_secs(30)).await?;
    res.set(Side::Ours, ROW, r?);
    s?;
    Ok(())
}
