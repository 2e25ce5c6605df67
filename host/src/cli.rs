//! Command-line flags and the environment a worker reads (rank, world size,
//! init method), and the dispatch to each subcommand.

mod launch;
mod plugin;
mod worker;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
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
    Worker(worker::WorkerArgs),
    /// Start a local cluster: host the store, run N workers as child
    /// processes (their log lines prefixed with their name), run the entry
    /// function on worker0, then shut everything down. Stops every worker,
    /// with a non-zero exit, as soon as one fails.
    Launch(launch::LaunchArgs),
    /// Tools for plugin files: `wasmrpc plugin inspect FILE` prints a
    /// plugin's manifest.
    Plugin(plugin::PluginArgs),
}

/// Sets up `tracing` output on stderr, filtered by `RUST_LOG` (default: info).
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
            runtime.block_on(worker::run(args))
        }
        Command::Launch(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            runtime.block_on(launch::run(args))
        }
        Command::Plugin(args) => plugin::run(args),
    }
}

/// Parses a duration given in seconds, as PyTorch's timeouts are (`0.5`,
/// `60`); 0 means no timeout where the flag says so.
pub(crate) fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}
