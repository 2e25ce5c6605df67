//! The `wasmrpc` command: one worker of a cluster (`wasmrpc worker`), or a
//! whole local cluster (`wasmrpc launch`). Thin: flags live in `cli`, the
//! work in the `wasmrpc` library.

mod cli;

use clap::Parser;

/// jemalloc for the whole process, libtorch's C++ included (`wasmrpc_alloc`).
#[global_allocator]
static ALLOCATOR: wasmrpc_alloc::Allocator = wasmrpc_alloc::Allocator;

fn main() -> std::process::ExitCode {
    wasmrpc::set_memory_release(wasmrpc_alloc::release_freed_memory);
    wasmrpc::serve_as_compile_helper();
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
