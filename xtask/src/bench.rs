//! `cargo xtask bench`: the benchmark suite (`bench/`, package
//! `wasmrpc-bench`) in release mode, after the set-up it needs (torch and
//! numpy in the venv, for the torch.distributed.rpc side).
//!
//! `cargo xtask bench collectives`: the c10d section instead
//! (`host/c10d/benches/collectives.rs` beside
//! `bench/torch_collectives_bench.py`, torch.distributed with its Gloo).
//!
//! `cargo xtask bench upgrade`: what a plugin upgrade and a rollback cost
//! the calls around the switch (`wasmrpc-upgrade-bench`; PyTorch has no
//! counterpart, so it has no torch column).
//!
//! A full run of either writes its table into the guide
//! (`docs/src/benchmarks/results.md`, see `results`).

mod results;

use crate::process::{self, step};
use anyhow::Result;
use std::path::Path;

/// Builds and runs `wasmrpc-bench` with `args` (e.g. `--quick`, `--only
/// echo`, `--baseline target/bench/latest.jsonl`); see `--help`.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some("upgrade") {
        step(
            "bench upgrade: calls through a plugin upgrade and a rollback (cargo run --release -p \
             wasmrpc-bench --bin wasmrpc-upgrade-bench)",
        );
        process::cargo(
            root,
            &[
                "run",
                "--release",
                "--quiet",
                "-p",
                "wasmrpc-bench",
                "--bin",
                "wasmrpc-upgrade-bench",
            ],
        )?;
        return results::record_upgrade(root);
    }
    if args.first().map(String::as_str) == Some("collectives") {
        collectives(root, &args[1..])?;
        return match results::records_collectives(&args[1..]) {
            Ok(()) => results::record_collectives(root),
            Err(why) => {
                println!("bench: the guide's table is left as it is ({why})");
                Ok(())
            }
        };
    }
    step(
        "bench: the Python package's release build, for the rows of a Python program (cargo build \
         --release -p wasmrpc-python)",
    );
    process::cargo(
        root,
        &["build", "--release", "--quiet", "-p", "wasmrpc-python"],
    )?;
    step(
        "bench: wasmrpc beside torch.distributed.rpc and the raw limits (cargo run --release -p wasmrpc-bench)",
    );
    let mut cargo_args = vec!["run", "--release", "--quiet", "-p", "wasmrpc-bench", "--"];
    cargo_args.extend(args.iter().map(String::as_str));
    process::cargo(root, &cargo_args)?;
    match results::records_suite(args) {
        Ok(()) => results::record_suite(root),
        Err(why) => {
            println!("bench: the guide's table is left as it is ({why})");
            Ok(())
        }
    }
}

/// Builds and runs the collectives bench with `args` (`--quick`, `--rounds
/// N`, `--world N`, `--backend tcp`, `--out FILE`).
fn collectives(root: &Path, args: &[String]) -> Result<()> {
    step(
        "bench collectives: wasmrpc-c10d's gloo beside torch.distributed's Gloo, 4 ranks \
         (cargo bench -p wasmrpc-c10d --bench collectives)",
    );
    let mut cargo_args = vec![
        "bench",
        "--quiet",
        "-p",
        "wasmrpc-c10d",
        "--bench",
        "collectives",
        "--",
    ];
    cargo_args.extend(args.iter().map(String::as_str));
    process::cargo(root, &cargo_args)
}
