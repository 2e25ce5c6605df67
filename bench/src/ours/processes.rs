//! The worker processes of a measured group: their ports, their command
//! lines, starting and killing them, and their memory.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::Config;
use super::variants::TLS_ENV;

/// A free loopback port (bound, then released).
pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Worker processes of one group; killed if still running when dropped.
pub(crate) struct Children(pub(super) Vec<Child>);

impl Children {
    /// The process ids of the workers, in rank order.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.0.iter().map(Child::id).collect()
    }

    pub(crate) fn spawn(
        cfg: &Config,
        args: impl Fn(u32) -> Vec<String>,
        ranks: std::ops::Range<u32>,
        piped: bool,
    ) -> Result<Self> {
        Self::spawn_with_env(cfg, args, ranks, piped, |_| Ok(Vec::new()))
    }

    /// As [`spawn`](Self::spawn), each rank's process with the environment
    /// variables `env(rank)` (and without TLS credentials from this
    /// process's environment unless `env` sets them).
    pub(super) fn spawn_with_env(
        cfg: &Config,
        args: impl Fn(u32) -> Vec<String>,
        ranks: std::ops::Range<u32>,
        piped: bool,
        env: impl Fn(u32) -> Result<Vec<(&'static str, String)>>,
    ) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mut children = Vec::new();
        for rank in ranks {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&cfg.log)
                .with_context(|| format!("cannot open {}", cfg.log.display()))?;
            let mut cmd = Command::new(&exe);
            crate::worker::started_by_this_bench(&mut cmd)
                .args(args(rank))
                .stderr(log);
            if let Some(window) = crate::worker::busy_poll() {
                cmd.arg("--busy-poll-us")
                    .arg(window.as_micros().to_string());
            }
            if let Some(threads) = crate::worker::intra_op_threads() {
                cmd.arg("--intra-op-threads").arg(threads.to_string());
            }
            for var in TLS_ENV {
                cmd.env_remove(var);
            }
            cmd.envs(env(rank)?);
            if piped {
                cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
            } else {
                cmd.stdin(Stdio::null()).stdout(Stdio::null());
            }
            children.push(cmd.spawn().context("could not start a worker process")?);
        }
        Ok(Children(children))
    }

    /// Waits for every child to exit, up to `timeout`.
    pub(crate) async fn wait(mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for c in &mut self.0 {
            loop {
                if let Some(status) = c.try_wait()? {
                    if !status.success() {
                        bail!("a worker process exited with {status}");
                    }
                    break;
                }
                if Instant::now() > deadline {
                    bail!("a worker process did not exit within {timeout:?}");
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Ok(())
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

pub(crate) fn worker_args(cfg: &Config, method: &str, rank: u32, world: u32) -> Vec<String> {
    let mut args = plain_worker_args(cfg, method, rank, world);
    if world == 2 {
        // The group of the per-call rows serves the seed functions'
        // plugins, in Rust and in Python.
        for plugin in [wasmrpc_plugins::SEED_FNS, wasmrpc_plugins::SEED_FNS_PY] {
            args.push("--plugin".into());
            args.push(plugin.into());
        }
    }
    args
}

/// A worker's arguments with no plugin: it serves the bench functions only.
pub(crate) fn plain_worker_args(cfg: &Config, method: &str, rank: u32, world: u32) -> Vec<String> {
    vec![
        "worker".into(),
        "--init-method".into(),
        method.into(),
        "--rank".into(),
        rank.to_string(),
        "--world-size".into(),
        world.to_string(),
        "--threads".into(),
        cfg.threads.to_string(),
    ]
}

/// Resident memory of process `pid`, in MiB.
pub(crate) fn rss_mib(pid: u32) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS line")?;
    Ok(kib / 1024.0)
}
