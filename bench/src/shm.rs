//! The same-host shared-memory rows (`shm_*`): echoes between two worker
//! processes of this host with shared memory on (the transport's TR-9),
//! where the main group's echo rows keep it off to measure the connection.

use std::time::Duration;

use anyhow::{Result, bail};
use tch::Device;

use crate::ours::{Children, Config, echo, free_port, worker_args};
use crate::progress::Progress;
use crate::rows::{Results, Side};
use crate::worker;

/// The rows: (id, bytes, runs in a quick run, runs in a full run).
pub(crate) const ROWS: &[(&str, usize, usize, usize)] = &[
    ("shm_echo_4k", 4 << 10, 500, 3000),
    ("shm_echo_1m", 1 << 20, 100, 500),
    ("shm_echo_64m", 64 << 20, 5, 20),
    ("shm_echo_1g", 1 << 30, 3, 5),
];

/// Measures the wanted `shm_*` rows in a group of two with shared memory on,
/// and checks that storages of 1 MiB and more did cross in shared memory.
pub(crate) async fn rows(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    progress.set("wasmrpc: starting a group of 2 workers with shared memory");
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let args = |r| {
        let mut args = worker_args(cfg, &method, r, 2);
        args.push("--shared-memory".into());
        args
    };
    let children = Children::spawn(cfg, args, 1..2, false)?;
    let agent = worker::join(&method, 0, 2, &[], None, true).await?;
    let measured = async {
        for &(row, size, nq, nf) in ROWS {
            if !cfg.wanted(row) {
                continue;
            }
            progress.set(&format!(
                "wasmrpc: echo of a {size} B tensor, shared memory"
            ));
            let before = shared_bytes(&agent);
            let stat = echo(cfg, &agent, Device::Cpu, size, nq, nf).await?;
            if size >= 1 << 20 && shared_bytes(&agent) == before {
                bail!("the echo of {size} bytes did not go through shared memory");
            }
            res.set(Side::Ours, row, stat);
        }
        Ok(())
    }
    .await;
    progress.set("wasmrpc: graceful shutdown of the group of 2");
    let shut = agent.shutdown(true, Duration::ZERO).await;
    children
        .finish(measured, shut, Duration::from_secs(30))
        .await
}

fn shared_bytes(agent: &wasmrpc::RpcAgent) -> u64 {
    agent
        .get_debug_info()
        .get("agent.shared_memory_bytes_sent")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
