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

/// Sets `path`'s mode to 0755.
pub(crate) fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("could not make {} executable", path.display()))
}

/// `HEAD`'s commit, marked `-dirty` when the work tree has changes.
pub(crate) fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        output(Command::new("git").args(args).current_dir(root)).unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])
        .trim()
        .is_empty();
    format!("{}{}", head.trim(), if dirty { "-dirty" } else { "" })
}
