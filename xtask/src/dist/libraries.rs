//! Which shared libraries a bundle carries, and the binary's run path:
//! what `ldd` resolves for the binary, less the system's own, plus what
//! libtorch and CUDA open at run time in a CUDA flavour.

use super::Flavour;
use crate::process::{self, make_executable, output};
use crate::setup;
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Folders whose libraries are the system's and stay out of the bundle.
pub(super) const SYSTEM_LIB_DIRS: &[&str] = &["/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/"];
/// System libraries the bundle carries anyway: the C++ runtime the shims
/// were compiled against (newer than an older distribution's).
pub(super) const SHIPPED_SYSTEM_LIBS: &[&str] = &["libstdc++.so.6", "libgcc_s.so.1"];
/// Libraries CUDA's packages open at run time (by name prefix), shipped in
/// a CUDA flavour from the folders the linked CUDA libraries came from.
pub(super) const CUDA_RUNTIME_LIBS: &[&str] = &[
    "libcudnn",
    "libnvrtc-builtins",
    "libcusolver",
    "libnvJitLink",
];
/// Libraries libtorch opens at run time (not in `ldd`'s list) that a CUDA
/// flavour ships: its CUDA linear algebra and its NVRTC wrapper.
pub(super) const TORCH_RUNTIME_LIBS: &[&str] = &["libtorch_cuda_linalg.so", "libcaffe2_nvrtc.so"];

/// The shared libraries `binary` loads, by file name, with the path `ldd`
/// resolved each to.
pub(super) fn linked_libraries(binary: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let text = output(
        Command::new("ldd")
            .arg(binary)
            .env_remove("LD_LIBRARY_PATH"),
    )?;
    let mut libs = BTreeMap::new();
    let mut missing = Vec::new();
    for line in text.lines() {
        // `libc10.so => /path/libc10.so (0x...)`, or `=> not found`.
        let Some((name, rest)) = line.trim().split_once(" => ") else {
            continue;
        };
        if rest.starts_with("not found") {
            missing.push(name.to_owned());
            continue;
        }
        if let Some(path) = rest.split(" (").next().filter(|p| p.starts_with('/')) {
            libs.insert(name.to_owned(), PathBuf::from(path));
        }
    }
    if !missing.is_empty() {
        bail!(
            "{} needs libraries ldd cannot find: {}",
            binary.display(),
            missing.join(", ")
        );
    }
    Ok(libs)
}

pub(super) fn is_system(path: &Path) -> bool {
    let p = path.to_string_lossy();
    SYSTEM_LIB_DIRS.iter().any(|d| p.starts_with(d))
}

/// Copies `from` to `to` without debug info, with `rpath` as its run path
/// (or none).
pub(super) fn copy_binary(from: &Path, to: &Path, rpath: Option<&str>) -> Result<()> {
    // `strip -o` writes the copy: debug info is most of a debug build.
    process::run(
        Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(to)
            .arg(from),
    )
    .context("stripping the binary's debug info (binutils' strip)")?;
    let patchelf = setup::patchelf()?;
    let mut cmd = Command::new(patchelf);
    match rpath {
        Some(r) => cmd.args(["--set-rpath", r]),
        None => cmd.arg("--remove-rpath"),
    };
    process::run(cmd.arg(to))?;
    make_executable(to)
}

/// Copies the libraries the bundle ships into `lib`; returns their names.
pub(super) fn copy_libraries(
    needs: &BTreeMap<String, PathBuf>,
    torch: &Path,
    flavour: Flavour,
    lib: &Path,
) -> Result<Vec<String>> {
    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    for (name, path) in needs {
        if !is_system(path) || SHIPPED_SYSTEM_LIBS.contains(&name.as_str()) {
            files.insert(name.clone(), path.clone());
        }
    }
    if flavour == Flavour::Cuda {
        // CUDA's packages open more of their own libraries at run time
        // (cuDNN's engines, NVRTC's builtins, cuSOLVER for libtorch's
        // CUDA linear algebra): ship those from the folders the linked
        // libraries came from.
        let dirs: std::collections::BTreeSet<PathBuf> = files
            .values()
            .filter(|p| p.to_string_lossy().contains("/nvidia/"))
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .collect();
        for dir in dirs {
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                if name.contains(".so") && CUDA_RUNTIME_LIBS.iter().any(|p| name.starts_with(p)) {
                    files.entry(name.into_owned()).or_insert(path);
                }
            }
        }
        for name in TORCH_RUNTIME_LIBS {
            let path = torch.join("lib").join(name);
            if path.is_file() {
                files.insert((*name).to_owned(), path);
            }
        }
    }
    for (name, from) in &files {
        stage_file(from, &lib.join(name))
            .with_context(|| format!("copying {} into the bundle", from.display()))?;
    }
    Ok(files.into_keys().collect())
}

/// Puts the file `from` resolves to at `to`: a hard link where the two
/// share a file system, else a copy. Either way the bundle holds a plain
/// file, never a symbolic link. The stage lives only until it is packed
/// and nothing writes to its libraries (the binaries that are patched are
/// `copy_binary`'s copies), so a link costs neither the 3.5 GB nor the time
/// a CUDA flavour's copy took.
fn stage_file(from: &Path, to: &Path) -> std::io::Result<()> {
    // `hard_link` would link a symbolic link itself: resolve it first.
    let from = std::fs::canonicalize(from)?;
    if std::fs::hard_link(&from, to).is_ok() {
        return Ok(());
    }
    std::fs::copy(&from, to).map(drop)
}

/// The newest `GLIBC_2.N` symbol version any executable file of the bundle
/// needs.
pub(super) fn glibc_needed(stage: &Path) -> Result<String> {
    let mut newest = (2u32, 17u32);
    for dir in ["bin", "lib", "libexec"] {
        let dir = stage.join(dir);
        if !dir.is_dir() {
            continue;
        }
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let Ok(text) = output(Command::new("objdump").arg("-T").arg(&path)) else {
                continue; // a script
            };
            for word in text.split_whitespace() {
                let Some(v) = word.trim_matches(['(', ')']).strip_prefix("GLIBC_2.") else {
                    continue;
                };
                let minor: u32 = v.split('.').next().unwrap_or("").parse().unwrap_or(0);
                newest = newest.max((2, minor));
            }
        }
    }
    Ok(format!("{}.{}", newest.0, newest.1))
}
