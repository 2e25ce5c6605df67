//! `wasmrpc worker`: one worker of a group. It finds the group through an
//! init method (as `torch.distributed.rpc.init_rpc` does), serves the
//! functions of the plugins it loads (and every builtin op), may run an
//! entry function, and stops with the group's graceful shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use wasmrpc::prelude::*;

use anyhow::{Context, Result, bail};
use tracing::info;
use wasmrpc::{Args, FunctionRegistry, PluginHost, RpcBackendOptions, init_rpc};

use super::parse_seconds;

mod entry;

pub(crate) use entry::json_entry_args;
use entry::{describe, parse_arg, to_json};

/// Flags of `wasmrpc worker`.
#[derive(clap::Args, Debug)]
pub(crate) struct WorkerArgs {
    /// This worker's name, unique in the group [default: worker<RANK>].
    #[arg(long)]
    name: Option<String>,
    /// This worker's rank. `env://` also reads it from RANK (as torchrun sets it).
    #[arg(long)]
    rank: Option<u32>,
    /// The number of workers. `env://` also reads it from WORLD_SIZE. Leave it
    /// out with `--rank` to join a dynamic group.
    #[arg(long)]
    world_size: Option<u32>,
    /// How to find the group's store: `env://` (MASTER_ADDR and MASTER_PORT,
    /// as torchrun sets them), `tcp://HOST:PORT` (rank 0 hosts the store
    /// unless TORCHELASTIC_USE_AGENT_STORE=True), or `file:///PATH`.
    #[arg(long, default_value = "env://")]
    init_method: String,
    /// The address to accept peers on. Its IP is what peers dial: on a
    /// cluster of several machines give this machine's reachable address.
    /// Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The default timeout of calls, in seconds (0: none).
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    rpc_timeout: Duration,
    /// How long a peer may send nothing (no call, no reply, no heartbeat)
    /// before this worker declares it failed, in seconds: its pending
    /// calls then fail at once with the cause ("worker2 failed: no
    /// heartbeat for 2.0 s"), and so do new ones. Idle connections carry a
    /// heartbeat every fifth of this. 0: no heartbeats (a stalled peer is
    /// noticed only by each call's timeout).
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    failure_timeout: Duration,
    /// How long to wait for the other workers to join, in seconds.
    #[arg(long, default_value = "300", value_parser = parse_seconds)]
    init_timeout: Duration,
    /// In a dynamic group (no world size), wait until N workers, this one
    /// included, have joined before `--ping-all` and `--entry`, for at most
    /// `--init-timeout` (`wasmrpc launch --accept-plugin-deployment` starts
    /// its workers this way). A static group waits for its world size by
    /// itself.
    #[arg(long, value_name = "N", conflicts_with = "world_size")]
    wait_for_workers: Option<u32>,
    /// Threads that run calls on this worker.
    #[arg(long, default_value_t = wasmrpc::DEFAULT_NUM_WORKER_THREADS)]
    pub(crate) num_worker_threads: usize,
    /// Load the wasm plugins in this folder (every `*.wasm` file) or this
    /// file, and serve their functions as `plugin::function`. Repeatable.
    #[arg(long = "plugins", value_name = "DIR")]
    plugins: Vec<PathBuf>,
    /// Once the group is up, call this registered function on this worker
    /// (e.g. `plugin::function`), print its result, then shut down.
    #[arg(long)]
    entry: Option<String>,
    /// Call the entry function on this worker of the group instead
    /// [default: this worker].
    #[arg(long, value_name = "WORKER", requires = "entry")]
    entry_on: Option<String>,
    /// Only the worker of this rank calls the entry; the others serve. For
    /// torchrun, which gives every worker the same command line
    /// [default: every worker given `--entry` calls it].
    #[arg(long, value_name = "RANK", requires = "entry")]
    entry_rank: Option<u32>,
    /// Write the entry function's result to this file as JSON (tensors as
    /// `{"shape": [...], "data": [...]}`).
    #[arg(long, value_name = "FILE", requires = "entry")]
    result: Option<PathBuf>,
    /// Once the group is up, call every other worker once and print the
    /// round trip (the launcher's health check when it has no entry).
    #[arg(long)]
    ping_all: bool,
    /// Let peers of the group deploy plugins to this worker at run time
    /// (`wasmrpc plugin deploy`, `Deploy::deploy_plugin`). Off by default:
    /// without it a deployment is refused with "worker X does not accept
    /// plugin deployment". Deployments only come from authenticated peers
    /// (those holding the cluster secret).
    #[arg(long)]
    accept_plugin_deployment: bool,
    /// How long, in seconds, an old version of a deployed plugin stays
    /// loaded after an upgrade or rollback replaced it while calls still
    /// run on it or objects of it live (it is unloaded as soon as none do;
    /// the version just replaced stays, for a rollback).
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    plugin_drain_timeout: std::time::Duration,
    /// How long, in seconds, a plugin version staged by a deployment waits
    /// for its commit before this worker drops it (a deployer that died
    /// between the two phases).
    #[arg(long, default_value = "600", value_parser = parse_seconds)]
    plugin_stage_timeout: std::time::Duration,
    /// Send tensor storages of 1 MiB and more to workers on this host over
    /// the socket, not through shared memory (which is on by default, and
    /// falls back to the socket by itself for workers on other hosts).
    #[arg(long)]
    no_shared_memory: bool,
    /// Serve this worker's metrics in Prometheus' text format at
    /// `http://ADDR/metrics` (calls served and made per function and peer,
    /// their latencies and errors, connections, tensor memory, RRefs,
    /// autograd contexts, peer failures; never argument values). Off by
    /// default. Port 0 picks a free port (the worker logs it).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Allow `--metrics-addr` to be an address other machines reach
    /// (anyone who reaches it reads the metrics: plain HTTP, no
    /// authentication). Without it only a loopback address is taken.
    #[arg(long, requires = "metrics_addr")]
    metrics_public: bool,
    /// Export this worker's spans to the OpenTelemetry collector at this
    /// OTLP/HTTP URL (e.g. `http://127.0.0.1:4318`: OTLP's `/v1/traces`
    /// is added to a URL without a path). Each call's spans (its send, its
    /// serving, its function's run) join the caller's trace, so one call
    /// tree is seen across workers; spans name functions and workers,
    /// never argument values. Off by default: nothing is recorded or sent.
    /// Loopback only (run a collector beside the worker to forward them).
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// With `--otlp-endpoint`: the share of the traces this worker starts
    /// that it records, 0 to 1 (a call inside a trace follows its caller's
    /// choice). Every span costs CPU; under heavy load, sample.
    #[arg(
        long,
        value_name = "RATIO",
        default_value_t = 1.0,
        requires = "otlp_endpoint"
    )]
    otlp_sample_ratio: f64,
    /// The longest, in microseconds, a connection keeps polling its socket
    /// for the next message before it sleeps. Within it a connection polls
    /// about twice its recent waits, and not at all when those are as long
    /// as this or while several calls are in progress on it. Polling saves
    /// the tens of microseconds a wake-up costs (on VMs most of a small
    /// call's round trip) at the price of CPU while it polls; a connection
    /// whose polling keeps losing its CPU to other threads stops polling
    /// for a while by itself. 0 never polls.
    #[arg(long, value_name = "US", default_value_t = wasmrpc::DEFAULT_BUSY_POLL.as_micros() as u64)]
    busy_poll_us: u64,
    /// How many threads one builtin op (a matmul, a backward pass) may use
    /// [default: libtorch's, one per core]. Workers sharing a host should
    /// split its cores (`wasmrpc launch` gives each its share): op threads
    /// on top of the worker's own threads oversubscribe the cores, and on
    /// a busy host they spin waiting for each other.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) intra_op_threads: Option<u32>,
    /// Once up (and after `--ping-all` and `--entry`), keep serving calls
    /// until interrupted (Ctrl-C or SIGTERM), then shut down gracefully. A
    /// worker of a dynamic group (no world size) otherwise leaves at once.
    #[arg(long)]
    serve: bool,
    #[command(flatten)]
    tensor_memory: super::TensorMemoryArgs,
    #[command(flatten)]
    credentials: super::credentials::CredentialArgs,
    /// Which builtin ops this worker runs for peers and plugins (its op
    /// policy; `wasmrpc ops list` shows it).
    #[command(flatten)]
    op_policy: super::ops::OpPolicyArgs,
    /// Which host folders this worker's plugins may use.
    #[command(flatten)]
    grants: super::grants::FolderGrantArgs,
    /// The entry function's arguments.
    #[command(flatten)]
    entry_call: super::EntryArgs,
}

