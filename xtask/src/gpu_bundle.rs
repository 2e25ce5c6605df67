//! `cargo xtask gpu-bundle`: the GPU-relevant test binaries built against
//! the libtorch of another PyTorch release (by default 2.11.0, the one the
//! GPU machines' image ships), packed with what runs them on a machine that
//! has a GPU and that PyTorch but no Rust toolchain.
//!
//! What it owns: the libtorch of that release in the cache folder
//! (`libtorch-<version>/site-packages`, from PyPI's wheel, with the NCCL
//! headers its wheel pins and the set-up's CUDA headers), the build of the
//! tests against it in `target/gpu-bundle/torch-<version>/`, and the bundle
//! folder `target/gpu-bundle/wasmrpc-gpu-torch-<version>/`: a nextest
//! archive of the test binaries and the plugins, the `cargo-nextest`
//! binary, `run.sh` (`xtask/gpu-bundle/run.sh`) and `bundle.env`. It leaves
//! the main build (`target/debug`, `.wasmrpc-env/`) alone. Fetching and
//! building against that release is `torch_release`'s.

use crate::process::{self, commit, make_executable, step};
use crate::setup;
use crate::torch_release::{TorchInfo, cargo_against, check_tch_api_compiles, ensure_libtorch};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyTorch release the GPU machines' image ships.
pub(crate) const DEFAULT_TORCH: &str = "2.11.0";
/// The test binaries in the bundle: `(package, test target)`. The ported
/// seed suites (their GPU tests among them), the c10d engines, the shim's
/// ops, the run-time loading of libtorch's CUDA side (`cuda_load`, whose
/// automatic case must load CUDA and see the GPU there), and the shim's
/// CUDA streams, events and sleep kernel (`cuda_stream`).
const TESTS: &[(&str, &str)] = &[
    ("wasmrpc-tests", "all"),
    ("wasmrpc-torch-sys", "ops"),
    ("wasmrpc-torch-sys", "cuda_load"),
    ("wasmrpc-torch-sys", "cuda_stream"),
    ("wasmrpc-c10d", "nccl_engine"),
    ("wasmrpc-c10d", "ddp_backends"),
    ("wasmrpc-c10d", "gloo_engine"),
    ("wasmrpc-c10d", "c10d_common_test"),
];
/// The script that runs the bundle on the GPU machine.
const RUN_SCRIPT: &str = "xtask/gpu-bundle/run.sh";
/// The script that runs the bench (`--bench`) there.
const BENCH_SCRIPT: &str = "xtask/gpu-bundle/run-bench.sh";
/// Where the plugins' .wasm files are, relative to the target folder.
const PLUGINS_REL: &str = "wasm-plugins/wasm32-unknown-unknown/release";
/// What the device tool carries at most in one call.
const CARRY_LIMIT: u64 = 64 << 20;

/// Builds the bundle for torch `version` (and, with `bench`, the bench
/// beside it) and returns its folder.
pub(crate) fn run(root: &Path, version: &str, bench: bool) -> Result<PathBuf> {
    let venv = setup::run(root)?;
    let site = ensure_libtorch(&venv, version)?;
    let torch = site.join("torch");
    check_tch_api_compiles(root, &torch, version)?;

    let out = root.join("target").join("gpu-bundle");
    let target = out.join(format!("torch-{version}"));
    let bundle = out.join(format!("wasmrpc-gpu-torch-{version}"));
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)
            .with_context(|| format!("could not remove the old {}", bundle.display()))?;
    }
    std::fs::create_dir_all(&bundle)?;

    step(&format!(
        "gpu-bundle: building the tests against libtorch {version} into {} \
         (a full build on the first run)",
        target.display()
    ));
    build_archive(root, &torch, &target, &bundle.join("tests.tar.zst"))?;

    let info = TorchInfo::read(&torch)?;
    std::fs::write(
        bundle.join("bundle.env"),
        format!(
            "BUNDLE_TORCH_VERSION='{}'\nBUNDLE_TORCH_GIT='{}'\nBUNDLE_COMMIT='{}'\n\
             BUNDLE_PLUGINS_DIR='{}'\nBUNDLE_PLUGINS_REL='{PLUGINS_REL}'\n",
            info.version,
            info.git,
            commit(root),
            target.join(PLUGINS_REL).display()
        ),
    )?;
    let script = bundle.join("run.sh");
    std::fs::copy(root.join(RUN_SCRIPT), &script)?;
    make_executable(&script)?;
    pack_nextest(&bundle)?;

    let size = folder_size(&bundle)?;
    println!(
        "gpu-bundle: {} ({:.1} MiB) for torch {}",
        bundle.display(),
        size as f64 / f64::from(1 << 20),
        info.version
    );
    if size > CARRY_LIMIT - (4 << 20) {
        println!(
            "gpu-bundle: warning: over 60 MiB; with the checkout it may not fit the 64 MiB a \
             device call carries"
        );
    }
    println!(
        "gpu-bundle: on the GPU machine, in a checkout of the same commit: \
         {}/run.sh --out OUT [nextest filters]",
        bundle.strip_prefix(root).unwrap_or(&bundle).display()
    );
    if bench {
        let dir = out.join(format!("wasmrpc-gpu-bench-torch-{version}"));
        step(&format!(
            "gpu-bundle: building the bench (release) against libtorch {version} into {}",
            dir.display()
        ));
        build_bench(root, &torch, &target, &dir)?;
        println!(
            "gpu-bundle: the bench: {}/run-bench.sh [wasmrpc-bench flags, e.g. --only cuda], \
             in a checkout of the same commit at {}",
            dir.strip_prefix(root).unwrap_or(&dir).display(),
            root.display()
        );
    }
    Ok(bundle)
}

