//! `cargo xtask bench collectives`: all_reduce, all_gather, broadcast and
//! reduce_scatter of 4 KiB, 1 MiB and 64 MiB over 4 ranks, this crate's
//! `gloo` (libtorch's ProcessGroupGloo behind the Rust API) beside
//! `torch.distributed` with its Gloo (`bench/torch_collectives_bench.py`),
//! in one run, as bus bandwidth (nccl-tests' busbw) and the ratio.
//!
//! Both sides run the same protocol: every rank is its own process (this
//! binary re-run with `--worker`, or the Python script), all ranks meet in
//! one FileStore file, tensors are float32 on the CPU; per (op, size) the
//! ranks make `warmup` unmeasured calls, a barrier, then `iters` calls back
//! to back, each waited for; rank 0 reports the mean time per call. Every
//! case runs in fresh processes, `--rounds` times per side, the sides
//! alternating; a row keeps each side's best round, so load from other
//! processes penalises both alike.
//!
//! busbw = algbw × factor, algbw = bytes / time, with bytes the buffer size
//! nccl-tests uses (the tensor for all_reduce and broadcast, the whole
//! gathered output for all_gather, the whole input for reduce_scatter) and
//! factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather and
//! reduce_scatter, 1 for broadcast.
//!
//! Flags: `--quick` (fewer calls), `--rounds N` (default 2), `--world N`
//! (default 4), `--python PATH` (default `$WASMRPC_ENV/venv/bin/python`),
//! `--backend NAME` (ours: default `gloo`; `tcp` measures our own backend),
//! `--out FILE` (where the Markdown table goes, from the workspace root;
//! default `target/bench/collectives.md`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use wasmrpc_c10d::{InitOptions, ReduceOp, World};
use wasmrpc_store::FileStore;

const OPS: [&str; 4] = ["all_reduce", "all_gather", "broadcast", "reduce_scatter"];
const SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// One measured case: `op:bytes:warmup:iters`.
#[derive(Debug, Clone)]
struct Case {
    op: String,
    bytes: usize,
    warmup: usize,
    iters: usize,
}

impl Case {
    fn arg(&self) -> String {
        format!("{}:{}:{}:{}", self.op, self.bytes, self.warmup, self.iters)
    }

    fn parse(s: &str) -> Res<Case> {
        let parts: Vec<&str> = s.split(':').collect();
        let [op, bytes, warmup, iters] = parts.as_slice() else {
            return Err(format!("bad case {s:?}: want op:bytes:warmup:iters").into());
        };
        Ok(Case {
            op: (*op).to_owned(),
            bytes: bytes.parse()?,
            warmup: warmup.parse()?,
            iters: iters.parse()?,
        })
    }
}

fn cases(quick: bool) -> Vec<Case> {
    let mut out = Vec::new();
    for op in OPS {
        for bytes in SIZES {
            let (warmup, iters) = match (bytes, quick) {
                (b, false) if b <= 4 << 10 => (50, 400),
                (b, false) if b <= 1 << 20 => (5, 40),
                (_, false) => (1, 5),
                (b, true) if b <= 4 << 10 => (10, 100),
                (b, true) if b <= 1 << 20 => (2, 10),
                (_, true) => (1, 2),
            };
            out.push(Case {
                op: op.to_owned(),
                bytes,
                warmup,
                iters,
            });
        }
    }
    out
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.iter().any(|a| a == "--worker") {
        worker(&args)
    } else {
        driver(&args)
    };
    if let Err(e) = result {
        eprintln!("collectives bench: {e}");
        std::process::exit(1);
    }
}

