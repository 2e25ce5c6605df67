//! `wasmrpc-bench anatomy`: where a small call's time goes, thread by
//! thread, beside the raw TCP ping-pong that is its floor.
//!
//! On the machines we run on most of a small round trip is waking sleeping
//! threads (`busy_poll`'s module doc: about 35 µs per wake-up on a 2-core
//! VM), so the first question about a slow call is how many times each of
//! its threads went to sleep and was woken, and how much CPU each spent
//! (and, for calls that move large tensors, how many pages each faulted in).
//! This reads both from `/proc/<pid>/task/<tid>/{status,stat}` before and
//! after a block of calls, for the caller (this process) and the callee
//! (a `wasmrpc-bench worker` process), and prints them per call.
//!
//! It measures; it judges nothing (the suite's rows carry the targets).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};
use wasmrpc::{Payload, args};

use crate::limit::PingPong;
use crate::ours::{self, Children, free_port, worker_args_serving};
use crate::stats::{CpuTicks, fmt_steal};
use crate::worker::{self, NOOP};

/// The calls `anatomy` can dissect.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    /// `bench::noop(1)`, a native function (the `rtt_noop_native` row).
    Noop,
    /// `aten::add` of two 4-element tensors (the `rtt_aten_add` row).
    AtenAdd,
    /// `seed_fns::identity(1)`, a Rust wasm plugin's function.
    Wasm,
    /// `seed_fns_py::identity(1)`, a Python plugin's function.
    Python,
    /// `dispatch_floor_py::identity(1)`: the same call served with none of
    /// the kit's code on its path, componentize-py's dispatch alone.
    PythonFloor,
    /// `seed_fns::my_tensor_function` (a + b of two 4-element tensors in a
    /// Rust wasm plugin: the `rtt_add_wasm` row).
    WasmAdd,
    /// `seed_fns_py::my_tensor_function`, the same in a Python plugin (the
    /// `rtt_add_py` row).
    PythonAdd,
    /// One distributed autograd step with a remote 16x16 matmul (the
    /// `dist_autograd_16` row): a forward call and a backward pass.
    Step16,
    /// The same with a 256x256 matmul (the `dist_autograd_256` row).
    Step256,
    /// The 16x16 step's forward call alone: `aten::matmul` of two leaves
    /// that require grad, in a fresh distributed autograd context.
    Forward16,
    /// The same `aten::matmul` outside any context, of tensors that
    /// require no grad: what the forward call costs as a plain op call.
    Matmul16,
    /// The 256x256 step's forward call alone (as `forward16`).
    Forward256,
    /// The 256x256 `aten::matmul` as a plain op call (as `matmul16`).
    Matmul256,
}

impl Call {
    /// The function this call runs and its arguments (`a` and `b` for the
    /// adds); `None` for the autograd step, which is more than one call.
    fn function_and_args(self, a: &Tensor, b: &Tensor) -> Option<(&'static str, wasmrpc::Args)> {
        let add = || args![a.shallow_clone(), b.shallow_clone()];
        Some(match self {
            Call::Noop => (NOOP, args![1]),
            Call::AtenAdd => ("aten::add", add()),
            Call::Wasm => (worker::WASM_IDENTITY, args![1]),
            Call::Python => (worker::PY_IDENTITY, args![1]),
            Call::PythonFloor => (worker::PY_FLOOR_IDENTITY, args![1]),
            Call::WasmAdd => ("seed_fns::my_tensor_function", add()),
            Call::PythonAdd => ("seed_fns_py::my_tensor_function", add()),
            Call::Matmul16 | Call::Matmul256 => ("aten::matmul", add()),
            Call::Step16 | Call::Step256 | Call::Forward16 | Call::Forward256 => return None,
        })
    }
}

