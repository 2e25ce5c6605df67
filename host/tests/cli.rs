//! The `wasmrpc` binary as users run it: whole local clusters of worker
//! processes through `wasmrpc launch`, single workers, and their errors.
//!
//! These tests start real processes, so they live in the host package, where
//! cargo hands them the binary's path (`CARGO_BIN_EXE_wasmrpc`).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
#[path = "cli/pytorch_examples.rs"]
mod pytorch_examples;

use common::{
    CREDENTIAL_ENV, ServingProcess, run_with_deadline, spawn_captured, text, wait_with_deadline,
    wasmrpc,
};

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
    // Zero configuration, and still TLS with mutual authentication.
    assert!(
        stderr.contains("connections: TLS 1.3 with mutual authentication"),
        "{stderr}"
    );
    assert!(!stderr.contains("not authenticated"), "{stderr}");
}

#[test]
fn cert_init_and_issue_make_credentials_that_workers_run_tls_with() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = |p: &str| dir.path().join(p).to_str().expect("UTF-8").to_string();
    let (ca, certs) = (path("ca"), path("certs"));
    let out = wasmrpc(&["cert", "init", "--out", &ca], Duration::from_secs(30));
    assert!(out.status.success(), "{:?}", text(&out));
    for name in ["worker0", "worker1"] {
        let out = wasmrpc(
            &["cert", "issue", name, "--ca", &ca, "--out", &certs],
            Duration::from_secs(30),
        );
        assert!(out.status.success(), "{:?}", text(&out));
    }
    {
        use std::os::unix::fs::PermissionsExt;
        for key in [path("ca/ca.key"), path("certs/worker0.key")] {
            let mode = std::fs::metadata(&key).expect("key").permissions().mode();
            assert_eq!(mode & 0o077, 0, "{key} is readable by others: {mode:o}");
        }
    }
    // `init` never overwrites a CA.
    let out = wasmrpc(&["cert", "init", "--out", &ca], Duration::from_secs(30));
    assert!(!out.status.success());

    let url = format!("file://{}", path("store"));
    let tls = |name: &str| {
        vec![
            "--tls-ca".to_string(),
            path("ca/ca.pem"),
            "--tls-cert".to_string(),
            path(&format!("certs/{name}.pem")),
            "--tls-key".to_string(),
            path(&format!("certs/{name}.key")),
        ]
    };
    // A worker with another worker's certificate does not start.
    let mut stolen = vec![
        "worker",
        "--rank",
        "1",
        "--world-size",
        "2",
        "--init-method",
    ];
    stolen.push(&url);
    let stolen_tls = tls("worker0");
    stolen.extend(stolen_tls.iter().map(String::as_str));
    let out = wasmrpc(&stolen, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("another name"), "{stderr}");

    // `{name}` in a path becomes the worker's name (one setting per machine).
    let mut w1 = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    w1.args([
        "worker",
        "--rank",
        "1",
        "--world-size",
        "2",
        "--init-method",
        &url,
    ])
    .args(tls("{name}"))
    .env("RUST_LOG", "info");
    for var in CREDENTIAL_ENV {
        w1.env_remove(var);
    }
    let w1 = std::thread::spawn(move || run_with_deadline(&mut w1, Duration::from_secs(60)));
    let mut w0 = vec![
        "worker",
        "--rank",
        "0",
        "--world-size",
        "2",
        "--ping-all",
        "--init-method",
    ];
    w0.push(&url);
    let w0_tls = tls("worker0");
    w0.extend(w0_tls.iter().map(String::as_str));
    let out = wasmrpc(&w0, Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("worker0 -> worker1: answered"), "{stdout}");
    assert!(
        stderr.contains("connections: TLS 1.3 with mutual authentication"),
        "{stderr}"
    );
    let out = w1.join().expect("worker1's thread");
    assert!(out.status.success(), "{:?}", text(&out));
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
    assert!(
        stdout.contains("--tensor-memory <BYTES>")
            && stdout.contains("--tensor-memory-per-call <BYTES>"),
        "{stdout}"
    );
}

#[test]
fn a_bad_tensor_memory_budget_is_refused_by_the_flag_parser() {
    let out = wasmrpc(
        &["launch", "--nproc", "1", "--tensor-memory", "4 parsecs"],
        Duration::from_secs(10),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--tensor-memory") && stderr.contains("unknown unit"),
        "{stderr}"
    );
}

/// Each worker of `launch` gets its share of the cores for an op's
/// threads unless `--intra-op-threads` says otherwise, and says so when it
/// is up; 0 is refused by the flag parser.
#[test]
fn launch_gives_each_worker_its_share_of_the_cores_for_op_threads() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let share = (cores / 2).max(1);
    for (flags, threads) in [(vec![], share), (vec!["--intra-op-threads", "3"], 3)] {
        let mut args = vec!["launch", "--nproc", "2"];
        args.extend(flags);
        let out = wasmrpc(&args, Duration::from_secs(60));
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("serving on 127.0.0.1:"))
            .collect();
        assert_eq!(lines.len(), 2, "{stderr}");
        for line in lines {
            assert!(
                line.ends_with(&format!(", {threads} op thread(s)")),
                "{line}"
            );
        }
    }
    let out = wasmrpc(
        &["launch", "--nproc", "1", "--intra-op-threads", "0"],
        Duration::from_secs(10),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("--intra-op-threads"), "{stderr}");
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

    // TLS under torchrun: one environment for every worker, `{name}` in the
    // certificate paths.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = |p: &str| dir.path().join(p).to_str().expect("UTF-8").to_string();
    let out = wasmrpc(
        &["cert", "init", "--out", &path("ca")],
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    for name in ["worker0", "worker1"] {
        let out = wasmrpc(
            &[
                "cert",
                "issue",
                name,
                "--ca",
                &path("ca"),
                "--out",
                &path("certs"),
            ],
            Duration::from_secs(30),
        );
        assert!(out.status.success(), "{:?}", text(&out));
    }
    let mut cmd = Command::new(&torchrun);
    cmd.args(["--no-python", "--standalone", "--nproc-per-node", "2"])
        .arg(env!("CARGO_BIN_EXE_wasmrpc"))
        .args(["worker", "--ping-all"])
        .env("WASMRPC_TLS_CA", path("ca/ca.pem"))
        .env("WASMRPC_TLS_CERT", path("certs/{name}.pem"))
        .env("WASMRPC_TLS_KEY", path("certs/{name}.key"))
        .env("RUST_LOG", "info");
    let out = run_with_deadline(&mut cmd, Duration::from_secs(120));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "torchrun failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("worker0 -> worker1: answered")
            && stdout.contains("worker1 -> worker0: answered"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("connections: TLS 1.3 with mutual authentication"),
        "{stderr}"
    );
}