/// One rank of ours: prints `RESULT op bytes seconds` lines on rank 0.
fn worker(args: &[String]) -> Res<()> {
    let rank: usize = flag(args, "--rank").ok_or("--rank")?.parse()?;
    let world_size: usize = flag(args, "--world").ok_or("--world")?.parse()?;
    let file = PathBuf::from(flag(args, "--file").ok_or("--file")?);
    let backend = flag(args, "--backend").unwrap_or("gloo").to_owned();
    let cases: Vec<Case> = args
        .windows(2)
        .filter(|w| w[0] == "--case")
        .map(|w| Case::parse(&w[1]))
        .collect::<Res<_>>()?;
    // One worker thread: the rank's program runs on one thread, as a
    // Python rank's does; the engine's own threads do the communication.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let world = World::new();
        world
            .init_process_group(InitOptions {
                backend: Some(backend),
                store: Some(Arc::new(FileStore::new(&file, Some(world_size)))),
                rank: Some(rank as i64),
                world_size: Some(world_size as i64),
                timeout: Some(Duration::from_secs(120)),
                ..Default::default()
            })
            .await?;
        let n = world_size as i64;
        let opts = (Kind::Float, Device::Cpu);
        for case in &cases {
            let elems = (case.bytes / 4) as i64;
            let t = Tensor::ones([elems], opts);
            let chunk_in = Tensor::ones([elems / n], opts);
            let chunks: Vec<Tensor> = (0..n).map(|_| Tensor::ones([elems / n], opts)).collect();
            let chunk_out = Tensor::empty([elems / n], opts);
            let call = || -> Res<wasmrpc_c10d::Work> {
                Ok(match case.op.as_str() {
                    "all_reduce" => world.all_reduce(&t, ReduceOp::SUM, None)?,
                    "broadcast" => world.broadcast(&t, 0, None)?,
                    "all_gather" => world.all_gather(&chunks, &chunk_in, None)?,
                    "reduce_scatter" => {
                        world.reduce_scatter(&chunk_out, &chunks, ReduceOp::SUM, None)?
                    }
                    other => return Err(format!("unknown op {other}").into()),
                })
            };
            for _ in 0..case.warmup {
                call()?.wait().await?;
            }
            world.barrier(None)?.wait().await?;
            let start = Instant::now();
            for _ in 0..case.iters {
                call()?.wait().await?;
            }
            let seconds = start.elapsed().as_secs_f64() / case.iters as f64;
            if rank == 0 {
                println!("RESULT {} {} {seconds:.9}", case.op, case.bytes);
            }
        }
        world.barrier(None)?.wait().await?;
        world.destroy_process_group(None)?;
        Res::Ok(())
    })
}

/// Starts `world` processes from `make(rank)` and returns rank 0's results.
fn run_side(
    world: usize,
    make: impl Fn(usize, &Path) -> Command,
) -> Res<BTreeMap<(String, usize), f64>> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("store");
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let mut cmd = make(rank, &file);
        cmd.stdout(if rank == 0 {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        children.push(cmd.spawn()?);
    }
    let mut results = BTreeMap::new();
    if let Some(out) = children[0].stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            let parts: Vec<&str> = line.split_whitespace().collect();
            if let ["RESULT", op, bytes, secs] = parts.as_slice() {
                results.insert(((*op).to_owned(), bytes.parse()?), secs.parse()?);
            }
        }
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            failed.push(format!("rank {rank}: {status}"));
        }
    }
    if !failed.is_empty() {
        return Err(format!("ranks failed: {}", failed.join(", ")).into());
    }
    Ok(results)
}

