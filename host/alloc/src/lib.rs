//! The memory allocator of wasmrpc's executables (`wasmrpc`, `wasmrpc-bench`):
//! jemalloc, linked unprefixed, so that it serves not only Rust's
//! allocations but every `malloc`, `posix_memalign` and `operator new` of
//! the process, libtorch's included (the executable defines those symbols,
//! and the shared libraries it loads bind to the executable's first).
//!
//! Why: a worker's hot path is full of small, short-lived C++ allocations
//! (tensor storage through `posix_memalign`, `TensorImpl`s, autograd nodes),
//! and glibc's `malloc` pays for them in `_int_memalign`, `_int_free` and
//! fastbin consolidation. With jemalloc the distributed autograd step of two
//! 16x16 matrices took 63-65 µs against glibc's 70-72 µs in alternating
//! runs (2026-12-05, `wasmrpc-bench anatomy --call step16`), and an idle
//! worker stays as small (143 MiB against 139 MiB). See the benchmarks
//! guide, "The allocator".
//!
//! This crate owns the choice and nothing else: each executable installs
//! [`Allocator`] as its `#[global_allocator]` and hands
//! [`release_freed_memory`] to the library (`wasmrpc::set_memory_release`),
//! which calls it after a plugin compile. Libraries never depend on it: the
//! Python extension module, loaded into a CPython process whose libtorch
//! allocates with glibc, must not bring an allocator of its own.

/// The executables' global allocator: `#[global_allocator] static ALLOCATOR:
/// wasmrpc_alloc::Allocator = wasmrpc_alloc::Allocator;`.
pub use tikv_jemallocator::Jemalloc as Allocator;

/// The control that purges every arena (4096 is jemalloc's
/// `MALLCTL_ARENAS_ALL`).
const PURGE_ALL_ARENAS: &std::ffi::CStr = c"arena.4096.purge";

/// Hands the pages that every arena holds freed but unreturned back to the
/// system now.
///
/// jemalloc returns freed pages on its own only as an arena keeps being
/// used; a burst of work on threads that then go quiet (a compile on
/// Cranelift's threads: a few hundred MiB) would otherwise stay resident for
/// the worker's life. Cheap when there is nothing to purge.
///
/// # Errors
///
/// The error jemalloc's `mallctl` reports (as an OS error code), which only
/// happens when this process's allocator is not jemalloc's unprefixed build.
pub fn release_freed_memory() -> std::io::Result<()> {
    // SAFETY: the name is a C string; a purge reads and writes no value,
    // so the old and new value pointers are null with zero lengths, as
    // jemalloc's manual specifies for void controls.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL_ARENAS.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    match rc {
        0 => Ok(()),
        code => Err(std::io::Error::from_raw_os_error(code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[global_allocator]
    static ALLOCATOR: Allocator = Allocator;

    /// This process's resident memory, in MiB (`/proc/self/statm`).
    fn resident_mib() -> f64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: f64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096.0 / (1024.0 * 1024.0)
    }

    /// 256 MiB in 64 KiB blocks, written, then freed on a thread that stays
    /// (this one): the shape of a compile on Cranelift's pooled threads.
    /// (A thread that ends has its arena's pages purged as it goes.)
    fn churn() {
        let blocks: Vec<Vec<u8>> = (0..4096)
            .map(|i| vec![(i % 250 + 1) as u8; 64 * 1024])
            .collect();
        std::hint::black_box(&blocks);
    }

    /// What a compile freed stays resident until released, and the release
    /// hands it back (the reason the library calls it after a compile).
    #[test]
    fn freed_memory_stays_until_released_and_then_goes() {
        let before = resident_mib();
        churn();
        let kept = resident_mib();
        assert!(
            kept - before > 128.0,
            "jemalloc kept {:.1} MiB of the 256 MiB freed (resident {before:.1} -> {kept:.1} MiB)",
            kept - before
        );
        release_freed_memory().unwrap();
        let released = resident_mib();
        assert!(
            kept - released > 128.0,
            "the release handed back {:.1} MiB (resident {kept:.1} -> {released:.1} MiB)",
            kept - released
        );
    }
}
