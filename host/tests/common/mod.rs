//! What the tests that run the `wasmrpc` binary share.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The variables that give a process credentials: the tests give them
/// explicitly, never by inheritance.
pub(crate) const CREDENTIAL_ENV: [&str; 8] = [
    "WASMRPC_CLUSTER_SECRET",
    "WASMRPC_CLUSTER_SECRET_FILE",
    "WASMRPC_TLS_CA",
    "WASMRPC_TLS_CERT",
    "WASMRPC_TLS_KEY",
    "WASMRPC_TLS_CA_PEM",
    "WASMRPC_TLS_CERT_PEM",
    "WASMRPC_TLS_KEY_PEM",
];

/// Runs the binary with `args`, failing the test if it outlives `deadline`
/// (a hang must fail, not stall the run).
pub(crate) fn wasmrpc(args: &[&str], deadline: Duration) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    cmd.args(args).env("RUST_LOG", "info");
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    run_with_deadline(&mut cmd, deadline)
}

/// Runs `cmd` to completion with its output captured, killing it and
/// failing the test if it outlives `deadline`.
pub(crate) fn run_with_deadline(cmd: &mut Command, deadline: Duration) -> Output {
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

pub(crate) fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
