//! Developer commands for wasmrpc, run as `cargo xtask <command>`.
//!
//! - `setup`: installs what the build needs and links it into `.wasmrpc-env/`
//!   (the wasm32 target, the torch wheel in a cache folder outside the repo).
//! - `demo`: set-up, then the README's main job on a local cluster.
//! - `test`: set-up, then format check, the guide and its links, lints,
//!   every test, the ported suites again with every test cluster over TLS
//!   (those of Python plugins aside: their calls take the transport that
//!   the Rust plugins' calls take), and the seed coverage table.
//! - `docs`: builds the guide (`docs/`, an mdBook) into `target/book/` and
//!   checks the links of every markdown file.
//! - `coverage`: regenerates `tests/SEED_COVERAGE.md` from the last test run
//!   and the newest GPU run record (`--gpu-run DIR` imports one first).
//! - `bench`: set-up, then the benchmark suite beside torch.distributed.rpc;
//!   `bench collectives`: the c10d collectives beside torch.distributed's
//!   Gloo. A full run of either writes its table into the guide
//!   (`docs/src/benchmarks/results.md`).
//! - `build`: the `wasmrpc` binary built against another PyTorch release
//!   (`--torch X.Y.Z`) or the torch of a Python (`--torch-from-python`).
//! - `dist`: the release bundle, a tarball that runs on a machine with
//!   nothing installed.
//! - `gpu-bundle`: the GPU-relevant tests built against another PyTorch's
//!   libtorch (that of the GPU machines' image), packed to run there
//!   without a Rust toolchain.
//!
//! Each command reuses what an earlier run installed, so a second run starts
//! in seconds.

mod bench;
mod coverage;
mod demo;
mod dist;
mod docs;
mod gpu_bundle;
mod process;
mod python;
mod setup;
mod torch_release;
#[cfg(test)]
mod unit_graphs;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};

