//! Compiles the c10d shim (`shim/c10d_shim.cpp`: libtorch's
//! `ProcessGroupGloo`, and `ProcessGroupNCCL` in a CUDA build, behind a C
//! interface) against the libtorch that torch-sys links, and embeds an rpath
//! to libtorch's folder in every binary of this package, so they find
//! `libtorch_cpu.so` at run time without `LD_LIBRARY_PATH`.
//!
//! `ProcessGroupNCCL`'s construction (`shim/nccl.cpp`) is a shared library
//! of its own, `libwasmrpc_c10d_nccl.so`, linked with `torch_cuda` and
//! `c10_cuda`; nothing links it: the engine opens it when an NCCL group is
//! asked for (`src/engine/nccl.rs`), so no other process maps CUDA. It is
//! built into `OUT_DIR` (its path reaches the crate as
//! `WASMRPC_C10D_NCCL_LIB`, empty without NCCL) and copied next to the
//! profile's binaries (`target/<profile>/`), where `cargo xtask dist` finds
//! it for the bundle's `lib/`.
//!
//! Gloo's headers are not in the torch wheel: `cargo xtask setup` extracts
//! Debian's `libgloo-dev` into the cache folder and links it as
//! `.wasmrpc-env/gloo`; `WASMRPC_GLOO_INCLUDE` may name another folder
//! holding `gloo/*.h`.
//!
//! NCCL is compiled in when libtorch has `libtorch_cuda.so` and the wheel's
//! `nvidia/nccl/include/nccl.h` and CUDA runtime headers are present (the
//! CUDA wheels of PyPI) together with CUDA's `crt/` and CCCL headers (the
//! `nvidia-cuda-crt` and `nvidia-cuda-cccl` wheels, which `cargo xtask
//! setup` installs into a CUDA build's venv); `WASMRPC_C10D_NCCL=0` leaves
//! it out, and so does `WASMRPC_CUDA=0` (a host that links no CUDA
//! library: the release bundle's `cpu` flavour).

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=shim/c10d_shim.cpp");
    println!("cargo:rerun-if-changed=shim/c10d_shim.h");
    println!("cargo:rerun-if-changed=shim/nccl.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=WASMRPC_GLOO_INCLUDE");
    println!("cargo:rerun-if-env-changed=WASMRPC_ENV");
    println!("cargo:rerun-if-env-changed=WASMRPC_C10D_NCCL");
    println!("cargo:rerun-if-env-changed=WASMRPC_CUDA");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");

    // torch-sys (links = "tch") publishes the folder it linked against.
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("DEP_TCH_LIBTORCH_LIB is not set: is torch-sys a dependency?");
    };
    // Resolve the set-up's links, so binaries keep working if the checkout
    // moves.
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    // Tells the tests whether this libtorch is a CUDA build (where NCCL
    // must be available).
    let cuda_build = lib.join("libtorch_cuda.so").exists()
        && std::env::var("WASMRPC_CUDA").map_or(true, |v| v != "0");
    println!(
        "cargo:rustc-env=WASMRPC_C10D_CUDA_BUILD={}",
        u8::from(cuda_build)
    );
    if only_checking() {
        // No NCCL library is built, so none is named.
        println!("cargo:rustc-env=WASMRPC_C10D_NCCL_LIB=");
        return;
    }
    let include = lib.join("../include");
    let gloo = gloo_include();

    let cxx11_abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&gloo)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include("shim")
        .flag("-std=c++20")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-DUSE_C10D_GLOO")
        .file("shim/c10d_shim.cpp");

    build.compile("wasmrpc_c10d_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    let nccl_library = match nccl_includes(&lib) {
        Some(dirs) => nccl_library(&lib, &include, &dirs, &cxx11_abi),
        None => {
            remove_stale_copy();
            String::new()
        }
    };
    println!("cargo:rustc-env=WASMRPC_C10D_NCCL_LIB={nccl_library}");
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

/// The NCCL library's file name.
const NCCL_LIBRARY: &str = "libwasmrpc_c10d_nccl.so";

