//! How many threads one builtin op may use: the size of libtorch's
//! intra-op pool (`torch.set_num_threads`), for the whole process.
//!
//! Why the worker processes choose it: libtorch's default is one op
//! thread per core, and a worker also runs calls on threads of its own
//! (`num_worker_threads`, the agent's runtime). Several workers on one
//! host, each with a full pool, put two or more busy threads on each
//! core; an op's threads then spin waiting for each other while the
//! calls and the peer workers wait for a core. `wasmrpc launch` and the
//! bench therefore give each worker its share of the host's cores
//! ([`cores_per_worker`]), for its op threads and for its runtime's
//! threads alike; `wasmrpc worker` keeps libtorch's default and
//! `DEFAULT_NUM_WORKER_THREADS` unless `--intra-op-threads` and
//! `--num-worker-threads` say otherwise.
//!
//! Why every thread that runs ops adopts the count ([`adopt_intra_op_threads`]):
//! libtorch applies `set_num_threads` to the calling thread's OpenMP and
//! MKL settings only. Another thread picks the count up when it first runs
//! one of libtorch's own parallel loops, but MKL's sgemm does not wait for
//! one: on a thread of tokio's blocking pool it split a 256x256 matmul over
//! every core, and each such thread kept an OpenMP helper of its own
//! spinning between ops (measured 2026-12-03 with `wasmrpc-bench anatomy
//! --call matmul256`: a worker given one op thread ran four helpers beside
//! its four pool threads).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Sets how many threads each builtin op (and each backward pass) may use
/// in this process, as `torch.set_num_threads` does. Process-wide: every
/// agent and plugin of the process shares it. 0 counts as 1.
pub fn set_intra_op_threads(threads: usize) {
    let threads = threads.max(1);
    INTRA_OP_THREADS.store(threads, Ordering::Relaxed);
    tch::set_num_threads(i32::try_from(threads).unwrap_or(i32::MAX));
    ADOPTED.set(threads);
}

/// The count [`set_intra_op_threads`] set last; 0 while it never ran (every
/// thread keeps libtorch's default then).
static INTRA_OP_THREADS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The count this thread's OpenMP and MKL settings hold, as far as
    /// [`adopt_intra_op_threads`] knows; 0 for libtorch's default.
    static ADOPTED: Cell<usize> = const { Cell::new(0) };
}

/// Makes the calling thread's ops use the count [`set_intra_op_threads`]
/// set, as the thread that set it does (see the module docs for why
/// libtorch does not). Every thread the host runs ops or backward passes
/// on calls it first; a thread that already holds the count pays one
/// thread-local read.
pub fn adopt_intra_op_threads() {
    let wanted = INTRA_OP_THREADS.load(Ordering::Relaxed);
    if wanted != 0 && ADOPTED.get() != wanted {
        tch::set_num_threads(i32::try_from(wanted).unwrap_or(i32::MAX));
        ADOPTED.set(wanted);
    }
}

/// How many threads each builtin op may use in this process now.
pub fn intra_op_threads() -> usize {
    usize::try_from(tch::get_num_threads()).unwrap_or(1).max(1)
}

/// The share of this host's cores of each of `workers` workers running on
/// it: the cores divided among them, at least 1. Both a worker's op
/// threads and its runtime's threads are sized to it where the workers of
/// a host are started together (`wasmrpc launch`, the bench): more
/// threads than cores only make the runtime wake threads that find
/// nothing to do, and each wake-up costs as much as a small call's work
/// (`wasmrpc-bench anatomy` shows it).
pub fn cores_per_worker(workers: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cores / workers.max(1)).max(1)
}

/// torchrun's count of the workers it started on this host.
const LOCAL_WORLD_SIZE_ENV: &str = "LOCAL_WORLD_SIZE";

/// [`cores_per_worker`] for a process started by torchrun (or anything
/// that sets `LOCAL_WORLD_SIZE`): the share of the cores of each of
/// the host's workers. Without the variable (or with one that is not a
/// count) the process counts as the host's only worker. A Python program
/// sizes its runtime to it (`host/python`).
pub fn cores_per_local_worker() -> usize {
    cores_per_worker(local_workers(
        std::env::var(LOCAL_WORLD_SIZE_ENV).ok().as_deref(),
    ))
}

