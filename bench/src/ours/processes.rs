//! The worker processes of a measured group: their ports, their command
//! lines, starting and killing them, and their memory.

use std::path::{Path, PathBuf};
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
pub(crate) struct Children {
    pub(super) procs: Vec<Child>,
    /// The file their standard error goes to.
    log: PathBuf,
}

/// How many of a worker log's last lines an error about a worker quotes.
const LOG_LINES_QUOTED: usize = 5;

impl Children {
    /// The process ids of the workers, in rank order.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(Child::id).collect()
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
        Ok(Children {
            procs: children,
            log: cfg.log.clone(),
        })
    }

    /// Waits for the children of a group whose measurement gave
    /// `measured` and whose graceful shutdown gave `shutdown`, and reports
    /// the first error: the measurement's (followed by a worker's failure,
    /// since a measurement that failed often made a worker fail too, or
    /// was failed by it), then the shutdown's, then the workers'.
    pub(crate) async fn finish<T>(
        self,
        measured: Result<T>,
        shutdown: wasmrpc::Result<()>,
        timeout: Duration,
    ) -> Result<T> {
        let exited = self.wait(timeout).await;
        match (measured, exited) {
            (Err(e), Err(w)) => Err(anyhow::anyhow!("{e:#}; and {w:#}")),
            (measured, exited) => {
                let value = measured?;
                shutdown?;
                exited?;
                Ok(value)
            }
        }
    }

    /// Waits for every child to exit, up to `timeout`; a worker that
    /// failed is reported with the last lines of the workers' log.
    pub(crate) async fn wait(mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for c in &mut self.procs {
            loop {
                if let Some(status) = c.try_wait()? {
                    if !status.success() {
                        bail!(
                            "a worker process exited with {status} ({})",
                            log_tail(&self.log)
                        );
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

/// The last lines of the workers' log at `path`, for an error message.
fn log_tail(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if lines.is_empty() {
                return format!("its log {} is empty", path.display());
            }
            let tail = &lines[lines.len().saturating_sub(LOG_LINES_QUOTED)..];
            format!(
                "the end of its log {}: {}",
                path.display(),
                tail.join(" | ")
            )
        }
        Err(e) => format!("its log {} cannot be read: {e}", path.display()),
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.procs {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

pub(crate) fn worker_args(cfg: &Config, method: &str, rank: u32, world: u32) -> Vec<String> {
    // The group of the per-call rows serves the seed functions' plugins,
    // in Rust and in Python.
    let plugins: &[&str] = if world == 2 {
        &crate::worker::ROW_PLUGINS
    } else {
        &[]
    };
    worker_args_serving(cfg, method, rank, world, plugins)
}

/// A worker's arguments serving `plugins` beside the bench functions.
pub(crate) fn worker_args_serving(
    cfg: &Config,
    method: &str,
    rank: u32,
    world: u32,
    plugins: &[&str],
) -> Vec<String> {
    let mut args = plain_worker_args(cfg, method, rank, world);
    for plugin in plugins {
        args.push("--plugin".into());
        args.push((*plugin).into());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn log_with(lines: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let log = dir.path().join("workers.log");
        std::fs::write(&log, lines).expect("the log written");
        (dir, log)
    }

    fn exiting(code: i32, log: &Path) -> Children {
        let child = Command::new("sh")
            .args(["-c", &format!("exit {code}")])
            .spawn()
            .expect("sh runs");
        Children {
            procs: vec![child],
            log: log.to_path_buf(),
        }
    }

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
            .block_on(f)
    }

    #[test]
    fn a_worker_that_failed_is_reported_with_the_end_of_its_log() {
        let (_dir, log) = log_with("one\ntwo\n\nthree\nfour\nfive\nsix: the cause\n\n");
        let err = run(exiting(1, &log).wait(Duration::from_secs(10))).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("exited with exit status: 1"), "{text}");
        assert!(
            text.contains("two | three | four | five | six: the cause"),
            "{text}"
        );
        assert!(!text.contains("one"), "only the last lines: {text}");
    }

    #[test]
    fn a_failed_measurement_is_reported_first_and_the_worker_failure_after_it() {
        let (_dir, log) = log_with("wasmrpc-bench: out of tensor memory\n");
        let measured: Result<u32> = Err(anyhow::anyhow!("the echo of 1073741824 bytes failed"));
        let err =
            run(exiting(1, &log).finish(measured, Ok(()), Duration::from_secs(10))).unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.starts_with("the echo of 1073741824 bytes failed"),
            "{text}"
        );
        assert!(text.contains("out of tensor memory"), "{text}");
    }

    #[test]
    fn a_measurement_and_workers_that_succeeded_give_the_measured_value() {
        let (_dir, log) = log_with("");
        let value = run(exiting(0, &log).finish(Ok(7), Ok(()), Duration::from_secs(10)));
        assert_eq!(value.expect("no error"), 7);
        let err = run(exiting(2, &log).finish(Ok(7), Ok(()), Duration::from_secs(10))).unwrap_err();
        assert!(format!("{err:#}").contains("its log"), "{err:#}");
    }
}
