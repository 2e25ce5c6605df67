//! `libwasmrpc_c10d_nccl.so`, the library that constructs
//! `c10d::ProcessGroupNCCL` (`shim/nccl.cpp`): finding it, opening it, and
//! its factory. This module owns when that library (and with it CUDA's
//! runtime and NCCL) enters a process: only when an NCCL group is asked
//! for, and only after `wasmrpc_torch_sys::cuda::load` has loaded
//! libtorch's CUDA side (on a GPU machine, or with `WASMRPC_LOAD_CUDA=1`).
//! Without CUDA loaded the group is refused with PyTorch's own words plus
//! why CUDA is not there.
//!
//! Where the library is looked for, in order: `<exe dir>/../lib/` (the
//! release bundle, whose `lib/` ships it in the `cuda` flavour),
//! `<exe dir>/` (a build's `target/<profile>/`, where the build script
//! copies it), `<exe dir>/../` (a test binary in `target/<profile>/deps/`,
//! also as `cargo xtask gpu-bundle`'s nextest archive carries it), and the
//! path the build script built it at.

use std::ffi::{c_char, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use wasmrpc_torch_sys::cuda::loader_error;

/// The library's file name.
pub const LIBRARY: &str = "libwasmrpc_c10d_nccl.so";

/// Where the build script built the library; empty when it built none (a
/// CPU libtorch, `WASMRPC_CUDA=0`, `WASMRPC_C10D_NCCL=0`, or CUDA's
/// headers missing).
const BUILT_AT: &str = env!("WASMRPC_C10D_NCCL_LIB");

/// `wrc_nccl_construct` (see `shim/c10d_shim.h`).
pub(super) type Factory = unsafe extern "C" fn(
    store: *const c_void,
    rank: i32,
    size: i32,
    timeout_ms: i64,
    backend: *mut c_void,
    err: *mut c_char,
    cap: usize,
) -> i32;

/// Whether this build has the NCCL library (`torch.distributed`'s
/// `is_nccl_available()`: compiled in, GPU or not).
pub fn compiled() -> bool {
    !BUILT_AT.is_empty()
}

/// The factory of the NCCL library, opened once per process; or why an
/// NCCL group cannot be made here.
///
/// # Errors
/// No NCCL in this build; CUDA not loaded (no device, or
/// `WASMRPC_LOAD_CUDA=0`), or failing to load; the library not found or
/// not opening (the loader's message).
pub(super) fn factory() -> Result<Factory, String> {
    static FACTORY: OnceLock<Result<Factory, String>> = OnceLock::new();
    FACTORY.get_or_init(open).clone()
}

fn open() -> Result<Factory, String> {
    if !compiled() {
        return Err(
            "ProcessGroupNCCL is not compiled into this build (no CUDA libtorch)".to_owned(),
        );
    }
    match wasmrpc_torch_sys::cuda::load() {
        Err(e) => {
            return Err(format!(
                "ProcessGroupNCCL needs CUDA, which did not load: {e}"
            ));
        }
        Ok(status) if !status.loaded => {
            // PyTorch's words for a machine without a GPU, then ours.
            return Err(format!(
                "ProcessGroupNCCL is only supported with GPUs, no GPUs found! (this process \
                 did not load CUDA: {})",
                status.why
            ));
        }
        Ok(_) => {}
    }
    let candidates = candidates();
    let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
        let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
        format!(
            "ProcessGroupNCCL's library {LIBRARY} was not found (looked in {})",
            looked.join(", ")
        )
    })?;
    // SAFETY: the library's initialisers are libtorch's and NCCL's static
    // ones; the libtorch_cuda.so it links is the one already loaded.
    let library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| format!("opening {}: {}", path.display(), loader_error(&e)))?;
    // SAFETY: `wrc_nccl_construct` has the signature `Factory` declares
    // (shim/c10d_shim.h).
    let factory = unsafe { library.get::<Factory>(b"wrc_nccl_construct\0") }
        .map(|symbol| *symbol)
        .map_err(|e| {
            format!(
                "{} has no wrc_nccl_construct: {}",
                path.display(),
                loader_error(&e)
            )
        })?;
    // Never closed: the groups it makes run its code for the life of the
    // process.
    std::mem::forget(library);
    Ok(factory)
}

fn candidates() -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(PathBuf::from))
    {
        paths.push(dir.join("../lib").join(LIBRARY));
        paths.push(dir.join(LIBRARY));
        // A test binary in `target/<profile>/deps/`, built here or
        // extracted from a nextest archive (`cargo xtask gpu-bundle`).
        paths.push(dir.join("..").join(LIBRARY));
    }
    paths.push(PathBuf::from(BUILT_AT));
    paths
}
