//! `wasmrpc launch`: a local cluster in one command, in the manner of
//! `torchrun --standalone`. The launcher hosts the store; each worker is a
//! child process running `wasmrpc worker`, its output prefixed with its
//! name; worker0 runs the entry function. When one worker fails, the others
//! are stopped and the launcher exits non-zero, or, with `--max-restarts
//! N`, the whole group starts again (torchrun's way: a new store, every
//! worker anew, `TORCHELASTIC_RESTART_COUNT` in their environment) so the
//! entry can resume from its last checkpoint.
//!
//! Progress reports of the workers' plugins ([`wasmrpc::progress`]) arrive
//! as event lines on their stderr; [`Progress`] draws them as one bar per
//! worker and task when stderr is a terminal, and as plain lines (about
//! five per task) otherwise. `--result FILE` has worker0 write the entry's result
//! there as JSON.
//!
//! Credentials: the launcher makes an ephemeral cluster CA in memory and
//! issues each worker a certificate naming it, plus a random cluster secret
//! (or the operator's WASMRPC_CLUSTER_SECRET), and hands each child its own
//! in its environment (`WASMRPC_TLS_*_PEM`, `WASMRPC_CLUSTER_SECRET`),
//! which only this user can read: never on the command line (every local
//! user can read it in /proc), never in a file, never in the store. A local
//! cluster thus runs TLS with mutual authentication with no configuration.
//! With `--cluster-ca DIR` the certificates come from the operator's CA
//! instead (and the secret only from WASMRPC_CLUSTER_SECRET), so that tools
//! holding a certificate of that CA can join the group.
//!
//! Deployments (`--accept-plugin-deployment`, which needs `--cluster-ca`):
//! the workers form a dynamic group instead of a static one, since only a
//! dynamic group takes a member that was not counted at the start (`wasmrpc
//! plugin deploy` joins as one). The first waits until all have joined
//! (`wasmrpc worker --wait-for-workers`) before the entry; once the entry's
//! worker has finished, the launcher asks the others to stop (SIGTERM, a
//! graceful leave). Without an entry, every worker serves until the
//! launcher is interrupted.

use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tracing::{error, info};
use wasmrpc::progress::{EVENTS_ENV, ProgressEvent};
use wasmrpc::store::TcpStoreServer;

use super::parse_seconds;

mod progress;

use progress::Progress;