/// The folder the seed-fns plugin is built into (by `wasmrpc-plugins`).
fn plugin_dir() -> String {
    std::path::Path::new(wasmrpc_plugins::SEED_FNS)
        .parent()
        .expect("the plugin file has a folder")
        .display()
        .to_string()
}

#[test]
fn launch_serves_plugins_and_runs_an_entry_that_makes_a_nested_rpc() {
    let dir = plugin_dir();
    // worker0 runs seed_fns::nested_udf("worker1", 4), whose guest calls
    // my_function(4, 1, 2) on worker1.
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "2",
            "--plugins",
            &dir,
            "--entry",
            "seed_fns::nested_udf",
            "--",
            "worker1",
            "4",
        ],
        Duration::from_secs(90),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("[worker0] seed_fns::nested_udf returned Int(7)"),
        "unexpected result:\n{stdout}\n{stderr}"
    );
    for worker in ["worker0", "worker1"] {
        assert!(
            stderr.contains(&format!("[{worker}]")) && stderr.contains("plugin seed_fns 0.1.0"),
            "{worker} did not report its plugin:\n{stderr}"
        );
    }
}

#[test]
fn launch_names_its_workers_and_takes_json_entry_arguments() {
    let dir = plugin_dir();
    // ps runs seed_fns::nested_udf("trainer_1", n=4), whose guest calls
    // my_function(4, 1, 2) on trainer_1.
    let out = wasmrpc(
        &[
            "launch",
            "--names",
            "ps,trainer_1",
            "--plugins",
            &dir,
            "--entry",
            "seed_fns::nested_udf",
            "--entry-json",
            r#"{"args": ["trainer_1"], "kwargs": {"n": 4}}"#,
        ],
        Duration::from_secs(90),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("[ps] seed_fns::nested_udf returned Int(7)"),
        "unexpected result:\n{stdout}\n{stderr}"
    );
    assert!(stderr.contains("[trainer_1]"), "{stderr}");
    for (args, needle) in [
        (&["--names", "ps,ps"][..], "--names: \"ps\" appears twice"),
        (
            &["--names", "ps,1x"][..],
            "--names: \"1x\" is not a worker name",
        ),
        (
            &["--nproc", "3", "--names", "a,b"][..],
            "--nproc 3 and --names with 2 names disagree",
        ),
        (
            &["--grant-dir", "ps:/data=/nonexistent/wasmrpc"][..],
            "cannot open the folder /nonexistent/wasmrpc",
        ),
        (
            &["--grant-dir", "ps:/data"][..],
            "no '=' between the guest path and the host folder",
        ),
        (
            &["--entry", "seed_fns::nested_udf", "--entry-json", "[1,"][..],
            "--entry-json \"[1,\" is not JSON",
        ),
    ] {
        let mut all = vec!["launch"];
        all.extend_from_slice(args);
        let out = wasmrpc(&all, Duration::from_secs(30));
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("launching"),
            "{args:?} started workers: {stderr}"
        );
    }
}

#[test]
fn plugin_inspect_prints_the_manifest() {
    let out = wasmrpc(
        &["plugin", "inspect", wasmrpc_plugins::SEED_FNS],
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for needle in [
        "wasmrpc-plugin-seed-fns 0.1.0 (protocol 1)",
        "namespace: seed_fns (functions are served as seed_fns::<fn>",
        "sha256:    ",
        "  fn my_function(a, b, c)",
        "  async fn async_add(to, x, y)",
        "  class MyClass(a, delay)",
        "    method MyClass.my_instance_method(my_instance_arg)",
    ] {
        assert!(stdout.contains(needle), "no {needle:?} in:\n{stdout}");
    }
    let sha = stdout
        .lines()
        .find_map(|l| l.strip_prefix("sha256:    "))
        .expect("a sha256 line");
    assert!(
        sha.len() == 64 && sha.chars().all(|c| c.is_ascii_hexdigit()),
        "{sha}"
    );

    let not_a_plugin = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(not_a_plugin.path(), b"\0asm\x01\0\0\0").expect("write");
    let out = wasmrpc(
        &[
            "plugin",
            "inspect",
            &not_a_plugin.path().display().to_string(),
        ],
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("is not a wasmrpc plugin") && stderr.contains("wasmrpc-manifest"),
        "{stderr}"
    );
}

/// A world of one worker serving the seed-fns plugin, with
/// `WASMRPC_PERF_MAP` set to `value`: its pid, when it started, and its
/// output once it has shut down.
fn worker_with_perf_map(value: &str) -> (u32, std::time::SystemTime, std::process::Output) {
    let store = tempfile::tempdir().expect("temp dir");
    let url = format!("file://{}", store.path().join("store").display());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    cmd.args(["worker", "--rank", "0", "--world-size", "1"])
        .args([
            "--init-method",
            &url,
            "--plugins",
            wasmrpc_plugins::SEED_FNS,
        ])
        .env("RUST_LOG", "info")
        .env("WASMRPC_PERF_MAP", value);
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    let started = std::time::SystemTime::now();
    let child = spawn_captured(&mut cmd);
    let pid = child.id();
    let out = wait_with_deadline(child, "a worker", Duration::from_secs(60));
    (pid, started, out)
}

/// `WASMRPC_PERF_MAP=1` has a worker name its plugins' compiled functions
/// to `perf` in `/tmp/perf-PID.map`; `0` writes none; any other value stops
/// the worker before it joins, with an error naming the variable.
#[test]
fn wasmrpc_perf_map_names_a_workers_plugin_functions_to_perf() {
    let (pid, _, out) = worker_with_perf_map("1");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let map = std::path::PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let written = std::fs::read_to_string(&map);
    let _ = std::fs::remove_file(&map);
    let written = written.unwrap_or_else(|e| panic!("no {}: {e}\n{stderr}", map.display()));
    // perf's format: `START SIZE NAME`, hex, the start with `0x`; a
    // plugin function's name is its symbol in the plugin's name section.
    let named = written.lines().filter(|l| {
        let mut f = l.splitn(3, ' ');
        let start = f.next().and_then(|a| a.strip_prefix("0x")).unwrap_or("");
        let size = f.next().unwrap_or("");
        u64::from_str_radix(start, 16).is_ok()
            && u64::from_str_radix(size, 16).is_ok()
            && f.next()
                .is_some_and(|n| n.contains("wasmrpc_plugin_seed_fns"))
    });
    assert!(
        named.clone().any(|l| l.contains("my_function")),
        "the plugin's `my_function` is not named in {} ({} of the plugin's functions):\n{}",
        map.display(),
        named.count(),
        written.lines().take(20).collect::<Vec<_>>().join("\n")
    );

    let (pid, started, out) = worker_with_perf_map("0");
    assert!(out.status.success(), "{:?}", text(&out));
    let map = std::path::PathBuf::from(format!("/tmp/perf-{pid}.map"));
    // A map of an earlier process that had this pid would predate the worker.
    let fresh = std::fs::metadata(&map)
        .and_then(|m| m.modified())
        .is_ok_and(|at| at >= started);
    assert!(!fresh, "WASMRPC_PERF_MAP=0 wrote {}", map.display());

    for bad in ["yes", "true", "2"] {
        let (_, _, out) = worker_with_perf_map(bad);
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "WASMRPC_PERF_MAP={bad} was accepted");
        assert!(
            stderr.contains("WASMRPC_PERF_MAP must be 1") && stderr.contains(&format!("{bad:?}")),
            "WASMRPC_PERF_MAP={bad}: {stderr}"
        );
    }
}

