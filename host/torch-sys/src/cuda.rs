//! libtorch's CUDA side, loaded at run time where it can be used.
//!
//! This module owns the decision to load `libtorch_cuda.so` and the loading
//! itself; nothing else in the workspace links or opens it (the c10d crate's
//! NCCL library needs it loaded first and asks [`load`]).
//!
//! Why at run time: libtorch's CPU library finds its CUDA half through a
//! registry of "hooks" that `libtorch_cuda.so`'s static initialisers fill
//! when the library is loaded. Linking it into every process (as the host
//! once did) costs an idle worker about 270 MiB resident more than a CPU
//! build, GPU or not (405 MiB against 132 MiB where this was measured). Instead [`load`] decides, once per process:
//!
//! - [`LOAD_ENV`] (`WASMRPC_LOAD_CUDA`) `=1`: load, GPU or not (an error if
//!   it cannot be loaded); `=0`: never load, even on a GPU machine; unset
//!   or `auto`: load exactly when the CUDA driver (`libcuda.so.1`) opens,
//!   `cuInit(0)` succeeds and `cuDeviceGetCount` counts a device. A GPU that
//!   is there is therefore always seen, unless the operator says `0`.
//! - A host built without CUDA (a CPU libtorch, or `WASMRPC_CUDA=0`, the
//!   release bundle's `cpu` flavour) never loads it, and `=1` is an error.
//!
//! Loading opens `libtorch_cuda.so` from the folder of the
//! `libtorch_cpu.so` this process runs (found with `dladdr`; in the bundle
//! that is its `lib/`), with `RTLD_NOW | RTLD_GLOBAL`, and keeps it for the
//! life of the process: its initialisers register the CUDA hooks (and with
//! `libc10_cuda.so` the CUDA device guard, allocator and streams), after
//! which `torch::cuda::device_count()` and CUDA tensors work as in a
//! process that linked it.
//!
//! When: libtorch settles on its hooks the first time anything asks for
//! them (`at::detail::getCUDAHooks()` caches its answer in a static), and
//! almost everything asks: creating a CPU tensor does, as does
//! `manual_seed`. So the decision runs when the process starts, before
//! `main` (a constructor in `.init_array`, which runs after libtorch's own
//! initialisers): in every process that links this crate (the `wasmrpc`
//! binary, the tests, the bench, programs using the library), whatever it
//! does first. [`load`] returns that outcome (`wasmrpc worker` and
//! `init_rpc` call it to log it, and to fail when CUDA should be there and
//! is not). A load that came too late anyway (a library whose own
//! initialiser made a tensor) is detected (the hooks are registered but
//! libtorch still uses its placeholder) and reported as an error rather
//! than a GPU that silently goes unseen.
//!
//! On a GPU machine every such process therefore loads CUDA at start, as
//! when it was linked (`wasmrpc launch`'s own process too, which uses
//! none; `WASMRPC_LOAD_CUDA=0` in its environment spares it, and its
//! workers if they inherit it). Without a device nothing of CUDA's is
//! mapped.
//!
//! On a machine with a CUDA driver the probe initialises it (`cuInit`) at
//! start, as libtorch's own first device query would (which `init_rpc`
//! makes anyway): as in PyTorch, a process that then forks without `exec`
//! cannot use CUDA in the child (`wasmrpc launch` starts its workers with
//! `exec`).
//!
//! On a GPU machine the path is: probe (driver opens, a device counted) →
//! `libtorch_cuda.so` opened → hooks registered → [`CudaStatus::loaded`],
//! with the CUDA runtime version the hooks report. The probe's driver
//! handle stays open, as libtorch opens the same library next anyway.

use std::ffi::{CStr, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};

use crate::ffi;

/// The environment variable that forces the decision: `1` loads CUDA, `0`
/// never does, `auto` (or unset) loads it where a CUDA device is present.
pub const LOAD_ENV: &str = "WASMRPC_LOAD_CUDA";

/// Whether this build may load CUDA: it was built against a CUDA libtorch
/// (with `libtorch_cuda.so`) and without `WASMRPC_CUDA=0`.
pub const BUILT_WITH_CUDA: bool = matches!(env!("WASMRPC_TORCH_CUDA_BUILD").as_bytes(), b"1");