/// wasmrpc's developer commands.
#[derive(Parser)]
#[command(name = "cargo xtask", about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what the build needs (wasm32 target, torch 2.13.0 in the
    /// cache folder) and link it into `.wasmrpc-env/`; reused when present.
    Setup,
    /// Set up, then run the demo: a local cluster of workers calling each
    /// other's wasm plugins. It reads its data from `examples/data` and
    /// saves a checkpoint after every epoch in `target/demo/checkpoints`.
    Demo {
        /// Continue the last run from its last checkpoint instead of
        /// starting afresh.
        #[arg(long)]
        resume: bool,
    },
    /// Set up, then run `cargo fmt --check`, build the guide and check its
    /// links, clippy, every test, and regenerate `tests/SEED_COVERAGE.md`
    /// (not after a run given a filter, which sees only some suites).
    Test {
        /// Build and run the tests against this PyTorch release's libtorch
        /// (fetched from PyPI into the cache folder) in a target folder of
        /// its own, without the lints and the TLS pass.
        #[arg(long, value_name = "X.Y.Z")]
        torch: Option<String>,
        /// Extra arguments passed to `cargo nextest run` (e.g. a filter).
        #[arg(trailing_var_arg = true)]
        nextest_args: Vec<String>,
    },
    /// Build the `wasmrpc` binary against another PyTorch than the
    /// set-up's 2.13.0: a release's libtorch (its wheel from PyPI, into the
    /// cache folder) or the torch a Python imports, into
    /// `target/torch-VERSION/`. tch 0.26's C API must compile against its
    /// headers (with `xtask/gpu-bundle/tch-compat.h`): 2.11 and 2.13 do.
    Build {
        /// The PyTorch release to build against (e.g. 2.11.0).
        #[arg(long, value_name = "X.Y.Z", conflicts_with = "torch_from_python")]
        torch: Option<String>,
        /// Build against the torch this Python imports [default: python3].
        #[arg(long, value_name = "PYTHON", num_args = 0..=1, default_missing_value = "python3")]
        torch_from_python: Option<String>,
        /// An optimized build (`--release`).
        #[arg(long)]
        release: bool,
    },
    /// Build the release bundle: `target/dist/wasmrpc-VERSION-x86_64-linux-FLAVOUR.tar.zst`,
    /// the binary with the libraries it loads (found relative to it), the
    /// example plugins, the demo's data, the deployment recipes and the
    /// plugin SDK. Unpacked anywhere, `bin/wasmrpc` runs with no Rust, no
    /// Python and no cache folder.
    Dist {
        /// cuda: libtorch and CUDA's libraries (runs on CPU-only machines
        /// too); cpu: a build that links no CUDA, libtorch's CPU libraries
        /// only; system-torch: no libtorch inside, the machine's Python's
        /// torch (which must be the release it was built against).
        /// [default: cuda when the torch is a CUDA build, else cpu]
        #[arg(long, value_enum)]
        flavour: Option<dist::Flavour>,
        /// Build against this PyTorch release instead of the set-up's.
        #[arg(long, value_name = "X.Y.Z")]
        torch: Option<String>,
        /// Pack this built binary instead of building one (the tests pack
        /// their debug build).
        #[arg(long, value_name = "BINARY", hide = true, conflicts_with = "torch")]
        from_build: Option<PathBuf>,
        /// Where the tarball goes (and, until it is packed, the bundle's folder)
        /// [default: target/dist].
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// zstd's compression level (1-19).
        #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=19))]
        level: u32,
    },
    /// Set up, then build the `wasmrpc` Python package (torch.distributed.rpc's
    /// API for a Python program) with maturin and install it into the
    /// torch venv (`.wasmrpc-env/venv`), whose libtorch it links. The wheel
    /// stays in `target/wheels/`.
    Python {
        /// An unoptimized build (faster to make, slower to run).
        #[arg(long)]
        debug: bool,
    },
    /// Build the guide (`docs/`, an mdBook; mdbook is installed into the
    /// cache folder on first use) into `target/book/`, and check every
    /// relative link and anchor of the repository's markdown files.
    Docs,
    /// Regenerate `tests/SEED_COVERAGE.md` from the last `cargo xtask test`
    /// and the newest GPU run record (`tests/gpu-runs/`).
    Coverage {
        /// First import a GPU run: the folder where the gpu-bundle's
        /// `run.sh --out DIR` wrote `junit.xml` and `machine.txt`.
        #[arg(long, value_name = "DIR")]
        gpu_run: Option<PathBuf>,
    },
    /// Set up, then run the benchmark suite: wasmrpc beside
    /// torch.distributed.rpc and the machine's raw limits, one table of ratios.
    /// `bench collectives [--quick] [--rounds N]`: the c10d collectives
    /// (libtorch's Gloo behind wasmrpc-c10d) beside torch.distributed's Gloo.
    /// A full run (no `--quick`, `--only`, `--no-torch`) writes its table
    /// into the guide, `docs/src/benchmarks/results.md`.
    Bench {
        /// Arguments passed to `wasmrpc-bench` (e.g. `--quick`, `--only
        /// echo`, `--baseline FILE`; `-- --help` lists them), or
        /// `collectives` and the collectives bench's flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        bench_args: Vec<String>,
    },
    /// Build the ported seed suites, the shim's op tests and the c10d engine
    /// tests against the libtorch of another PyTorch release (torch's wheel from PyPI, into
    /// the cache folder) and pack them into
    /// `target/gpu-bundle/wasmrpc-gpu-torch-VERSION/`: a nextest archive,
    /// cargo-nextest and `run.sh`, which runs them on a machine with a GPU
    /// and that PyTorch but no Rust toolchain, in a checkout of the same
    /// commit, and writes a JUnit report.
    GpuBundle {
        /// The PyTorch release whose libtorch the tests load there.
        #[arg(long, default_value = gpu_bundle::DEFAULT_TORCH)]
        torch: String,
        /// Also build `wasmrpc-bench` (release) against it, into
        /// `target/gpu-bundle/wasmrpc-gpu-bench-torch-VERSION/` with
        /// `run-bench.sh` (its GPU row: `--only cuda`).
        #[arg(long)]
        bench: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Command::Setup => {
            setup::run(&root)?;
        }
        Command::Demo { resume } => {
            setup::run(&root)?;
            demo::run(&root, resume)?;
        }
        Command::Test {
            torch: Some(version),
            nextest_args,
        } => {
            torch_release::test(
                &root,
                &torch_release::TorchChoice::Release(version),
                &nextest_args,
            )?;
        }
        Command::Test {
            torch: None,
            nextest_args,
        } => {
            setup::run(&root)?;
            run_tests(&root, &nextest_args)?;
        }
        Command::Build {
            torch,
            torch_from_python,
            release,
        } => {
            let choice = match (torch, torch_from_python) {
                (_, Some(python)) => torch_release::TorchChoice::Python(python),
                (Some(version), None) => torch_release::TorchChoice::Release(version),
                (None, None) => torch_release::TorchChoice::Release(setup::TORCH_VERSION.into()),
            };
            torch_release::build(&root, &choice, release)?;
        }
        Command::Dist {
            flavour,
            torch,
            from_build,
            out,
            level,
        } => {
            dist::run(
                &root,
                &dist::DistOptions {
                    flavour,
                    torch,
                    from_build,
                    out,
                    level,
                },
            )?;
        }
        Command::Python { debug } => {
            let venv = setup::run(&root)?;
            python::install(&root, &venv, debug)?;
        }
        Command::Docs => {
            docs::run(&root)?;
        }
        Command::Coverage { gpu_run } => {
            if let Some(dir) = gpu_run {
                let record = coverage::import_gpu_run(&root, &dir)?;
                println!("coverage: GPU run recorded in {}", record.display());
            }
            let report = coverage::regenerate(&root)?;
            println!("{}", report.summary_line());
        }
        Command::Bench { bench_args } => {
            setup::run(&root)?;
            bench::run(&root, &bench_args)?;
        }
        Command::GpuBundle { torch, bench } => {
            gpu_bundle::run(&root, &torch, bench)?;
        }
    }
    Ok(())
}

