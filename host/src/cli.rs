//! Command-line flags and the environment a worker reads (rank, world size,
//! init method), and the dispatch to each subcommand.

mod cert;
mod credentials;
mod grants;
mod launch;
mod ops;
mod plugin;
mod top;
mod worker;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

/// wasmrpc: PyTorch-style distributed RPC between workers that run
/// registered WebAssembly functions.
///
/// Run `wasmrpc launch --nproc N` to start a local cluster, or `wasmrpc
/// worker` on each machine of a larger one (including under `torchrun
/// --no-python`). Logs go to stderr; set `RUST_LOG` (e.g. `RUST_LOG=debug`)
/// to see more.
#[derive(Parser, Debug)]
#[command(name = "wasmrpc", version, about, long_about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run one worker: rendezvous with the others, serve calls, and stop
    /// when the whole group shuts down.
    // Boxed, as `Launch`: their flags make them several times larger than
    // the others.
    Worker(Box<worker::WorkerArgs>),
    /// Start a local cluster: host the store, run N workers as child
    /// processes (their log lines prefixed with their name), run the entry
    /// function on worker0, then shut everything down. Stops every worker,
    /// with a non-zero exit, as soon as one fails.
    Launch(Box<launch::LaunchArgs>),
    /// Tools for plugin files: `wasmrpc plugin inspect FILE` prints a
    /// plugin's manifest.
    Plugin(plugin::PluginArgs),
    /// TLS credentials for a cluster: `wasmrpc cert init --out DIR` makes a
    /// cluster CA, `wasmrpc cert issue NAME --ca DIR --out DIR` a worker's
    /// certificate and key. Workers given them (--tls-ca, --tls-cert,
    /// --tls-key) accept only peers with a certificate of the same CA that
    /// names the worker they claim to be.
    Cert(cert::CertArgs),
    /// What a worker's op policy serves: `wasmrpc ops list` prints the
    /// builtin ops a worker with the same --allow-op/--deny-op/--op-policy
    /// flags runs for peers and plugins (`--denied`: what it refuses, and
    /// why); `wasmrpc ops families` the default families.
    Ops(ops::OpsArgs),
    /// A live view of a running group: one row per worker (calls served
    /// and made per second, errors, serve-time p50/p99, tensor memory,
    /// connections, pending calls) and the busiest functions, refreshed
    /// from the workers' metrics endpoints (`wasmrpc worker --metrics-addr`,
    /// `wasmrpc launch --metrics-port`).
    Top(top::TopArgs),
    /// The compile helper a worker runs for a plugin missing from its
    /// module cache (`wasmrpc::serve_as_compile_helper`): compiles the wasm
    /// bytes on standard input and writes the cache entry at `--out`.
    #[command(name = wasmrpc::COMPILE_HELPER_SUBCOMMAND, hide = true)]
    CompilePluginEntry {
        /// `module` or `component`.
        #[arg(long)]
        kind: String,
        /// The cache entry to write.
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

/// Sets up `tracing` output on stderr, filtered by `RUST_LOG` (default: info).
/// `e` and its causes on one line, each said once. A layer whose own
/// message already ends with its cause's (the store's I/O errors say what
/// failed and why, and give the I/O error as their source too) does not
/// have it repeated, as `{e:#}` would.
pub(crate) fn error_report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
}

/// Runs the parsed command on a tokio runtime of the right size.
pub(crate) fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Worker(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(args.num_worker_threads.max(1))
                .enable_all()
                .build()?;
            runtime.block_on(worker::run(*args))
        }
        Command::Launch(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            runtime.block_on(launch::run(*args))
        }
        Command::Plugin(args) => plugin::run(args),
        Command::Cert(args) => cert::run(args),
        Command::Ops(args) => ops::run(args),
        Command::Top(args) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(top::run(args))
        }
        Command::CompilePluginEntry { kind, out } => Ok(wasmrpc::wasm::helper_main(&kind, &out)),
    }
}

/// Checks each `--plugins` path before anything starts, so a missing build
/// fails once, in one line, instead of in every worker.
///
/// # Errors
/// The first path that does not exist, or is a folder without a `.wasm`
/// file; for paths under a cargo `target/` folder, the error says how to
/// build what it expected.
pub(crate) fn check_plugin_paths(paths: &[std::path::PathBuf]) -> Result<()> {
    for path in paths {
        let hint = || {
            let in_target = path.components().any(|c| c.as_os_str() == "target");
            if !in_target {
                return String::new();
            }
            if path.components().any(|c| c.as_os_str() == "wasm-plugins") {
                "; it is where this repository's plugins are built: `cargo run -q -p \
                 wasmrpc-plugins` builds them and prints their paths"
                    .to_owned()
            } else {
                "; it is a build output: build the plugin first (`cargo build --release \
                 --target wasm32-unknown-unknown` in its crate)"
                    .to_owned()
            }
        };
        if !path.exists() {
            bail!(
                "--plugins {}: no such file or folder{}",
                path.display(),
                hint()
            );
        }
        if path.is_dir() {
            let has_wasm = std::fs::read_dir(path)
                .with_context(|| format!("--plugins {}: cannot list the folder", path.display()))?
                .filter_map(|e| e.ok())
                .any(|e| e.path().extension().is_some_and(|x| x == "wasm"));
            if !has_wasm {
                bail!(
                    "--plugins {}: no plugins (*.wasm files) in the folder{}",
                    path.display(),
                    hint()
                );
            }
        }
    }
    Ok(())
}

