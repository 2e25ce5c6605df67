//! [`MemoryBudget`]: a limit on the bytes of CPU tensor memory that work run
//! inside its scope may hold at once.
//!
//! This module owns the safe API over the shim's budgeting allocator
//! (`shim/budget.cpp`): installing it, budgets and their parents, running
//! work in a budget's scope, and reading why an allocation was refused. What
//! a budget is *for* (a worker, a call, a received frame) and how a refusal
//! is reported to a caller belong to the host.
//!
//! How it works: the first budget made installs a CPU allocator in front of
//! the one libtorch had. Every CPU allocation libtorch makes on a thread that
//! is inside [`MemoryBudget::run`] is charged to that budget and each of its
//! parents until the memory is freed (whenever and on whatever thread the
//! last tensor using it is dropped); one that would take any of them over
//! its limit fails inside libtorch with `tensor memory budget of N bytes
//! exceeded (asked M bytes, U in use)`, which the op reports as its error,
//! and [`MemoryBudget::run`] returns the [`BudgetRefusal`].
//!
//! Invariants:
//! - BUD-1: allocations outside a scope are never charged or refused; a
//!   scope is per thread and ends when `run` returns, so it can never leak
//!   into unrelated work that later runs on the same thread.
//! - BUD-2: a charge is released exactly once, by the memory's deleter, to
//!   the budgets it was charged to, even after every handle to those budgets
//!   is gone (the allocation holds a reference).
//!
//! Not covered: CUDA memory (libtorch's caching allocator), allocations that
//! libtorch makes on its own intra-op worker threads, and memory that does
//! not come from libtorch's CPU allocator (wasm memories, network buffers).

use std::ptr::NonNull;
use std::sync::OnceLock;

use crate::ffi::{self, RawBudget, RawBudgetRefusal};

/// A tensor memory budget: a limit in bytes, what is charged to it now, and
/// optionally a parent that everything charged here is charged to as well.
///
/// Cheap to clone (a reference count); `Send` and `Sync`.
pub struct MemoryBudget {
    raw: NonNull<RawBudget>,
}

// SAFETY: the shim's budget is a set of atomics plus an immutable parent
// pointer; every function over it may be called from any thread at once.
unsafe impl Send for MemoryBudget {}
// SAFETY: as for `Send`.
unsafe impl Sync for MemoryBudget {}

impl Clone for MemoryBudget {
    fn clone(&self) -> Self {
        // SAFETY: `raw` is a live budget this handle holds a reference to.
        unsafe { ffi::wrs_budget_retain(self.raw.as_ptr()) };
        MemoryBudget { raw: self.raw }
    }
}

impl Drop for MemoryBudget {
    fn drop(&mut self) {
        // SAFETY: gives back the reference this handle holds (BUD-2: live
        // allocations keep their own).
        unsafe { ffi::wrs_budget_release(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("used", &self.used())
            .field("limit", &self.limit())
            .finish()
    }
}

/// Why an allocation inside a budget's scope was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// The bytes the allocation asked for.
    pub asked: u64,
    /// The limit of the budget that refused it.
    pub limit: u64,
    /// What that budget held before the allocation.
    pub used: u64,
    /// Which budget refused: 0 for the one whose scope the work ran in, 1
    /// for its parent, and so on.
    pub depth: u32,
}

/// Installs the budgeting allocator once per process.
pub(crate) fn install() {
    static INSTALLED: OnceLock<i32> = OnceLock::new();
    // SAFETY: the shim catches everything; installing twice is a no-op.
    let status = *INSTALLED.get_or_init(|| unsafe { ffi::wrs_budget_install() });
    // Without it budgets would silently not apply: a process whose CPU
    // allocator cannot be replaced must not pretend to enforce them.
    assert_eq!(
        status, 0,
        "cannot install the tensor memory budget allocator in libtorch (status {status})"
    );
}

impl MemoryBudget {
    /// A budget of `limit` bytes with no parent.
    pub fn new(limit: u64) -> MemoryBudget {
        MemoryBudget::with_parent(limit, None)
    }

    /// A budget of `limit` bytes whose charges also count against `self`
    /// (and its parents): a call's budget under its worker's.
    pub fn child(&self, limit: u64) -> MemoryBudget {
        MemoryBudget::with_parent(limit, Some(self))
    }

    fn with_parent(limit: u64, parent: Option<&MemoryBudget>) -> MemoryBudget {
        install();
        let parent = parent.map_or(std::ptr::null_mut(), |p| p.raw.as_ptr());
        // SAFETY: `parent` is null or a live budget; the shim takes its own
        // reference to it.
        let raw = unsafe { ffi::wrs_budget_new(limit, parent) };
        MemoryBudget {
            raw: NonNull::new(raw).expect("out of memory allocating a memory budget"),
        }
    }

    /// Bytes charged to this budget now (by it and its children).
    pub fn used(&self) -> u64 {
        // SAFETY: `raw` is live.
        unsafe { ffi::wrs_budget_used(self.raw.as_ptr()) }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        // SAFETY: `raw` is live.
        unsafe { ffi::wrs_budget_limit(self.raw.as_ptr()) }
    }

