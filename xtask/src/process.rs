//! Running child commands with their output passed through, and step headers.

use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;

/// Prints a step header, so a long run shows where it is.
pub(crate) fn step(what: &str) {
    println!("\n==> {what}");
}

/// Runs `cargo ARGS` in `root`, failing if it fails.
pub(crate) fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).args(args).current_dir(root))
}

/// Runs `cmd` with inherited output, failing with its command line if it fails.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let line = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start {line}"))?;
    if !status.success() {
        bail!("{line} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` and returns its standard output, failing if it fails.
pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    let line = format!("{cmd:?}");
    let out = cmd
        .output()
        .with_context(|| format!("could not start {line}"))?;
    if !out.status.success() {
        bail!(
            "{line} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `cmd` with its standard error passed through (a build's progress
/// stays visible) and returns its standard output, failing if it fails.
pub(crate) fn stdout(cmd: &mut Command) -> Result<String> {
    let line = format!("{cmd:?}");
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("could not start {line}"))?;
    if !out.status.success() {
        bail!("{line} failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
