//! `cargo xtask dist`: the release bundle, a tarball that runs on a Linux
//! machine with nothing installed: unpack it anywhere and run
//! `bin/wasmrpc`. No Rust, no Python, no cache folder.
//!
//! What it owns: the bundle's layout and its checks. The layout, inside
//! `wasmrpc-<version>-x86_64-linux-<flavour>/`:
//!
//! - `bin/wasmrpc`: the host binary, debug info stripped, its run path
//!   rewritten to `$ORIGIN/../lib` (so it finds the bundle's libtorch
//!   wherever the bundle is unpacked). In the `system-torch` flavour
//!   `bin/wasmrpc` is a launcher script (`xtask/dist/system-torch.sh`)
//!   that finds torch in the machine's Python and checks its version, and
//!   the binary is `libexec/wasmrpc`.
//! - `lib/`: the shared libraries the binary loads that the system does not
//!   provide: libtorch's (`libtorch_cpu.so`, `libc10.so`, OpenMP), CUDA's in
//!   a CUDA flavour, and the C++ runtime the shims were compiled against
//!   (`libstdc++.so.6`, `libgcc_s.so.1`), so an older distribution's C++
//!   runtime is not the one that loads. Which libraries: those `ldd` lists
//!   for the binary, plus (CUDA flavour) the libraries libtorch and CUDA's
//!   packages open at run time (cuDNN's engines, NVRTC's builtins,
//!   cuSOLVER, libtorch's CUDA linear algebra). A CUDA build's binary links
//!   no CUDA library (it loads `libtorch_cuda.so` where a GPU is); c10d's
//!   `libwasmrpc_c10d_nccl.so`, shipped in `lib/`, links them, and its
//!   `ldd` list joins the binary's. The C library and the dynamic loader stay the system's:
//!   `BUNDLE.txt` says which glibc the binary needs.
//! - `share/wasmrpc/plugins/`: the example plugins (the demo's
//!   `param_server.wasm` among them); `share/wasmrpc/examples/data/`: the
//!   demo's data; `share/wasmrpc/deploy/`: the container, Kubernetes and
//!   Slurm recipes (`examples/deploy/`); `share/wasmrpc/sdk/`: what a plugin
//!   author builds against (the Rust guest SDK as a workspace of its own,
//!   the Python kit, the WIT world).
//! - `BUNDLE.txt`: version, commit, torch, flavour, glibc, and how to run
//!   the demo from the bundle.
//!
//! Flavours: `cuda` (the set-up's torch is a CUDA build: libtorch and CUDA's
//! libraries, runs on CPU-only machines too; named after the CUDA release,
//! e.g. `cu130`), `cpu` (a build that links no CUDA library, in a target
//! folder of its own: libtorch's CPU libraries only, a fraction of the
//! size), and `system-torch` (no libtorch inside; the torch of the
//! machine's Python, which must be the release the bundle was built
//! against).
//!
//! The tests pack the debug binary the test command built
//! (`--from-build`) and run the bundle in an empty root
//! (`host/tests/bundle.rs`).

mod libraries;
mod share;
#[cfg(test)]
mod tests;

use crate::process::{self, commit, make_executable, output, step};
use crate::setup;
use crate::torch_release::{TorchInfo, cargo_against, check_tch_api_compiles, ensure_libtorch};
use anyhow::{Context, Result, bail};
use libraries::{copy_binary, copy_libraries, glibc_needed, is_system, linked_libraries};
use share::{EXAMPLE_PLUGINS, copy_share};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The bundle's flavour: what it carries of torch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Flavour {
    /// libtorch and CUDA's libraries (the set-up's torch is a CUDA build).
    Cuda,
    /// libtorch's CPU libraries only, from a build that links no CUDA.
    Cpu,
    /// No libtorch: the torch installed in the machine's Python.
    SystemTorch,
}

