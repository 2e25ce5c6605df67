//! The worker processes of our side: `wasmrpc-bench worker` (a member of a
//! group that serves the bench functions until the group shuts down) and
//! `wasmrpc-bench init-worker` (runs `init_rpc` + graceful shutdown on cue,
//! for the init rows).
//!
//! Why the bench binary re-executes itself rather than using the `wasmrpc
//! worker` binary: the bench needs functions of its own on the callee (echo,
//! the all-to-all load loop) and an init that starts on cue, and `wasmrpc
//! worker` serves only builtin ops and its plugins. The worker code below is
//! what `wasmrpc worker` does (rendezvous through the init method, plugins
//! installed through `PluginHost`, `init_rpc`, graceful shutdown).

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use wasmrpc::{Args, FunctionRegistry, Payload, RpcAgent, RpcBackendOptions, args, init_rpc};

/// The no-op: takes an int, returns `None` (the torch side's `noop(x)`).
pub(crate) const NOOP: &str = "bench::noop";
/// Returns its argument (the torch side's `echo(t)`).
pub(crate) const ECHO: &str = "bench::echo";
/// Runs the all-to-all load from this worker: `(seconds, window, world)` →
/// `(calls, seconds)`.
pub(crate) const LOAD: &str = "bench::load";

/// Registers the bench functions.
pub(crate) fn register(registry: &FunctionRegistry) {
    registry.register_native(NOOP, |_ctx, args: Args| async move {
        args.get(0)?.as_int()?;
        Ok(Payload::none())
    });
    registry.register_native(ECHO, |_ctx, args: Args| async move { args.get(0) });
    registry.register_native(LOAD, |ctx, args: Args| async move {
        let secs = args.get(0)?.as_float()?;
        let window = args.get(1)?.as_int()?;
        let world = u32::try_from(args.get(2)?.as_int()?).unwrap_or(0);
        let (calls, took) = load(
            ctx.agent(),
            world,
            Duration::from_secs_f64(secs),
            usize::try_from(window).unwrap_or(1),
        )
        .await?;
        Ok(Payload::tuple([
            Payload::from(calls as i64),
            Payload::from(took.as_secs_f64()),
        ]))
    });
}

