//! Recycled tensor memory: big CPU blocks whose pages are already faulted
//! in, for tensors that are about to be overwritten whole.
//!
//! This module owns the safe API over the pool in the shim's allocator
//! (`shim/budget.cpp`, "Recycling"). Which tensors are allocated from it is
//! the caller's choice: the host receives a frame's tensors this way.
//!
//! Why: a fresh block of 64 MiB is 16,384 pages the kernel must zero and
//! map one fault at a time as they are first written, which costs about as
//! much again as the copy that fills them. A block freed by an earlier
//! tensor has its pages mapped already.
//!
//! Invariants:
//! - REC-1: only allocations made inside [`for_overwrite`] (of at least
//!   1 MiB) get a recycled block, and only blocks so allocated are
//!   recycled; every other tensor's memory is the wrapped allocator's, as
//!   before. A recycled block holds the bytes of the tensor that last used
//!   it, so the closure's caller must write every byte of what it allocates
//!   before anything else can read it; this is what keeps one call's data
//!   out of another's tensors.
//! - REC-2: tensor memory budgets charge and release a recycled block as
//!   any other allocation (the bytes asked, while a tensor uses it); idle
//!   blocks are charged to no budget.
//! - REC-3: the pool holds at most its [`limit`](stats) idle, and frees a
//!   block that has been idle for 5 s, from a thread of its own, so an idle
//!   worker gives the memory back.

use crate::ffi;

/// Runs `f` with every CPU tensor allocation of at least 1 MiB it makes on
/// this thread taken from the recycled blocks when one of its size class
/// (the size rounded up to a quarter of its power of two) is idle (REC-1).
///
/// The caller writes every byte of the tensors `f` allocates before any
/// other code reads them. Scopes nest, and the previous one is back when
/// this returns, also if `f` panics.
pub fn for_overwrite<R>(f: impl FnOnce() -> R) -> R {
    crate::budget::install();
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: a thread-local flag; restoring it has no precondition.
            unsafe { ffi::wrs_overwrite_exit(self.0) }
        }
    }
    // SAFETY: a thread-local flag; setting it has no precondition.
    let _restore = Restore(unsafe { ffi::wrs_overwrite_enter() });
    f()
}

/// What the pool holds, for tests and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecycleStats {
    /// Bytes held idle.
    pub idle_bytes: u64,
    /// The most the pool holds idle.
    pub limit: u64,
    /// Allocations served from an idle block since the process started.
    pub reused: u64,
}

/// The pool's figures now.
pub fn stats() -> RecycleStats {
    let mut raw = ffi::RawRecycleStats::default();
    // SAFETY: `raw` is a writable stats record.
    unsafe { ffi::wrs_recycle_stats(&mut raw) };
    RecycleStats {
        idle_bytes: raw.idle_bytes,
        limit: raw.limit,
        reused: raw.reused,
    }
}

/// Sets the most the pool holds idle (1 GiB by default), freeing idle
/// blocks above it now. Zero turns recycling off.
pub fn set_limit(bytes: u64) {
    // SAFETY: no precondition; the shim locks the pool.
    unsafe { ffi::wrs_recycle_set_limit(bytes) }
}

