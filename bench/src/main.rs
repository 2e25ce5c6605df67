//! `wasmrpc-bench`: wasmrpc beside `torch.distributed.rpc` and the
//! machine's raw limits, measured in one run, printed as one table of ratios.
//!
//! One run measures, in order:
//! 1. the limits (`limit`): raw TCP round trip and echo between two
//!    processes, memcpy, and the shared-memory channel's bound (two
//!    overlapped copies each way);
//! 2. our side (`ours`): groups of `wasmrpc-bench worker` processes, measured
//!    from rank 0 in this process; the small call and the distributed
//!    autograd step (its ops in this process plus two raw TCP round trips
//!    of its bytes) alternate with their floors there;
//! 3. the torch side (`torch`): `bench/torch_rpc_bench.py`, which spawns its
//!    own TensorPipe workers and measures the same rows the same way.
//!
//! Sides run one after the other, never at once. Only ratios within one run
//! mean anything: absolute numbers drift with the machine and its load.

mod anatomy;
mod cipher;
mod cuda;
mod limit;
mod ours;
mod plot;
mod progress;
mod python;
mod python_program;
mod report;
mod rows;
mod scale;
mod shm;
mod stats;
mod torch;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;

use crate::progress::Progress;
use crate::report::{MachineLoad, load_average};
use crate::rows::{ROWS, Results, Side, wanted};

/// The allocator of the `wasmrpc` executable, for this process and the
/// workers it spawns from itself (`wasmrpc_alloc`).
#[global_allocator]
static ALLOCATOR: wasmrpc_alloc::Allocator = wasmrpc_alloc::Allocator;

/// Benchmarks wasmrpc beside torch.distributed.rpc (TensorPipe) and the
/// machine's raw limits in one run, and prints one table of ratios.
///
/// Rows: round trip of a no-op (native and wasm functions; torch: a Python
/// function), aten::add, async calls with 128 in flight, tensor echo (4 KiB,
/// 1 MiB, 64 MiB), remote()+to_here(), a distributed autograd step,
/// init_rpc + shutdown (world 2/4/8), all-to-all load (world 4 and 8), local wasm
/// calls, and the resident memory of a worker idle and after N calls. Each
/// side runs worker processes of its own; the limits are a raw TCP
/// round trip and echo between two processes, memcpy, the bound of the
/// shared-memory echo (two overlapped copies of 64 MiB each way), and the
/// floor of an autograd step (its ops in one process plus two raw TCP
/// round trips of its bytes).
///
/// Writes JSON lines (one per row) and a PNG plot of latency against payload
/// size under target/bench/. A full run takes about 5-8 minutes on 2 cores;
/// --quick about 2-3.
#[derive(Parser, Debug)]
#[command(
    name = "wasmrpc-bench",
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// A short run: fewer repetitions, 100,000 calls before the second memory
    /// reading instead of 1,000,000.
    #[arg(long)]
    quick: bool,
    /// Only the rows whose id contains NAME (repeatable); --list shows ids.
    #[arg(long, value_name = "NAME")]
    only: Vec<String>,
    /// List the row ids and exit.
    #[arg(long)]
    list: bool,
    /// Compare with an earlier run's JSON lines (e.g. target/bench/latest.jsonl).
    #[arg(long, value_name = "FILE")]
    baseline: Option<PathBuf>,
    /// Write this run's JSON lines here [default: target/bench/bench-<unix time>.jsonl,
    /// also copied to target/bench/latest.jsonl].
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the plot here [default: target/bench/latency_vs_size.png].
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// The Python interpreter with torch and numpy [default:
    /// $WASMRPC_ENV/venv/bin/python, as `cargo xtask setup` installs it].
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// Skip the torch side.
    #[arg(long)]
    no_torch: bool,
    /// Calls before the second memory reading on our side [default:
    /// 1,000,000; --quick: 100,000].
    #[arg(long, value_name = "N")]
    memory_calls: Option<u64>,
    /// Calls before the second memory reading on the torch side (about 3,000
    /// a second) [default: 20,000; --quick: 5,000].
    #[arg(long, value_name = "N")]
    torch_memory_calls: Option<u64>,
    /// Run the whole suite (every side: its worker processes inherit it) at
    /// this niceness, e.g. -10 to shield the measurements from other work on
    /// a shared machine (negative values need root). Recorded in the JSON.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    nice: Option<i32>,
    /// Tokio threads of each of our worker processes [default: the cores
    /// divided between the two workers of a row, as `wasmrpc launch` divides
    /// them; at least 1].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// How long our workers' readers busy-poll their sockets between frames
    /// that come close together, in microseconds; 0 turns it off (an A/B of
    /// `RpcBackendOptions::busy_poll`) [default: the agent's,
    /// `wasmrpc::DEFAULT_BUSY_POLL`, 500].
    #[arg(long, value_name = "US", global = true)]
    busy_poll_us: Option<u64>,
    /// The runtime this process makes its calls on: current-thread (the
    /// thread that calls reads the replies, as a plugin's calls run) or
    /// multi-thread (calls from the thread in `block_on`, which the
    /// runtime's worker thread wakes for each reply).
    #[arg(long, value_enum, default_value = "current-thread", global = true)]
    caller_runtime: worker::CallerRuntime,
    /// Threads one op may use in each of our worker processes (libtorch's
    /// intra-op pool) [default: the cores divided between the two workers
    /// of a row, as `wasmrpc launch` divides them; the torch side keeps
    /// torch's default, one per core].
    #[arg(long, value_name = "N", global = true)]
    intra_op_threads: Option<usize>,
    #[command(subcommand)]
    command: Option<Internal>,
}