/// One thread's counters at one moment.
#[derive(Clone, Copy, Default)]
struct Counters {
    /// Times it went to sleep (and so had to be woken).
    voluntary: u64,
    /// Times the scheduler took its core away.
    involuntary: u64,
    /// User plus system CPU time, in clock ticks.
    ticks: u64,
    /// Minor page faults: pages the kernel mapped on first touch (fresh
    /// tensor storage that `malloc` took from `mmap` faults in page by page).
    faults: u64,
    /// Write system calls (`write`, `writev`; `/proc/PID/task/TID/io`'s
    /// `syscw`): frames sent per write, where batches of calls are in
    /// flight, say whether their frames were coalesced (TR-10).
    writes: u64,
}

/// Every thread of a process, by thread id: its name and counters.
type Snapshot = BTreeMap<u32, (String, Counters)>;

fn snapshot(pid: u32) -> Result<Snapshot> {
    let mut threads = Snapshot::new();
    let dir = format!("/proc/{pid}/task");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("cannot list {dir}"))? {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        // A thread can end between the listing and the reads: skip it.
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Readable only with ptrace access to the thread (our own children).
        let io = std::fs::read_to_string(entry.path().join("io")).unwrap_or_default();
        let field = |name: &str| labelled(&status, name);
        let comm = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        // `stat`'s fields after the parenthesised name: minflt is the 10th
        // field of the line, utime the 14th, stime the 15th.
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let number_at = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        threads.insert(
            tid,
            (
                comm,
                Counters {
                    voluntary: field("voluntary_ctxt_switches:"),
                    involuntary: field("nonvoluntary_ctxt_switches:"),
                    ticks: number_at(11) + number_at(12),
                    faults: number_at(7),
                    writes: labelled(&io, "syscw:"),
                },
            ),
        );
    }
    Ok(threads)
}

/// The number on the line of `text` that starts with `label` (`/proc`'s
/// `status` and `io` files); 0 without one.
fn labelled(text: &str, label: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(label))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Prints, per call, each thread's sleeps, preemptions, CPU time, page
/// faults and write system calls between two snapshots of `who` (threads
/// that did none of these are left out).
fn report(who: &str, before: &Snapshot, after: &Snapshot, calls: u64) {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc_sysconf_clk_tck() } as f64;
    println!("  {who}:");
    let mut total = Counters::default();
    for (tid, (comm, end)) in after {
        let start = before.get(tid).map(|(_, c)| *c).unwrap_or_default();
        let d = Counters {
            voluntary: end.voluntary - start.voluntary,
            involuntary: end.involuntary - start.involuntary,
            ticks: end.ticks - start.ticks,
            faults: end.faults - start.faults,
            writes: end.writes - start.writes,
        };
        total.voluntary += d.voluntary;
        total.involuntary += d.involuntary;
        total.ticks += d.ticks;
        total.faults += d.faults;
        total.writes += d.writes;
        let per = |v: u64| v as f64 / calls as f64;
        if per(d.voluntary) < 0.01
            && per(d.involuntary) < 0.01
            && d.ticks == 0
            && d.faults == 0
            && d.writes == 0
        {
            continue;
        }
        println!(
            "    {comm:<18} {tid:>7}  sleeps {:>5.2}  preempted {:>5.2}  cpu {:>6.1} µs  faults {:>6.1}  \
             writes {:>5.2}",
            per(d.voluntary),
            per(d.involuntary),
            d.ticks as f64 / hz * 1e6 / calls as f64,
            per(d.faults),
            per(d.writes),
        );
    }
    println!(
        "    {:<26} sleeps {:>5.2}  preempted {:>5.2}  cpu {:>6.1} µs  faults {:>6.1}  writes {:>5.2}",
        "all threads",
        total.voluntary as f64 / calls as f64,
        total.involuntary as f64 / calls as f64,
        total.ticks as f64 / hz * 1e6 / calls as f64,
        total.faults as f64 / calls as f64,
        total.writes as f64 / calls as f64,
    );
}

