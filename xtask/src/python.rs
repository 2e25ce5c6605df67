//! `cargo xtask python`: builds the `wasmrpc` Python package (the PyO3
//! crate `host/python`) with maturin and installs it into the project's
//! torch venv, the environment whose libtorch the module links.
//!
//! maturin comes from PyPI into that venv (pinned, once). The wheel is
//! built in the workspace's target folder, so the host's crates compiled
//! for the tests or the binary are reused, and left in
//! `target/wheels/`, from where `pip install` can take it into another
//! environment with the same torch.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::process::{self, step};

/// The maturin release the package is built with.
const MATURIN: &str = "maturin==1.16.0";

/// Installs maturin into `venv` unless it is there.
fn ensure_maturin(venv: &Path) -> Result<PathBuf> {
    let maturin = venv.join("bin/maturin");
    if maturin.is_file() {
        return Ok(maturin);
    }
    step(&format!(
        "python: installing {MATURIN} from PyPI into {}",
        venv.display()
    ));
    process::run(Command::new(venv.join("bin/pip")).args([
        "install",
        "--disable-pip-version-check",
        "--quiet",
        MATURIN,
    ]))?;
    if !maturin.is_file() {
        bail!("{MATURIN} installed no {}", maturin.display());
    }
    Ok(maturin)
}

/// Builds the wheel (optimized unless `debug`) and installs it into the
/// torch venv; returns the wheel's path.
pub(crate) fn install(root: &Path, venv: &Path, debug: bool) -> Result<PathBuf> {
    let maturin = ensure_maturin(venv)?;
    let python = venv.join("bin/python");
    let wheels = root.join("target/wheels");
    // A wheel left by an earlier build must not be the one installed.
    let _ = std::fs::remove_dir_all(&wheels);
    step(&format!(
        "python: maturin build{} of host/python (the host's crates, then the module; \
         several minutes the first time in release)",
        if debug { "" } else { " --release" }
    ));
    let mut build = Command::new(&maturin);
    build
        .args([
            "build",
            "--manifest-path",
            "host/python/Cargo.toml",
            "--interpreter",
        ])
        .arg(&python)
        .arg("--out")
        .arg(&wheels)
        // The module links the torch installed beside it, never a copy:
        // no repair (which would bundle libtorch), a plain `linux` tag.
        .args(["--auditwheel", "skip", "--compatibility", "linux"])
        .current_dir(root);
    if !debug {
        build.arg("--release");
    }
    process::run(&mut build)?;
    let wheel = std::fs::read_dir(&wheels)
        .with_context(|| format!("maturin wrote nothing to {}", wheels.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("no wheel in {}", wheels.display()))?;
    step(&format!("python: pip install {}", wheel.display()));
    process::run(
        Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "--disable-pip-version-check",
                "--quiet",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(&wheel),
    )?;
    // The check a user would make first.
    let check = process::output(
        Command::new(&python).args(["-c", "import wasmrpc, wasmrpc.rpc; print(wasmrpc.__file__)"]),
    )
    .context("the installed package does not import")?;
    println!(
        "python: installed; `{} -c 'from wasmrpc import rpc'` imports {}",
        python.display(),
        check.trim()
    );
    Ok(wheel)
}