/// Calls every other worker of a group of `world` round robin, `window`
/// calls in flight, for `duration`; returns the calls completed and the time
/// taken. It first waits until this worker knows every peer.
pub(crate) async fn load(
    agent: &RpcAgent,
    world: u32,
    duration: Duration,
    window: usize,
) -> wasmrpc::Result<(u64, Duration)> {
    let peers: Vec<u32> = (0..world).filter(|r| *r != agent.rank()).collect();
    // A call can reach a worker whose own `init_rpc` has not returned yet
    // (its table of members still empty): wait until it knows every peer.
    let known = Instant::now() + Duration::from_secs(30);
    while agent.get_worker_infos().len() < world as usize {
        if Instant::now() > known {
            return Err(wasmrpc::Error::runtime(format!(
                "{} still knows {} of {world} workers after 30 s",
                agent.name(),
                agent.get_worker_infos().len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    if peers.is_empty() {
        return Err(wasmrpc::Error::runtime(
            "all-to-all load needs a group of 2 or more",
        ));
    }
    let start = Instant::now();
    let deadline = start + duration;
    let mut queue = VecDeque::with_capacity(window);
    let (mut done, mut i) = (0u64, 0usize);
    while Instant::now() < deadline {
        while queue.len() < window.max(1) {
            queue.push_back(agent.rpc_async(peers[i % peers.len()], NOOP, args![i as i64]));
            i += 1;
        }
        if let Some(f) = queue.pop_front() {
            f.wait().await?;
            done += 1;
        }
    }
    while let Some(f) = queue.pop_front() {
        f.wait().await?;
        done += 1;
    }
    Ok((done, start.elapsed()))
}

/// The wasm function of the wasm round-trip row: `identity(a)` of the seed
/// functions' plugin, called with an int.
pub(crate) const WASM_IDENTITY: &str = "seed_fns::identity";

/// The Python function of the Python round-trip row: `identity(a)` of the
/// Python seed plugin (`plugins/python/seed-fns-py`).
pub(crate) const PY_IDENTITY: &str = "seed_fns_py::identity";

/// The Python no-op's floor: `identity(a)` of a Python plugin whose calls
/// run none of the kit's code (`plugins/python/dispatch-floor-py`), what
/// componentize-py's dispatch alone costs.
pub(crate) const PY_FLOOR_IDENTITY: &str = "dispatch_floor_py::identity";

/// The plugins the per-call rows' workers serve: the seed functions in
/// Rust and in Python.
pub(crate) const ROW_PLUGINS: [&str; 2] = [wasmrpc_plugins::SEED_FNS, wasmrpc_plugins::SEED_FNS_PY];

/// The plugins of the Python no-op's group: [`ROW_PLUGINS`] and the
/// dispatch floor. A group of its own, as a worker that loads a third
/// plugin, the Python floor, holds 25 MiB more (2026-12-07), which the
/// per-call group's memory rows must not count.
pub(crate) const PYTHON_ROW_PLUGINS: [&str; 3] = [
    wasmrpc_plugins::SEED_FNS,
    wasmrpc_plugins::SEED_FNS_PY,
    wasmrpc_plugins::DISPATCH_FLOOR_PY,
];

/// Rendezvous through `init_method` and join as `worker<rank>` with the
/// bench functions, and the wasm plugins at `plugins`. `tls`: this
/// worker's credentials (the TLS rows); `None`: those of the environment,
/// if any (`TlsCredentials::from_env`, how the TLS rows' worker processes
/// get theirs). `shared_memory`: whether large storages to the other
/// workers (all on this host) cross in shared memory; the bench's groups
/// measure the connection (off) except for the `shm_*` rows.
pub(crate) async fn join(
    init_method: &str,
    rank: u32,
    world_size: u32,
    plugins: &[std::path::PathBuf],
    tls: Option<wasmrpc::TlsCredentials>,
    shared_memory: bool,
) -> Result<RpcAgent> {
    let options = options(tls, shared_memory);
    join_with(init_method, rank, world_size, plugins, options).await
}

/// The options every bench worker starts from.
pub(crate) fn options(
    tls: Option<wasmrpc::TlsCredentials>,
    shared_memory: bool,
) -> RpcBackendOptions {
    RpcBackendOptions {
        rpc_timeout: Duration::from_secs(300),
        init_timeout: Duration::from_secs(120),
        tls,
        shared_memory,
        busy_poll: busy_poll().unwrap_or(wasmrpc::DEFAULT_BUSY_POLL),
        ..RpcBackendOptions::default()
    }
}

/// [`join`] with `options` (e.g. a device map).
pub(crate) async fn join_with(
    init_method: &str,
    rank: u32,
    world_size: u32,
    plugins: &[std::path::PathBuf],
    options: RpcBackendOptions,
) -> Result<RpcAgent> {
    let (store, _, _) = wasmrpc::store::rendezvous(
        init_method,
        i64::from(rank),
        i64::from(world_size),
        Duration::from_secs(120),
    )
    .await
    .with_context(|| format!("rendezvous of rank {rank} through {init_method}"))?;
    register(&options.registry);
    for path in plugins {
        wasmrpc::PluginHost::shared()
            .and_then(|host| host.install(path, &options.registry))
            .with_context(|| format!("cannot load the plugin {}", path.display()))?;
    }
    init_rpc(
        &format!("worker{rank}"),
        Some(rank),
        Some(world_size),
        store,
        options,
    )
    .await
    .with_context(|| format!("init_rpc of rank {rank}"))
}

/// `--busy-poll-us`, when given: our workers' busy-poll window.
static BUSY_POLL: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();

/// Sets every worker's busy-poll window (`--busy-poll-us`), here and in the
/// worker processes started from now on.
pub(crate) fn set_busy_poll(window: Duration) {
    let _ = BUSY_POLL.set(window);
}

/// The busy-poll window `--busy-poll-us` set, if any.
pub(crate) fn busy_poll() -> Option<Duration> {
    BUSY_POLL.get().copied()
}

/// The op threads of each of our workers, here and in the worker processes.
static INTRA_OP_THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Sizes this process's op thread pool, before any op runs: `threads`
/// (`--intra-op-threads`) or the share of the cores of each of a row's two
/// workers; the worker processes started from now on get the same.
pub(crate) fn set_intra_op_threads(threads: Option<usize>) {
    let threads = threads.unwrap_or_else(|| wasmrpc::cores_per_worker(2));
    wasmrpc::set_intra_op_threads(threads);
    let _ = INTRA_OP_THREADS.set(threads);
}

/// The op threads [`set_intra_op_threads`] chose, if it ran.
pub(crate) fn intra_op_threads() -> Option<usize> {
    INTRA_OP_THREADS.get().copied()
}

/// Where the bench's own calls run: the runtime of the process that
/// makes them (its workers always run a multi-threaded one).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum CallerRuntime {
    /// One thread that makes the calls and reads their replies, as a
    /// plugin's calls are made on the worker thread that runs it: a reply
    /// wakes the thread that waits for it, once.
    #[default]
    CurrentThread,
    /// The calls made from the thread in `block_on`, their replies read
    /// by the runtime's worker threads, which then wake it: a wake-up more
    /// per call, as for a caller outside the runtime (a Python program's
    /// thread, `#[tokio::main]`'s main future).
    MultiThread,
}

/// The runtime the bench makes its own calls on (`threads` worker threads
/// for a multi-threaded one).
pub(crate) fn caller_runtime(
    kind: CallerRuntime,
    threads: usize,
) -> Result<tokio::runtime::Runtime> {
    match kind {
        CallerRuntime::CurrentThread => Ok(tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?),
        CallerRuntime::MultiThread => runtime(threads),
    }
}

/// Runs `work`, which blocks for a while (seconds of CPU, a floor's
/// blocking ping-pong, a plugin's compile), on a thread of tokio's blocking
/// pool, and waits for it without holding the runtime: whatever the
/// caller's runtime, its connections keep sending their heartbeats, so its
/// peers do not declare it failed (LIVE-2).
pub(crate) async fn off_runtime<T, F>(work: F) -> Result<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    // The floors' ops run here: with the op threads the workers' ops get.
    tokio::task::spawn_blocking(|| {
        wasmrpc::adopt_intra_op_threads();
        work()
    })
    .await
    .map_err(|e| anyhow::anyhow!("blocking work of the bench failed: {e}"))
}

/// Makes a fresh plugin host with the given cache folder (or none).
pub(crate) trait HostMaker:
    Fn(Option<std::path::PathBuf>) -> wasmrpc::Result<wasmrpc::PluginHost>
{
}
impl<F: Fn(Option<std::path::PathBuf>) -> wasmrpc::Result<wasmrpc::PluginHost>> HostMaker for F {}

/// The bytes of the plugin at `path`, and a maker of fresh plugin hosts
/// (the default config, with the given cache folder or none): what the
/// cold-start rows load and time.
pub(crate) fn plugin_and_hosts(path: &str) -> Result<(std::sync::Arc<[u8]>, impl HostMaker)> {
    use anyhow::Context;
    let bytes = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    let defaults = wasmrpc::PluginHost::default_config()?;
    let host = move |cache_dir| {
        wasmrpc::PluginHost::new(wasmrpc::wasm::Config {
            cache_dir,
            ..defaults.clone()
        })
    };
    Ok((bytes.into(), host))
}

/// Loads the plugin `bytes` into `host` off the runtime (compiling takes
/// seconds), as a worker loads its plugins.
pub(crate) async fn load_plugin(
    host: &wasmrpc::PluginHost,
    bytes: &std::sync::Arc<[u8]>,
) -> Result<std::sync::Arc<wasmrpc::wasm::Plugin>> {
    let (host, bytes) = (host.clone(), bytes.clone());
    Ok(off_runtime(move || host.load(&bytes)).await??)
}

/// A tokio runtime for a worker process.
pub(crate) fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?)
}

/// What a bench worker tells observers about itself (the `*_metrics` and
/// `*_traced` rows).
#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct Observe {
    /// Serve metrics on this address.
    #[arg(long)]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// Export spans to the OTLP/HTTP collector at this URL.
    #[arg(long)]
    pub(crate) otlp_endpoint: Option<String>,
    /// The share of traces recorded (default: every one).
    #[arg(long)]
    pub(crate) otlp_sample_ratio: Option<f64>,
}

