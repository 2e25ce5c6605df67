//! Running child commands with their output passed through, and step headers.

use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

/// The steps of this run so far: each header and when it was printed.
static STEPS: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());

/// Prints a step header, so a long run shows where it is; the step's time
/// is counted until the next header (see [`print_step_times`]).
pub(crate) fn step(what: &str) {
    println!("\n==> {what}");
    STEPS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((what.to_string(), Instant::now()));
}

/// Prints how long each step of this run took, so a slow CI run shows
/// which phase grew.
pub(crate) fn print_step_times() {
    let steps = STEPS.lock().unwrap_or_else(|p| p.into_inner());
    if steps.is_empty() {
        return;
    }
    println!("\nsteps, in seconds:");
    let ends = steps.iter().skip(1).map(|(_, began)| *began);
    for ((what, began), end) in steps.iter().zip(ends.chain([Instant::now()])) {
        println!("  {:>7.1}  {}", (end - *began).as_secs_f64(), short(what));
    }
}

/// A step's header without its command line: the text before " (" or " --",
/// at most 60 characters.
fn short(header: &str) -> String {
    let cut = [" (", " --"]
        .iter()
        .filter_map(|sep| header.find(sep))
        .min()
        .unwrap_or(header.len());
    let head = &header[..cut];
    match head.char_indices().nth(60) {
        Some((i, _)) => format!("{}...", &head[..i]),
        None => head.to_string(),
    }
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

#[cfg(test)]
mod tests {
    use super::short;

    #[test]
    fn step_headers_are_shortened_to_what_the_step_is() {
        assert_eq!(short("tests (cargo nextest run --profile ci)"), "tests");
        assert_eq!(
            short("demo: wasmrpc launch --nproc 4 --plugins /x.wasm"),
            "demo: wasmrpc launch"
        );
        assert_eq!(short("doc tests"), "doc tests");
        let long = "x".repeat(70);
        assert_eq!(short(&long), format!("{}...", "x".repeat(60)));
    }
}