/// Runs one worker until the group shuts down.
pub(crate) async fn run(args: WorkerArgs) -> Result<ExitCode> {
    // CUDA where a device can use it (decided at start): logged, and an
    // error if it should be there and is not.
    wasmrpc::device::load_cuda()?;
    let mut interruptions = match args.serve {
        true => Some(Interruptions::listen()?),
        false => None,
    };
    if let Some(threads) = args.intra_op_threads {
        wasmrpc::set_intra_op_threads(threads as usize);
    }
    // Credentials first: a worker that may not start should not join.
    let mut credentials = RpcBackendOptions {
        listen_addr: args.listen,
        ..RpcBackendOptions::default()
    };
    // The name is known here unless the rank comes from the rendezvous;
    // `init_rpc` checks again in any case.
    let rank_env = std::env::var("RANK")
        .ok()
        .and_then(|r| r.trim().parse::<u32>().ok());
    let name_hint = args
        .name
        .clone()
        .or_else(|| args.rank.or(rank_env).map(|r| format!("worker{r}")));
    args.credentials
        .apply(&mut credentials, name_hint.as_deref())?;
    if let Some(name) = &name_hint {
        credentials.check_credentials(name)?;
    }
    // Before the rendezvous: a worker that cannot serve its plugins should
    // not join a group it would leave at once.
    super::check_plugin_paths(&args.plugins)?;
    let plugin_folders = std::sync::Arc::new(args.grants.open()?);
    let rank_hint = args.rank.map_or(-1, i64::from);
    let world_hint = args.world_size.map_or(-1, i64::from);
    let (store, rank, world) = match (args.rank, args.world_size) {
        // A dynamic group with an explicit rank: PyTorch makes its store
        // without `rendezvous`, which requires a world size.
        (Some(rank), None) if !args.init_method.starts_with("env://") => {
            let store = super::dynamic_store(&args.init_method, rank, args.init_timeout).await?;
            (store, i64::from(rank), -1)
        }
        _ => {
            wasmrpc::store::rendezvous(&args.init_method, rank_hint, world_hint, args.init_timeout)
                .await
                .with_context(|| format!("rendezvous through {} failed", args.init_method))?
        }
    };
    let rank = u32::try_from(rank).with_context(|| format!("invalid rank {rank}"))?;
    let world = u32::try_from(world).ok();
    let name = args.name.clone().unwrap_or_else(|| format!("worker{rank}"));

    let registry = FunctionRegistry::new();
    if !args.plugins.is_empty() {
        load_plugins(&args.plugins, &registry).await?;
    }
    let options = RpcBackendOptions {
        cluster_secret: credentials.cluster_secret,
        insecure: credentials.insecure,
        tls: credentials.tls,
        registry: std::sync::Arc::new(registry),
        rpc_timeout: args.rpc_timeout,
        num_worker_threads: args.num_worker_threads,
        init_method: args.init_method.clone(),
        listen_addr: args.listen,
        init_timeout: args.init_timeout,
        accept_plugin_deployment: args.accept_plugin_deployment,
        plugin_drain_timeout: args.plugin_drain_timeout,
        plugin_stage_timeout: args.plugin_stage_timeout,
        shared_memory: !args.no_shared_memory,
        busy_poll: std::time::Duration::from_micros(args.busy_poll_us),
        tensor_memory: args.tensor_memory.budget(1),
        op_policy: std::sync::Arc::new(args.op_policy.policy()?),
        plugin_folders,
        failure_timeout: (!args.failure_timeout.is_zero()).then_some(args.failure_timeout),
        restart_count: restart_count()?,
        metrics_addr: args.metrics_addr,
        metrics_public: args.metrics_public,
        otlp_endpoint: args.otlp_endpoint.clone(),
        otlp_sample_ratio: args.otlp_sample_ratio,
        ..RpcBackendOptions::default()
    };
    let agent = init_rpc(&name, Some(rank), world, store, options)
        .await
        .with_context(|| format!("init_rpc of {name} (rank {rank}) failed"))?;
    info!(
        "{name}: rank {rank} of {} workers, serving on {}, {} op thread(s)",
        world.map_or_else(|| "a dynamic group of".to_string(), |w| w.to_string()),
        agent
            .local_addr()
            .map_or_else(|| "?".to_string(), |a| a.to_string()),
        wasmrpc::intra_op_threads(),
    );

    if world.is_none() && args.accept_plugin_deployment {
        // Plugins deployed to the group before this worker joined.
        let names = agent
            .install_deployed_plugins()
            .await
            .with_context(|| format!("{name}: installing the group's deployed plugins failed"))?;
        if !names.is_empty() {
            info!("{name}: serving deployed plugins: {}", names.join(", "));
        }
    }
    if let Some(n) = args.wait_for_workers {
        wait_for_members(&agent, &name, n as usize, args.init_timeout).await?;
    }
    let mut failed = false;
    if args.ping_all {
        for peer in agent.get_worker_infos() {
            if peer.name == name {
                continue;
            }
            let started = std::time::Instant::now();
            match agent
                .rpc_sync(peer.name.as_str(), wasmrpc::NOOP, Args::new())
                .await
            {
                Ok(_) => println!(
                    "{name} -> {}: answered, round trip {} us",
                    peer.name,
                    started.elapsed().as_micros()
                ),
                Err(e) => {
                    eprintln!("{name} -> {}: failed: {e}", peer.name);
                    failed = true;
                }
            }
        }
    }
    let entry = args
        .entry
        .as_ref()
        .filter(|_| args.entry_rank.is_none_or(|r| r == rank));
    if let Some(entry) = entry {
        let call_args = match &args.entry_call.entry_json {
            Some(json) => json_entry_args(json)?,
            None => args
                .entry_call
                .entry_args
                .iter()
                .fold(Args::new(), |a, s| a.arg(parse_arg(s))),
        };
        let on = args.entry_on.as_deref().unwrap_or(name.as_str());
        // A worker of the group declared failed (FAIL-1) ends the entry at
        // once, whatever it waits for: a trainer stuck behind the failed
        // one would otherwise hold it forever.
        let outcome = tokio::select! {
            // A call that failed with its own cause (its connection closed
            // under it) reports that, though its worker is declared failed
            // at the same moment.
            biased;
            result = agent.rpc_sync(on, entry, call_args) => result,
            failure = agent.next_failure(&[]) => Err(wasmrpc::Error::runtime(failure.to_string())),
        };
        match outcome {
            Ok(result) => {
                println!("{entry} returned {}", describe(&result));
                if let Some(file) = &args.result {
                    let json = to_json(&result.value, &result.tensors);
                    let text = serde_json::to_string_pretty(&json)
                        .context("cannot encode the entry's result")?;
                    std::fs::write(file, text).with_context(|| {
                        format!("cannot write the entry's result to {}", file.display())
                    })?;
                }
            }
            Err(e) => {
                eprintln!("{name}: entry {entry} on {on} failed: {e}");
                failed = true;
            }
        }
    }
    if args.serve {
        info!("{name}: serving until interrupted");
        if let Some(interruptions) = &mut interruptions {
            interruptions.next().await;
        }
        info!("{name}: interrupted, shutting down");
    }
    if let Err(e) = agent.shutdown(true, Duration::ZERO).await {
        return Err(shutdown_error(&name, e));
    }
    info!("{name}: shut down");
    if failed {
        bail!("{name}: a call failed (see above)");
    }
    Ok(ExitCode::SUCCESS)
}