#[test]
fn a_worker_with_a_bad_plugin_folder_fails_and_says_why() {
    let empty = tempfile::tempdir().expect("temp dir");
    let store = tempfile::tempdir().expect("temp dir");
    let url = format!("file://{}", store.path().join("store").display());
    let out = wasmrpc(
        &[
            "worker",
            "--rank",
            "0",
            "--world-size",
            "1",
            "--init-method",
            &url,
            "--plugins",
            &empty.path().display().to_string(),
        ],
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("--plugins {}", empty.path().display()))
            && stderr.contains("no plugins (*.wasm files)"),
        "{stderr}"
    );
}

#[test]
fn launch_with_a_missing_plugin_path_fails_once_before_starting_workers() {
    let missing = tempfile::tempdir().expect("temp dir");
    let path = missing
        .path()
        .join("target/wasm-plugins/wasm32-unknown-unknown/release/nothing.wasm");
    let path = path.display().to_string();
    let out = wasmrpc(
        &["launch", "--nproc", "4", "--plugins", &path],
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(
        errors.len(),
        1,
        "one error line, not one per worker:\n{stderr}"
    );
    assert!(
        errors[0].contains(&format!("--plugins {path}: no such file or folder"))
            && errors[0].contains("cargo run -q -p wasmrpc-plugins"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("[worker0]"),
        "no worker should start:\n{stderr}"
    );

    // A plugin crate's own build output gets the build command instead.
    let own = missing
        .path()
        .join("hello/target/wasm32-unknown-unknown/release");
    let own = own.display().to_string();
    let out = wasmrpc(
        &["launch", "--nproc", "2", "--plugins", &own],
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cargo build --release --target wasm32-unknown-unknown"),
        "{stderr}"
    );
}

/// The pid of `parent`'s child process named `worker` (`--name worker`).
fn worker_pid(parent: u32, worker: &str) -> Option<u32> {
    let needle = format!("--name\0{worker}\0");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces, so split after
        // its closing parenthesis.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid != Some(parent) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn killing_a_worker_mid_call_fails_the_callers_future_and_the_launch() {
    use std::io::{BufRead, BufReader};
    use std::sync::{Arc, Mutex};

    let dir = plugin_dir();
    // worker0 calls seed_fns::my_sleep_func(60) on worker1, then we kill
    // worker1 while the call sleeps there.
    let mut child = Command::new(env!("CARGO_BIN_EXE_wasmrpc"))
        .args([
            "launch",
            "--nproc",
            "2",
            "--plugins",
            &dir,
            "--entry",
            "seed_fns::my_sleep_func",
            "--entry-on",
            "worker1",
            "--",
            "60",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the wasmrpc binary starts");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut readers = Vec::new();
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    for stream in [
        Box::new(stdout) as Box<dyn std::io::Read + Send>,
        Box::new(stderr),
    ] {
        let lines = lines.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                lines.lock().expect("lines lock").push(line);
            }
        }));
    }
    let seen = |needle: &str| {
        lines
            .lock()
            .expect("lines lock")
            .iter()
            .any(|l| l.contains(needle))
    };
    let dump = |lines: &Arc<Mutex<Vec<String>>>| lines.lock().expect("lines lock").join("\n");

    let started = Instant::now();
    while !(seen("[worker0] ") && seen("worker0: rank 0 of 2") && seen("worker1: rank 1 of 2")) {
        if started.elapsed() > Duration::from_secs(60) || child.try_wait().ok().flatten().is_some()
        {
            let _ = child.kill();
            panic!("the cluster did not come up:\n{}", dump(&lines));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The entry starts as soon as worker0 is up; give it time to reach
    // worker1's guest, which then sleeps a minute.
    std::thread::sleep(Duration::from_millis(1500));
    let pid = worker_pid(child.id(), "worker1").unwrap_or_else(|| {
        let _ = child.kill();
        panic!("no worker1 process under the launcher:\n{}", dump(&lines))
    });
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success(), "could not kill worker1 ({pid})");
    let killed_at = Instant::now();

    let status = loop {
        if let Some(status) = child.try_wait().expect("wait on launch") {
            break status;
        }
        if killed_at.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("launch hung after worker1 was killed:\n{}", dump(&lines));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed_at.elapsed();
    for r in readers {
        let _ = r.join();
    }
    let all = dump(&lines);
    assert!(!status.success(), "launch succeeded:\n{all}");
    assert!(
        took < Duration::from_secs(15),
        "launch took {took:?} to stop:\n{all}"
    );
    let failure = all
        .lines()
        .find(|l| l.contains("entry seed_fns::my_sleep_func on worker1 failed"))
        .unwrap_or_else(|| panic!("worker0 did not report the failed call:\n{all}"));
    assert!(
        failure.starts_with("[worker0]") && failure.contains("connection to worker worker1 closed"),
        "the error does not name the dead worker: {failure}\n{all}"
    );
    assert!(all.contains("worker1 failed"), "{all}");
}

/// Progress reports of a plugin reach the launcher, which prints them as
/// plain lines when its stderr is not a terminal, and `--result` writes
/// the entry's result as JSON (the RL example: one average return per
/// round).
#[test]
fn launch_shows_plugin_progress_and_writes_the_result_as_json() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let result = dir.path().join("result.json");
    let result_arg = result.display().to_string();
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "3",
            "--plugins",
            wasmrpc_plugins::RL,
            "--entry",
            "rl::run",
            "--result",
            &result_arg,
            "--",
            "2",
            "3",
            "20",
            "0.01",
            "true",
        ],
        Duration::from_secs(60),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("[worker0] round 3/3 average return"),
        "no progress line for the last round:\n{stderr}"
    );
    assert!(
        !stderr.contains("@wasmrpc-progress"),
        "a raw event line leaked:\n{stderr}"
    );
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&result).expect("launch wrote the result file"),
    )
    .expect("the result is JSON");
    let rounds = json[0].as_array().expect("a list of average returns");
    assert_eq!(rounds.len(), 3, "{json}");
    assert!(
        rounds.iter().all(|r| r.as_f64().is_some_and(|r| r > 0.0)),
        "{json}"
    );
    // 2 observers x 20 steps x 3 rounds, answered in batches of 2.
    assert_eq!(json[2], 120, "{json}");
    assert_eq!(json[1], 60, "{json}");
}

