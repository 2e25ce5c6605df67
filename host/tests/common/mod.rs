//! What the tests that run the `wasmrpc` binary share.

#[allow(dead_code, reason = "for the tests that run the demo's job")]
pub(crate) mod demo;
#[allow(dead_code, reason = "for the tests that run two hosts")]
pub(crate) mod netns;

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
#[allow(dead_code, reason = "not every test crate sharing these uses it")]
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
    let child = spawn_captured(cmd);
    wait_with_deadline(child, &format!("{cmd:?}"), deadline)
}

/// Starts `cmd` with no stdin and its stdout and stderr captured.
pub(crate) fn spawn_captured(cmd: &mut Command) -> std::process::Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"))
}

/// Waits for `child` (`what`, for the message) and collects its output,
/// killing it and failing the test if it outlives `deadline`.
pub(crate) fn wait_with_deadline(
    mut child: std::process::Child,
    what: &str,
    deadline: Duration,
) -> Output {
    let started = Instant::now();
    while child.try_wait().expect("wait on the child").is_none() {
        if started.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect the output");
            panic!(
                "{what} ran for more than {deadline:?}\nstdout:\n{}\nstderr:\n{}",
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

/// A `wasmrpc` process that serves until SIGTERM, with its stdout and
/// stderr collected as they come.
pub(crate) struct ServingProcess {
    name: String,
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl ServingProcess {
    /// Starts `cmd` as `name` (for messages).
    pub(crate) fn start(name: &str, mut cmd: Command) -> ServingProcess {
        use std::io::{BufRead, BufReader};
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name} ({cmd:?}) does not start: {e}"));
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for stream in [
            Box::new(child.stdout.take().expect("piped stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("piped stderr")),
        ] {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().expect("lines lock").push(line);
                }
            });
        }
        ServingProcess {
            name: name.to_owned(),
            child,
            lines,
        }
    }

    /// What it printed so far.
    pub(crate) fn output(&self) -> String {
        self.lines.lock().expect("lines lock").join("\n")
    }

    /// Waits until it printed `what`, failing the test if it exits first or
    /// takes more than a minute.
    #[allow(dead_code, reason = "not every test crate sharing these uses it")]
    pub(crate) fn wait_for(&mut self, what: &str) {
        let started = Instant::now();
        while !self.output().contains(what) {
            if started.elapsed() > Duration::from_secs(60)
                || self.child.try_wait().ok().flatten().is_some()
            {
                panic!("{}: no {what:?} in:\n{}", self.name, self.output());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its process id.
    #[allow(
        dead_code,
        reason = "for the chaos tests; not every test crate sharing these uses it"
    )]
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited, and how.
    #[allow(
        dead_code,
        reason = "for the chaos tests; not every test crate sharing these uses it"
    )]
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("wait on the process")
    }

    /// Waits for it to exit, failing the test (with what it printed) if it
    /// runs for more than `within`.
    #[allow(
        dead_code,
        reason = "for the chaos tests; not every test crate sharing these uses it"
    )]
    pub(crate) fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                // Its last lines, read by the threads after the exit.
                std::thread::sleep(Duration::from_millis(200));
                return status;
            }
            assert!(
                started.elapsed() < within,
                "{} ran for more than {within:?}:\n{}",
                self.name,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then waits for a clean exit (a graceful leave); returns
    /// everything it printed.
    #[allow(dead_code, reason = "not every test crate sharing these uses it")]
    pub(crate) fn stop(mut self) -> String {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(
            sent.is_ok_and(|s| s.success()),
            "cannot signal {}",
            self.name
        );
        let started = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait on the worker") {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{} did not stop:\n{}",
                self.name,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // Its last lines, read by the threads after the exit.
        std::thread::sleep(Duration::from_millis(200));
        assert!(status.success(), "{}:\n{}", self.name, self.output());
        self.output()
    }
}

impl Drop for ServingProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
