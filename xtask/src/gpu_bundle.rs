//! `cargo xtask gpu-bundle`: the GPU-relevant test binaries built against
//! the libtorch of another PyTorch release (by default 2.11.0, the one the
//! GPU machines' image ships), packed with what runs them on a machine that
//! has a GPU and that PyTorch but no Rust toolchain.
//!
//! What it owns: the libtorch of that release in the cache folder
//! (`libtorch-<version>/site-packages`, from PyPI's wheel, with the NCCL
//! headers its wheel pins and the set-up's CUDA headers), the build of the
//! tests against it in `target/gpu-bundle/torch-<version>/`, and the bundle
//! folder `target/gpu-bundle/wasmrpc-gpu-torch-<version>/`: a nextest
//! archive of the test binaries and the plugins, the `cargo-nextest`
//! binary, `run.sh` (`xtask/gpu-bundle/run.sh`) and `bundle.env`. It leaves
//! the main build (`target/debug`, `.wasmrpc-env/`) alone.
//!
//! tch 0.26's C API is generated from libtorch 2.13's op list; the few ops
//! an older libtorch lacks are declared by `xtask/gpu-bundle/tch-compat.h`
//! (calling one is an error naming it). The build force-includes that
//! header, so torch-sys itself is built unchanged.

use crate::process::{self, output, step};
use crate::setup;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyTorch release the GPU machines' image ships.
pub(crate) const DEFAULT_TORCH: &str = "2.11.0";
/// The test binaries in the bundle: `(package, test target)`. The ported
/// seed suites (their GPU tests among them), the c10d engines, and the
/// shim's ops (whose `a_cuda_build_loads_libtorch_cuda` guards CUDA itself).
const TESTS: &[(&str, &str)] = &[
    ("wasmrpc-tests", "all"),
    ("wasmrpc-torch-sys", "ops"),
    ("wasmrpc-c10d", "nccl_engine"),
    ("wasmrpc-c10d", "ddp_backends"),
    ("wasmrpc-c10d", "gloo_engine"),
    ("wasmrpc-c10d", "c10d_common_test"),
];
/// Declares the ops tch 0.26 binds that older libtorch releases lack.
const COMPAT_HEADER: &str = "xtask/gpu-bundle/tch-compat.h";
/// The script that runs the bundle on the GPU machine.
const RUN_SCRIPT: &str = "xtask/gpu-bundle/run.sh";
/// The script that runs the bench (`--bench`) there.
const BENCH_SCRIPT: &str = "xtask/gpu-bundle/run-bench.sh";
/// Where the plugins' .wasm files are, relative to the target folder.
const PLUGINS_REL: &str = "wasm-plugins/wasm32-unknown-unknown/release";
/// Written into the libtorch folder once it is complete.
const READY_STAMP: &str = ".wasmrpc-ready";
/// What the device tool carries at most in one call.
const CARRY_LIMIT: u64 = 64 << 20;

/// Builds the bundle for torch `version` (and, with `bench`, the bench
/// beside it) and returns its folder.
pub(crate) fn run(root: &Path, version: &str, bench: bool) -> Result<PathBuf> {
    let venv = setup::run(root)?;
    let site = ensure_libtorch(&venv, version)?;
    let torch = site.join("torch");
    check_tch_api_compiles(root, &torch, version)?;

    let out = root.join("target").join("gpu-bundle");
    let target = out.join(format!("torch-{version}"));
    let bundle = out.join(format!("wasmrpc-gpu-torch-{version}"));
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)
            .with_context(|| format!("could not remove the old {}", bundle.display()))?;
    }
    std::fs::create_dir_all(&bundle)?;

    step(&format!(
        "gpu-bundle: building the tests against libtorch {version} into {} \
         (a full build on the first run)",
        target.display()
    ));
    build_archive(root, &torch, &target, &bundle.join("tests.tar.zst"))?;

    let info = TorchInfo::read(&torch)?;
    std::fs::write(
        bundle.join("bundle.env"),
        format!(
            "BUNDLE_TORCH_VERSION='{}'\nBUNDLE_TORCH_GIT='{}'\nBUNDLE_COMMIT='{}'\n\
             BUNDLE_PLUGINS_DIR='{}'\nBUNDLE_PLUGINS_REL='{PLUGINS_REL}'\n",
            info.version,
            info.git,
            commit(root),
            target.join(PLUGINS_REL).display()
        ),
    )?;
    let script = bundle.join("run.sh");
    std::fs::copy(root.join(RUN_SCRIPT), &script)?;
    make_executable(&script)?;
    pack_nextest(&bundle)?;

    let size = folder_size(&bundle)?;
    println!(
        "gpu-bundle: {} ({:.1} MiB) for torch {}",
        bundle.display(),
        size as f64 / f64::from(1 << 20),
        info.version
    );
    if size > CARRY_LIMIT - (4 << 20) {
        println!(
            "gpu-bundle: warning: over 60 MiB; with the checkout it may not fit the 64 MiB a \
             device call carries"
        );
    }
    println!(
        "gpu-bundle: on the GPU machine, in a checkout of the same commit: \
         {}/run.sh --out OUT [nextest filters]",
        bundle.strip_prefix(root).unwrap_or(&bundle).display()
    );
    if bench {
        let dir = out.join(format!("wasmrpc-gpu-bench-torch-{version}"));
        step(&format!(
            "gpu-bundle: building the bench (release) against libtorch {version} into {}",
            dir.display()
        ));
        build_bench(root, &torch, &target, &dir)?;
        println!(
            "gpu-bundle: the bench: {}/run-bench.sh [wasmrpc-bench flags, e.g. --only cuda], \
             in a checkout of the same commit at {}",
            dir.strip_prefix(root).unwrap_or(&dir).display(),
            root.display()
        );
    }
    Ok(bundle)
}