/// The workers on this host as `LOCAL_WORLD_SIZE` says; 1 when unset or
/// not a count.
fn local_workers(var: Option<&str>) -> usize {
    var.and_then(|n| n.trim().parse::<usize>().ok())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_worker_gets_its_share_of_the_cores_and_never_none() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        assert_eq!(cores_per_worker(1), cores);
        assert_eq!(cores_per_worker(0), cores);
        assert_eq!(cores_per_worker(cores * 4), 1);
        if cores >= 2 {
            assert_eq!(cores_per_worker(2), cores / 2);
        }
    }

    #[test]
    fn local_world_size_counts_the_hosts_workers_and_anything_else_counts_as_one() {
        assert_eq!(local_workers(Some("4")), 4);
        assert_eq!(local_workers(Some(" 2\n")), 2);
        for unreadable in [None, Some(""), Some("two"), Some("-3"), Some("1.5")] {
            assert_eq!(local_workers(unreadable), 1, "{unreadable:?}");
        }
        // Zero workers is not a host's share: `cores_per_worker` counts it
        // as one.
        assert_eq!(
            cores_per_worker(local_workers(Some("0"))),
            cores_per_worker(1)
        );
    }

    /// Threads of this process now.
    fn threads_of_this_process() -> usize {
        std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
    }

    /// The threads a 512x512 matmul run on a new thread leaves beside it
    /// (OpenMP helpers outlive the op while their thread lives), the
    /// thread adopting the process's count first or not.
    fn helpers_of_a_matmul_on_a_new_thread(adopt: bool) -> usize {
        let before = threads_of_this_process();
        let during = std::thread::spawn(move || {
            if adopt {
                adopt_intra_op_threads();
            }
            let a = tch::Tensor::rand([512, 512], (tch::Kind::Float, tch::Device::Cpu));
            let _ = a.matmul(&a);
            threads_of_this_process()
        })
        .join()
        .expect("the matmul thread");
        during.saturating_sub(before + 1)
    }

    /// OPS-1 runs a 256x256 matmul in place, on whatever thread received
    /// the call: that thread adopts the count too.
    #[test]
    fn an_op_run_in_place_on_a_new_thread_starts_no_helper_threads() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if cores < 2 {
            eprintln!("skipped: one core, where MKL never splits an op");
            return;
        }
        set_intra_op_threads(1);
        let before = threads_of_this_process();
        let during = std::thread::spawn(|| {
            let a = tch::Tensor::rand([256, 256], (tch::Kind::Float, tch::Device::Cpu));
            let policy = crate::ops::OpPolicy::shared_default();
            let call =
                crate::ops::call_builtin(&policy, "worker0", "aten::matmul", crate::args![&a, &a]);
            tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a runtime")
                .block_on(call)
                .expect("the matmul");
            threads_of_this_process()
        })
        .join()
        .expect("the calling thread");
        assert_eq!(
            during.saturating_sub(before + 1),
            0,
            "an op run in place started helper threads"
        );
    }

    #[test]
    fn a_thread_that_adopts_one_op_thread_runs_a_matmul_on_itself_alone() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if cores < 2 {
            eprintln!("skipped: one core, where MKL never splits an op");
            return;
        }
        set_intra_op_threads(1);
        assert_eq!(
            helpers_of_a_matmul_on_a_new_thread(true),
            0,
            "an adopting thread's matmul started helper threads"
        );
        // The same on a thread that does not adopt the count: MKL splits
        // it over the cores, so the check above can fail. (Unless the
        // environment already caps OpenMP or MKL for every thread.)
        if std::env::var_os("OMP_NUM_THREADS").is_none()
            && std::env::var_os("MKL_NUM_THREADS").is_none()
        {
            assert!(
                helpers_of_a_matmul_on_a_new_thread(false) > 0,
                "libtorch applied the count to a new thread by itself: adopt_intra_op_threads \
                 may no longer be needed"
            );
        }
    }

    #[test]
    fn the_pool_size_set_is_the_one_libtorch_uses() {
        let before = intra_op_threads();
        set_intra_op_threads(1);
        assert_eq!(intra_op_threads(), 1);
        set_intra_op_threads(0);
        assert_eq!(intra_op_threads(), 1, "0 counts as 1");
        set_intra_op_threads(before);
    }
}
