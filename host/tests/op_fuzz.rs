//! The op fuzzer against a real worker process (issue 43): every op the
//! default op policy serves, called with the argument lists
//! `wasmrpc::testing::op_fuzz` generates from its schemas, the way a peer
//! sends them (through the agent, by op name) and the way a plugin does
//! (the probe plugin's `Tensor::op`, by tensor method where there is one).
//!
//! The worker is a `wasmrpc worker` child process, so a crash (the process
//! dying on any signal) is caught, not shared: the calls in flight are
//! replayed one at a time on fresh workers to name the ones that crash, and
//! the test fails listing each crash and each call that hung, with its op
//! and arguments. Afterwards the worker that served the rest must still
//! answer an ordinary call, hold no tensor memory, and have logged the
//! refusals at WARN only, within the rate limit.
//!
//! CI runs a bounded sample (a fixed seed, a few values per parameter);
//! `WASMRPC_OP_FUZZ=full` runs every boundary value of every parameter and
//! `WASMRPC_OP_FUZZ_SEED=N` other random combinations (see the guide's
//! op policy chapter, `docs/src/using/op-policy.md`).

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmrpc::testing::op_fuzz::{FuzzCall, FuzzPlan, calls};
use wasmrpc::{Args, DEBUG_INFO, OpPolicy, RpcAgent, RpcBackendOptions, Value, init_rpc};

/// The worker under fuzz.
const TARGET: &str = "worker1";
/// Calls in flight at once.
const BATCH: usize = 32;
/// A call that takes longer hangs.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A batch that takes longer is printed.
const SLOW_BATCH: Duration = Duration::from_secs(5);

/// The plan of this run: CI's bounded sample unless the environment asks
/// for more.
fn plan() -> FuzzPlan {
    let mut plan = FuzzPlan::default();
    if let Ok(seed) = std::env::var("WASMRPC_OP_FUZZ_SEED") {
        plan.seed = seed.parse().expect("WASMRPC_OP_FUZZ_SEED is a number");
    }
    if std::env::var("WASMRPC_OP_FUZZ").as_deref() != Ok("full") {
        plan.values_per_param = 8;
        plan.random_per_overload = 2;
    }
    plan
}

/// A `wasmrpc worker` child serving the probe plugin, and this process
/// joined to it as worker0.
struct Session {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    agent: RpcAgent,
    _store: tempfile::TempDir,
}

impl Session {
    async fn start() -> Session {
        let store = tempfile::tempdir().expect("a temporary folder");
        let url = format!("file://{}", store.path().join("store").display());
        let mut child = Command::new(env!("CARGO_BIN_EXE_wasmrpc"))
            .args(["worker", "--rank", "1", "--world-size", "2"])
            .args(["--init-method", &url, "--serve"])
            .args(["--plugins", wasmrpc_plugins::PROBE])
            .env("RUST_LOG", "info")
            .env_remove("WASMRPC_CLUSTER_SECRET")
            .env_remove("WASMRPC_CLUSTER_SECRET_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the wasmrpc binary starts");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("piped stderr");
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().expect("log lock").push(line);
            }
        });
        let (store_handle, _, _) = wasmrpc::store::rendezvous(&url, 0, 2, Duration::from_secs(60))
            .await
            .expect("rendezvous with the worker");
        let options = RpcBackendOptions {
            rpc_timeout: CALL_TIMEOUT,
            ..RpcBackendOptions::default()
        };
        let agent = init_rpc("worker0", Some(0), Some(2), store_handle, options)
            .await
            .expect("join the worker's group");
        Session {
            child,
            log,
            agent,
            _store: store,
        }
    }

    /// How the worker ended, if it did.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("wait on the worker")
    }

    /// How the worker ended, if the last call killed it: a call's error
    /// can arrive before the process is reaped, so a worker that does not
    /// answer a no-op is waited for.
    async fn died(&mut self) -> Option<ExitStatus> {
        if let Some(status) = self.exited() {
            return Some(status);
        }
        let ping = self
            .agent
            .rpc_async_with_timeout(TARGET, wasmrpc::NOOP, Args::new(), Duration::from_secs(5))
            .wait()
            .await;
        if ping.is_ok() {
            return None;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Stops this session's agent and kills the worker (it may be dead
    /// already, or busy with a call that hangs).
    async fn end(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = self.agent.shutdown(false, Duration::from_secs(5)).await;
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().expect("log lock").clone()
    }
}

/// A failing run must not leave its worker behind: a `--serve` worker whose
/// peer is gone spins on (two did, after the run against torch 2.11), so it
/// dies with its session, ended or not.
impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a case reaches the worker.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// As a peer: the op by name through the agent.
    Peer,
    /// As a plugin: the probe plugin's `Tensor::op`, by tensor method where
    /// the op has one.
    Plugin,
}