/// What [`load`] decided, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaStatus {
    /// Whether `libtorch_cuda.so` is loaded and its hooks are the ones
    /// libtorch uses.
    pub loaded: bool,
    /// The CUDA runtime version the hooks report (`12080` for 12.8), when
    /// loaded.
    pub cudart_version: Option<i64>,
    /// Why CUDA was or was not loaded, for logs and error messages
    /// ("no CUDA device: cuInit failed with CUDA_ERROR_NO_DEVICE").
    pub why: String,
}

/// CUDA should have been loaded (forced, or a device is present) but could
/// not be; the message says what failed and how to run without it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CudaLoadError(String);

/// What the operator asked for through [`LOAD_ENV`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    Auto,
    Always,
    Never,
}

fn policy() -> Result<Policy, CudaLoadError> {
    match std::env::var(LOAD_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(Policy::Auto),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Policy::Auto),
            "1" | "true" | "yes" => Ok(Policy::Always),
            "0" | "false" | "no" => Ok(Policy::Never),
            other => Err(CudaLoadError(format!(
                "{LOAD_ENV}={other:?}: expected 1 (load CUDA), 0 (never) or auto \
                 (where a CUDA device is present)"
            ))),
        },
        Err(e) => Err(CudaLoadError(format!("{LOAD_ENV}: {e}"))),
    }
}

/// Decides whether to load libtorch's CUDA side, loads it if so, and
/// returns the outcome; once per process (later calls return the first
/// outcome, which the process's start made: see the module
/// documentation).
///
/// # Errors
/// [`CudaLoadError`] when CUDA is forced (`WASMRPC_LOAD_CUDA=1`) or a
/// device is present but `libtorch_cuda.so` cannot be loaded or comes too
/// late to take effect, when the build has no CUDA and `=1` is set, or when
/// [`LOAD_ENV`] holds something else than `1`, `0` or `auto`.
pub fn load() -> Result<&'static CudaStatus, CudaLoadError> {
    static OUTCOME: OnceLock<Result<CudaStatus, CudaLoadError>> = OnceLock::new();
    OUTCOME
        .get_or_init(decide_and_load)
        .as_ref()
        .map_err(Clone::clone)
}

/// Makes the decision when the process starts, before `main` and before
/// anything can make a tensor: an `.init_array` entry, which the loader
/// runs after the initialisers of the libraries the binary links
/// (libtorch's among them). `#[used]` keeps it in every binary that links
/// this crate.
#[used]
#[unsafe(link_section = ".init_array")]
static LOAD_AT_START: extern "C" fn() = load_at_start;

extern "C" fn load_at_start() {
    // Nothing may unwind out of a constructor; `load` keeps its outcome
    // (an error included) for the process's first caller to report.
    let _ = std::panic::catch_unwind(|| {
        let _ = load();
    });
}

/// Whether libtorch's CUDA side is loaded and in effect (calling [`load`]
/// first); false where loading failed.
pub fn is_loaded() -> bool {
    load().is_ok_and(|s| s.loaded)
}

/// Whether a CUDA hooks implementation is registered with libtorch
/// (`libtorch_cuda.so`'s initialisers ran), without settling libtorch's
/// choice of hooks and without loading anything.
pub fn hooks_registered() -> bool {
    // SAFETY: no arguments; the shim catches every exception.
    unsafe { ffi::wrs_cuda_hooks_registered() != 0 }
}