/// What `cargo xtask dist` was asked for.
pub(crate) struct DistOptions {
    /// [default: `cuda` for a CUDA torch, else `cpu`; for `--from-build`,
    /// `cuda` where c10d's NCCL library lies beside the binary]
    pub(crate) flavour: Option<Flavour>,
    /// Build against this PyTorch release instead of the set-up's.
    pub(crate) torch: Option<String>,
    /// Pack this already built binary instead of building one (the tests
    /// pack the debug build).
    pub(crate) from_build: Option<PathBuf>,
    /// Where the tarball goes (and, until it is packed, the bundle's
    /// folder) [default: `target/dist`].
    pub(crate) out: Option<PathBuf>,
    /// zstd's compression level.
    pub(crate) level: u32,
}

/// c10d's NCCL library (`host/c10d/build.rs`), beside a CUDA build's
/// binary and in a CUDA bundle's `lib/`.
const NCCL_LIBRARY: &str = "libwasmrpc_c10d_nccl.so";

/// The launcher of the `system-torch` flavour.
const SYSTEM_TORCH_LAUNCHER: &str = "xtask/dist/system-torch.sh";
/// Builds (or takes) the binary, lays out the bundle, checks it and packs
/// it; returns the tarball.
pub(crate) fn run(root: &Path, opts: &DistOptions) -> Result<PathBuf> {
    let venv = setup::run(root)?;
    // Another release than the set-up's, if one was asked for.
    let other = opts.torch.as_deref().filter(|v| *v != setup::TORCH_VERSION);
    let torch = match other {
        Some(version) => ensure_libtorch(&venv, version)?.join("torch"),
        None => setup::torch_dir(&venv)?.context("the set-up's venv holds no torch")?,
    };
    let info = TorchInfo::read(&torch)?;
    let binary = match &opts.from_build {
        Some(path) => {
            if !path.is_file() {
                bail!("--from-build {}: no such file", path.display());
            }
            path.clone()
        }
        None => {
            let flavour = opts.flavour.unwrap_or(if info.cuda.is_some() {
                Flavour::Cuda
            } else {
                Flavour::Cpu
            });
            if flavour == Flavour::Cuda && info.cuda.is_none() {
                bail!(
                    "torch {} is a CPU build: there is no CUDA flavour of it (use --flavour cpu)",
                    info.version
                );
            }
            build(root, &torch, other, flavour)?
        }
    };
    let needs = linked_libraries(&binary)?;
    // A built binary says itself which libtorch it was linked against (a
    // build against another release, `cargo xtask build --torch`).
    let (torch, info) = match &opts.from_build {
        Some(_) => {
            let linked = needs
                .get("libtorch_cpu.so")
                .context("the binary does not link libtorch_cpu.so")?;
            let torch = std::fs::canonicalize(linked)?
                .parent()
                .and_then(Path::parent)
                .context("libtorch_cpu.so outside a torch folder")?
                .to_path_buf();
            let info = TorchInfo::read(&torch)?;
            (torch, info)
        }
        None => (torch, info),
    };
    // A CUDA build links no CUDA library: it loads libtorch_cuda.so at run
    // time where a GPU is (host/torch-sys/src/cuda.rs), and c10d's NCCL
    // library, which its build script leaves beside the binary, is what
    // links CUDA. That library says the build is a CUDA one, and its own
    // libraries are what a CUDA flavour ships.
    let nccl = binary
        .parent()
        .map(|dir| dir.join(NCCL_LIBRARY))
        .filter(|p| p.is_file());
    let cuda_build = nccl.is_some();
    let flavour = opts.flavour.unwrap_or(if cuda_build {
        Flavour::Cuda
    } else {
        Flavour::Cpu
    });
    match flavour {
        Flavour::Cpu if cuda_build => bail!(
            "{} is a CUDA build ({NCCL_LIBRARY} beside it): a cpu bundle needs a build \
             without CUDA (`cargo xtask dist --flavour cpu` makes one)",
            binary.display()
        ),
        Flavour::Cuda if !cuda_build => bail!(
            "{} is not a CUDA build (no {NCCL_LIBRARY} beside it): pack it as --flavour cpu",
            binary.display()
        ),
        _ => {}
    }
    // What the NCCL library links (libtorch_cuda.so, CUDA's runtime, NCCL,
    // cuDNN, ...) joins the binary's own.
    let mut needs = needs;
    if let Some(nccl) = &nccl {
        needs.extend(linked_libraries(nccl)?);
    }

    let flavour_name = match flavour {
        Flavour::Cpu => "cpu".to_owned(),
        Flavour::Cuda => cuda_tag(info.cuda.as_deref()),
        Flavour::SystemTorch => format!(
            "system-torch{}-{}",
            base_version(&info.version),
            if cuda_build {
                cuda_tag(info.cuda.as_deref())
            } else {
                "cpu".into()
            }
        ),
    };
    let name = format!(
        "wasmrpc-{}-x86_64-linux-{flavour_name}",
        env!("CARGO_PKG_VERSION")
    );
    let out = opts
        .out
        .clone()
        .unwrap_or_else(|| crate::coverage::target_dir(root).join("dist"));
    let stage = out.join(&name);
    if stage.exists() {
        std::fs::remove_dir_all(&stage)
            .with_context(|| format!("could not remove the old {}", stage.display()))?;
    }
    step(&format!(
        "dist: laying out {} (removed once packed)",
        stage.display()
    ));
    for dir in ["bin", "lib", "share/wasmrpc"] {
        std::fs::create_dir_all(stage.join(dir))?;
    }

    let shipped = match flavour {
        Flavour::SystemTorch => {
            let libexec = stage.join("libexec");
            std::fs::create_dir_all(&libexec)?;
            let real = libexec.join("wasmrpc");
            copy_binary(&binary, &real, None)?;
            if let Some(nccl) = &nccl {
                // Found beside the binary; what it links is loaded by then.
                copy_binary(nccl, &libexec.join(NCCL_LIBRARY), None)?;
            }
            // The libraries the launcher must find in the machine's
            // `torch/lib` (ldd's paths run through `..`: compare resolved).
            let torch_lib = std::fs::canonicalize(torch.join("lib"))?;
            let torch_libs: Vec<&str> = needs
                .iter()
                .filter(|(_, path)| {
                    std::fs::canonicalize(path).is_ok_and(|p| p.parent() == Some(&torch_lib))
                })
                .map(|(name, _)| name.as_str())
                .collect();
            write_launcher(root, &stage, &info.version, &torch_libs)?;
            std::fs::remove_dir(stage.join("lib"))?;
            Vec::new()
        }
        Flavour::Cpu | Flavour::Cuda => {
            copy_binary(&binary, &stage.join("bin/wasmrpc"), Some("$ORIGIN/../lib"))?;
            let mut shipped = copy_libraries(&needs, &torch, flavour, &stage.join("lib"))?;
            if let Some(nccl) = &nccl {
                copy_binary(nccl, &stage.join("lib").join(NCCL_LIBRARY), Some("$ORIGIN"))?;
                shipped.push(NCCL_LIBRARY.to_owned());
            }
            shipped
        }
    };
    copy_share(root, &stage.join("share/wasmrpc"))?;
    let glibc = glibc_needed(&stage)?;
    write_manifest(root, &stage, &info, &flavour_name, &glibc, &shipped)?;
    check_bundle(&stage, flavour)?;

    let tarball = out.join(format!("{name}.tar.zst"));
    step(&format!(
        "dist: packing {} (zstd -{}, all cores)",
        tarball.display(),
        opts.level
    ));
    pack(&out, &name, &tarball, opts.level)?;
    let size = std::fs::metadata(&tarball)?.len();
    let unpacked = folder_bytes(&stage)?;
    // The tarball is the product: the folder it was packed from would
    // double what a CUDA bundle holds of the disk (3.5 GB beside 2.3 GB).
    std::fs::remove_dir_all(&stage)
        .with_context(|| format!("could not remove the staging folder {}", stage.display()))?;
    println!(
        "dist: {} ({:.0} MiB packed, {:.0} MiB unpacked; torch {}, needs glibc {glibc} or newer)",
        tarball.display(),
        size as f64 / f64::from(1 << 20),
        unpacked as f64 / f64::from(1 << 20),
        info.version
    );
    println!(
        "dist: try it: tar -xf {} -C /tmp && /tmp/{name}/bin/wasmrpc --help (BUNDLE.txt runs the demo)",
        tarball.display()
    );
    Ok(tarball)
}

