//! Building against a PyTorch release other than the set-up's: its
//! libtorch fetched from PyPI into the cache folder, tch's C API checked
//! against its headers, and cargo pointed at it. Shared by `cargo xtask
//! build --torch`, `cargo xtask dist --torch` and `cargo xtask gpu-bundle`.
//!
//! tch 0.26's C API is generated from libtorch 2.13's op list; the few ops
//! an older libtorch lacks are declared by `xtask/gpu-bundle/tch-compat.h`
//! (calling one is an error naming it). A build against another release
//! force-includes that header, so torch-sys itself is built unchanged.

use crate::process::{self, output, step};
use crate::setup;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Declares the ops tch 0.26 binds that older libtorch releases lack.
pub(crate) const COMPAT_HEADER: &str = "xtask/gpu-bundle/tch-compat.h";
/// Written into the libtorch folder once it is complete.
pub(crate) const READY_STAMP: &str = ".wasmrpc-ready";
/// What a torch folder's `version.py` says.
pub(crate) struct TorchInfo {
    /// `__version__`, e.g. `2.11.0+cu130`.
    pub(crate) version: String,
    /// `git_version`, the commit it was built from.
    pub(crate) git: String,
    /// `cuda`, e.g. `13.0`; `None` in a CPU build.
    pub(crate) cuda: Option<String>,
}

impl TorchInfo {
    pub(crate) fn read(torch: &Path) -> Result<Self> {
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
pub(crate) fn ensure_libtorch(venv: &Path, version: &str) -> Result<PathBuf> {
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
        "fetching torch {version}'s libtorch from PyPI into {} (about 1 GB, once)",
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
pub(crate) fn check_tch_api_compiles(root: &Path, torch: &Path, version: &str) -> Result<()> {
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
pub(crate) fn cargo_against(root: &Path, torch: &Path, target: &Path) -> Command {
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

/// Which torch a build is against.
pub(crate) enum TorchChoice {
    /// A PyTorch release's libtorch, fetched from PyPI into the cache folder
    /// (the set-up's own when it is the set-up's release).
    Release(String),
    /// The torch installed in this Python.
    Python(String),
}

impl TorchChoice {
    /// The `torch` folder (holding `lib/` and `include/`), fetched first if
    /// needed, and a name for the target folder built against it.
    pub(crate) fn resolve(&self, venv: &Path) -> Result<(PathBuf, String)> {
        match self {
            TorchChoice::Release(version) if version == setup::TORCH_VERSION => Ok((
                setup::torch_dir(venv)?.context("the set-up's venv holds no torch")?,
                format!("torch-{version}"),
            )),
            TorchChoice::Release(version) => Ok((
                ensure_libtorch(venv, version)?.join("torch"),
                format!("torch-{version}"),
            )),
            TorchChoice::Python(python) => {
                let torch = torch_from_python(python)?;
                let info = TorchInfo::read(&torch)?;
                Ok((
                    torch,
                    format!("torch-{}-python", info.version.replace('+', "-")),
                ))
            }
        }
    }

    fn label(&self) -> String {
        match self {
            TorchChoice::Release(v) => format!("torch {v}"),
            TorchChoice::Python(p) => format!("the torch of {p}"),
        }
    }
}

/// The `torch` folder of the torch `python` imports, checked to hold the
/// headers and libraries a build needs.
pub(crate) fn torch_from_python(python: &str) -> Result<PathBuf> {
    let dir = output(Command::new(python).args([
        "-c",
        "import os, torch; print(os.path.dirname(torch.__file__))",
    ]))
    .with_context(|| format!("{python} cannot import torch"))?;
    let torch = PathBuf::from(dir.trim());
    for needed in ["lib/libtorch_cpu.so", "include/torch/all.h", "version.py"] {
        if !torch.join(needed).exists() {
            bail!(
                "the torch of {python} ({}) has no {needed}: a build needs a torch wheel \
                 with its headers and libraries",
                torch.display()
            );
        }
    }
    Ok(torch)
}

/// `cargo xtask build`: the `wasmrpc` binary (and the plugins) built
/// against `choice`, into `target/torch-<version>/`; returns the binary.
/// The binary finds that libtorch through its run path.
pub(crate) fn build(root: &Path, choice: &TorchChoice, release: bool) -> Result<PathBuf> {
    let venv = setup::run(root)?;
    let (torch, dir) = choice.resolve(&venv)?;
    let info = TorchInfo::read(&torch)?;
    check_tch_api_compiles(root, &torch, &info.version)?;
    let target = crate::coverage::target_dir(root).join(dir);
    step(&format!(
        "build: wasmrpc against {} ({} at {}) into {} (a full build the first time)",
        choice.label(),
        info.version,
        torch.display(),
        target.display()
    ));
    let mut cmd = cargo_against(root, &torch, &target);
    cmd.args(["build", "-p", "wasmrpc", "--bin", "wasmrpc"]);
    if release {
        cmd.arg("--release");
    }
    process::run(&mut cmd)?;
    let binary = target
        .join(if release { "release" } else { "debug" })
        .join("wasmrpc");
    println!(
        "build: {} (torch {}; `cargo xtask test --torch {}` runs the tests against it)",
        binary.display(),
        info.version,
        base(&info.version)
    );
    Ok(binary)
}

/// `2.11.0` of `2.11.0+cu130`.
fn base(version: &str) -> &str {
    version.split('+').next().unwrap_or(version)
}

/// `cargo xtask test --torch`: the test suite (no lints; the CPU tests run,
/// the GPU ones report themselves skipped) built against `choice` in its
/// own target folder.
pub(crate) fn test(root: &Path, choice: &TorchChoice, nextest_args: &[String]) -> Result<()> {
    let venv = setup::run(root)?;
    let (torch, dir) = choice.resolve(&venv)?;
    let info = TorchInfo::read(&torch)?;
    check_tch_api_compiles(root, &torch, &info.version)?;
    setup::ensure_nextest()?;
    let target = crate::coverage::target_dir(root).join(dir);
    step(&format!(
        "tests against {} ({}) in {} (cargo nextest run --profile ci)",
        choice.label(),
        info.version,
        target.display()
    ));
    let mut cmd = cargo_against(root, &torch, &target);
    cmd.args(["nextest", "run", "--profile", "ci", "--no-fail-fast"]);
    // The Python package's module links the libtorch it is built against,
    // and its suite runs in the set-up's venv, whose torch is another: it
    // is built here (it must compile) but not run.
    if !nextest_args
        .iter()
        .any(|a| a == "-E" || a.starts_with("--filter"))
    {
        cmd.args(["-E", "not package(wasmrpc-python)"]);
    }
    cmd.args(nextest_args);
    process::run(&mut cmd)
}