/// Flags of `wasmrpc launch`.
#[derive(clap::Args, Debug)]
pub(crate) struct LaunchArgs {
    /// How many workers to start (named worker0 .. worker<N-1> unless
    /// `--names` names them) [default: 2, or as many as `--names` has].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    nproc: Option<u32>,
    /// The workers' names, comma-separated, in rank order (`--names
    /// ps,trainer_1,trainer_2`): the first runs the entry. Each must be
    /// unique, start with a letter and hold letters, digits, `_` or `-`.
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    names: Vec<String>,
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
    /// Serve each worker's metrics (Prometheus' text format) on
    /// `http://127.0.0.1:PORT+RANK/metrics`; 0 gives each worker a free
    /// port, which it logs ("metrics on http://...").
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
    /// Every worker exports its spans (one tree per call across the
    /// group) to the OpenTelemetry collector at this OTLP/HTTP URL, on
    /// loopback (e.g. `http://127.0.0.1:4318`); off by default.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// With `--otlp-endpoint`: the share of traces recorded, 0 to 1 (each
    /// `wasmrpc worker --otlp-sample-ratio`).
    #[arg(long, value_name = "RATIO", requires = "otlp_endpoint")]
    otlp_sample_ratio: Option<f64>,
    /// The default timeout of calls, in seconds (0: none).
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    rpc_timeout: Duration,
    /// How long a worker may send nothing before its peers declare it
    /// failed, in seconds (each `wasmrpc worker --failure-timeout`; 0: no
    /// heartbeats).
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    failure_timeout: Duration,
    /// Restart the whole group up to N times when a worker fails, as
    /// torchrun does: every worker is stopped, a new store is made, and
    /// every worker starts again with TORCHELASTIC_RESTART_COUNT set to the
    /// restart's number, so the entry can resume from its last checkpoint
    /// (the demo's `param_server::run` does). 0: the first failure ends the
    /// launch.
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: u32,
    /// Write the entry function's result to this file as JSON.
    #[arg(long, value_name = "FILE", requires = "entry")]
    result: Option<PathBuf>,
    /// How many threads one builtin op may use in each worker [default:
    /// this machine's cores divided among the workers, at least 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    intra_op_threads: Option<u32>,
    /// How many threads each worker's runtime has, the threads that read
    /// its connections and run its calls (each `wasmrpc worker
    /// --num-worker-threads`) [default: this machine's cores divided among
    /// the workers, at least 1].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    num_worker_threads: Option<u32>,
    #[command(flatten)]
    tensor_memory: super::TensorMemoryArgs,
    /// Every worker's op policy (passed to each `wasmrpc worker`).
    #[command(flatten)]
    op_policy: super::ops::OpPolicyArgs,
    /// Every worker's folder grants (passed to each `wasmrpc worker`).
    #[command(flatten)]
    grants: super::grants::FolderGrantArgs,
    /// Let `wasmrpc plugin deploy`, `rollback` and `list` reach the group
    /// while it runs: its workers accept plugin deployments and form a
    /// dynamic group (they wait for each other before the entry). Without
    /// `--entry` they serve until the launcher is interrupted (Ctrl-C,
    /// SIGTERM). Needs `--cluster-ca`: a deployer joins with a certificate
    /// of that CA (`wasmrpc cert issue deployer --ca DIR --out ...`), and
    /// with WASMRPC_CLUSTER_SECRET too if the launcher was given it.
    /// Deployments last for the round: a restarted group (`--max-restarts`)
    /// starts again from `--plugins`.
    #[arg(long)]
    accept_plugin_deployment: bool,
    /// Issue the workers' certificates from this cluster CA (the folder
    /// `wasmrpc cert init` wrote ca.pem and ca.key to) instead of a CA made
    /// in memory, so tools given a certificate of the same CA can join the
    /// group. The workers then use a cluster secret only if
    /// WASMRPC_CLUSTER_SECRET gives one: mutual TLS authenticates every
    /// peer.
    #[arg(long, value_name = "DIR")]
    cluster_ca: Option<PathBuf>,
    /// The entry function's arguments.
    #[command(flatten)]
    entry_call: super::EntryArgs,
}

/// The workers' names: `--names`, else `worker0 .. worker<N-1>`.
fn worker_names(args: &LaunchArgs) -> Result<Vec<String>> {
    if args.names.is_empty() {
        let n = args.nproc.unwrap_or(2);
        return Ok((0..n).map(|rank| format!("worker{rank}")).collect());
    }
    if let Some(n) = args.nproc
        && n as usize != args.names.len()
    {
        anyhow::bail!(
            "--nproc {n} and --names with {} names disagree (leave out --nproc)",
            args.names.len()
        );
    }
    let mut seen = std::collections::HashSet::new();
    for name in &args.names {
        let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            anyhow::bail!(
                "--names: {name:?} is not a worker name (a letter, then letters, digits, '_' or \
                 '-')"
            );
        }
        if !seen.insert(name) {
            anyhow::bail!("--names: {name:?} appears twice");
        }
    }
    Ok(args.names.clone())
}

