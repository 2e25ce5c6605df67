//! `wasmrpc launch`: a local cluster in one command, in the manner of
//! `torchrun --standalone`. The launcher hosts the store; each worker is a
//! child process running `wasmrpc worker`, its output prefixed with its
//! name; worker0 runs the entry function. When one worker fails, the others
//! are stopped and the launcher exits non-zero.

use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tracing::{error, info};
use wasmrpc::store::TcpStoreServer;

use super::parse_seconds;

/// Flags of `wasmrpc launch`.
#[derive(clap::Args, Debug)]
pub(crate) struct LaunchArgs {
    /// How many workers to start (named worker0 .. worker<N-1>).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    nproc: u32,
    /// The registered function worker0 runs once every worker has joined
    /// (e.g. `plugin::function`); without it the cluster starts, checks that
    /// every worker answers, and shuts down.
    #[arg(long)]
    entry: Option<String>,
    /// Run the entry function on this worker (worker0 calls it there)
    /// [default: worker0].
    #[arg(long, value_name = "WORKER", requires = "entry")]
    entry_on: Option<String>,
    /// Every worker loads the wasm plugins in this folder (or this `.wasm`
    /// file) and serves their functions as `plugin::function`. Repeatable.
    #[arg(long = "plugins", value_name = "DIR")]
    plugins: Vec<PathBuf>,
    /// The port of the store the launcher hosts (0: any free port).
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// The default timeout of calls, in seconds (0: none).
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    rpc_timeout: Duration,
    /// Arguments of the entry function: integers, floats, `true`/`false`,
    /// or strings.
    #[arg(last = true)]
    entry_args: Vec<String>,
}

/// Runs the cluster to completion.
pub(crate) async fn run(args: LaunchArgs) -> Result<ExitCode> {
    let server = Arc::new(
        TcpStoreServer::bind(("127.0.0.1", args.master_port))
            .await
            .context("could not host the store")?,
    );
    let port = server.local_addr().port();
    let exe = std::env::current_exe().context("cannot find the wasmrpc executable")?;
    info!(
        "launching {} workers; store on 127.0.0.1:{port}",
        args.nproc
    );

    // Workers may run elsewhere than here one day; give them absolute paths.
    let plugins = args
        .plugins
        .iter()
        .map(|p| std::path::absolute(p).with_context(|| format!("bad plugin path {}", p.display())))
        .collect::<Result<Vec<_>>>()?;

    let mut children: Vec<(String, Child)> = Vec::new();
    let mut output = JoinSet::new();
    for rank in 0..args.nproc {
        let name = format!("worker{rank}");
        let mut cmd = Command::new(&exe);
        cmd.arg("worker")
            .args(["--name", &name])
            .args(["--rank", &rank.to_string()])
            .args(["--world-size", &args.nproc.to_string()])
            .args(["--init-method", &format!("tcp://127.0.0.1:{port}")])
            .args(["--rpc-timeout", &args.rpc_timeout.as_secs_f64().to_string()])
            // The launcher hosts the store, as torchrun's agent does.
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for dir in &plugins {
            cmd.arg("--plugins").arg(dir);
        }
        if rank == 0 {
            match &args.entry {
                Some(entry) => {
                    cmd.args(["--entry", entry]);
                    if let Some(on) = &args.entry_on {
                        cmd.args(["--entry-on", on]);
                    }
                    cmd.arg("--").args(&args.entry_args);
                }
                None => {
                    cmd.arg("--ping-all");
                }
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("could not start {name}"))?;
        if let Some(out) = child.stdout.take() {
            output.spawn(prefix_lines(name.clone(), out, false));
        }
        if let Some(err) = child.stderr.take() {
            output.spawn(prefix_lines(name.clone(), err, true));
        }
        children.push((name, child));
    }

    let result = supervise(children).await;
    // Drain what the workers printed before reporting.
    while output.join_next().await.is_some() {}
    drop(server);
    match result {
        Ok(()) => {
            info!("all {} workers finished", args.nproc);
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Err(e),
    }
}

/// How long the other workers get, once one has failed, to report what they
/// saw of the failure (e.g. a call to the dead worker failing) and exit on
/// their own, before they are stopped.
const GRACE: Duration = Duration::from_secs(3);

/// Waits for every child; the first failure stops the rest (after
/// [`GRACE`]).
async fn supervise(children: Vec<(String, Child)>) -> Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let mut waits = JoinSet::new();
    for (name, mut child) in children {
        let mut stop = stop_rx.clone();
        waits.spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                _ = async { let _ = stop.wait_for(|stop| *stop).await; } => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            (name, status)
        });
    }
    let mut failure = None;
    while let Some(joined) = waits.join_next().await {
        let (name, status) = joined.context("a worker's supervisor task failed")?;
        let status = status.with_context(|| format!("could not wait for {name}"))?;
        if !status.success() && failure.is_none() {
            error!(
                "{name} failed ({status}); stopping the other workers in {} s unless they exit",
                GRACE.as_secs()
            );
            failure = Some(format!("{name} failed ({status})"));
            let stop_tx = stop_tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(GRACE).await;
                let _ = stop_tx.send(true);
            });
        }
    }
    match failure {
        Some(failure) => bail!(failure),
        None => Ok(()),
    }
}

/// Copies a child's output line by line, prefixed with its name.
async fn prefix_lines(name: String, stream: impl AsyncRead + Unpin, stderr: bool) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if stderr {
            eprintln!("[{name}] {line}");
        } else {
            println!("[{name}] {line}");
        }
    }
}
