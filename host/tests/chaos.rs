//! Chaos: the demo's group losing a worker the ways operators lose them.
//!
//! - A trainer stopped (`SIGSTOP`: its sockets stay open, it answers
//!   nothing) is declared failed by its peers within the failure window,
//!   with the cause, and the whole group ends in bounded time, well before
//!   the calls' own 60 s timeout.
//! - Trainers killed (`SIGKILL`) three times at random moments, under
//!   `wasmrpc launch --max-restarts 3`: each time the group restarts,
//!   resumes from its last checkpoint, and the job ends with the held-out
//!   accuracy of a run nobody disturbed.
//! - The same under torchrun's own elastic agent (`torchrun --max-restarts
//!   3 --no-python wasmrpc worker ...`): a killed trainer, a restarted
//!   group on the agent's store, and a resumed job.
//!
//! Every run here is bounded: a hang fails the test.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

#[allow(dead_code, reason = "helpers shared with the CLI tests")]
mod common;

use common::demo::{accuracy, checkpointed_step, children, data_dir};
use common::{CREDENTIAL_ENV, ServingProcess, text, wasmrpc};

const TRAINERS: usize = 3;

/// `wasmrpc launch` of the demo: `epochs` epochs on [`TRAINERS`] trainers,
/// checkpoints in `checkpoints`, then `extra` flags.
fn launch_args(epochs: usize, checkpoints: &Path, result: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "launch".into(),
        "--nproc".into(),
        (TRAINERS + 1).to_string(),
        "--plugins".into(),
        wasmrpc_plugins::PARAM_SERVER.into(),
        "--grant-dir".into(),
        format!("param_server:/data={}:ro", data_dir().display()),
        "--grant-dir".into(),
        format!("param_server:/ckpt={}:rw", checkpoints.display()),
        "--entry".into(),
        "param_server::run".into(),
        "--result".into(),
        result.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--".into(), TRAINERS.to_string(), epochs.to_string()]);
    args
}

fn start_launch(name: &str, args: &[String]) -> ServingProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    cmd.args(args).env("RUST_LOG", "info");
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    ServingProcess::start(name, cmd)
}

/// The pid of the live worker `name` among `launcher`'s children.
fn worker_pid(launcher: u32, name: &str) -> Option<u32> {
    children(launcher).into_iter().find(|pid| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        args.windows(2)
            .any(|w| w[0] == b"--name" && w[1] == name.as_bytes())
    })
}

fn signal(signal: &str, pid: u32) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {signal} {pid} failed");
}

/// Waits until the checkpoint folder holds step `step` or later.
fn wait_for_step(launch: &mut ServingProcess, checkpoints: &Path, step: i64) {
    let started = Instant::now();
    while checkpointed_step(checkpoints).is_none_or(|s| s < step) {
        assert!(
            launch.exited().is_none(),
            "the run ended before epoch {step} was checkpointed:\n{}",
            launch.output()
        );
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint of epoch {step} came:\n{}",
            launch.output()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_stopped_trainer_is_reported_within_the_window_and_the_group_ends() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let checkpoints = dir.path().join("ckpt");
    std::fs::create_dir_all(&checkpoints).expect("a checkpoint folder");
    // More epochs than the test lets it run, and a call timeout far beyond
    // the test's bound: only the failure detection can end this run in time.
    let args = launch_args(
        500,
        &checkpoints,
        &dir.path().join("r.json"),
        &["--rpc-timeout", "600"],
    );
    let mut launch = start_launch("launch", &args);
    wait_for_step(&mut launch, &checkpoints, 1);
    let trainer = worker_pid(launch.pid(), "worker2").expect("worker2 runs");
    signal("-STOP", trainer);
    let stopped = Instant::now();
    let status = launch.wait_exit(Duration::from_secs(40));
    let took = stopped.elapsed();
    // The launcher stopped the group (SIGKILL ends a stopped process too).
    let _ = Command::new("kill")
        .args(["-CONT", &trainer.to_string()])
        .status();
    let output = launch.output();
    assert!(!status.success(), "{output}");
    assert!(
        output.contains("worker2 failed: no heartbeat for 2.0 s"),
        "the cause is not reported:\n{output}"
    );
    assert!(
        output.contains("entry param_server::run on worker0 failed"),
        "{output}"
    );
    eprintln!("a stopped trainer ended the group {took:.1?} after SIGSTOP");
}

/// A small xorshift64* generator: the test's random moments, from a seed it
/// prints, so a failure can be replayed.
struct Chaos(u64);

impl Chaos {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % below
    }
}

/// What the demo reports when it goes on from a checkpoint.
const RESUMED: &str = "resumed from the checkpoint of epoch";