/// Starts a worker of a dynamic group (no world size) that serves until
/// SIGTERM, with `extra` flags.
fn serving_worker(rank: u32, init_method: &str, extra: &[&str]) -> ServingProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    cmd.args(["worker", "--rank", &rank.to_string()])
        .args(["--init-method", init_method, "--serve"])
        .args(extra)
        .env("RUST_LOG", "info");
    ServingProcess::start(&format!("worker{rank}"), cmd)
}

/// What a worker prints once it has joined and serves.
const SERVING: &str = "serving until interrupted";

/// Writes `contents` to `dir/name`, readable by its owner only.
fn private_file(dir: &std::path::Path, name: &str, contents: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, contents).expect("write a credential file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .expect("chmod a credential file");
    path
}

#[test]
fn a_worker_without_credentials_refuses_a_non_loopback_address_unless_insecure() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("file://{}", dir.path().join("store").display());
    let base = [
        "worker",
        "--rank",
        "0",
        "--world-size",
        "1",
        "--init-method",
        &url,
        "--listen",
        "0.0.0.0:0",
    ];
    let out = wasmrpc(&base, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    for needle in [
        "0.0.0.0:0, which is not a loopback address, without credentials",
        "--cluster-secret-file",
        "--insecure",
    ] {
        assert!(stderr.contains(needle), "{needle} missing from:\n{stderr}");
    }
    assert!(
        !dir.path().join("store").exists(),
        "the refused worker joined the store"
    );

    let mut insecure = base.to_vec();
    insecure.push("--insecure");
    let out = wasmrpc(&insecure, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("WARN") && stderr.contains("NOT authenticated"),
        "{stderr}"
    );

    // A secret file that others can read is refused, naming the file.
    let secret = private_file(dir.path(), "secret", "s3cret-value");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    let mut with_file = base.to_vec();
    let secret_path = secret.to_str().expect("a UTF-8 path");
    with_file.extend(["--cluster-secret-file", secret_path]);
    let out = wasmrpc(&with_file, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(secret_path) && stderr.contains("chmod 600"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cret-value"),
        "the secret leaked: {stderr}"
    );
    // Readable by its owner only, it is used: the worker starts on 0.0.0.0.
    let secret = private_file(dir.path(), "secret", "s3cret-value");
    assert!(secret.exists());
    let out = wasmrpc(&with_file, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stderr.contains("not authenticated"), "{stderr}");
}

/// A port nothing listens on now (the store's, hosted by worker0).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[test]
fn plugin_deploy_ships_a_plugin_to_a_running_group_that_then_serves_it() {
    let init = format!("tcp://127.0.0.1:{}", free_port());
    let hello = wasmrpc_plugins::HELLO;
    // The group's secret, from the operator: a file only its owner reads.
    let secret_dir = tempfile::tempdir().expect("a temporary folder");
    let secret = private_file(secret_dir.path(), "secret", "deploy-test-secret\n");
    let secret = secret.to_str().expect("a UTF-8 path");
    // Only seed-fns' file: its folder also holds hello.
    let mut w0 = serving_worker(
        0,
        &init,
        &[
            "--accept-plugin-deployment",
            "--cluster-secret-file",
            secret,
            "--plugins",
            wasmrpc_plugins::SEED_FNS,
        ],
    );
    w0.wait_for(SERVING);
    let mut w1 = serving_worker(
        1,
        &init,
        &[
            "--accept-plugin-deployment",
            "--cluster-secret-file",
            secret,
        ],
    );
    w1.wait_for(SERVING);
    // worker2 keeps the default: deployment off.
    let mut w2 = serving_worker(2, &init, &["--cluster-secret-file", secret]);
    w2.wait_for(SERVING);

    // Without the secret, the deploy tool cannot even join.
    let out = wasmrpc(
        &["plugin", "deploy", hello, "--init-method", &init],
        Duration::from_secs(60),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("cluster secret") && !stdout.contains("serving hello::"),
        "{stdout}\n{stderr}"
    );

    let deploy = |file: &str| {
        let out = wasmrpc(
            &[
                "plugin",
                "deploy",
                file,
                "--init-method",
                &init,
                "--cluster-secret-file",
                secret,
            ],
            Duration::from_secs(60),
        );
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    let (ok, stdout, stderr) = deploy(hello);
    assert!(!ok, "worker2 refuses, so nobody switches");
    assert!(
        stdout.contains("plugin wasmrpc-plugin-hello") && stdout.contains("to 3 workers"),
        "{stdout}\n{stderr}"
    );
    for w in ["worker0", "worker1"] {
        assert!(
            stdout.contains(&format!(
                "{w}: staged, then dropped (another worker refused)"
            )),
            "{stdout}\n{stderr}"
        );
    }
    assert!(
        stdout.contains("worker2: FAILED: worker worker2 does not accept plugin deployment"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("was not deployed: 1 of 3 workers refused it"),
        "{stdout}\n{stderr}"
    );
    // Without worker2 (it leaves), the deployment goes through.
    drop(w2.stop());
    let (ok, stdout, stderr) = deploy(hello);
    assert!(ok, "{stdout}\n{stderr}");
    for w in ["worker0", "worker1"] {
        assert!(
            stdout.contains(&format!("{w}: serving hello::"))
                && stdout.contains("hello::greet")
                && stdout.contains("hello::double_on"),
            "{stdout}\n{stderr}"
        );
    }

    // Another worker joins, calls the deployed function on worker1 by
    // name, and leaves; then seed-fns on worker0 calls it on worker1.
    let call = |entry: &str, on: &str, entry_args: &[&str]| {
        let mut a = vec!["worker", "--rank", "7", "--init-method", &init];
        a.extend(["--cluster-secret-file", secret]);
        a.extend(["--entry", entry, "--entry-on", on, "--"]);
        a.extend(entry_args);
        let out = wasmrpc(&a, Duration::from_secs(60));
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        stdout
    };
    let stdout = call("hello::greet", "worker1", &["you"]);
    assert!(
        stdout.contains(r#"hello::greet returned Str("hello you from worker1")"#),
        "{stdout}"
    );
    let stdout = call(
        "seed_fns::call_str",
        "worker0",
        &["worker1", "hello::greet", "seed-fns"],
    );
    assert!(
        stdout.contains(r#"returned Str("hello seed-fns from worker1")"#),
        "{stdout}"
    );

    // The same bytes again: worker0 and worker1 already serve them.
    let (_, stdout, stderr) = deploy(hello);
    assert!(
        stdout.contains("worker0: already served") && stdout.contains("worker1: already served"),
        "{stdout}\n{stderr}"
    );
    // Another version (one more custom section) is an upgrade; `plugin
    // list` shows both versions, `plugin rollback` switches back.
    let dir = tempfile::tempdir().expect("a temporary folder");
    let v2 = dir.path().join("hello-v2.wasm");
    let mut bytes = std::fs::read(hello).expect("the hello plugin was built");
    bytes.extend_from_slice(&[0, 7, 4, b'n', b'o', b't', b'e', b'v', b'2']);
    std::fs::write(&v2, bytes).expect("write the new version");
    let (ok, stdout, stderr) = deploy(v2.to_str().expect("a UTF-8 path"));
    assert!(ok, "{stdout}\n{stderr}");
    let tool = |command: &[&str]| {
        let mut a = vec!["plugin"];
        a.extend(command);
        a.extend(["--init-method", &init, "--cluster-secret-file", secret]);
        let out = wasmrpc(&a, Duration::from_secs(60));
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    let (ok, stdout, stderr) = tool(&["list"]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("worker1:")
            && stdout.contains("wasmrpc-plugin-hello")
            && stdout.contains(" current: 0 calls in flight, 0 objects; deployed by deploy-")
            && stdout.contains(" previous: "),
        "{stdout}\n{stderr}"
    );
    let (ok, stdout, stderr) = tool(&["rollback", "hello"]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("plugin hello rolled back to") && stdout.contains("worker1: switched"),
        "{stdout}\n{stderr}"
    );
    // Not a plugin: refused before joining the group's work.
    let junk = dir.path().join("junk.wasm");
    std::fs::write(&junk, b"not wasm").expect("write junk");
    let (ok, _, stderr) = deploy(junk.to_str().expect("a UTF-8 path"));
    assert!(!ok && stderr.contains("was not deployed"), "{stderr}");

    assert!(w1.output().contains("staged plugin wasmrpc-plugin-hello"));
    // A worker that joins now installs what was deployed before it.
    let mut w3 = serving_worker(
        3,
        &init,
        &[
            "--accept-plugin-deployment",
            "--cluster-secret-file",
            secret,
        ],
    );
    w3.wait_for(SERVING);
    assert!(
        w3.output().contains("serving deployed plugins: hello::"),
        "{}",
        w3.output()
    );
    let stdout = call("hello::greet", "worker3", &["late"]);
    assert!(
        stdout.contains(r#"hello::greet returned Str("hello late from worker3")"#),
        "{stdout}"
    );
    drop(w3.stop());
    drop(w1.stop());
    drop(w0.stop());
}

#[test]
fn plugin_deploy_help_explains_how_to_reach_a_group() {
    let out = wasmrpc(&["plugin", "deploy", "--help"], Duration::from_secs(30));
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    for needle in [
        "--init-method",
        "--accept-plugin-deployment",
        "dynamic",
        "WASMRPC_CLUSTER_SECRET",
    ] {
        assert!(stdout.contains(needle), "{needle} missing from:\n{stdout}");
    }
}

// POLICY_TEST_NAMES_DENIED_OPS: the op policy tests below name refused ops
// on purpose.

#[test]
fn ops_list_prints_what_a_worker_serves_and_what_it_refuses() {
    let out = wasmrpc(&["ops", "list"], Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "ops list failed:\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.contains(&"aten::matmul\t@linalg"), "{stdout}");
    assert!(lines.contains(&"builtins.min\t@builtins"), "{stdout}");
    assert!(!stdout.contains("aten::from_file"), "{stdout}");
    assert!(stderr.contains("ops served"), "{stderr}");

    let out = wasmrpc(&["ops", "list", "--denied"], Duration::from_secs(60));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "ops list --denied failed:\n{stderr}");
    assert!(
        stdout.contains("aten::from_file\tunsafe schema: takes a file name"),
        "{stdout}"
    );
    assert!(
        stdout.contains("prim::dtype\tother namespace: prim"),
        "{stdout}"
    );
    assert!(stdout.contains("aten::set_\tnot in a family"), "{stdout}");
    assert!(
        !stdout.lines().any(|l| l.starts_with("aten::matmul\t")),
        "{stdout}"
    );

    // The flags widen and narrow it as they would a worker's.
    let out = wasmrpc(
        &[
            "ops",
            "list",
            "--allow-op",
            "aten::from_file",
            "--deny-op",
            "@random",
        ],
        Duration::from_secs(60),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("aten::from_file\tallow aten::from_file (--allow-op)"),
        "{stdout}"
    );
    assert!(
        !stdout.lines().any(|l| l.starts_with("aten::rand\t")),
        "{stdout}"
    );

    let out = wasmrpc(&["ops", "families"], Duration::from_secs(60));
    let (stdout, _) = text(&out);
    assert!(
        stdout.lines().any(|l| l.starts_with("@random\t")),
        "{stdout}"
    );

    let out = wasmrpc(&["ops", "list", "--help"], Duration::from_secs(10));
    let (stdout, _) = text(&out);
    for words in [
        "--denied",
        "--allow-op",
        "--deny-op",
        "--op-policy",
        "unsafe schema",
    ] {
        assert!(
            stdout.contains(words),
            "{words} missing from the help:\n{stdout}"
        );
    }
}

#[test]
fn a_bad_op_policy_file_names_its_line() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("ops.policy");
    std::fs::write(&file, "# ok\nallow aten::from_file\npermit aten::mul\n").expect("write");
    let file = file.display().to_string();
    for args in [
        vec!["ops", "list", "--op-policy", &file],
        vec!["launch", "--nproc", "1", "--op-policy", &file],
    ] {
        let out = wasmrpc(&args, Duration::from_secs(60));
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} accepted a bad policy");
        assert!(
            stderr.contains(&format!(
                "{file}:3: expected `allow PATTERN` or `deny PATTERN`"
            )),
            "{args:?}:\n{stderr}"
        );
    }
}

#[test]
fn launch_passes_the_op_policy_to_every_worker() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("ops.policy");
    std::fs::write(&file, "deny aten::relu   # no activations here\n").expect("write");
    let file = file.display().to_string();
    // seed_fns::udf_with_torch_ops runs add, mul, relu and sigmoid on
    // worker1, whose policy refuses relu.
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "2",
            "--plugins",
            &plugin_dir(),
            "--op-policy",
            &file,
            "--entry",
            "seed_fns::udf_with_torch_ops",
            "--entry-on",
            "worker1",
        ],
        Duration::from_secs(90),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "the entry ran:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "worker1 does not run aten::relu: denied by rule `deny aten::relu ({file}:1)`"
        )),
        "{stdout}\n{stderr}"
    );
    // Without the rule the same entry runs.
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "2",
            "--plugins",
            &plugin_dir(),
            "--entry",
            "seed_fns::udf_with_torch_ops",
            "--entry-on",
            "worker1",
        ],
        Duration::from_secs(90),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
}