/// How often a process the bench started looks whether the bench is gone.
const PARENT_CHECK: Duration = Duration::from_millis(200);

/// The variable that gives a process the bench starts the bench's pid
/// ([`exit_with_parent`]): a child that starts after its parent died
/// already has another parent by its first look.
const PARENT_ENV: &str = "WASMRPC_BENCH_PARENT";

/// Gives `cmd`, a process this bench starts, the bench's pid, which its
/// [`exit_with_parent`] watches.
pub(crate) fn started_by_this_bench(cmd: &mut std::process::Command) -> &mut std::process::Command {
    cmd.env(PARENT_ENV, std::process::id().to_string())
}

/// Ends this process (exit code 70) once the bench that started it is
/// gone: its parent is no longer the pid in [`PARENT_ENV`] (or, when run
/// by hand without it, the parent it started with). A bench killed
/// outright, or while its workers were still joining, never runs its
/// children's `Drop`, and its workers, reparented, would wait for a group
/// that will not come, or serve forever.
pub(crate) fn exit_with_parent() {
    let parent = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(std::os::unix::process::parent_id);
    std::thread::spawn(move || {
        loop {
            if std::os::unix::process::parent_id() != parent {
                std::process::exit(70);
            }
            std::thread::sleep(PARENT_CHECK);
        }
    });
}