/// What a torch folder's `version.py` says.
struct TorchInfo {
    /// `__version__`, e.g. `2.11.0+cu130`.
    version: String,
    /// `git_version`, the commit it was built from.
    git: String,
    /// `cuda`, e.g. `13.0`; `None` in a CPU build.
    cuda: Option<String>,
}

impl TorchInfo {
    fn read(torch: &Path) -> Result<Self> {
        let path = torch.join("version.py");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        // Lines such as `__version__ = '2.11.0+cu130'` and
        // `cuda: Optional[str] = '13.0'` (or `= None`).
        let value = |key: &str| {
            text.lines().find_map(|line| {
                let (lhs, rhs) = line.split_once('=')?;
                let name = lhs.split(':').next()?.trim();
                (name == key).then(|| rhs.trim().trim_matches(['\'', '"']).to_string())
            })
        };
        let version = value("__version__")
            .with_context(|| format!("no __version__ in {}", path.display()))?;
        Ok(Self {
            version,
            git: value("git_version").unwrap_or_default(),
            cuda: value("cuda").filter(|c| c != "None"),
        })
    }
}

/// Returns `site-packages` of the cache folder's libtorch `version`,
/// fetching it first: torch's wheel from PyPI (its `include`, `lib` and
/// `share`), the NCCL wheel it pins (the NCCL headers fix the layout of
/// `ProcessGroupNCCL`, so they must be the pinned release), and links to the
/// set-up's other CUDA packages (headers of the same CUDA release, and the
/// libraries `libtorch_cuda.so` needs at link time).
fn ensure_libtorch(venv: &Path, version: &str) -> Result<PathBuf> {
    let dir = setup::cache_dir()?.join(format!("libtorch-{version}"));
    let site = dir.join("site-packages");
    if dir.join(READY_STAMP).exists() {
        return Ok(site);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("could not remove the incomplete {}", dir.display()))?;
    }
    step(&format!(
        "gpu-bundle: fetching torch {version}'s libtorch from PyPI into {} (about 1 GB, once)",
        dir.display()
    ));
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels)?;
    let python = venv.join("bin").join("python");
    let wheel = pip_download(&python, &format!("torch=={version}"), &wheels, "torch-")?;
    unzip(
        &python,
        &wheel,
        &site,
        &[
            "torch/include/",
            "torch/lib/",
            "torch/share/",
            "torch/version.py",
        ],
    )?;
    let info = TorchInfo::read(&site.join("torch"))?;
    if let Some(cuda) = &info.cuda {
        let setup_torch = setup::torch_dir(venv)?.context("the set-up's venv holds no torch")?;
        let setup_cuda = TorchInfo::read(&setup_torch)?.cuda;
        if setup_cuda.as_deref() != Some(cuda.as_str()) {
            bail!(
                "torch {version} is built for CUDA {cuda}, the set-up's torch for {}: the \
                 CUDA headers the NCCL shim compiles against would not match",
                setup_cuda.as_deref().unwrap_or("no CUDA")
            );
        }
        let nccl = nccl_requirement(&python, &wheel)?;
        if let Some(nccl) = nccl {
            let nccl_wheel = pip_download(&python, &nccl, &wheels, "nvidia_nccl")?;
            unzip(&python, &nccl_wheel, &site, &["nvidia/nccl/"])?;
        }
        let setup_nvidia = setup_torch.join("..").join("nvidia");
        let nvidia = site.join("nvidia");
        std::fs::create_dir_all(&nvidia)?;
        for entry in std::fs::read_dir(&setup_nvidia)
            .with_context(|| format!("listing {}", setup_nvidia.display()))?
        {
            let entry = entry?;
            let name = entry.file_name();
            if name == "nccl" || name == "__pycache__" || name == "__init__.py" {
                continue;
            }
            let from = std::fs::canonicalize(entry.path())?;
            setup::relink(&nvidia.join(&name), &from)?;
        }
    }
    std::fs::remove_dir_all(&wheels)?;
    std::fs::write(dir.join(READY_STAMP), format!("torch {}\n", info.version))?;
    Ok(site)
}

