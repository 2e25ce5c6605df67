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
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    cmd.args(args).env("RUST_LOG", "info");
    run_with_deadline(&mut cmd, deadline)
}

/// Runs `cmd` to completion with its output captured, killing it and
/// failing the test if it outlives `deadline`.
fn run_with_deadline(cmd: &mut Command, deadline: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"));
    let started = Instant::now();
    while child.try_wait().expect("wait on the child").is_none() {
        if started.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect the output");
            panic!(
                "{cmd:?} ran for more than {deadline:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect the output")
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

/// `torchrun --no-python` runs our workers unchanged: they read its
/// environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) and rendezvous on the
/// store torchrun's agent hosts.
#[test]
fn torchrun_runs_wasmrpc_workers_on_its_agent_store() {
    let Some(env) = std::env::var_os("WASMRPC_ENV") else {
        println!("wasmrpc-skip: WASMRPC_ENV is not set (run `cargo xtask setup`)");
        return;
    };
    let torchrun = std::path::Path::new(&env).join("venv/bin/torchrun");
    if !torchrun.exists() {
        println!("wasmrpc-skip: torchrun not found at {}", torchrun.display());
        return;
    }
    let mut cmd = Command::new(&torchrun);
    cmd.args(["--no-python", "--standalone", "--nproc-per-node", "2"])
        .arg(env!("CARGO_BIN_EXE_wasmrpc"))
        .args(["worker", "--ping-all"]);
    let out = run_with_deadline(&mut cmd, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "torchrun failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("worker0 -> worker1: answered"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("worker1 -> worker0: answered"),
        "{stdout}\n{stderr}"
    );
}