/// `wasmrpc-bench worker`: joins, serves until the group shuts down.
pub(crate) fn serve(
    init_method: &str,
    rank: u32,
    world_size: u32,
    threads: usize,
    plugins: &[std::path::PathBuf],
    shared_memory: bool,
    observe: &Observe,
) -> Result<()> {
    runtime(threads)?.block_on(async {
        let options = RpcBackendOptions {
            metrics_addr: observe.metrics_addr,
            otlp_endpoint: observe.otlp_endpoint.clone(),
            otlp_sample_ratio: observe.otlp_sample_ratio.unwrap_or(1.0),
            ..options(None, shared_memory)
        };
        let agent = join_with(init_method, rank, world_size, plugins, options).await?;
        // As `wasmrpc worker` does: a graceful shutdown serves calls until
        // every worker of the group has called it.
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    })
}

fn unix_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// `wasmrpc-bench init-worker`: prints `ready`, then for each init method,
/// waits for `go` on stdin, runs `init_rpc` and a graceful shutdown, and
/// prints `done T0 T1` (Unix microseconds).
pub(crate) fn init_runs(
    init_methods: &[String],
    rank: u32,
    world_size: u32,
    threads: usize,
) -> Result<()> {
    let rt = runtime(threads)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "ready")?;
    stdout.flush()?;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    for method in init_methods {
        match lines.next() {
            Some(Ok(l)) if l.trim() == "go" => {}
            _ => return Ok(()),
        }
        let t0 = unix_micros();
        rt.block_on(async {
            let agent = join(method, rank, world_size, &[], None, false).await?;
            agent.shutdown(true, Duration::ZERO).await?;
            anyhow::Ok(())
        })?;
        let t1 = unix_micros();
        writeln!(stdout, "done {t0} {t1}")?;
        stdout.flush()?;
    }
    Ok(())
}