#[test]
fn the_demo_survives_three_killed_trainers_with_the_same_accuracy() {
    const EPOCHS: usize = 8;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let (calm, chaos) = (dir.path().join("calm"), dir.path().join("chaos"));
    for d in [&calm, &chaos] {
        std::fs::create_dir_all(d).expect("a checkpoint folder");
    }

    // The run nobody disturbs.
    let calm_result = dir.path().join("calm.json");
    let args = launch_args(EPOCHS, &calm, &calm_result, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = wasmrpc(&args, Duration::from_secs(180));
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let reference = accuracy(&calm_result);

    // The same run, a trainer killed after each of the first three
    // checkpoints, at a random moment of the next epoch.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    eprintln!("chaos seed {seed}");
    let mut rng = Chaos(seed);
    let chaos_result = dir.path().join("chaos.json");
    let args = launch_args(EPOCHS, &chaos, &chaos_result, &["--max-restarts", "3"]);
    let mut launch = start_launch("launch --max-restarts 3", &args);
    for kill in 1..=3 {
        // After a restart: once the new group resumed, one more epoch of
        // its own, so each kill hits a group that is training.
        let started = Instant::now();
        while launch.output().matches(RESUMED).count() < kill - 1 {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "restart {} did not resume (seed {seed}):\n{}",
                kill - 1,
                launch.output()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let resumed_at = checkpointed_step(&chaos).unwrap_or(0);
        wait_for_step(&mut launch, &chaos, resumed_at + 1);
        std::thread::sleep(Duration::from_millis(rng.next(400)));
        let name = format!("worker{}", 1 + rng.next(TRAINERS as u64));
        // A restarted group may still be starting its workers.
        let started = Instant::now();
        let pid = loop {
            if let Some(pid) = worker_pid(launch.pid(), &name) {
                break pid;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{name} does not run (seed {seed}):\n{}",
                launch.output()
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        signal("-KILL", pid);
        eprintln!("killed {name} after epoch {}'s checkpoint", resumed_at + 1);
        // The next kill is for the restarted group.
        let started = Instant::now();
        while worker_pid(launch.pid(), &name) == Some(pid) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{name} lives on"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let status = launch.wait_exit(Duration::from_secs(240));
    let output = launch.output();
    assert!(status.success(), "seed {seed}:\n{output}");
    for n in 1..=3 {
        assert!(
            output.contains(&format!("restarting the group ({n} of 3)")),
            "no restart {n} (seed {seed}):\n{output}"
        );
    }
    // Each restarted group went on from its checkpoint, not from scratch
    // (which would end at the same accuracy, only later).
    let resumed = output
        .matches("resumed from the checkpoint of epoch")
        .count();
    assert!(
        resumed >= 3,
        "{resumed} resumptions (seed {seed}):\n{output}"
    );
    let survived = accuracy(&chaos_result);
    assert_eq!(survived.len(), EPOCHS, "{survived:?}");
    let (last, expected) = (survived[EPOCHS - 1], reference[EPOCHS - 1]);
    assert!(
        (last - expected).abs() <= 0.01,
        "after three kills the run reached {last:.4}, undisturbed {expected:.4} (seed {seed})"
    );
}

#[test]
fn under_torchrun_a_killed_trainer_restarts_the_group_which_resumes() {
    const EPOCHS: usize = 5;
    let Some(env) = std::env::var_os("WASMRPC_ENV") else {
        println!("wasmrpc-skip: WASMRPC_ENV is not set (run `cargo xtask setup`)");
        return;
    };
    let torchrun = Path::new(&env).join("venv/bin/torchrun");
    if !torchrun.exists() {
        println!("wasmrpc-skip: torchrun not found at {}", torchrun.display());
        return;
    }
    let dir = tempfile::tempdir().expect("a temporary folder");
    let checkpoints = dir.path().join("ckpt");
    std::fs::create_dir_all(&checkpoints).expect("a checkpoint folder");
    let result = dir.path().join("result.json");
    let mut cmd = Command::new(&torchrun);
    cmd.args(["--no-python", "--standalone", "--max-restarts", "3"])
        .args(["--nproc-per-node", &(TRAINERS + 1).to_string()])
        .arg(env!("CARGO_BIN_EXE_wasmrpc"))
        .args(["worker", "--plugins", wasmrpc_plugins::PARAM_SERVER])
        .arg("--grant-dir")
        .arg(format!("param_server:/data={}:ro", data_dir().display()))
        .arg("--grant-dir")
        .arg(format!("param_server:/ckpt={}:rw", checkpoints.display()))
        // torchrun gives every worker the same command line.
        .args(["--entry", "param_server::run", "--entry-rank", "0"])
        .arg("--result")
        .arg(&result)
        .args(["--", &TRAINERS.to_string(), &EPOCHS.to_string()])
        .env("RUST_LOG", "info");
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    let mut run = ServingProcess::start("torchrun", cmd);
    wait_for_step(&mut run, &checkpoints, 1);
    // torchrun's workers are its children; its agent's own process is the
    // one this test started.
    let trainer = worker_pid_by_rank(run.pid(), 2).expect("rank 2 runs under torchrun");
    signal("-KILL", trainer);
    let status = run.wait_exit(Duration::from_secs(240));
    let output = run.output();
    assert!(status.success(), "{output}");
    assert!(
        output.contains(RESUMED),
        "the restarted group did not resume:\n{output}"
    );
    assert_eq!(accuracy(&result).len(), EPOCHS, "{output}");
}

/// The pid of the worker of rank `rank` among `agent`'s children (torchrun
/// names none: it tells them their rank in `RANK`).
fn worker_pid_by_rank(agent: u32, rank: u32) -> Option<u32> {
    children(agent).into_iter().find(|pid| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        environ
            .split(|&b| b == 0)
            .any(|v| v == format!("RANK={rank}").as_bytes())
    })
}
