//! The `wasmrpc` binary as users run it: whole local clusters of worker
//! processes through `wasmrpc launch`, single workers, and their errors.
//!
//! These tests start real processes, so they live in the host package, where
//! cargo hands them the binary's path (`CARGO_BIN_EXE_wasmrpc`).

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the binary with `args`, failing the test if it outlives `deadline`
/// (a hang must fail, not stall the run).
fn wasmrpc(args: &[&str], deadline: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wasmrpc"))
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the wasmrpc binary starts");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait on wasmrpc").is_some() {
            return child.wait_with_output().expect("collect wasmrpc output");
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect wasmrpc output");
            panic!(
                "wasmrpc {args:?} ran for more than {deadline:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn launch_starts_a_local_cluster_where_every_worker_answers() {
    let out = wasmrpc(&["launch", "--nproc", "3"], Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    for peer in ["worker1", "worker2"] {
        assert!(
            stdout.contains(&format!("[worker0] worker0 -> {peer}: answered")),
            "no answer from {peer}:\n{stdout}"
        );
    }
    for worker in ["worker0", "worker1", "worker2"] {
        assert!(
            stderr.contains(&format!("[{worker}]"))
                && stderr.contains(&format!("{worker}: shut down")),
            "{worker} did not shut down cleanly:\n{stderr}"
        );
    }
}

#[test]
fn launch_fails_and_stops_every_worker_when_the_entry_fails() {
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "2",
            "--entry",
            "nowhere::missing",
            "--",
            "1",
        ],
        Duration::from_secs(60),
    );
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "launch should fail:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("nowhere::missing is not registered on worker worker0"),
        "the error names neither function nor worker:\n{stderr}"
    );
    assert!(stderr.contains("worker0 failed"), "{stderr}");
}

#[test]
fn worker_reports_an_unknown_init_method() {
    let out = wasmrpc(
        &[
            "worker",
            "--rank",
            "0",
            "--world-size",
            "1",
            "--init-method",
            "bogus://nowhere",
        ],
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("No rendezvous handler for bogus://"),
        "unexpected error:\n{stderr}"
    );
}

#[test]
fn a_single_worker_group_over_a_file_store_runs_and_shuts_down() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("file://{}", dir.path().join("store").display());
    let out = wasmrpc(
        &[
            "worker",
            "--rank",
            "0",
            "--world-size",
            "1",
            "--init-method",
            &url,
        ],
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("worker0: rank 0 of 1 workers"), "{stderr}");
}

#[test]
fn help_explains_the_commands_and_init_methods() {
    let out = wasmrpc(&["--help"], Duration::from_secs(10));
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    assert!(
        stdout.contains("launch") && stdout.contains("worker"),
        "{stdout}"
    );
    let out = wasmrpc(&["worker", "--help"], Duration::from_secs(10));
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("env://") && stdout.contains("tcp://") && stdout.contains("file://"),
        "{stdout}"
    );
}