/// Builds [`TESTS`] against `torch` into `target` and archives them, with
/// the plugins, into `archive` (`cargo nextest archive`, profile
/// `gpu-bundle` of `.config/nextest.toml`).
fn build_archive(root: &Path, torch: &Path, target: &Path, archive: &Path) -> Result<()> {
    setup::ensure_nextest()?;
    let mut args: Vec<String> = ["nextest", "archive", "--profile", "gpu-bundle"]
        .map(String::from)
        .to_vec();
    let mut packages: Vec<&str> = TESTS.iter().map(|(p, _)| *p).collect();
    packages.sort_unstable();
    packages.dedup();
    for p in packages {
        args.extend(["-p".into(), p.into()]);
    }
    for (_, t) in TESTS {
        args.extend(["--test".into(), (*t).into()]);
    }
    args.push("--archive-file".into());
    args.push(archive.display().to_string());
    process::run(
        cargo_against(root, torch, target)
            .args(&args)
            // Small enough to carry: no debug info (symbol names stay, for
            // panics' backtraces).
            .env("CARGO_PROFILE_DEV_DEBUG", "false")
            .env("CARGO_PROFILE_DEV_STRIP", "debuginfo"),
    )
}

/// Builds `wasmrpc-bench` (release) against `torch` into `target` and puts
/// it, stripped of debug info, into `dir` beside `run-bench.sh`
/// (`xtask/gpu-bundle/run-bench.sh`). About 36 MiB: it travels apart from
/// the tests' bundle.
fn build_bench(root: &Path, torch: &Path, target: &Path, dir: &Path) -> Result<()> {
    process::run(cargo_against(root, torch, target).args([
        "build",
        "--release",
        "-p",
        "wasmrpc-bench",
    ]))?;
    if dir.exists() {
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("could not remove the old {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    let bench = dir.join("wasmrpc-bench");
    std::fs::copy(target.join("release").join("wasmrpc-bench"), &bench)?;
    // Best effort: without binutils' strip the binary is only larger.
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(&bench)
        .status();
    let script = dir.join("run-bench.sh");
    std::fs::copy(root.join(BENCH_SCRIPT), &script)?;
    make_executable(&script)?;
    Ok(())
}

/// Puts the `cargo-nextest` binary that built the archive into the bundle,
/// xz-compressed where xz is installed (`run.sh` unpacks it).
fn pack_nextest(bundle: &Path) -> Result<()> {
    let nextest = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("cargo-nextest"))
        .find(|p| p.is_file())
        .context("cargo-nextest is not on PATH")?;
    let packed = Command::new("xz")
        .args(["-T0", "-6", "-c"])
        .arg(&nextest)
        .output();
    match packed {
        Ok(out) if out.status.success() => {
            std::fs::write(bundle.join("cargo-nextest.xz"), out.stdout)?;
        }
        _ => {
            let to = bundle.join("cargo-nextest");
            std::fs::copy(&nextest, &to)?;
            make_executable(&to)?;
        }
    }
    Ok(())
}

/// The bytes of the files directly in `dir` (the bundle is flat).
fn folder_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let meta = entry?.metadata()?;
        total += meta.len();
    }
    Ok(total)
}