/// `cu130` for CUDA `13.0`.
fn cuda_tag(cuda: Option<&str>) -> String {
    format!("cu{}", cuda.unwrap_or("").replace('.', ""))
}

/// `2.13.0` of `2.13.0+cu130`.
fn base_version(version: &str) -> &str {
    version.split('+').next().unwrap_or(version)
}

/// Builds the `wasmrpc` binary (release) and the example plugins for the
/// bundle; returns the binary.
fn build(root: &Path, torch: &Path, release: Option<&str>, flavour: Flavour) -> Result<PathBuf> {
    let target = crate::coverage::target_dir(root);
    let mut cmd = match (release, flavour) {
        (Some(version), flavour) => {
            check_tch_api_compiles(root, torch, version)?;
            let dir = if flavour == Flavour::Cpu {
                format!("torch-{version}-cpu")
            } else {
                format!("torch-{version}")
            };
            cargo_against(root, torch, &target.join(dir))
        }
        (None, Flavour::Cpu) => {
            let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cmd.current_dir(root)
                .env("CARGO_TARGET_DIR", target.join("cpu-only"));
            cmd
        }
        (None, _) => {
            let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cmd.current_dir(root);
            cmd
        }
    };
    if flavour == Flavour::Cpu {
        // The shims then link no CUDA library (see host/torch-sys/build.rs
        // and host/c10d/build.rs).
        cmd.env("WASMRPC_CUDA", "0");
    }
    let target_dir = cmd
        .get_envs()
        .find(|(k, _)| *k == "CARGO_TARGET_DIR")
        .and_then(|(_, v)| v.map(PathBuf::from))
        .unwrap_or(target);
    step(&format!(
        "dist: building wasmrpc (release) into {} (a full build the first time: about 20 minutes on 2 cores)",
        target_dir.display()
    ));
    process::run(cmd.args(["build", "--release", "-p", "wasmrpc", "--bin", "wasmrpc"]))?;
    Ok(target_dir.join("release/wasmrpc"))
}

