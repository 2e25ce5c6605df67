//! `cargo xtask bench`: the benchmark suite (`bench/`, package
//! `wasmrpc-bench`) in release mode, after the set-up it needs (torch and
//! numpy in the venv, for the torch.distributed.rpc side).

use crate::process::{self, step};
use anyhow::Result;
use std::path::Path;

/// Builds and runs `wasmrpc-bench` with `args` (e.g. `--quick`, `--only
/// echo`, `--baseline target/bench/latest.jsonl`); see `--help`.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    step(
        "bench: wasmrpc beside torch.distributed.rpc and the raw limits (cargo run --release -p wasmrpc-bench)",
    );
    let mut cargo_args = vec!["run", "--release", "--quiet", "-p", "wasmrpc-bench", "--"];
    cargo_args.extend(args.iter().map(String::as_str));
    process::cargo(root, &cargo_args)
}
