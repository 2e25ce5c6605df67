//! A process the bench starts ends when the bench is gone, even one that
//! is still joining its group: a bench killed mid-start leaves no worker
//! behind.

use std::process::Command;
use std::time::{Duration, Instant};

/// Whether process `pid` still runs (a zombie waiting for a reaper does
/// not).
fn runs(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let after_name = stat.rsplit_once(')')?.1.to_string();
            after_name.split_whitespace().next().map(|s| s != "Z")
        })
        .unwrap_or(false)
}

#[test]
fn a_joining_worker_whose_bench_died_exits() {
    // `sh` stands for the bench: it starts a worker that joins a group
    // whose store never answers (port 9, nothing listens), names it its
    // parent, and exits at once.
    let out = Command::new("sh")
        .args([
            "-c",
            "WASMRPC_BENCH_PARENT=$$ \"$0\" worker --init-method tcp://127.0.0.1:9 --rank 1 \
             --world-size 2 --threads 1 >/dev/null 2>&1 & echo $!",
            env!("CARGO_BIN_EXE_wasmrpc-bench"),
        ])
        .output()
        .expect("sh runs");
    let pid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!pid.is_empty(), "no pid: {out:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while runs(&pid) {
        assert!(
            Instant::now() < deadline,
            "worker {pid} still runs 10 s after its bench exited"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