/// The `system-torch` launcher, with the torch release and the libraries
/// it must find filled in.
fn write_launcher(root: &Path, stage: &Path, version: &str, torch_libs: &[&str]) -> Result<()> {
    let template = std::fs::read_to_string(root.join(SYSTEM_TORCH_LAUNCHER))
        .with_context(|| format!("reading {SYSTEM_TORCH_LAUNCHER}"))?;
    let script = template
        .replace("@TORCH_VERSION@", base_version(version))
        .replace("@TORCH_LIBS@", &torch_libs.join(" "));
    let path = stage.join("bin/wasmrpc");
    std::fs::write(&path, script)?;
    make_executable(&path)
}

/// `BUNDLE.txt`: what the bundle is, what is inside, how to run it.
fn write_manifest(
    root: &Path,
    stage: &Path,
    info: &TorchInfo,
    flavour: &str,
    glibc: &str,
    libs: &[String],
) -> Result<()> {
    let name = stage.file_name().unwrap_or_default().to_string_lossy();
    let torch_line = if libs.is_empty() {
        format!(
            "torch:    none inside: bin/wasmrpc uses the torch of the machine's Python \
             (python3, or $WASMRPC_PYTHON), which must be torch {}",
            base_version(&info.version)
        )
    } else {
        format!("torch:    libtorch {} (in lib/)", info.version)
    };
    let text = format!(
        "wasmrpc {version} ({name})\n\
         commit:   {commit}\n\
         flavour:  {flavour}\n\
         {torch_line}\n\
         needs:    Linux x86_64 with glibc {glibc} or newer; nothing else\n\
         \n\
         Run the demo (a parameter server and 3 trainers on this machine):\n\
         \n\
         \x20 B=$(pwd)   # this folder\n\
         \x20 mkdir -p /tmp/wasmrpc-ckpt\n\
         \x20 $B/bin/wasmrpc launch --nproc 4 --plugins $B/share/wasmrpc/plugins/param_server.wasm \\\n\
         \x20   --grant-dir param_server:/data=$B/share/wasmrpc/examples/data:ro \\\n\
         \x20   --grant-dir param_server:/ckpt=/tmp/wasmrpc-ckpt:rw \\\n\
         \x20   --entry param_server::run -- 3 10\n\
         \n\
         On several machines: `bin/wasmrpc worker --help`; TLS credentials: `bin/wasmrpc cert --help`;\n\
         container, Kubernetes and Slurm recipes: share/wasmrpc/deploy/.\n\
         \n\
         Inside:\n\
         \x20 bin/wasmrpc                 the host{launcher}\n\
         \x20 lib/                        {lib_line}\n\
         \x20 share/wasmrpc/plugins/      example plugins (.wasm): {plugins}\n\
         \x20 share/wasmrpc/examples/     the demo's data\n\
         \x20 share/wasmrpc/deploy/       container, Kubernetes and Slurm recipes\n\
         \x20 share/wasmrpc/sdk/rust/     the Rust guest SDK (depend on sdk/rust/guest-sdk by path)\n\
         \x20 share/wasmrpc/sdk/python/   the Python guest kit (package `wasmrpc`)\n\
         \x20 share/wasmrpc/sdk/wit/      the WIT world Python plugins are built against\n",
        version = env!("CARGO_PKG_VERSION"),
        commit = commit(root),
        launcher = if libs.is_empty() {
            " (a launcher script; the binary is libexec/wasmrpc)"
        } else {
            ""
        },
        lib_line = if libs.is_empty() {
            "(none: the machine's torch)".to_owned()
        } else {
            libs.join(" ")
        },
        plugins = EXAMPLE_PLUGINS.join(", "),
    );
    std::fs::write(stage.join("BUNDLE.txt"), text)?;
    Ok(())
}