/// The guide's Python plugin steps (`docs/src/using/python-plugins.md`)
/// end to end: an `app.py` built with `wasmrpc
/// plugin build-py` (componentize-py from the cache folder, as `cargo
/// xtask setup` installs it) is served by a `wasmrpc launch` cluster, whose
/// entry is the Python function, making a nested RPC.
#[test]
fn a_python_plugin_built_with_build_py_runs_on_a_launch_cluster() {
    let dir = tempfile::tempdir().expect("temp dir");
    let src = dir.path().join("my-plugin");
    std::fs::create_dir(&src).expect("the plugin folder");
    std::fs::write(
        src.join("app.py"),
        "from wasmrpc import remote, rpc, torch\n\n\n\
         @remote\n\
         def nested_rpc(dst):\n    \
             return rpc.rpc_sync(dst, torch.add, args=(torch.ones(2, 2), 1)).sum().item()\n",
    )
    .expect("app.py");
    let out = wasmrpc(
        &["plugin", "build-py", &src.display().to_string()],
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "build-py failed:\n{stdout}\n{stderr}");
    let wasm = dir.path().join("my-plugin.wasm");
    assert!(wasm.is_file(), "no {}:\n{stdout}\n{stderr}", wasm.display());

    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).expect("the plugins folder");
    std::fs::rename(&wasm, plugins.join("my-plugin.wasm")).expect("move the plugin");
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "2",
            "--plugins",
            &plugins.display().to_string(),
            "--entry",
            "my_plugin::nested_rpc",
            "--",
            "worker1",
        ],
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("[worker0] my_plugin::nested_rpc returned Float(8.0)"),
        "unexpected result:\n{stdout}\n{stderr}"
    );
}