fn send(agent: &RpcAgent, case: &FuzzCall, path: Path) -> wasmrpc::Future {
    match path {
        Path::Peer => agent.rpc_async(TARGET, &case.op, case.to_args()),
        Path::Plugin => {
            let name = case.method_name().unwrap_or(&case.op);
            agent.rpc_async(TARGET, "probe::run_op_kw", case.to_plugin_args(name))
        }
    }
}

/// What went wrong with one case.
#[derive(Debug)]
struct Finding {
    case: String,
    what: String,
}

fn describe_exit(status: ExitStatus) -> String {
    match status.signal() {
        Some(11) => "the worker died of SIGSEGV".into(),
        Some(6) => "the worker died of SIGABRT".into(),
        Some(7) => "the worker died of SIGBUS".into(),
        Some(8) => "the worker died of SIGFPE".into(),
        Some(4) => "the worker died of SIGILL".into(),
        Some(s) => format!("the worker died of signal {s}"),
        None => format!("the worker exited: {status}"),
    }
}

/// Whether an error is the call timing out (a hang), not the op's error.
fn timed_out(e: &wasmrpc::Error) -> bool {
    let text = e.to_string();
    text.contains("timed out") || text.contains("Timeout")
}

/// Sends `cases` along `path`, `BATCH` at a time, restarting the worker
/// after each crash; returns the findings and the session still alive.
async fn fuzz(cases: &[FuzzCall], path: Path) -> (Vec<Finding>, Session, Duration, usize) {
    let started = Instant::now();
    let mut findings = Vec::new();
    let mut session = Session::start().await;
    // The tensor memory the worker holds between calls: 0 unless a call
    // leaked (reported once, then counted here).
    let mut held = 0;
    // Calls that returned a value: a run where (nearly) every call fails
    // before its op runs would prove nothing.
    let mut answered = 0_usize;
    let mut last_report = Instant::now();
    for (done, batch) in cases.chunks(BATCH).enumerate() {
        if last_report.elapsed() > Duration::from_secs(15) {
            eprintln!(
                "op fuzz ({path:?}): {} of {} cases, {} findings, {:.0?}",
                done * BATCH,
                cases.len(),
                findings.len(),
                started.elapsed()
            );
            last_report = Instant::now();
        }
        let batch_started = Instant::now();
        let futures: Vec<_> = batch
            .iter()
            .map(|c| send(&session.agent, c, path))
            .collect();
        let mut hung = Vec::new();
        for (case, future) in batch.iter().zip(futures) {
            match future.wait().await {
                Ok(_) => answered += 1,
                Err(e) if timed_out(&e) => hung.push(case),
                Err(_) => {}
            }
        }
        if batch_started.elapsed() > SLOW_BATCH {
            // Not a failure (each call answered in time), but where a
            // kernel's work is out of proportion to its arguments.
            eprintln!(
                "op fuzz ({path:?}): a batch took {:.1?}: {}",
                batch_started.elapsed(),
                batch
                    .iter()
                    .map(|c| c.op.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        if hung.is_empty() && session.died().await.is_none() {
            // Every tensor a call made must be freed once it answered: a
            // batch that leaves memory held is replayed one call at a time
            // to name the calls that keep it.
            if settled_tensor_memory(&session.agent, held)
                .await
                .is_some_and(|h| h > held)
            {
                for case in batch {
                    let Some(before) = settled_tensor_memory(&session.agent, held).await else {
                        break;
                    };
                    let _ = send(&session.agent, case, path).wait().await;
                    let Some(after) = settled_tensor_memory(&session.agent, before).await else {
                        break;
                    };
                    if after > before {
                        findings.push(Finding {
                            case: format!("{case} [{path:?}]"),
                            what: format!(
                                "the worker still holds {} bytes of tensor memory after it answered",
                                after - before
                            ),
                        });
                    }
                    held = after;
                }
            }
            if session.died().await.is_none() {
                continue;
            }
        }
        // Replay the batch one call at a time on fresh workers to name each
        // call that crashes or hangs.
        session.end().await;
        session = Session::start().await;
        for case in batch {
            let result = send(&session.agent, case, path).wait().await;
            let what = match (session.died().await, &result) {
                (Some(status), _) => describe_exit(status),
                (None, Err(e)) if timed_out(e) => format!("no answer in {CALL_TIMEOUT:?}: {e}"),
                _ => continue,
            };
            findings.push(Finding {
                case: format!("{case} [{path:?}]"),
                what,
            });
            session.end().await;
            session = Session::start().await;
        }
        held = 0;
    }
    (findings, session, started.elapsed(), answered)
}

/// The bytes of tensor memory the worker holds, if it answers.
async fn tensor_memory(agent: &RpcAgent) -> Option<u64> {
    let held = debug_info(agent)
        .await?
        .into_iter()
        .find(|(k, _)| k == "agent.tensor_memory_bytes")
        .and_then(|(_, v)| v.parse().ok());
    Some(held.expect("agent.tensor_memory_bytes in the debug info"))
}

/// The worker's tensor memory once it has come down to `expected` (a call's
/// tensors are freed just after its reply is written), or what it holds
/// after a second of waiting for that.
async fn settled_tensor_memory(agent: &RpcAgent, expected: u64) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let held = tensor_memory(agent).await?;
        if held <= expected || Instant::now() > deadline {
            return Some(held);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The worker's `get_debug_info`, read through the agent, if it answers.
async fn debug_info(agent: &RpcAgent) -> Option<Vec<(String, String)>> {
    let info = agent.rpc_sync(TARGET, DEBUG_INFO, Args::new()).await.ok()?;
    let Value::Dict(items) = info.value else {
        panic!("debug info is not a dict: {:?}", info.value)
    };
    Some(
        items
            .into_iter()
            .filter_map(|(k, v)| match (k, v) {
                (Value::Str(k), Value::Str(v)) => Some((k, v)),
                _ => None,
            })
            .collect(),
    )
}

/// An ordinary call, `aten::add(ones(len), addend)`, which a worker must
/// answer after any refusal.
async fn ones_plus(session: &Session, len: i64, addend: i64) -> Vec<f32> {
    let sum = session
        .agent
        .rpc_sync(
            TARGET,
            "aten::add",
            Args::new()
                .arg(tch::Tensor::ones(
                    [len],
                    (tch::Kind::Float, tch::Device::Cpu),
                ))
                .arg(addend),
        )
        .await
        .expect("the worker answers an ordinary call");
    let out = sum.tensors.first().expect("a tensor result");
    Vec::<f32>::try_from(out).expect("floats")
}

/// The runtime the tests drive the worker from.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// The whole-worker property after a fuzz run: it answers an ordinary
/// call, holds no tensor memory, and logged refusals at WARN only, within
/// the rate limit.
async fn check_the_worker_serves_on(session: &Session, elapsed: Duration) {
    assert_eq!(ones_plus(session, 3, 2).await, [3.0, 3.0, 3.0]);

    let held = settled_tensor_memory(&session.agent, 0).await;
    assert_eq!(
        held,
        Some(0),
        "the worker still holds tensor memory after the fuzzer"
    );

    let log = session.log();
    let errors: Vec<&String> = log.iter().filter(|l| l.contains("ERROR")).collect();
    assert!(
        errors.is_empty(),
        "refusals must be WARN at most: {errors:#?}"
    );
    // The worker's own start-up warning (a loopback worker without
    // credentials) is not the peer's: only the peer's lines are limited.
    let warns = log
        .iter()
        .filter(|l| l.contains("WARN") && !l.contains("no cluster credentials"))
        .count();
    // At most 10 lines every 10 s from the one peer (the limit of
    // `agent::warn_limit`), over the worker's whole life.
    let windows = elapsed.as_secs() / 10 + 2;
    assert!(
        warns as u64 <= windows * 10,
        "{warns} WARN lines in {elapsed:?}: the log is not rate limited"
    );
    // The note rides on the first line logged after a window in which
    // lines were held back; a fuzz run shorter than the window (10 s) has
    // logged none yet, so one more refused call past the window must
    // carry it.
    let noted = |log: &[String]| {
        log.iter()
            .any(|l| l.contains("earlier lines from this peer not logged"))
    };
    if !noted(&log) {
        tokio::time::sleep(Duration::from_secs(10).saturating_sub(elapsed)).await;
        // Calls inside the window are held back too; one every second
        // until the window ends and a line is logged with the note.
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while !noted(&session.log()) && std::time::Instant::now() < deadline {
            let refused = session
                .agent
                .rpc_sync(TARGET, "aten::abs", Args::new())
                .await;
            assert!(refused.is_err(), "aten::abs() with no argument answered");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let log = session.log();
    assert!(
        noted(&log),
        "a flood of refusals says how many lines it held back:\n{}",
        log.join("\n")
    );
}

fn run(path: Path) {
    let cases = calls(&OpPolicy::default(), plan());
    assert!(cases.len() > 1000, "only {} cases", cases.len());
    runtime().block_on(async {
        let (findings, session, elapsed, answered) = fuzz(&cases, path).await;
        eprintln!(
            "op fuzz ({path:?}): {} cases in {elapsed:.1?}, {answered} answered with a value, {} findings",
            cases.len(),
            findings.len()
        );
        let report: Vec<String> = findings
            .iter()
            .map(|f| format!("{}: {}", f.case, f.what))
            .collect();
        assert!(
            findings.is_empty(),
            "{} of {} calls crashed or hung the worker:\n{}",
            findings.len(),
            cases.len(),
            report.join("\n")
        );
        // Most cases are meant to fail; a fair share must reach a kernel
        // and succeed, or the fuzzer tests only the argument checks.
        assert!(
            answered * 10 > cases.len(),
            "only {answered} of {} calls answered with a value: do the calls reach the ops?",
            cases.len()
        );
        check_the_worker_serves_on(&session, elapsed).await;
        session.end().await;
    });
}

#[test]
fn no_op_call_from_a_peer_crashes_or_hangs_a_worker() {
    run(Path::Peer);
}

#[test]
fn no_op_call_from_a_plugin_crashes_or_hangs_a_worker() {
    run(Path::Plugin);
}

/// The three calls issue 43 reported, each of which killed a default
/// worker with SIGSEGV, as a peer sends them: each is an error that names
/// the argument, and the worker serves on.
#[test]
fn the_calls_that_killed_a_worker_are_errors_and_it_serves_on() {
    runtime().block_on(async {
        let mut session = Session::start().await;
        for op in ["aten::to", "aten::to_dense", "aten::view"] {
            let t = tch::Tensor::ones([4, 4], (tch::Kind::Float, tch::Device::Cpu));
            let err = session
                .agent
                .rpc_sync(TARGET, op, Args::new().arg(t).arg(-1))
                .await
                .expect_err("an enum code libtorch does not define");
            assert_eq!(err.kind(), wasmrpc::ErrorKind::RuntimeError, "{op}: {err}");
            let text = err.to_string();
            assert!(
                text.contains("for argument 'dtype'")
                    && text.contains("-1 is not the code of a dtype (torch.dtype)"),
                "{op}: {text}"
            );
            assert!(session.died().await.is_none(), "{op} killed the worker");
        }
        assert_eq!(ones_plus(&session, 2, 1).await, [2.0, 2.0]);
        session.end().await;
    });
}