/// The bundle's own check: its binary resolves every library inside the
/// bundle or from the system's folders (none from the cache folder or the
/// checkout), and it starts.
fn check_bundle(stage: &Path, flavour: Flavour) -> Result<()> {
    let binary = match flavour {
        Flavour::SystemTorch => return Ok(()), // checked where it runs: it needs a torch
        _ => stage.join("bin/wasmrpc"),
    };
    let stage = std::fs::canonicalize(stage)?;
    // The NCCL library (CUDA flavour) is opened at run time: it must
    // resolve inside the bundle too.
    let nccl = stage.join("lib").join(NCCL_LIBRARY);
    if flavour == Flavour::Cuda && !nccl.is_file() {
        bail!("a cuda bundle without lib/{NCCL_LIBRARY}");
    }
    let mut objects = vec![binary.clone()];
    if nccl.is_file() {
        objects.push(nccl);
    }
    for object in &objects {
        for (name, path) in linked_libraries(object)? {
            let path = std::fs::canonicalize(&path).unwrap_or(path);
            if !path.starts_with(&stage) && !is_system(&path) {
                bail!(
                    "the bundle's {} loads {name} from {}, outside the bundle",
                    object.display(),
                    path.display()
                );
            }
        }
    }
    let version = output(
        Command::new(&binary)
            .arg("--version")
            .env_remove("LD_LIBRARY_PATH"),
    )
    .context("the bundle's binary does not start")?;
    println!("dist: bin/wasmrpc --version: {}", version.trim());
    Ok(())
}

/// `tar | zstd` of `out/name` into `tarball`.
fn pack(out: &Path, name: &str, tarball: &Path, level: u32) -> Result<()> {
    let partial = tarball.with_extension("zst.partial");
    let status = Command::new("tar")
        .arg("-C")
        .arg(out)
        .arg(format!("--use-compress-program=zstd -T0 -q -{level}"))
        .arg("-cf")
        .arg(&partial)
        .arg(name)
        .status()
        .context("could not run tar (with zstd)")?;
    if !status.success() {
        bail!(
            "tar | zstd of {} failed ({status})",
            out.join(name).display()
        );
    }
    std::fs::rename(&partial, tarball)?;
    Ok(())
}

/// The bytes of every file under `dir`.
fn folder_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            folder_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
