//! Compiles the C++ shim (`shim/ops.cpp` with `op_args.cpp`, `op_match.cpp`
//! and `op_emit.cpp`, `autograd.cpp`, `profile.cpp`,
//! `budget.cpp`, `guards.cpp`, `cuda.cpp`, `cuda_stream.cpp`) against the libtorch that
//! torch-sys links, links it with `torch_cpu` and `c10`, and embeds an rpath
//! to libtorch's folder so this package's test and bench binaries find it at
//! run time.
//!
//! No CUDA library is linked, even against a CUDA libtorch: `src/cuda.rs`
//! loads `libtorch_cuda.so` at run time where a GPU can use it. This script
//! only tells it whether the build is a CUDA one (`WASMRPC_TORCH_CUDA_BUILD`).

use anyhow::{Context, Result};
use std::path::PathBuf;

fn main() -> Result<()> {
    println!("cargo:rerun-if-changed=shim/ops.cpp");
    println!("cargo:rerun-if-changed=shim/op_args.cpp");
    println!("cargo:rerun-if-changed=shim/op_args.h");
    println!("cargo:rerun-if-changed=shim/op_match.cpp");
    println!("cargo:rerun-if-changed=shim/op_match.h");
    println!("cargo:rerun-if-changed=shim/op_emit.cpp");
    println!("cargo:rerun-if-changed=shim/ops.h");
    println!("cargo:rerun-if-changed=shim/autograd.cpp");
    println!("cargo:rerun-if-changed=shim/profile.cpp");
    println!("cargo:rerun-if-changed=shim/common.h");
    println!("cargo:rerun-if-changed=shim/budget.cpp");
    println!("cargo:rerun-if-changed=shim/budget.h");
    println!("cargo:rerun-if-changed=shim/guards.cpp");
    println!("cargo:rerun-if-changed=shim/guards.h");
    println!("cargo:rerun-if-changed=shim/cuda.cpp");
    println!("cargo:rerun-if-changed=shim/cuda_stream.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");

    // torch-sys (links = "tch") publishes the folder it linked against.
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .context("DEP_TCH_LIBTORCH_LIB is not set: is torch-sys a dependency?")?;
    // Resolve the set-up's links, so binaries keep working if the checkout
    // moves.
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    let include = lib.join("../include");
    let api_include = lib.join("../include/torch/csrc/api/include");

    // torch-sys builds libtch with `-D_GLIBCXX_USE_CXX11_ABI=1` unless
    // `LIBTORCH_CXX11_ABI` says otherwise; the shim must agree with it.
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let cxx11_abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());

    // A CUDA libtorch: `libtorch_cuda.so` sits next to `libtorch_cpu.so`.
    // Nothing links it (an idle worker without a GPU would map 500 MiB of
    // CUDA libraries for nothing); `cuda::load` opens it at run time, and
    // only a CUDA build may. `WASMRPC_CUDA=0` builds a host that never does,
    // even against a CUDA libtorch (the release bundle's `cpu` flavour,
    // which ships no CUDA library).
    println!("cargo:rerun-if-env-changed=WASMRPC_CUDA");
    let cuda = lib.join("libtorch_cuda.so").exists()
        && std::env::var("WASMRPC_CUDA").map_or(true, |v| v != "0");

    // Tells `cuda::load` (and the tests) whether this build may load
    // libtorch_cuda.so.
    println!(
        "cargo:rustc-env=WASMRPC_TORCH_CUDA_BUILD={}",
        u8::from(cuda)
    );
    if only_checking() {
        return Ok(());
    }
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(&api_include)
        .include("shim")
        .flag("-std=c++20")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        // libtorch is a release build (its `caffe2/core/macros.h` lists
        // `-DNDEBUG` among its CXX_FLAGS), and its headers change with
        // NDEBUG: `at::RecordFunction` has an `inputs_valid_` member only
        // without it, and its `inputs()` then asserts that flag, which the
        // release library never sets. The shim must see the layout and
        // inline code the library was built with. Its other flags
        // (USE_KINETO, USE_FBGEMM, C10_NODEPRECATED, ...) touch no header
        // the shim includes, or no layout.
        .define("NDEBUG", None)
        .file("shim/ops.cpp")
        .file("shim/op_args.cpp")
        .file("shim/op_match.cpp")
        .file("shim/op_emit.cpp")
        .file("shim/autograd.cpp")
        .file("shim/profile.cpp")
        .file("shim/budget.cpp")
        .file("shim/guards.cpp")
        .file("shim/cuda.cpp")
        .file("shim/cuda_stream.cpp")
        .compile("wasmrpc_torch_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    Ok(())
}

include!("../build-support/only_checking.rs");