/// `pip download --no-deps` of `requirement` into `dir`; returns the wheel
/// whose name starts with `prefix`.
fn pip_download(python: &Path, requirement: &str, dir: &Path, prefix: &str) -> Result<PathBuf> {
    process::run(
        Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args(["--disable-pip-version-check", "--progress-bar", "on", "-d"])
            .arg(dir)
            .arg(requirement),
    )
    .with_context(|| format!("could not download {requirement} from PyPI"))?;
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".whl"))
        })
        .with_context(|| format!("pip downloaded no {prefix}*.whl for {requirement}"))
}

/// Extracts the members of `wheel` under `prefixes` into `to`.
fn unzip(python: &Path, wheel: &Path, to: &Path, prefixes: &[&str]) -> Result<()> {
    const SCRIPT: &str = "import sys, zipfile\n\
        wheel, dest, *prefixes = sys.argv[1:]\n\
        with zipfile.ZipFile(wheel) as z:\n\
        \x20   for m in z.namelist():\n\
        \x20       if m.startswith(tuple(prefixes)):\n\
        \x20           z.extract(m, dest)\n";
    process::run(
        Command::new(python)
            .args(["-c", SCRIPT])
            .arg(wheel)
            .arg(to)
            .args(prefixes),
    )
    .with_context(|| format!("could not unpack {}", wheel.display()))
}

/// The `nvidia-nccl-*==X` requirement in the torch wheel's metadata, if any.
fn nccl_requirement(python: &Path, wheel: &Path) -> Result<Option<String>> {
    const SCRIPT: &str = "import sys, zipfile\n\
        with zipfile.ZipFile(sys.argv[1]) as z:\n\
        \x20   name = next(n for n in z.namelist() if n.endswith('.dist-info/METADATA'))\n\
        \x20   print(z.read(name).decode())\n";
    let metadata = output(Command::new(python).args(["-c", SCRIPT]).arg(wheel))?;
    Ok(metadata.lines().find_map(|line| {
        let req = line.strip_prefix("Requires-Dist:")?.trim();
        let req = req.split(';').next()?.trim();
        req.starts_with("nvidia-nccl-").then(|| req.to_string())
    }))
}

/// Compiles tch's generated C API against the libtorch headers with the
/// compat header, so a release the header does not cover fails here, in
/// seconds and with the missing ops named, not deep in the build.
fn check_tch_api_compiles(root: &Path, torch: &Path, version: &str) -> Result<()> {
    let libtch = torch_sys_dir(root)?.join("libtch");
    let compat = root.join(COMPAT_HEADER);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-fsyntax-only", "-D_GLIBCXX_USE_CXX11_ABI=1"])
        .arg("-include")
        .arg(&compat)
        .arg(format!("-I{}", torch.join("include").display()))
        .arg(format!(
            "-I{}",
            torch.join("include/torch/csrc/api/include").display()
        ))
        .arg(libtch.join("torch_api_generated.cpp"))
        .output()
        .with_context(|| format!("could not run {cxx}"))?;
    if out.status.success() {
        return Ok(());
    }
    let errors: Vec<String> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("error:"))
        .take(20)
        .map(str::to_string)
        .collect();
    bail!(
        "tch's C API ({}) does not compile against libtorch {version}'s headers, even with \
         {COMPAT_HEADER}; declare the missing ops there:\n{}",
        libtch.display(),
        errors.join("\n")
    )
}