/// A launch group that accepts deployments: `wasmrpc plugin deploy`,
/// `list` and `rollback` reach it with a certificate of its CA; nothing
/// else gets in; the group then leaves gracefully on SIGTERM. With an
/// entry, the serving workers leave once the entry's worker is done.
#[test]
fn launch_accepts_plugin_deployment_from_holders_of_its_ca() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = |p: &str| {
        dir.path()
            .join(p)
            .to_str()
            .expect("a UTF-8 path")
            .to_owned()
    };
    let (ca, other_ca) = (path("ca"), path("other-ca"));
    for command in [
        ["cert", "init", "--out", &ca].as_slice(),
        &["cert", "init", "--out", &other_ca],
        &["cert", "issue", "deployer", "--ca", &ca, "--out", &ca],
        &[
            "cert", "issue", "deployer", "--ca", &other_ca, "--out", &other_ca,
        ],
    ] {
        let out = wasmrpc(command, Duration::from_secs(30));
        assert!(out.status.success(), "{command:?}: {:?}", text(&out));
    }

    // Without a CA a deployer could hold: refused before any worker starts.
    let out = wasmrpc(
        &["launch", "--nproc", "2", "--accept-plugin-deployment"],
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("--accept-plugin-deployment needs --cluster-ca DIR")
            && !format!("{stdout}{stderr}").contains("[worker0]"),
        "{stdout}\n{stderr}"
    );

    let launcher = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
        for var in CREDENTIAL_ENV {
            cmd.env_remove(var);
        }
        cmd.args(["launch", "--nproc", "2", "--accept-plugin-deployment"])
            .args(["--cluster-ca", &ca])
            .args(extra)
            .env("RUST_LOG", "info");
        cmd
    };
    let mut group = ServingProcess::start("launch", launcher(&[]));
    group.wait_for("[worker0] worker0 -> worker1: answered");
    let port = group
        .output()
        .split("store on 127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .expect("the launcher prints its store's port")
        .to_owned();
    let init = format!("tcp://127.0.0.1:{port}");
    let ca_pem = format!("{ca}/ca.pem");
    // A tool run as `deployer`, with the certificate and key in `cert_dir`
    // (None: no credentials at all).
    let tool = |command: &[&str], cert_dir: Option<&str>| {
        let (cert, key) = cert_dir.map_or_else(Default::default, |d| {
            (format!("{d}/deployer.pem"), format!("{d}/deployer.key"))
        });
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
        for var in CREDENTIAL_ENV {
            cmd.env_remove(var);
        }
        cmd.arg("plugin")
            .args(command)
            .args(["--init-method", &init, "--init-timeout", "30"]);
        if cert_dir.is_some() {
            cmd.args(["--name", "deployer", "--tls-ca", &ca_pem]).args([
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
            ]);
        }
        let out = run_with_deadline(&mut cmd, Duration::from_secs(90));
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    let hello = wasmrpc_plugins::HELLO;
    // Hostile deployers: one with no credentials, one whose certificate
    // another CA issued (it trusts the group's CA: that part is public).
    for cert_dir in [None, Some(other_ca.as_str())] {
        let (ok, stdout, stderr) = tool(&["deploy", hello], cert_dir);
        assert!(
            !ok && !stdout.contains("serving hello::"),
            "{cert_dir:?} deployed:\n{stdout}\n{stderr}"
        );
    }
    assert!(
        !group.output().contains("staged plugin"),
        "{}",
        group.output()
    );

    // The holder of a certificate of the group's CA deploys, upgrades,
    // lists and rolls back.
    let (ok, stdout, stderr) = tool(&["deploy", hello], Some(&ca));
    assert!(ok, "{stdout}\n{stderr}");
    for w in ["worker0", "worker1"] {
        assert!(
            stdout.contains(&format!("{w}: serving hello::")),
            "{stdout}\n{stderr}"
        );
    }
    let v2 = path("hello-v2.wasm");
    let mut bytes = std::fs::read(hello).expect("the hello plugin was built");
    bytes.extend_from_slice(&[0, 7, 4, b'n', b'o', b't', b'e', b'v', b'2']);
    std::fs::write(&v2, bytes).expect("write the new version");
    let (ok, stdout, stderr) = tool(&["deploy", &v2], Some(&ca));
    assert!(ok, "{stdout}\n{stderr}");
    let (ok, stdout, stderr) = tool(&["list"], Some(&ca));
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("worker0:")
            && stdout.contains("worker1:")
            && stdout.matches(" current: ").count() == 2
            && stdout.matches(" previous: ").count() == 2
            && stdout.contains("deployed by deployer"),
        "{stdout}\n{stderr}"
    );
    let (ok, stdout, stderr) = tool(&["rollback", "hello"], Some(&ca));
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("worker0: switched") && stdout.contains("worker1: switched"),
        "{stdout}\n{stderr}"
    );

    // SIGTERM: every worker leaves gracefully, and so does the launcher.
    let output = group.stop();
    for needle in [
        "interrupted: asking every worker to leave",
        "[worker0]",
        "worker0: shut down",
        "worker1: shut down",
        "all 2 workers finished",
    ] {
        assert!(output.contains(needle), "{needle} missing from:\n{output}");
    }

    // With an entry: it runs once both workers joined; then the other
    // worker, which serves until told, is asked to leave.
    let out = run_with_deadline(
        &mut launcher(&["--plugins", hello, "--entry", "hello::greet", "--", "you"]),
        Duration::from_secs(90),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(r#"hello::greet returned Str("hello you from worker0")"#)
            && stderr.contains("worker1: shut down")
            && stderr.contains("all 2 workers finished"),
        "{stdout}\n{stderr}"
    );
}