/// The bench's own worker processes (started by the bench itself).
#[derive(Subcommand, Debug)]
enum Internal {
    /// Compile the plugin on standard input into a module cache entry
    /// (`wasmrpc::serve_as_compile_helper`).
    #[command(name = wasmrpc::COMPILE_HELPER_SUBCOMMAND, hide = true)]
    CompilePluginEntry {
        #[arg(long)]
        kind: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Join a group and serve the bench functions until it shuts down.
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        init_method: String,
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        world_size: u32,
        #[arg(long, default_value_t = 2)]
        threads: usize,
        #[arg(long)]
        plugin: Vec<PathBuf>,
        /// Let large storages cross in shared memory (the `shm_*` rows).
        #[arg(long)]
        shared_memory: bool,
        #[command(flatten)]
        observe: worker::Observe,
    },
    /// On cue from stdin, run init_rpc + graceful shutdown once per init method.
    #[command(hide = true)]
    InitWorker {
        #[arg(long, value_delimiter = ',')]
        init_methods: Vec<String>,
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        world_size: u32,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// The raw TCP echo server of the limits.
    #[command(hide = true)]
    RawServer {
        /// Poll each connection in a loop instead of sleeping in `read`.
        #[arg(long)]
        spin: bool,
        /// Serve each connection with tokio on a current-thread runtime.
        #[arg(long, conflicts_with = "spin")]
        tokio: bool,
        /// Keep the core busy this long before each echo, as a callee's op.
        #[arg(long, default_value_t = 0)]
        work_ns: u64,
    },
    /// Where a small call's time goes: per round trip, how often each
    /// thread of the caller and of the callee slept (and had to be woken)
    /// or was preempted, and the CPU it spent, beside the same for a raw
    /// TCP ping-pong (the call's floor). Measures, judges nothing.
    Anatomy {
        /// The call to dissect.
        #[arg(long, value_enum, default_value = "noop")]
        call: anatomy::Call,
        /// Round trips measured (each side; a tenth more to warm up).
        #[arg(long, default_value_t = 20_000)]
        calls: usize,
        /// Tokio threads of the caller and of the callee [default: as the
        /// suite's, the cores divided between the two].
        #[arg(long)]
        threads: Option<usize>,
        /// Also no-op calls with this many in flight (the async rows'
        /// regime), dissected the same way; 1: none.
        #[arg(long, default_value_t = 1)]
        in_flight: usize,
        /// Call the function in this process instead, without the wire (a
        /// world of one that loads the plugins itself): the callee's own
        /// cost, to profile with `perf record`.
        #[arg(long, conflicts_with = "in_flight")]
        local: bool,
        /// Also print the median and 90th percentile of each run of this
        /// many consecutive round trips of the call: the VM's slow and fast
        /// phases within one run show as runs of chunks; 0: none.
        #[arg(long, default_value_t = 0, conflicts_with = "local")]
        chunks: usize,
    },
    /// What a group costs as it grows: init, memory per worker and per
    /// connection, an all-to-all round and shutdown, for in-process workers
    /// sharing one runtime; ends with an extrapolation to 1,000 workers.
    Scale {
        /// World sizes to measure.
        #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
        worlds: Vec<u32>,
        /// Tokio threads of the shared runtime.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Measure the one world size given, here, and print raw numbers
        /// (how the parent runs each size in a fresh process).
        #[arg(long, hide = true)]
        one: bool,
    },
}

fn main() -> ExitCode {
    wasmrpc::set_memory_release(wasmrpc_alloc::release_freed_memory);
    wasmrpc::serve_as_compile_helper();
    let cli = Cli::parse();
    if let Some(Internal::CompilePluginEntry { kind, out }) = &cli.command {
        return wasmrpc::wasm::helper_main(kind, out);
    }
    // libtorch's CUDA side is loaded at start where a device is present;
    // a GPU machine where it failed would run no CUDA row: say why.
    if let Err(e) = wasmrpc::device::load_cuda() {
        eprintln!("bench: {e}");
        return ExitCode::FAILURE;
    }
    if let Some(us) = cli.busy_poll_us {
        worker::set_busy_poll(Duration::from_micros(us));
    }
    worker::set_intra_op_threads(cli.intra_op_threads);
    if matches!(
        cli.command,
        Some(Internal::Worker { .. } | Internal::InitWorker { .. } | Internal::RawServer { .. })
    ) {
        worker::exit_with_parent();
    }
    let r = match &cli.command {
        Some(Internal::Worker {
            init_method,
            rank,
            world_size,
            threads,
            plugin,
            shared_memory,
            observe,
        }) => worker::serve(
            init_method,
            *rank,
            *world_size,
            *threads,
            plugin,
            *shared_memory,
            observe,
        ),
        Some(Internal::InitWorker {
            init_methods,
            rank,
            world_size,
            threads,
        }) => worker::init_runs(init_methods, *rank, *world_size, *threads),
        Some(Internal::RawServer {
            spin,
            tokio,
            work_ns,
        }) => {
            let waiting = match (spin, tokio) {
                (true, _) => limit::Waiting::Spinning,
                (_, true) => limit::Waiting::Tokio,
                _ => limit::Waiting::Blocking,
            };
            limit::serve(waiting, Duration::from_nanos(*work_ns))
        }
        Some(Internal::Anatomy {
            call,
            calls,
            threads,
            in_flight,
            local,
            chunks,
        }) => {
            let threads = threads.unwrap_or_else(|| wasmrpc::cores_per_worker(2));
            if *local {
                anatomy::run_local(*call, *calls, threads)
            } else {
                anatomy::run(
                    *call,
                    *calls,
                    threads,
                    *in_flight,
                    *chunks,
                    cli.caller_runtime,
                )
            }
        }
        Some(Internal::Scale {
            worlds,
            threads,
            one: true,
        }) => match worlds.as_slice() {
            [world] => scale::run_one(*world, *threads),
            _ => Err(anyhow::anyhow!("--one measures exactly one world size")),
        },
        Some(Internal::Scale {
            worlds,
            threads,
            one: false,
        }) => scale::run(worlds, *threads),
        Some(Internal::CompilePluginEntry { .. }) => unreachable!("handled before the rest"),
        None if cli.list => {
            for r in ROWS {
                println!("{:<26} {}", r.id, r.title);
            }
            Ok(())
        }
        None => suite(&cli),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wasmrpc-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn suite(cli: &Cli) -> Result<()> {
    let root = ours::workspace_root();
    let out_dir = root.join("target").join("bench");
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let baseline = cli
        .baseline
        .as_deref()
        .map(report::read_baseline)
        .transpose()?;
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if let Some(n) = cli.nice {
        // Children (our workers, the raw server, Python and its workers)
        // inherit the niceness.
        let pid = std::process::id().to_string();
        let ok = std::process::Command::new("renice")
            .args(["-n", &n.to_string(), "-p", &pid])
            .stdout(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            anyhow::bail!("could not set niceness {n} (renice failed; negative values need root)");
        }
    }
    let machine = MachineLoad::start();
    let only = &cli.only;
    let progress = Progress::new();
    let mut res = Results::default();
    let threads = cli.threads.unwrap_or_else(|| wasmrpc::cores_per_worker(2));
    let cfg = ours::Config {
        quick: cli.quick,
        only: only.clone(),
        memory_calls: cli
            .memory_calls
            .unwrap_or(if cli.quick { 100_000 } else { 1_000_000 }),
        threads,
        log: out_dir.join("workers.log"),
    };
    let _ = std::fs::remove_file(&cfg.log);

    // 1. Limits.
    limit::measure(cli.quick, only, &mut res, &progress);

    // 2. Our side.
    let rt = worker::caller_runtime(cli.caller_runtime, threads)?;
    let main_rows = [
        "rss_idle",
        "rss_after_calls",
        "rss_idle_compiled",
        "rtt_noop_native",
        "rtt_noop_wasm",
        "rtt_noop_py",
        "rtt_add_wasm",
        "rtt_add_py",
        "rtt_aten_add",
        "async_128",
        "echo_4k",
        "echo_1m",
        "echo_64m",
        "remote_to_here",
        "dist_autograd_16",
        "dist_autograd_256",
        "wasm_local_warm",
        "wasm_local_cold_cached",
        "wasm_local_cold_uncached",
        "py_cold_cached",
        "py_cold_uncached",
    ];
    if main_rows.iter().any(|r| wanted(only, r))
        && let Err(e) = rt.block_on(ours::main_group(&cfg, &mut res, &progress))
    {
        let why = format!("n/a (failed: {e:#})");
        main_rows.iter().for_each(|r| res.na(Side::Ours, r, &why));
    }
    if shm::ROWS.iter().any(|r| wanted(only, r.0))
        && let Err(e) = rt.block_on(shm::rows(&cfg, &mut res, &progress))
    {
        let why = format!("n/a (failed: {e:#})");
        shm::ROWS.iter().for_each(|r| res.na(Side::Ours, r.0, &why));
    }
    let tls_rows: Vec<&str> = ours::TLS_ROWS.iter().map(|r| r.id).collect();
    if tls_rows.iter().any(|r| wanted(only, r))
        && let Err(e) = rt.block_on(ours::tls_rows(&cfg, &mut res, &progress))
    {
        let why = format!("n/a (failed: {e:#})");
        tls_rows.iter().for_each(|r| res.na(Side::Ours, r, &why));
    }
    let metrics_rows: Vec<&str> = ours::METRICS_ROWS.iter().map(|r| r.id).collect();
    if metrics_rows.iter().any(|r| wanted(only, r))
        && let Err(e) = rt.block_on(ours::metrics_rows(&cfg, &mut res, &progress))
    {
        let why = format!("n/a (failed: {e:#})");
        metrics_rows
            .iter()
            .for_each(|r| res.na(Side::Ours, r, &why));
    }
    let traced_rows: Vec<&str> = ours::TRACED_ROWS
        .iter()
        .chain(ours::SAMPLED_ROWS)
        .map(|r| r.id)
        .collect();
    if traced_rows.iter().any(|r| wanted(only, r))
        && let Err(e) = rt.block_on(ours::traced_rows(&cfg, &mut res, &progress))
    {
        let why = format!("n/a (failed: {e:#})");
        traced_rows.iter().for_each(|r| res.na(Side::Ours, r, &why));
    }
    rt.block_on(cuda::cuda_rows(&cfg, &mut res, &progress));
    for world in [2, 4, 8] {
        let row = format!("init_w{world}");
        if wanted(only, &row)
            && let Err(e) = ours::init(&cfg, world, &mut res, &progress)
        {
            res.na(Side::Ours, &row, format!("n/a (failed: {e:#})"));
        }
    }
    for world in [4, 8] {
        let row = format!("all_to_all_w{world}");
        if wanted(only, &row)
            && let Err(e) = rt.block_on(ours::all_to_all(&cfg, world, &mut res, &progress))
        {
            res.na(Side::Ours, &row, format!("n/a (failed: {e:#})"));
        }
    }
    drop(rt);
    let python = torch::interpreter(cli.python.clone(), &root);
    python_program::run(
        &python_program::PythonProgram {
            root: &root,
            python: &python,
            quick: cli.quick,
            only,
            log: &out_dir.join("python-program.log"),
        },
        &mut res,
        &progress,
    );

    // 3. The torch side.
    let script = root.join("bench").join("torch_rpc_bench.py");
    if cli.no_torch {
        for r in ROWS {
            if let Some(k) = r.torch {
                res.na(Side::Torch, k, "n/a (--no-torch)");
            }
        }
    } else {
        let torch_calls = cli
            .torch_memory_calls
            .unwrap_or(if cli.quick { 5_000 } else { 20_000 });
        torch::run(
            &torch::TorchRun {
                side: Side::Torch,
                keys: torch::torch_keys(only),
                pythonpath: None,
                python: &python,
                script: &script,
                quick: cli.quick,
                only,
                memory_calls: torch_calls,
                log: &out_dir.join("torch.log"),
            },
            &mut res,
            &progress,
        );
    }
    let elapsed = progress.elapsed_secs();
    progress.set(&format!("done in {elapsed:.0} s"));
    progress.finish();

    // Report.
    let run = json!({
        "unix_time": started,
        "quick": cli.quick,
        "elapsed_s": elapsed,
        "load_average_before": machine.load_before(),
        "load_average_after": load_average(),
        "steal_percent": machine.steal_percent(),
        "torch_version": res.note_of(Side::Torch, "version"),
        "worker_threads": threads,
        "caller_runtime": format!("{:?}", cli.caller_runtime),
        "intra_op_threads": wasmrpc::intra_op_threads(),
        "nice": cli.nice,
    });
    let table = report::table(&res, only, baseline.as_ref());
    println!("{table}");
    println!("{}", report::targets(&res));
    println!(
        "Local wasm calls of the runtime alone (no agent): cargo bench -p wasmrpc-wasm --bench warm_call.\n\
         Hot paths (header and value encoding): cargo bench -p wasmrpc-bench --bench hot_paths."
    );
    println!(
        "Run: {elapsed:.0} s, {}, {} op thread(s) per worker of ours{}{}.",
        machine.summary(),
        wasmrpc::intra_op_threads(),
        if cli.quick { ", --quick" } else { "" },
        cli.nice
            .map(|n| format!(", niceness {n}"))
            .unwrap_or_default()
    );

    if let Some(note) = machine.busy_note() {
        println!("{note}");
    }

    let lines = report::json_lines(&res, only, &run);
    let json_path = cli
        .json
        .clone()
        .unwrap_or_else(|| out_dir.join(format!("bench-{started}.jsonl")));
    std::fs::write(&json_path, &lines)
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    std::fs::write(out_dir.join("latest.jsonl"), &lines)?;
    println!(
        "JSON lines: {} (and target/bench/latest.jsonl)",
        json_path.display()
    );

    let plot_path = cli
        .plot
        .clone()
        .unwrap_or_else(|| out_dir.join("latency_vs_size.png"));
    match plot::draw(&res, &plot_path) {
        Ok(note) => {
            println!("Plot: {}", plot_path.display());
            if let Some(n) = note {
                println!("  ({n})");
            }
        }
        Err(e) => println!("Plot: not drawn ({e:#})"),
    }
    println!("Worker logs: {}", cfg.log.display());
    Ok(())
}