fn decide_and_load() -> Result<CudaStatus, CudaLoadError> {
    let policy = policy()?;
    let skipped = |why: String| {
        Ok(CudaStatus {
            loaded: false,
            cudart_version: None,
            why,
        })
    };
    if !BUILT_WITH_CUDA {
        let why = "this host was built without CUDA (a CPU libtorch, or WASMRPC_CUDA=0)";
        return match policy {
            Policy::Always => Err(CudaLoadError(format!("{LOAD_ENV}=1, but {why}"))),
            Policy::Auto | Policy::Never => skipped(why.to_owned()),
        };
    }
    let why = match policy {
        Policy::Never => return skipped(format!("{LOAD_ENV}=0")),
        Policy::Always => format!("{LOAD_ENV}=1"),
        Policy::Auto => match probe_devices() {
            Ok(n) => format!("{n} CUDA device(s) present"),
            Err(absent) => return skipped(format!("no CUDA device: {absent}")),
        },
    };
    let fail = |what: String| {
        CudaLoadError(format!(
            "loading libtorch's CUDA library ({why}) failed: {what}; set {LOAD_ENV}=0 to run \
             without CUDA"
        ))
    };
    let path = libtorch_cuda_path().map_err(fail)?;
    // SAFETY: libtorch_cuda.so's initialisers register CUDA hooks, device
    // guards and allocators with the libtorch_cpu.so and libc10.so this
    // process already runs (the ones in its folder, which it links); they
    // start no threads and touch no device.
    let library = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| fail(format!("{}: {}", path.display(), loader_error(&e))))?;
    // Never unloaded: libtorch keeps pointers into it (the hooks, the
    // allocator) for the life of the process.
    std::mem::forget(library);
    if !hooks_registered() {
        return Err(fail(format!(
            "{} loaded but registered no CUDA hooks",
            path.display()
        )));
    }
    let mut buf = [0 as c_char; 512];
    // SAFETY: `buf` is writable for its length; the shim writes a
    // NUL-terminated text into it and catches every exception.
    let in_effect = unsafe { ffi::wrs_cuda_hooks_in_effect(buf.as_mut_ptr(), buf.len()) } != 0;
    // SAFETY: the shim NUL-terminated `buf`.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    if !in_effect {
        // The placeholder's first sentence; the rest is its advice on
        // linking, which does not apply here.
        let text = text.split(". ").next().unwrap_or(&text);
        return Err(fail(format!(
            "libtorch had already settled on no CUDA before the library was loaded ({text}): \
             something asked for libtorch's CUDA hooks before this process's start-up \
             decision"
        )));
    }
    let version = text
        .parse::<i64>()
        .map_err(|e| fail(format!("the CUDA hooks reported version {text:?}: {e}")))?;
    Ok(CudaStatus {
        loaded: true,
        cudart_version: Some(version),
        why,
    })
}

/// `libtorch_cuda.so` in the folder of the `libtorch_cpu.so` this process
/// runs.
fn libtorch_cuda_path() -> Result<PathBuf, String> {
    let mut buf = [0 as c_char; 4096];
    // SAFETY: as in `decide_and_load`.
    let found = unsafe { ffi::wrs_libtorch_cpu_path(buf.as_mut_ptr(), buf.len()) } != 0;
    // SAFETY: the shim NUL-terminated `buf`.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    if !found {
        return Err(format!("cannot locate libtorch_cpu.so: {text}"));
    }
    let folder = Path::new(&text)
        .parent()
        .ok_or_else(|| format!("libtorch_cpu.so has no folder: {text:?}"))?;
    let path = folder.join("libtorch_cuda.so");
    if !path.exists() {
        return Err(format!(
            "{} does not exist (libtorch_cpu.so is {text})",
            path.display()
        ));
    }
    Ok(path)
}

type CuInit = unsafe extern "C" fn(flags: u32) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> c_int;

/// The number of CUDA devices the driver counts, or why there is none.
/// The driver is opened privately and closed again when it finds none.
fn probe_devices() -> Result<u32, String> {
    // SAFETY: opening the driver runs its initialisers, which touch no
    // device; `cuInit` and `cuDeviceGetCount` are called with their
    // documented signatures.
    unsafe {
        let driver = Library::open(Some("libcuda.so.1"), RTLD_NOW | RTLD_LOCAL)
            .map_err(|e| format!("the CUDA driver does not load ({})", loader_error(&e)))?;
        let init = driver
            .get::<CuInit>(b"cuInit\0")
            .map_err(|e| format!("the CUDA driver has no cuInit ({})", loader_error(&e)))?;
        let get_count = driver
            .get::<CuDeviceGetCount>(b"cuDeviceGetCount\0")
            .map_err(|e| {
                format!(
                    "the CUDA driver has no cuDeviceGetCount ({})",
                    loader_error(&e)
                )
            })?;
        let status = init(0);
        if status != 0 {
            return Err(format!("cuInit failed with {}", cuda_error_name(status)));
        }
        let mut count: c_int = 0;
        let status = get_count(&mut count);
        if status != 0 {
            return Err(format!(
                "cuDeviceGetCount failed with {}",
                cuda_error_name(status)
            ));
        }
        let Ok(count @ 1..) = u32::try_from(count) else {
            return Err("the CUDA driver counts no device".to_owned());
        };
        // Kept open: libtorch's runtime opens the same driver next.
        std::mem::forget(driver);
        Ok(count)
    }
}

/// The loader's own words (`dlerror`), which libloading keeps as the
/// error's source behind "dlopen failed".
pub fn loader_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}

/// The names of the driver errors a probe meets without a usable GPU.
fn cuda_error_name(status: c_int) -> String {
    let name = match status {
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUDA error {status}"),
    };
    format!("{name} ({status})")
}