/// `wasmrpc top` against the demo's group while it trains, read from a
/// tmux screen as an operator would see it.
#[test]
fn top_shows_a_training_group_in_tmux() {
    if !Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        println!("wasmrpc-skip: tmux is not installed; `wasmrpc top` was not tried on a screen");
        return;
    }
    // Four consecutive free ports for the workers' metrics.
    let base = (0..200)
        .map(|i| 21000 + (std::process::id() % 1000) as u16 * 20 + i * 7)
        .find(|&p| (p..p + 4).all(|q| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok()))
        .expect("four free ports");
    let dir = tempfile::tempdir().expect("a temporary folder");
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
    for var in CREDENTIAL_ENV {
        cmd.env_remove(var);
    }
    cmd.args([
        "launch",
        "--nproc",
        "4",
        "--metrics-port",
        &base.to_string(),
    ])
    .args(["--plugins", wasmrpc_plugins::PARAM_SERVER, "--grant-dir"])
    .arg(format!("param_server:/data={}:ro", data.display()))
    .arg("--grant-dir")
    .arg(format!("param_server:/ckpt={}:rw", dir.path().display()))
    .args(["--entry", "param_server::run", "--", "3", "25"])
    .env("RUST_LOG", "warn");
    let mut group = ServingProcess::start("launch", cmd);
    group.wait_for("[worker0] epoch 1/25");

    let session = format!("wasmrpc-top-{}", std::process::id());
    let endpoints: Vec<String> = (0..4).map(|i| format!("127.0.0.1:{}", base + i)).collect();
    let top = format!(
        "{} top {} --interval 0.5",
        env!("CARGO_BIN_EXE_wasmrpc"),
        endpoints.join(" ")
    );
    let started = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &session,
            "-x",
            "150",
            "-y",
            "40",
            &top,
        ])
        .status()
        .expect("tmux runs");
    assert!(started.success(), "tmux new-session failed");
    let screen = || {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &session])
            .output()
            .expect("tmux capture-pane runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut shown = screen();
    while !(shown.contains("worker3") && shown.contains("param_server::forward"))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(250));
        shown = screen();
    }
    let _ = Command::new("tmux")
        .args(["kill-session", "-t", &session])
        .status();
    for needle in [
        "WORKER", "SERVED/s", "P99", "worker0", "worker1", "worker2", "worker3",
    ] {
        assert!(
            shown.contains(needle),
            "{needle} not on the screen:\n{shown}"
        );
    }
    // The parameter server serves every trainer's calls: its row shows a
    // rate, and the busiest functions are the training's.
    let ps = shown
        .lines()
        .find(|l| l.starts_with("worker0 "))
        .expect("a row for worker0");
    let served: f64 = ps
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no rate in {ps:?}"));
    assert!(served > 0.0, "{shown}");
    assert!(shown.contains("param_server::forward"), "{shown}");
    let status = group.wait_exit(Duration::from_secs(180));
    assert!(status.success(), "{}", group.output());
}

