//! The demo's job as a real job: the parameter server reads its data from a
//! granted folder, checkpoints every epoch into another, and a run killed
//! part-way (`SIGKILL` of the launcher and every worker) resumes from its
//! last checkpoint (`param_server::resume`) to the same held-out accuracy
//! as a run that was never interrupted.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

// This test uses the one-shot runner of the shared helpers, not the
// serving process.
#[allow(dead_code, reason = "helpers shared with the CLI tests")]
mod common;

use common::demo::{accuracy, checkpointed_step, data_dir};
use common::{CREDENTIAL_ENV, text, wasmrpc};

/// Trainers and epochs of these runs: small enough to be quick, long
/// enough to interrupt.
const TRAINERS: &str = "3";
const EPOCHS: usize = 5;

fn launch_args(entry: &str, checkpoints: &Path, result: &Path) -> Vec<String> {
    vec![
        "launch".into(),
        "--nproc".into(),
        "4".into(),
        "--plugins".into(),
        wasmrpc_plugins::PARAM_SERVER.into(),
        "--grant-dir".into(),
        format!("param_server:/data={}:ro", data_dir().display()),
        "--grant-dir".into(),
        format!("param_server:/ckpt={}:rw", checkpoints.display()),
        "--entry".into(),
        entry.into(),
        "--result".into(),
        result.display().to_string(),
        "--".into(),
        TRAINERS.into(),
        EPOCHS.to_string(),
    ]
}

fn run(args: &[String]) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    wasmrpc(&args, Duration::from_secs(180))
}

#[test]
fn a_killed_demo_resumes_from_its_last_checkpoint_to_the_same_accuracy() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let (whole, interrupted) = (dir.path().join("whole"), dir.path().join("interrupted"));
    for d in [&whole, &interrupted] {
        std::fs::create_dir_all(d).expect("a checkpoint folder");
    }

    // Resuming with nothing to resume from says so.
    let out = run(&launch_args(
        "param_server::resume",
        &interrupted,
        &dir.path().join("none.json"),
    ));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no checkpoint to resume from in /ckpt: start with param_server::run"),
        "{stderr}"
    );

    // A run that is never interrupted.
    let whole_result = dir.path().join("whole.json");
    let out = run(&launch_args("param_server::run", &whole, &whole_result));
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let reference = accuracy(&whole_result);
    assert_eq!(reference.len(), EPOCHS);
    assert_eq!(checkpointed_step(&whole), Some(EPOCHS as i64));

    // The same run, killed (launcher and workers, SIGKILL) once two epochs
    // are checkpointed.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    cmd.args(launch_args(
        "param_server::run",
        &interrupted,
        &dir.path().join("killed.json"),
    ))
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().expect("launch starts");
    let started = Instant::now();
    let killed_at = loop {
        if let Some(step) = checkpointed_step(&interrupted).filter(|&s| s >= 2) {
            break step;
        }
        assert!(
            child.try_wait().expect("wait on launch").is_none(),
            "the run ended before it could be interrupted"
        );
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint came"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let group = format!("-{}", child.id());
    let status = Command::new("kill")
        .args(["-KILL", "--", &group])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -KILL {group} failed");
    let _ = child.wait();
    let step = checkpointed_step(&interrupted).expect("the checkpoint survives the kill");
    assert!(
        (killed_at..EPOCHS as i64).contains(&step),
        "killed after epoch {killed_at}, the checkpoint says {step}"
    );

    // Resumed: the remaining epochs only, and the history kept.
    let resumed_result = dir.path().join("resumed.json");
    let out = run(&launch_args(
        "param_server::resume",
        &interrupted,
        &resumed_result,
    ));
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("resumed from the checkpoint of epoch {step}")),
        "{stderr}"
    );
    let resumed = accuracy(&resumed_result);
    assert_eq!(resumed.len(), EPOCHS, "{resumed:?}");
    let (last, expected) = (resumed[EPOCHS - 1], reference[EPOCHS - 1]);
    assert!(
        (last - expected).abs() <= 0.01,
        "resumed to {last:.4}, the uninterrupted run reached {expected:.4}"
    );
    assert_eq!(checkpointed_step(&interrupted), Some(EPOCHS as i64));
}