/// Waits until the dynamic group `agent` belongs to has `n` members, for
/// at most `timeout`.
async fn wait_for_members(
    agent: &wasmrpc::RpcAgent,
    name: &str,
    n: usize,
    timeout: Duration,
) -> Result<()> {
    let started = std::time::Instant::now();
    loop {
        let members = agent.get_worker_infos();
        if members.len() >= n {
            return Ok(());
        }
        if started.elapsed() >= timeout {
            let names: Vec<_> = members.iter().map(|m| m.name.as_str()).collect();
            bail!(
                "{name}: {} of the {n} workers awaited joined in {:.0} s (--init-timeout): {}",
                members.len(),
                timeout.as_secs_f64(),
                names.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How many times the group was restarted: `TORCHELASTIC_RESTART_COUNT`,
/// as torchrun's elastic agent and `wasmrpc launch --max-restarts` set it.
fn restart_count() -> Result<u32> {
    match std::env::var(RESTART_COUNT_ENV) {
        Err(_) => Ok(0),
        Ok(n) => n
            .trim()
            .parse()
            .with_context(|| format!("{RESTART_COUNT_ENV}={n:?} is not a number of restarts")),
    }
}

/// The variable torchrun's elastic agent sets to the number of restarts.
pub(crate) const RESTART_COUNT_ENV: &str = "TORCHELASTIC_RESTART_COUNT";

/// Ctrl-C (SIGINT) and SIGTERM, listened for from the moment this is
/// made: one that arrives while the process still starts is kept for
/// [`next`](Self::next) instead of killing it (a launcher may ask a
/// worker to leave before it has finished joining).
pub(crate) struct Interruptions {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Interruptions {
    pub(crate) fn listen() -> Result<Interruptions> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Interruptions {
            interrupt: signal(SignalKind::interrupt()).context("cannot listen for Ctrl-C")?,
            terminate: signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?,
        })
    }

    /// Returns at the next Ctrl-C or SIGTERM (or one that came before).
    pub(crate) async fn next(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// Loads every plugin under `paths` (compiling off the async threads) and
/// registers their functions in `registry`.
async fn load_plugins(paths: &[PathBuf], registry: &FunctionRegistry) -> Result<()> {
    let host = PluginHost::shared().context("cannot start the wasm runtime")?;
    for path in paths {
        let loaded = host
            .load_and_register(path, registry)
            .await
            .with_context(|| format!("cannot load the plugins in {}", path.display()))?;
        for (plugin, names) in loaded {
            let namespace = wasmrpc::plugin_namespace(plugin.name());
            info!(
                "plugin {namespace} {} from {}: serving {} functions as {namespace}::*",
                plugin.manifest().version,
                path.display(),
                names.len(),
            );
            tracing::debug!("plugin {namespace}: {}", names.join(", "));
        }
    }
    Ok(())
}

/// The error of a graceful shutdown that failed, saying once which
/// worker's: one that gave up on a failed peer names it already (FAIL-3);
/// others (a timed-out all-gather, a leak check) get it here.
fn shutdown_error(name: &str, e: wasmrpc::Error) -> anyhow::Error {
    let said = format!("graceful shutdown of {name}");
    if e.message().starts_with(&said) {
        anyhow::Error::from(e)
    } else {
        anyhow::Error::from(e).context(format!("{said} failed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shutdown_error_names_the_worker_once() {
        let gave_up = wasmrpc::Error::runtime(
            "graceful shutdown of worker1 gave up: worker0 failed: no heartbeat for 2.0 s",
        );
        let text = format!("{:#}", shutdown_error("worker1", gave_up));
        assert_eq!(
            text.matches("graceful shutdown of worker1").count(),
            1,
            "{text}"
        );
        let other = wasmrpc::Error::runtime("worker1 gave up in _all_gather");
        let text = format!("{:#}", shutdown_error("worker1", other));
        assert!(
            text.starts_with("graceful shutdown of worker1 failed: ")
                && text.contains("worker1 gave up in _all_gather"),
            "{text}"
        );
    }
}