/// Runs the cluster to completion.
pub(crate) async fn run(args: LaunchArgs) -> Result<ExitCode> {
    super::check_plugin_paths(&args.plugins)?;
    // Opened here too, so a missing folder fails once, before any worker.
    args.grants.open()?;
    let names = worker_names(&args)?;
    let nproc = names.len() as u32;
    if let Some(json) = &args.entry_call.entry_json {
        super::worker::json_entry_args(json)?;
    }
    let exe = std::env::current_exe().context("cannot find the wasmrpc executable")?;

    // Workers may run elsewhere than here one day; give them absolute paths.
    let plugins = args
        .plugins
        .iter()
        .map(|p| std::path::absolute(p).with_context(|| format!("bad plugin path {}", p.display())))
        .collect::<Result<Vec<_>>>()?;

    // Checked here, so a bad rule fails once rather than in every worker.
    args.op_policy.policy()?;
    let op_policy = args.op_policy.child_args()?;
    let grants = args.grants.child_args()?;
    let result_file = args
        .result
        .as_ref()
        .map(|p| std::path::absolute(p).with_context(|| format!("bad result path {}", p.display())))
        .transpose()?;
    // The workers share this machine: each gets its share of the default
    // tensor memory and of the cores.
    let budget = args.tensor_memory.budget(nproc);
    let share = wasmrpc::cores_per_worker(nproc as usize);
    let intra_op_threads = args.intra_op_threads.map_or(share, |n| n as usize);
    let runtime_threads = args.num_worker_threads.map_or(share, |n| n as usize);

    // The cluster's credentials: the operator's if the environment gives
    // them, else a fresh secret. Each child gets it in its environment,
    // which only this user can read (never argv, which every local user
    // can read in /proc, never a file, never the store).
    if args.accept_plugin_deployment && args.cluster_ca.is_none() {
        bail!(
            "--accept-plugin-deployment needs --cluster-ca DIR: a deployer must hold a \
             certificate of the group's CA, and the CA the launcher makes by default never leaves \
             its memory (make one with `wasmrpc cert init --out DIR`, and the deployer's with \
             `wasmrpc cert issue deployer --ca DIR --out DIR`)"
        );
    }
    let operator_secret = std::env::var(wasmrpc::CLUSTER_SECRET_ENV)
        .ok()
        .filter(|s| !s.is_empty());
    let (authority, secret) = match &args.cluster_ca {
        Some(dir) => (
            super::cert::read_authority(dir)
                .with_context(|| format!("--cluster-ca {}", dir.display()))?,
            operator_secret,
        ),
        None => (
            wasmrpc::CertificateAuthority::generate().context("cannot make the cluster's CA")?,
            Some(operator_secret.unwrap_or_else(wasmrpc::transport::generate_secret)),
        ),
    };
    let dynamic = args.accept_plugin_deployment;
    let finish = match (dynamic, args.entry.is_some()) {
        (false, _) => Finish::ByThemselves,
        (true, true) => Finish::AfterFirst,
        (true, false) => Finish::OnInterrupt,
    };

    let mut restart = 0;
    loop {
        // Each round has a store of its own, as torchrun's rendezvous
        // rounds do: nothing of a failed round's keys is left.
        let server = TcpStoreServer::bind(("127.0.0.1", args.master_port))
            .await
            .context("could not host the store")?;
        let port = server.local_addr().port();
        match restart {
            0 if dynamic => info!(
                "launching {nproc} workers that accept plugin deployments; store on \
                 127.0.0.1:{port} (`wasmrpc plugin deploy FILE --init-method \
                 tcp://127.0.0.1:{port} --name deployer --tls-ca ... --tls-cert ... --tls-key ...`)"
            ),
            0 => info!("launching {nproc} workers; store on 127.0.0.1:{port}"),
            n => info!(
                "restarting the group ({n} of {}): launching {nproc} workers; store on \
                 127.0.0.1:{port}",
                args.max_restarts
            ),
        }
        // Each round draws its own bars: a restarted group's first report
        // (a resumption) is news, whatever the last round's bars showed.
        let progress = Arc::new(Progress::new(std::io::IsTerminal::is_terminal(
            &std::io::stderr(),
        )));
        // Listened for before any worker starts, so that an interruption
        // in the meantime is not lost (nor kills the launcher).
        let mut interruptions = match finish {
            Finish::OnInterrupt => Some(super::worker::Interruptions::listen()?),
            _ => None,
        };
        let mut children: Vec<(String, Child)> = Vec::new();
        let mut output = JoinSet::new();
        for (rank, name) in (0..nproc).zip(names.iter().cloned()) {
            let (cert_pem, key_pem) = authority
                .issue(&name)
                .with_context(|| format!("cannot issue {name}'s certificate"))?;
            let mut cmd = Command::new(&exe);
            cmd.arg("worker")
                .args(["--name", &name])
                .args(["--rank", &rank.to_string()])
                .args(["--init-method", &format!("tcp://127.0.0.1:{port}")])
                .args(["--rpc-timeout", &args.rpc_timeout.as_secs_f64().to_string()])
                .args([
                    "--failure-timeout",
                    &args.failure_timeout.as_secs_f64().to_string(),
                ])
                // The launcher hosts the store, as torchrun's agent does.
                .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                .env(super::worker::RESTART_COUNT_ENV, restart.to_string())
                .env("TORCHELASTIC_MAX_RESTARTS", args.max_restarts.to_string())
                .env(EVENTS_ENV, "1")
                .env_remove(wasmrpc::CLUSTER_SECRET_ENV)
                .env(wasmrpc::transport::TLS_CA_PEM_ENV, authority.cert_pem())
                .env(wasmrpc::transport::TLS_CERT_PEM_ENV, &cert_pem)
                .env(wasmrpc::transport::TLS_KEY_PEM_ENV, &key_pem)
                // The files an operator's environment may name would
                // override the launcher's credentials.
                .env_remove(wasmrpc::transport::TLS_CA_ENV)
                .env_remove(wasmrpc::transport::TLS_CERT_ENV)
                .env_remove(wasmrpc::transport::TLS_KEY_ENV)
                .env_remove("WASMRPC_CLUSTER_SECRET_FILE")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            if let Some(secret) = &secret {
                cmd.env(wasmrpc::CLUSTER_SECRET_ENV, secret);
            }
            match dynamic {
                false => cmd.args(["--world-size", &nproc.to_string()]),
                true => cmd.arg("--accept-plugin-deployment"),
            };
            // Only the first worker, which runs the entry (or the health
            // check), waits for the others: one that waited too could miss
            // a group whose entry was already done and left.
            if dynamic && rank == 0 {
                cmd.args(["--wait-for-workers", &nproc.to_string()]);
            }
            // Only the entry's worker ends by itself in a dynamic group.
            if dynamic && (rank != 0 || args.entry.is_none()) {
                cmd.arg("--serve");
            }
            for dir in &plugins {
                cmd.arg("--plugins").arg(dir);
            }
            if let Some(base) = args.metrics_port {
                let port = match base {
                    0 => 0,
                    base => u32::from(base) + rank,
                };
                let port = u16::try_from(port).with_context(|| {
                    format!("--metrics-port {base}: worker {name}'s port {port} is past 65535")
                })?;
                cmd.args(["--metrics-addr", &format!("127.0.0.1:{port}")]);
            }
            if let Some(endpoint) = &args.otlp_endpoint {
                cmd.args(["--otlp-endpoint", endpoint]);
            }
            if let Some(ratio) = args.otlp_sample_ratio {
                cmd.args(["--otlp-sample-ratio", &ratio.to_string()]);
            }
            cmd.args(super::TensorMemoryArgs::child_args(budget));
            cmd.args(["--intra-op-threads", &intra_op_threads.to_string()]);
            cmd.args(["--num-worker-threads", &runtime_threads.to_string()]);
            cmd.args(&op_policy);
            cmd.args(&grants);
            if rank == 0 {
                match &args.entry {
                    Some(entry) => {
                        cmd.args(["--entry", entry]);
                        if let Some(on) = &args.entry_on {
                            cmd.args(["--entry-on", on]);
                        }
                        if let Some(file) = &result_file {
                            cmd.arg("--result").arg(file);
                        }
                        if let Some(json) = &args.entry_call.entry_json {
                            cmd.args(["--entry-json", json]);
                        }
                        cmd.arg("--").args(&args.entry_call.entry_args);
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
                output.spawn(prefix_lines(name.clone(), out, None));
            }
            if let Some(err) = child.stderr.take() {
                output.spawn(prefix_lines(name.clone(), err, Some(progress.clone())));
            }
            children.push((name, child));
        }

        // With a restart to come, the others need not report at length.
        let grace = match restart < args.max_restarts {
            true => RESTART_GRACE,
            false => GRACE,
        };
        let result = supervise(children, grace, finish, interruptions.take()).await;
        // Drain what the workers printed before reporting.
        while output.join_next().await.is_some() {}
        drop(server);
        match result {
            Ok(()) => {
                progress.finish();
                info!("all {} workers finished", nproc);
                return Ok(ExitCode::SUCCESS);
            }
            Err(e) if restart < args.max_restarts => {
                progress.finish();
                error!("the group failed: {}", super::error_report(&e));
                restart += 1;
            }
            Err(e) => {
                progress.finish();
                return Err(match args.max_restarts {
                    0 => e,
                    n => e.context(format!("the group failed again after {n} restarts")),
                });
            }
        }
    }
}

/// How long the other workers get, once one has failed, to report what they
/// saw of the failure (e.g. a call to the dead worker failing) and exit on
/// their own, before they are stopped.
const GRACE: Duration = Duration::from_secs(3);

/// [`GRACE`] when the group restarts next: what the others saw matters
/// less than the time lost.
const RESTART_GRACE: Duration = Duration::from_secs(1);

/// How a group's workers come to their end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finish {
    /// Each ends by itself (a static group's shutdown is collective).
    ByThemselves,
    /// The first worker (the entry's) ends by itself; then the others,
    /// which serve until told, are asked to leave (SIGTERM).
    AfterFirst,
    /// Every worker serves until the launcher is interrupted (Ctrl-C,
    /// SIGTERM), then is asked to leave.
    OnInterrupt,
}

/// Waits for every child; the first failure stops the rest (after
/// `grace`). `finish` says when the launcher asks the workers still
/// running to leave gracefully.
async fn supervise(
    children: Vec<(String, Child)>,
    grace: Duration,
    finish: Finish,
    interruptions: Option<super::worker::Interruptions>,
) -> Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let (leave_tx, leave_rx) = tokio::sync::watch::channel(false);
    let leave_tx = Arc::new(leave_tx);
    let first = children.first().map(|(name, _)| name.clone());
    let mut waits = JoinSet::new();
    for (name, mut child) in children {
        let mut stop = stop_rx.clone();
        let mut leave = leave_rx.clone();
        waits.spawn(async move {
            let status = tokio::select! {
                status = child.wait() => status,
                _ = async { let _ = stop.wait_for(|stop| *stop).await; } => {
                    let _ = child.start_kill();
                    child.wait().await
                }
                _ = async { let _ = leave.wait_for(|leave| *leave).await; } => {
                    ask_to_leave(&child);
                    tokio::select! {
                        status = child.wait() => status,
                        _ = async { let _ = stop.wait_for(|stop| *stop).await; } => {
                            let _ = child.start_kill();
                            child.wait().await
                        }
                    }
                }
            };
            (name, status)
        });
    }
    if let Some(mut interruptions) = interruptions {
        let leave_tx = leave_tx.clone();
        tokio::spawn(async move {
            interruptions.next().await;
            info!("interrupted: asking every worker to leave");
            let _ = leave_tx.send(true);
        });
    }
    let mut failure = None;
    while let Some(joined) = waits.join_next().await {
        let (name, status) = joined.context("a worker's supervisor task failed")?;
        let status = status.with_context(|| format!("could not wait for {name}"))?;
        if status.success() && finish == Finish::AfterFirst && first.as_ref() == Some(&name) {
            let _ = leave_tx.send(true);
        }
        if !status.success() && failure.is_none() {
            error!(
                "{name} failed ({status}); stopping the other workers in {} s unless they exit",
                grace.as_secs_f64()
            );
            failure = Some(format!("{name} failed ({status})"));
            let stop_tx = stop_tx.clone();
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                let _ = stop_tx.send(true);
            });
        }
    }
    match failure {
        Some(failure) => bail!(failure),
        None => Ok(()),
    }
}

/// Sends a worker SIGTERM: a worker serving until interrupted leaves its
/// group gracefully.
fn ask_to_leave(child: &Child) {
    let pid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

/// Copies a child's output line by line, prefixed with its name; on
/// stderr (`progress` given), progress event lines go to the bars instead.
async fn prefix_lines(
    name: String,
    stream: impl AsyncRead + Unpin,
    progress: Option<Arc<Progress>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match &progress {
            Some(progress) => match ProgressEvent::parse(&line) {
                Some(event) => progress.show(&event),
                None => progress.println(&format!("[{name}] {line}")),
            },
            None => println!("[{name}] {line}"),
        }
    }
}