/// `sysconf(_SC_CLK_TCK)`: the unit of `/proc/*/stat`'s CPU times.
unsafe fn libc_sysconf_clk_tck() -> i64 {
    unsafe extern "C" {
        fn sysconf(name: i32) -> i64;
    }
    /// `_SC_CLK_TCK` on Linux.
    const SC_CLK_TCK: i32 = 2;
    // SAFETY: the caller's.
    unsafe { sysconf(SC_CLK_TCK) }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Calls `call` `calls` times in this process, without the wire (a world
/// of one that loads the callee's plugins itself), and prints its median
/// and this process's threads: what the function costs where it runs, the
/// part of a round trip no transport can remove. Under `perf record` it
/// profiles the callee's side of a call alone.
pub(crate) fn run_local(call: Call, calls: usize, threads: usize) -> Result<()> {
    let calls = calls.max(100);
    let (a, b) = (
        Tensor::ones([4], (Kind::Float, Device::Cpu)),
        Tensor::ones([4], (Kind::Float, Device::Cpu)),
    );
    let Some((function, _)) = call.function_and_args(&a, &b) else {
        anyhow::bail!("an autograd step needs two workers: drop --local");
    };
    let rt = worker::runtime(threads)?;
    rt.block_on(async {
        let method = format!("tcp://127.0.0.1:{}", free_port()?);
        let plugins = worker::PYTHON_ROW_PLUGINS.map(Into::into);
        let agent = worker::join(&method, 0, 1, &plugins, None, false).await?;
        let one = || {
            let args = call
                .function_and_args(&a, &b)
                .map_or(args![], |(_, args)| args);
            agent.call_local(function, args)
        };
        ours::timed(calls / 10, 0, one).await?;
        let me = std::process::id();
        let c0 = snapshot(me)?;
        let samples = ours::timed(calls, 0, one).await?;
        let c1 = snapshot(me)?;
        println!(
            "{function} called in this process: median {:.2?}",
            median(samples)
        );
        report("this process", &c0, &c1, calls as u64);
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    })
}

/// Runs the raw ping-pong and then `call`, `calls` times each, and prints
/// the threads of both ends of each; with `chunks` > 0, also the call's
/// median per run of `chunks` consecutive round trips.
pub(crate) fn run(
    call: Call,
    calls: usize,
    threads: usize,
    in_flight: usize,
    chunks: usize,
    caller: worker::CallerRuntime,
) -> Result<()> {
    let calls = calls.max(100);
    println!("{calls} round trips each; per round trip:");

    let mut floor = PingPong::start(false)?;
    floor.round_trips(calls / 10, 0)?;
    let (me, server) = (std::process::id(), floor.server_pid());
    let (c0, s0) = (snapshot(me)?, snapshot(server)?);
    let ticks = CpuTicks::now();
    let took = median(floor.round_trips(calls, 0)?);
    let stolen = fmt_steal(ticks, CpuTicks::now());
    let (c1, s1) = (snapshot(me)?, snapshot(server)?);
    println!(
        "raw TCP ping-pong, both sides blocking in read: median {took:.1?} (the hypervisor's \
         steal: {stolen} of the CPUs' time)"
    );
    report("caller (this process)", &c0, &c1, calls as u64);
    report("echo server", &s0, &s1, calls as u64);
    drop(floor);

    let cfg = ours::Config {
        quick: true,
        only: Vec::new(),
        memory_calls: 0,
        threads,
        log: std::env::temp_dir().join("wasmrpc-bench-anatomy.log"),
    };
    println!("the caller's runtime: {caller:?}");
    let rt = worker::caller_runtime(caller, threads)?;
    rt.block_on(async {
        let method = format!("tcp://127.0.0.1:{}", free_port()?);
        // Anatomy reads no memory: its callee serves every plugin a call
        // may name, the Python dispatch floor's too.
        let args = |r| worker_args_serving(&cfg, &method, r, 2, &worker::PYTHON_ROW_PLUGINS);
        let children = Children::spawn(&cfg, args, 1..2, false)?;
        let callee = children.pids()[0];
        let agent = worker::join(&method, 0, 2, &[], None, false).await?;
        let (a, b) = (
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
        );
        let side = if matches!(call, Call::Step256 | Call::Forward256 | Call::Matmul256) {
            256
        } else {
            16
        };
        let leaf =
            || Tensor::rand([side, side], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (x, y) = (leaf(), leaf());
        let phases = std::cell::RefCell::new(Vec::new());
        let (a, b) = if matches!(call, Call::Matmul16 | Call::Matmul256) {
            (x.detach(), y.detach())
        } else {
            (a, b)
        };
        let one = || -> std::pin::Pin<Box<dyn Future<Output = wasmrpc::Result<Payload>> + '_>> {
            match call.function_and_args(&a, &b) {
                Some((function, args)) => Box::pin(agent.rpc_sync("worker1", function, args)),
                None if matches!(call, Call::Forward16 | Call::Forward256) => {
                    Box::pin(ours::forward_in_context(&agent, "worker1", &x, &y))
                }
                None => Box::pin(ours::autograd_step(&agent, "worker1", &x, &y, &phases)),
            }
        };
        ours::timed(calls / 10, 0, one).await?;
        if in_flight > 1 {
            // No-op calls `in_flight` at a time: the async rows' regime.
            ours::windowed(&agent, "worker1", calls as u64 / 10, in_flight).await?;
            let (c0, w0) = (snapshot(me)?, snapshot(callee)?);
            let took = ours::windowed(&agent, "worker1", calls as u64, in_flight).await?;
            let (c1, w1) = (snapshot(me)?, snapshot(callee)?);
            println!(
                "wasmrpc no-op calls, {in_flight} in flight: {:.0} calls/s",
                calls as f64 / took.as_secs_f64()
            );
            report("caller (this process, rank 0)", &c0, &c1, calls as u64);
            report("callee (worker1)", &w0, &w1, calls as u64);
        }
        phases.borrow_mut().clear();
        let (c0, w0) = (snapshot(me)?, snapshot(callee)?);
        let started = Instant::now();
        let ticks = CpuTicks::now();
        let samples = ours::timed(calls, 0, one).await?;
        let stolen = fmt_steal(ticks, CpuTicks::now());
        let elapsed = started.elapsed();
        if chunks > 0 {
            for (i, chunk) in samples.chunks(chunks).enumerate() {
                let mut chunk = chunk.to_vec();
                chunk.sort();
                let (median, p90) = (chunk[chunk.len() / 2], chunk[chunk.len() * 9 / 10]);
                println!(
                    "  round trips {}..: median {median:.1?}, p90 {p90:.1?}",
                    i * chunks
                );
            }
        }
        let (c1, w1) = (snapshot(me)?, snapshot(callee)?);
        println!(
            "wasmrpc {call:?}: median {:.2?} (mean {:.2?}; the hypervisor's steal: {stolen} of \
             the CPUs' time)",
            median(samples),
            elapsed / calls as u32
        );
        if !phases.borrow().is_empty() {
            println!("  {}", ours::StepPhases::medians(&phases.borrow()));
        }
        report("caller (this process, rank 0)", &c0, &c1, calls as u64);
        report("callee (worker1)", &w0, &w1, calls as u64);
        // BUSY-8: polling given up for a crowded CPU, since each started.
        let key = "agent.busy_poll_back_offs";
        let callee_info = agent
            .rpc_sync("worker1", wasmrpc::DEBUG_INFO, args![])
            .await?;
        let callee_back_offs = callee_info.get(key)?.map(|v| v.as_str().map(str::to_owned));
        println!(
            "busy polling backed off for a crowded CPU: caller {}, callee {} times",
            agent.get_debug_info().get(key).map_or("?", String::as_str),
            callee_back_offs.transpose()?.as_deref().unwrap_or("?"),
        );
        agent.shutdown(true, Duration::ZERO).await?;
        children.wait(Duration::from_secs(30)).await
    })
}
