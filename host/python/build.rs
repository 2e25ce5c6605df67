//! Compiles `src/thp.cpp`, the bridge between a Python `torch.Tensor` and
//! the `torch::Tensor` tch holds (libtorch_python's `THPVariable_Wrap` and
//! `THPVariable_Unpack`), against the libtorch torch-sys links and the
//! headers of the Python that builds the module (`PYO3_PYTHON`).
//!
//! `libtorch_python` is linked into the extension module only (a
//! `cdylib` link argument): it needs the interpreter's symbols, which a
//! test executable does not have, and the module finds it loaded already,
//! since `wasmrpc/__init__.py` imports torch first.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<()> {
    println!("cargo:rerun-if-changed=src/thp.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");

    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .context("DEP_TCH_LIBTORCH_LIB is not set: is torch-sys a dependency?")?;
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('include'))",
        ])
        .output()
        .with_context(|| format!("cannot run {python} to find Python's headers"))?;
    let python_include = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !python_include.join("Python.h").exists() {
        bail!(
            "{python} has no Python.h in {} (a Python with its development headers is \
             needed to build the wasmrpc Python package)",
            python_include.display()
        );
    }
    if only_checking() {
        return Ok(());
    }
    let cxx11_abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(lib.join("../include"))
        .include(lib.join("../include/torch/csrc/api/include"))
        .include(&python_include)
        .flag("-std=c++20")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        // libtorch is a release build; its headers' layouts follow NDEBUG.
        .define("NDEBUG", None)
        .file("src/thp.cpp")
        .compile("wasmrpc_thp");
    println!("cargo:rustc-cdylib-link-arg=-L{}", lib.display());
    println!("cargo:rustc-cdylib-link-arg=-ltorch_python");
    // Every target of the package (the module, the test) finds libtorch.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    Ok(())
}

include!("../build-support/only_checking.rs");