/// The entry function's arguments, for `worker` and `launch` (which passes
/// them to the worker that runs the entry).
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct EntryArgs {
    /// The entry function's arguments as JSON: an array of positional
    /// arguments, or an object of keyword arguments, or `{"args": [...],
    /// "kwargs": {...}}` (lists, dicts, numbers, strings, booleans, null).
    #[arg(
        long,
        value_name = "JSON",
        requires = "entry",
        conflicts_with = "entry_args"
    )]
    pub(crate) entry_json: Option<String>,
    /// Arguments of the entry function: integers, floats, `true`/`false`,
    /// or strings.
    #[arg(last = true)]
    pub(crate) entry_args: Vec<String>,
}

/// The tensor memory budget flags, shared by `worker` and `launch`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct TensorMemoryArgs {
    /// The CPU tensor memory this worker's peers and plugins may hold at
    /// once through the ops it runs for them and the tensors they send
    /// (e.g. `4GiB`, `512MiB`, bytes). Over it, the call that asked fails
    /// with "tensor memory budget ... exceeded" and the worker serves on.
    /// [default: half the machine's memory (or its cgroup's limit); under
    /// `launch`, that divided among its workers]
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    tensor_memory: Option<u64>,
    /// The same limit for one call: a builtin op a peer asked for, or a
    /// plugin function with every op it runs. [default: half of
    /// --tensor-memory]
    #[arg(long, value_name = "BYTES", value_parser = parse_byte_count)]
    tensor_memory_per_call: Option<u64>,
}

impl TensorMemoryArgs {
    /// The limits these flags give a worker that is one of `workers` on
    /// this machine.
    pub(crate) fn budget(&self, workers: u32) -> wasmrpc::TensorMemoryBudget {
        let default = wasmrpc::TensorMemoryBudget::for_memory(
            wasmrpc::machine_memory() / u64::from(workers.max(1)),
        );
        let per_worker = self.tensor_memory.unwrap_or(default.per_worker);
        wasmrpc::TensorMemoryBudget {
            per_worker,
            per_call: self.tensor_memory_per_call.unwrap_or(per_worker / 2),
        }
    }

    /// The flags that give a worker process `budget`.
    pub(crate) fn child_args(budget: wasmrpc::TensorMemoryBudget) -> [String; 4] {
        [
            "--tensor-memory".into(),
            budget.per_worker.to_string(),
            "--tensor-memory-per-call".into(),
            budget.per_call.to_string(),
        ]
    }
}

fn parse_byte_count(s: &str) -> Result<u64, String> {
    wasmrpc::parse_bytes(s)
}

/// Parses a duration given in seconds, as PyTorch's timeouts are (`0.5`,
/// `60`); 0 means no timeout where the flag says so.
pub(crate) fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

/// [`wasmrpc::store::dynamic_store`], with the init method named in its
/// errors.
pub(crate) async fn dynamic_store(
    init_method: &str,
    rank: u32,
    timeout: Duration,
) -> Result<std::sync::Arc<dyn wasmrpc::store::Store>> {
    wasmrpc::store::dynamic_store(init_method, rank, timeout)
        .await
        .with_context(|| format!("cannot reach the store of {init_method}"))
}

#[cfg(test)]
mod tests {
    use super::error_report;

    /// An error that says its source in its own message and also gives it
    /// as its source, as the store's I/O errors do.
    #[derive(Debug)]
    struct Connect(std::io::Error);

    impl std::fmt::Display for Connect {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "connect to store at 127.0.0.1:1: {}", self.0)
        }
    }

    impl std::error::Error for Connect {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_said_by_its_layer_is_not_repeated() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = anyhow::Error::new(Connect(refused)).context("rendezvous through tcp://x failed");
        let report = error_report(&e);
        assert_eq!(
            report,
            "rendezvous through tcp://x failed: connect to store at 127.0.0.1:1: connection refused"
        );
        // `{e:#}` says the cause twice.
        assert!(format!("{e:#}").ends_with("connection refused: connection refused"));
    }

    #[test]
    fn causes_that_differ_are_all_said_in_order() {
        let e = anyhow::anyhow!("the socket closed")
            .context("reading the reply")
            .context("calling worker1");
        assert_eq!(
            error_report(&e),
            "calling worker1: reading the reply: the socket closed"
        );
    }
}