/// The requests a test collector took: each one's first line and body.
type Posts = std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>;

/// A collector on loopback that answers every request `200 OK` and keeps
/// each request's first line and body (one request per connection, as the
/// worker's exporter sends them).
fn collector() -> (u16, Posts) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let port = listener.local_addr().expect("an address").port();
    let posts = Posts::default();
    let keep = posts.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            let (mut first, mut length) = (String::new(), 0);
            if reader.read_line(&mut first).is_err() {
                continue;
            }
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_ok() {
                keep.lock().unwrap().push((first.trim().to_owned(), body));
            }
            let _ = reader
                .get_mut()
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        }
    });
    (port, posts)
}

#[test]
fn launch_exports_every_workers_spans_to_the_named_collector() {
    let (port, posts) = collector();
    let endpoint = format!("http://127.0.0.1:{port}");
    let dir = plugin_dir();
    // worker0's entry calls my_function on worker1 from inside the plugin.
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "2",
            "--plugins",
            &dir,
            "--otlp-endpoint",
            &endpoint,
            "--entry",
            "seed_fns::nested_udf",
            "--",
            "worker1",
            "4",
        ],
        Duration::from_secs(90),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    let posts = posts.lock().unwrap().clone();
    assert!(!posts.is_empty(), "nothing was exported:\n{stderr}");
    for (first, _) in &posts {
        assert_eq!(first, "POST /v1/traces HTTP/1.1");
    }
    // The spans travel as protobuf, whose strings are stored as they are.
    let all: Vec<u8> = posts.iter().flat_map(|(_, body)| body.clone()).collect();
    let has = |s: &str| all.windows(s.len()).any(|w| w == s.as_bytes());
    for span in [
        "call seed_fns::my_function",
        "serve seed_fns::my_function",
        "run seed_fns::my_function",
    ] {
        assert!(
            has(span),
            "no span {span:?} in {:?}",
            String::from_utf8_lossy(&all)
        );
    }
    for worker in ["worker0", "worker1"] {
        assert!(has(worker), "nothing from {worker}");
    }

    // A collector the worker cannot send to safely is refused at start.
    let out = wasmrpc(
        &[
            "launch",
            "--nproc",
            "1",
            "--otlp-endpoint",
            "http://198.51.100.7:4318",
            "--entry",
            "aten::add",
            "--",
            "1",
            "2",
        ],
        Duration::from_secs(60),
    );
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "a remote collector was taken:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("only a loopback collector is taken"),
        "the refusal does not say why:\n{stderr}"
    );
}

/// The compile helper a worker runs for a plugin missing from its module
/// cache (CACHE-3), as the worker runs it: `wasmrpc compile-plugin-entry
/// --kind KIND --out PATH` with the wasm bytes on standard input. It writes
/// an entry for a plugin; for bytes that do not compile it writes nothing
/// and exits 65 with the compiler's message alone, which the worker gives
/// as the load's error; a kind it does not know is refused.
#[test]
fn the_compile_helper_writes_an_entry_or_refuses_bytes_that_do_not_compile() {
    let dir = tempfile::tempdir().expect("temp dir");
    let helper = |kind: &str, input: &std::path::Path, out: &std::path::Path| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmrpc"));
        cmd.args([wasmrpc::COMPILE_HELPER_SUBCOMMAND, "--kind", kind, "--out"])
            .arg(out)
            .stdin(std::fs::File::open(input).expect("the input"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().expect("the helper starts");
        wait_with_deadline(child, "the compile helper", Duration::from_secs(120))
    };
    let entry = dir.path().join("seed_fns.cwasm");
    let out = helper(
        "module",
        std::path::Path::new(wasmrpc_plugins::SEED_FNS),
        &entry,
    );
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // Wasmtime's compiled code: an ELF image.
    let written = std::fs::read(&entry).expect("the entry");
    assert_eq!(&written[..4], b"\x7fELF");

    let bad = dir.path().join("bad.wasm");
    std::fs::write(&bad, b"\0asm\x01\0\0\0\x01").expect("write");
    let refused = dir.path().join("refused.cwasm");
    for kind in ["module", "component"] {
        let out = helper(kind, &bad, &refused);
        let (_, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(i32::from(wasmrpc::wasm::INVALID_WASM_EXIT)),
            "{stderr}"
        );
        assert_eq!(
            stderr.lines().count(),
            1,
            "more than the compiler's message: {stderr}"
        );
        assert!(
            !refused.exists(),
            "{kind}: bytes that do not compile left an entry"
        );
    }
    let out = helper("core", &bad, &refused);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("expected module or component"), "{stderr}");
}