fn busbw(op: &str, bytes: usize, seconds: f64, n: usize) -> f64 {
    let n = n as f64;
    let factor = match op {
        "all_reduce" => 2. * (n - 1.) / n,
        "all_gather" | "reduce_scatter" => (n - 1.) / n,
        _ => 1.,
    };
    bytes as f64 / seconds * factor / 1e9
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn keep_best(best: &mut BTreeMap<(String, usize), f64>, round: BTreeMap<(String, usize), f64>) {
    for (k, v) in round {
        let e = best.entry(k).or_insert(f64::INFINITY);
        *e = e.min(v);
    }
}

fn driver(args: &[String]) -> Res<()> {
    let quick = args.iter().any(|a| a == "--quick");
    let rounds: usize = flag(args, "--rounds").map_or(Ok(2), str::parse)?;
    let world: usize = flag(args, "--world").map_or(Ok(4), str::parse)?;
    let backend = flag(args, "--backend").unwrap_or("gloo").to_owned();
    let python = flag(args, "--python")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let env = std::env::var_os("WASMRPC_ENV")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.wasmrpc-env")
                });
            env.join("venv/bin/python")
        });
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/torch_collectives_bench.py");
    let cases = cases(quick);
    let exe = std::env::current_exe()?;

    let mut ours = BTreeMap::new();
    let mut torch = BTreeMap::new();
    let mut torch_error = None;
    // Case by case, the sides alternating (ours first in odd rounds, torch
    // first in even ones), so that load which drifts over the run falls on
    // both sides of a row alike.
    for case in &cases {
        let case_args = ["--case".to_owned(), case.arg()];
        for round in 1..=rounds {
            let run_ours = |ours: &mut BTreeMap<_, _>| -> Res<()> {
                let r = run_side(world, |rank, file| {
                    let mut c = Command::new(&exe);
                    c.args(["--worker", "--backend", &backend])
                        .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
                        .arg("--file")
                        .arg(file)
                        .args(&case_args);
                    c
                })?;
                keep_best(ours, r);
                Ok(())
            };
            let run_torch = |torch: &mut BTreeMap<_, _>, err: &mut Option<String>| match run_side(
                world,
                |rank, file| {
                    let mut c = Command::new(&python);
                    c.arg(&script)
                        .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
                        .arg("--file")
                        .arg(file)
                        .args(&case_args);
                    c
                },
            ) {
                Ok(r) => keep_best(torch, r),
                Err(e) => *err = Some(format!("{e} ({})", python.display())),
            };
            eprintln!(
                "collectives: {} {}: round {round}/{rounds}",
                case.op,
                size_name(case.bytes)
            );
            if round % 2 == 1 {
                run_ours(&mut ours)?;
                run_torch(&mut torch, &mut torch_error);
            } else {
                run_torch(&mut torch, &mut torch_error);
                run_ours(&mut ours)?;
            }
        }
    }

    let mut table = String::new();
    table.push_str(&format!(
        "collectives over {world} ranks (CPU, float32; busbw in GB/s, best of {rounds} round(s){})\n\n",
        if quick { ", --quick" } else { "" }
    ));
    table.push_str(&format!(
        "| op | size | ours ({backend}) busbw | torch gloo busbw | ratio | ours time | torch time |\n"
    ));
    table.push_str("|---|---|---:|---:|---:|---:|---:|\n");
    for c in &cases {
        let key = (c.op.clone(), c.bytes);
        let o = ours.get(&key).copied();
        let t = torch.get(&key).copied();
        let cell = |s: Option<f64>| {
            s.map_or("n/a".to_owned(), |s| {
                format!("{:.3}", busbw(&c.op, c.bytes, s, world))
            })
        };
        let time = |s: Option<f64>| s.map_or("n/a".to_owned(), |s| format!("{:.1} µs", s * 1e6));
        let ratio = match (o, t) {
            (Some(o), Some(t)) => format!("{:.2}x", t / o),
            _ => "n/a".to_owned(),
        };
        table.push_str(&format!(
            "| {} | {} | {} | {} | {ratio} | {} | {} |\n",
            c.op,
            size_name(c.bytes),
            cell(o),
            cell(t),
            time(o),
            time(t)
        ));
    }
    if let Some(e) = &torch_error {
        table.push_str(&format!("\ntorch side failed: {e}\n"));
    }
    println!("{table}");
    // cargo runs benches in the package's folder: paths are taken from the
    // workspace root, where `cargo xtask` runs.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let out = root.join(flag(args, "--out").unwrap_or("target/bench/collectives.md"));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, &table)?;
    eprintln!("collectives: table written to {}", out.display());
    Ok(())
}