/// The source folder of the torch-sys crate the workspace locks.
fn torch_sys_dir(root: &Path) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let json = output(
        Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--locked"])
            .current_dir(root),
    )?;
    let meta: serde_json::Value = serde_json::from_str(&json).context("parsing cargo metadata")?;
    let manifest = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "torch-sys")
        .and_then(|p| p["manifest_path"].as_str())
        .context("cargo metadata lists no torch-sys package")?;
    Ok(Path::new(manifest)
        .parent()
        .context("torch-sys's manifest has no folder")?
        .to_path_buf())
}

/// A cargo command that builds against `torch` into `target`.
fn cargo_against(root: &Path, torch: &Path, target: &Path) -> Command {
    let compat = root.join(COMPAT_HEADER);
    let mut cxxflags = format!("-include {}", compat.display());
    if let Ok(more) = std::env::var("CXXFLAGS") {
        cxxflags = format!("{more} {cxxflags}");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .env("LIBTORCH", torch)
        // tch checks the version it was generated for; the compat header is
        // what makes an older one build.
        .env("LIBTORCH_BYPASS_VERSION_CHECK", "1")
        .env("CXXFLAGS", cxxflags)
        .env("CARGO_TARGET_DIR", target);
    cmd
}

/// Builds [`TESTS`] against `torch` into `target` and archives them, with
/// the plugins, into `archive` (`cargo nextest archive`, profile
/// `gpu-bundle` of `.config/nextest.toml`).
fn build_archive(root: &Path, torch: &Path, target: &Path, archive: &Path) -> Result<()> {
    setup::ensure_nextest()?;
    let mut args: Vec<String> = ["nextest", "archive", "--profile", "gpu-bundle"]
        .map(String::from)
        .to_vec();
    let mut packages: Vec<&str> = TESTS.iter().map(|(p, _)| *p).collect();
    packages.sort_unstable();
    packages.dedup();
    for p in packages {
        args.extend(["-p".into(), p.into()]);
    }
    for (_, t) in TESTS {
        args.extend(["--test".into(), (*t).into()]);
    }
    args.push("--archive-file".into());
    args.push(archive.display().to_string());
    process::run(
        cargo_against(root, torch, target)
            .args(&args)
            // Small enough to carry: no debug info (symbol names stay, for
            // panics' backtraces).
            .env("CARGO_PROFILE_DEV_DEBUG", "false")
            .env("CARGO_PROFILE_DEV_STRIP", "debuginfo"),
    )
}

/// Builds `wasmrpc-bench` (release) against `torch` into `target` and puts
/// it, stripped of debug info, into `dir` beside `run-bench.sh`
/// (`xtask/gpu-bundle/run-bench.sh`). About 36 MiB: it travels apart from
/// the tests' bundle.
fn build_bench(root: &Path, torch: &Path, target: &Path, dir: &Path) -> Result<()> {
    process::run(cargo_against(root, torch, target).args([
        "build",
        "--release",
        "-p",
        "wasmrpc-bench",
    ]))?;
    if dir.exists() {
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("could not remove the old {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    let bench = dir.join("wasmrpc-bench");
    std::fs::copy(target.join("release").join("wasmrpc-bench"), &bench)?;
    // Best effort: without binutils' strip the binary is only larger.
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(&bench)
        .status();
    let script = dir.join("run-bench.sh");
    std::fs::copy(root.join(BENCH_SCRIPT), &script)?;
    make_executable(&script)?;
    Ok(())
}

/// Puts the `cargo-nextest` binary that built the archive into the bundle,
/// xz-compressed where xz is installed (`run.sh` unpacks it).
fn pack_nextest(bundle: &Path) -> Result<()> {
    let nextest = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("cargo-nextest"))
        .find(|p| p.is_file())
        .context("cargo-nextest is not on PATH")?;
    let packed = Command::new("xz")
        .args(["-T0", "-6", "-c"])
        .arg(&nextest)
        .output();
    match packed {
        Ok(out) if out.status.success() => {
            std::fs::write(bundle.join("cargo-nextest.xz"), out.stdout)?;
        }
        _ => {
            let to = bundle.join("cargo-nextest");
            std::fs::copy(&nextest, &to)?;
            make_executable(&to)?;
        }
    }
    Ok(())
}

/// Sets `path`'s mode to 0755.
fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("could not make {} executable", path.display()))
}

/// `HEAD`'s commit, marked `-dirty` when the work tree has changes.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        output(Command::new("git").args(args).current_dir(root)).unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])
        .trim()
        .is_empty();
    format!("{}{}", head.trim(), if dirty { "-dirty" } else { "" })
}

/// The bytes of the files directly in `dir` (the bundle is flat).
fn folder_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let meta = entry?.metadata()?;
        total += meta.len();
    }
    Ok(total)
}