    /// Changes the limit; memory already charged stays charged, even above
    /// a lowered limit (only new allocations are refused).
    pub fn set_limit(&self, limit: u64) {
        // SAFETY: `raw` is live.
        unsafe { ffi::wrs_budget_set_limit(self.raw.as_ptr(), limit) }
    }

    /// Runs `f` on this thread with every CPU tensor allocation charged to
    /// this budget (BUD-1), and returns what `f` returned with the refusal
    /// that made an allocation inside it fail, if one did. Scopes nest: the
    /// previous scope is back when this returns, also if `f` panics.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> (R, Option<BudgetRefusal>) {
        struct Restore(*mut RawBudget);
        impl Drop for Restore {
            fn drop(&mut self) {
                // SAFETY: puts back the scope `enter` replaced on this thread.
                unsafe { ffi::wrs_budget_exit(self.0) }
            }
        }
        // SAFETY: `raw` is live for the whole scope: `self` outlives it.
        let restore = Restore(unsafe { ffi::wrs_budget_enter(self.raw.as_ptr()) });
        let out = f();
        let mut raw = RawBudgetRefusal::default();
        // SAFETY: `raw` is a writable refusal record.
        let refused = unsafe { ffi::wrs_budget_take_refusal(&mut raw) } == 1;
        drop(restore);
        let refusal = refused.then_some(BudgetRefusal {
            asked: raw.asked,
            limit: raw.limit,
            used: raw.used,
            depth: raw.depth,
        });
        (out, refusal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    const MIB: u64 = 1 << 20;

    #[test]
    fn allocations_in_scope_are_charged_until_freed() {
        let budget = MemoryBudget::new(64 * MIB);
        let (t, refusal) = budget.run(|| Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu)));
        assert_eq!(refusal, None);
        assert_eq!(budget.used(), 4 * MIB);
        // Outside the scope nothing is charged (BUD-1).
        let outside = Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu));
        assert_eq!(budget.used(), 4 * MIB);
        drop(outside);
        drop(t);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn an_allocation_over_the_limit_fails_and_says_by_how_much() {
        let budget = MemoryBudget::new(8 * MIB);
        let (r, refusal) = budget.run(|| Tensor::f_zeros([4 << 20], (Kind::Float, Device::Cpu)));
        let e = r.expect_err("16 MiB over an 8 MiB budget");
        assert!(
            e.to_string()
                .contains("tensor memory budget of 8388608 bytes exceeded (asked 16777216 bytes"),
            "{e}"
        );
        assert_eq!(
            refusal,
            Some(BudgetRefusal {
                asked: 16 * MIB,
                limit: 8 * MIB,
                used: 0,
                depth: 0
            })
        );
        assert_eq!(budget.used(), 0, "a refused allocation holds nothing");
        // The budget still serves what fits.
        let (ok, refusal) = budget.run(|| Tensor::f_zeros([1 << 20], (Kind::Float, Device::Cpu)));
        assert!(ok.is_ok() && refusal.is_none());
    }

    #[test]
    fn a_child_charges_its_parent_and_the_parent_limit_holds() {
        let worker = MemoryBudget::new(6 * MIB);
        let call = worker.child(100 * MIB);
        let (a, _) = call.run(|| Tensor::zeros([1 << 20], (Kind::Float, Device::Cpu)));
        assert_eq!((call.used(), worker.used()), (4 * MIB, 4 * MIB));
        let (r, refusal) = call.run(|| Tensor::f_zeros([1 << 20], (Kind::Float, Device::Cpu)));
        assert!(r.is_err());
        assert_eq!(refusal.map(|r| (r.depth, r.limit)), Some((1, 6 * MIB)));
        assert_eq!((call.used(), worker.used()), (4 * MIB, 4 * MIB));
        // The tensor outlives every handle to its budgets (BUD-2).
        drop(call);
        drop(worker);
        drop(a);
    }

    #[test]
    fn scopes_nest_and_refusals_do_not_leak_into_later_runs() {
        let outer = MemoryBudget::new(64 * MIB);
        let inner = MemoryBudget::new(MIB);
        let ((t, inner_refusal), outer_refusal) = outer.run(|| {
            let r = inner.run(|| Tensor::f_zeros([1 << 20], (Kind::Float, Device::Cpu)));
            // Back in the outer scope: charged there.
            let t = Tensor::zeros([1 << 18], (Kind::Float, Device::Cpu));
            (t, r.1)
        });
        assert!(inner_refusal.is_some());
        assert_eq!(outer_refusal, None);
        assert_eq!(outer.used(), MIB);
        assert_eq!(inner.used(), 0);
        drop(t);
        let (_, later) = inner.run(|| ());
        assert_eq!(later, None);
    }

    #[test]
    fn tensors_from_the_budgeted_allocator_behave_as_usual() {
        let budget = MemoryBudget::new(64 * MIB);
        let (sum, _) = budget.run(|| {
            let mut t = Tensor::arange(1000, (Kind::Float, Device::Cpu));
            // Resizing reallocates through the allocator's copy path.
            let _ = t.resize_([4000]);
            let v = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
            (&v * 2).sum(Kind::Float).double_value(&[])
        });
        assert_eq!(sum, 12.0);
        assert_eq!(budget.used(), 0);
    }
}