/// The checks and tests behind `cargo xtask test`; fails if any of them fails.
fn run_tests(root: &Path, nextest_args: &[String]) -> Result<()> {
    process::step("format check (cargo fmt --check)");
    process::cargo(root, &["fmt", "--all", "--check"])?;

    process::step("the guide: mdbook build (docs/ into target/book/) and the markdown links");
    docs::run(root)?;

    process::step("lints, host crates (cargo clippy --all-targets -D warnings)");
    process::cargo(root, &["clippy", "--all-targets", "--", "-D", "warnings"])?;
    process::step("lints, guest SDK and plugins on wasm32");
    let mut args = vec![
        "clippy",
        "--target",
        "wasm32-unknown-unknown",
        "-p",
        "wasmrpc-guest",
    ];
    let plugins = plugin_packages(root)?;
    for p in &plugins {
        args.extend(["-p", p.as_str()]);
    }
    args.extend(["--", "-D", "warnings"]);
    process::cargo(root, &args)?;

    process::step("tests (cargo nextest run --profile ci)");
    setup::ensure_nextest()?;
    let mut args = vec!["nextest", "run", "--profile", "ci", "--no-fail-fast"];
    args.extend(nextest_args.iter().map(String::as_str));
    let tests = process::cargo(root, &args);

    // A filter, not `-p`: the same build as the run above, so nothing is
    // compiled again for other features. Python plugins' tests stay out:
    // their calls go through the agent and transport the Rust plugins'
    // tests take over TLS, and they are a sixth of this pass's time.
    const TLS_FILTER: &str = "package(wasmrpc-tests) and not test(/^python_plugins::/)";
    process::step(&format!(
        "the ported suites again over TLS (WASMRPC_TEST_TLS=1 cargo nextest run --profile ci-tls \
         -E '{TLS_FILTER}')"
    ));
    let mut args = vec!["nextest", "run", "--profile", "ci-tls", "-E", TLS_FILTER];
    args.extend(nextest_args.iter().map(String::as_str));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tls_tests = process::run(
        std::process::Command::new(cargo)
            .args(&args)
            .env("WASMRPC_TEST_TLS", "1")
            .current_dir(root),
    );

    process::step("doc tests (cargo test --doc)");
    let doc_tests = process::cargo(root, &["test", "--doc", "--quiet"]);

    // A filtered run saw some of the suites only: the file it would write
    // would count every seed test it left out as not run.
    if nextest_args.is_empty() {
        process::step("seed coverage (tests/SEED_COVERAGE.md)");
        let report = coverage::regenerate(root)?;
        println!("{}", report.summary_line());
        println!("{}", report.closing_line());
    } else {
        println!(
            "seed coverage: tests/SEED_COVERAGE.md left as it was (the run was filtered: {})",
            nextest_args.join(" ")
        );
    }
    process::print_step_times();

    tests?;
    tls_tests?;
    doc_tests?;
    Ok(())
}

/// The workspace root: the parent of this crate's manifest folder.
fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// The package names of the plugins under `plugins/` (every folder with a
/// `Cargo.toml`, except `artifacts`, which builds them for the host), so a
/// new plugin is linted on wasm32 without being listed here.
fn plugin_packages(root: &Path) -> Result<Vec<String>> {
    let dir = root.join("plugins");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let manifest = path.join("Cargo.toml");
        if path.file_name().is_some_and(|n| n == "artifacts") || !manifest.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&manifest)
            .with_context(|| format!("reading {}", manifest.display()))?;
        let name = text
            .lines()
            .find_map(|l| {
                let (key, value) = l.split_once('=')?;
                (key.trim() == "name").then(|| value.trim().trim_matches('"').to_string())
            })
            .with_context(|| format!("no package name in {}", manifest.display()))?;
        names.push(name);
    }
    names.sort();
    Ok(names)
}
