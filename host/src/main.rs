//! The `wasmrpc` command: one worker of a cluster (`wasmrpc worker`), or a
//! whole local cluster (`wasmrpc launch`). Thin: flags live in `cli`, the
//! work in the `wasmrpc` library.

mod cli;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    cli::init_logging();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("wasmrpc: error: {}", cli::error_report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