/// Compiles and links `libwasmrpc_c10d_nccl.so` into `OUT_DIR`, copies it
/// next to the profile's binaries, and returns its path in `OUT_DIR`.
fn nccl_library(lib: &Path, include: &Path, nccl_dirs: &[PathBuf], cxx11_abi: &str) -> String {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let out = out_dir.join(NCCL_LIBRARY);
    let compiler = cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .get_compiler();
    let mut cmd = compiler.to_command();
    cmd.arg("-shared")
        .arg("-std=c++20")
        .arg(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .args(["-DGLOG_USE_GLOG_EXPORT", "-DUSE_C10D_NCCL", "-DUSE_CUDA"])
        .arg(format!("-I{}", include.display()))
        .arg(format!(
            "-I{}",
            include.join("torch/csrc/api/include").display()
        ))
        .arg("-Ishim");
    for d in nccl_dirs {
        cmd.arg(format!("-I{}", d.display()));
    }
    cmd.arg("shim/nccl.cpp")
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        // Needed although only ProcessGroupNCCL's constructor is named:
        // loading the library must load CUDA's half of libtorch.
        .arg("-Wl,--no-as-needed")
        .args(["-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"])
        .arg("-Wl,--as-needed")
        // The bundle's lib/ holds libtorch next to it; a build finds it in
        // the set-up's libtorch.
        .arg("-Wl,-rpath,$ORIGIN")
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler ({cmd:?}): {e}"));
    assert!(
        status.success(),
        "compiling {NCCL_LIBRARY} failed ({status}): {cmd:?}"
    );
    if let Some(profile) = profile_dir(&out_dir) {
        let copy = profile.join(NCCL_LIBRARY);
        // Replaced, not overwritten: a running process may map the old one.
        let _ = std::fs::remove_file(&copy);
        std::fs::copy(&out, &copy)
            .unwrap_or_else(|e| panic!("copying {NCCL_LIBRARY} to {}: {e}", copy.display()));
    }
    out.display().to_string()
}

/// `target/<profile>/` of `target/<profile>/build/<pkg>-<hash>/out`.
fn profile_dir(out_dir: &Path) -> Option<PathBuf> {
    let profile = out_dir.parent()?.parent()?.parent()?;
    (profile.join("build").is_dir()).then(|| profile.to_path_buf())
}

/// A build without NCCL leaves no NCCL library of an earlier build next to
/// the binaries (where `cargo xtask dist` would take it for a CUDA build).
fn remove_stale_copy() {
    if let Some(profile) = std::env::var_os("OUT_DIR").and_then(|o| profile_dir(Path::new(&o))) {
        let _ = std::fs::remove_file(profile.join(NCCL_LIBRARY));
    }
}

/// The folder holding `gloo/rendezvous/store.h`.
fn gloo_include() -> PathBuf {
    let candidates: Vec<PathBuf> = [
        std::env::var_os("WASMRPC_GLOO_INCLUDE").map(PathBuf::from),
        std::env::var_os("WASMRPC_ENV").map(|e| PathBuf::from(e).join("gloo/include")),
    ]
    .into_iter()
    .flatten()
    .collect();
    for c in &candidates {
        if c.join("gloo/rendezvous/store.h").exists() {
            let c = std::fs::canonicalize(c).unwrap_or_else(|_| c.clone());
            println!(
                "cargo:rerun-if-changed={}",
                c.join("gloo/config.h").display()
            );
            return c;
        }
    }
    panic!(
        "Gloo's headers were not found (looked in {candidates:?}): run `cargo xtask setup`, \
         which extracts Debian's libgloo-dev into the cache folder and links it as \
         .wasmrpc-env/gloo, or set WASMRPC_GLOO_INCLUDE to a folder holding gloo/*.h"
    );
}

/// The include folders NCCL's c10d headers need, if this libtorch is a CUDA
/// build whose wheel ships them.
fn nccl_includes(lib: &Path) -> Option<Vec<PathBuf>> {
    if std::env::var("WASMRPC_C10D_NCCL").is_ok_and(|v| v == "0")
        || std::env::var("WASMRPC_CUDA").is_ok_and(|v| v == "0")
    {
        return None;
    }
    if !lib.join("libtorch_cuda.so").exists() {
        return None;
    }
    // torch/lib -> site-packages/nvidia/...
    let nvidia = lib.join("../../nvidia");
    let nccl = nvidia.join("nccl/include");
    if !nccl.join("nccl.h").exists() {
        return None;
    }
    let cuda = std::fs::read_dir(&nvidia)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("include"))
        .find(|p| p.join("cuda_runtime_api.h").exists())?;
    // cuda_runtime.h includes crt/host_config.h and cuda_fp16.h includes
    // nv/target: the nvidia-cuda-crt and nvidia-cuda-cccl wheels, which
    // `cargo xtask setup` adds to a CUDA build's venv.
    for needed in ["crt/host_config.h", "nv/target"] {
        if !cuda.join(needed).exists() {
            println!(
                "cargo:warning=NCCL left out: {} lacks {needed} (run `cargo xtask setup`)",
                cuda.display()
            );
            return None;
        }
    }
    Some(vec![nccl, cuda])
}

include!("../build-support/only_checking.rs");