/// Frees every idle block now.
pub fn trim() {
    // SAFETY: no precondition; the shim locks the pool.
    unsafe { ffi::wrs_recycle_trim() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryBudget;
    use tch::{Device, Kind, Tensor};

    const MIB: i64 = 1 << 20;

    /// The pool is process-wide and the tests of this crate run in
    /// parallel: the tests that count its blocks take turns.
    static POOL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn empty(bytes: i64) -> Tensor {
        Tensor::empty([bytes], (Kind::Uint8, Device::Cpu))
    }

    #[test]
    fn a_freed_block_is_reused_by_the_next_overwrite_of_its_class() {
        let _turn = POOL.lock().unwrap_or_else(|p| p.into_inner());
        trim();
        let mut first = for_overwrite(|| empty(3 * MIB));
        let address = first.data_ptr() as usize;
        let _ = first.fill_(7);
        drop(first);
        let idle = stats().idle_bytes;
        assert_eq!(idle, 3 * MIB as u64, "3 MiB is its own class");
        let reused_before = stats().reused;
        // 2.9 MiB rounds up to the same 3 MiB class.
        let second = for_overwrite(|| empty(3 * MIB - 100 * 1024));
        assert_eq!(second.data_ptr() as usize, address);
        assert_eq!(stats().reused, reused_before + 1);
        assert_eq!(stats().idle_bytes, 0);
        // The bytes are the last tensor's: the caller overwrites them.
        assert_eq!(second.get(0).int64_value(&[]), 7);
        drop(second);
        trim();
        assert_eq!(stats().idle_bytes, 0);
    }

    #[test]
    fn tensors_outside_the_scope_and_small_ones_are_never_recycled() {
        let _turn = POOL.lock().unwrap_or_else(|p| p.into_inner());
        trim();
        drop(empty(4 * MIB));
        drop(for_overwrite(|| empty(MIB - 1)));
        assert_eq!(stats().idle_bytes, 0);
        // An idle block is not handed to an allocation outside the scope.
        drop(for_overwrite(|| empty(4 * MIB)));
        assert_eq!(stats().idle_bytes, 4 * MIB as u64);
        let reused = stats().reused;
        drop(empty(4 * MIB));
        assert_eq!(stats().reused, reused);
        assert_eq!(stats().idle_bytes, 4 * MIB as u64);
        trim();
    }

    #[test]
    fn budgets_charge_recycled_blocks_while_a_tensor_uses_them() {
        let _turn = POOL.lock().unwrap_or_else(|p| p.into_inner());
        trim();
        let budget = MemoryBudget::new(64 * MIB as u64);
        let (t, refusal) = budget.run(|| for_overwrite(|| empty(5 * MIB)));
        assert_eq!(refusal, None);
        assert_eq!(
            budget.used(),
            5 * MIB as u64,
            "the bytes asked, not the class"
        );
        drop(t);
        assert_eq!(budget.used(), 0);
        let (t, _) = budget.run(|| for_overwrite(|| empty(5 * MIB)));
        assert_eq!(
            budget.used(),
            5 * MIB as u64,
            "a reused block is charged too"
        );
        drop(t);
        assert_eq!(budget.used(), 0);
        let small = MemoryBudget::new(MIB as u64);
        let (r, refusal) =
            small.run(|| for_overwrite(|| Tensor::f_empty([5 * MIB], (Kind::Uint8, Device::Cpu))));
        assert!(r.is_err() && refusal.is_some(), "a budget still refuses");
        trim();
    }

    #[test]
    fn the_limit_bounds_what_is_kept_idle() {
        let _turn = POOL.lock().unwrap_or_else(|p| p.into_inner());
        trim();
        let before = stats().limit;
        set_limit(6 * MIB as u64);
        let a = for_overwrite(|| empty(4 * MIB));
        let b = for_overwrite(|| empty(4 * MIB));
        drop(a);
        drop(b);
        assert_eq!(
            stats().idle_bytes,
            4 * MIB as u64,
            "the second would pass the limit"
        );
        set_limit(0);
        assert_eq!(stats().idle_bytes, 0, "a lower limit frees what is over it");
        drop(for_overwrite(|| empty(4 * MIB)));
        assert_eq!(stats().idle_bytes, 0, "a zero limit recycles nothing");
        set_limit(before);
    }

    #[test]
    fn idle_blocks_are_freed_after_five_seconds() {
        let _turn = POOL.lock().unwrap_or_else(|p| p.into_inner());
        trim();
        drop(for_overwrite(|| empty(2 * MIB)));
        assert_eq!(stats().idle_bytes, 2 * MIB as u64);
        let start = std::time::Instant::now();
        while stats().idle_bytes != 0 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(15),
                "an idle block outlived 15 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert!(start.elapsed() >= std::time::Duration::from_secs(4));
    }
}
