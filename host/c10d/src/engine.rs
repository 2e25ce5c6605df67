//! libtorch's own c10d engines behind [`CollectiveBackend`]: `gloo` is
//! `c10d::ProcessGroupGloo` and `nccl` is `c10d::ProcessGroupNCCL` (in a
//! CUDA build), both compiled into the libtorch this crate links and reached
//! through the C++ shim (`shim/c10d_shim.cpp`); `ProcessGroupNCCL` is
//! constructed by a library of its own that only an NCCL group loads
//! ([`nccl`]), so a process without one maps no CUDA library.
//!
//! This module owns the FFI to the shim (`ffi`), the bridge that serves the
//! engine's rendezvous from the group's Rust [`Store`](wasmrpc_store::Store)
//! (`store_bridge`; any store: file, hash, TCP, prefixed; the engine calls
//! back into Rust for every store operation), and the mapping of each
//! collective onto the engine's `c10d::Backend` virtual call and
//! `Work::wait` (`collectives`). Tensors cross as the `at::Tensor*` tch holds, so
//! the engine reads and writes the caller's memory directly.
//!
//! Ordering: a c10d engine tags collectives by the order they are issued, so
//! issuing must follow program order on every rank. Each method issues its
//! operation synchronously before its first `.await`, and [`crate::Work`]
//! polls a collective once before handing it to tokio; issuing is
//! additionally serialised by a lock. Waiting: a Gloo work's future calls
//! back into Rust when it completes (no thread blocks); NCCL's `wait`, which
//! also orders the caller's CUDA stream, runs on tokio's blocking pool.
//!
//! Destroying a group drops this side's reference: libtorch's Gloo has no
//! abort, so operations in flight finish or fail at the group's timeout, as
//! in PyTorch, and the engine is freed on a thread of its own.
//!
//! What the engines authenticate: nothing of their own. Rendezvous goes
//! through the group's store (PyTorch's TCPStore protocol when it is a TCP
//! store: unauthenticated); Gloo's pair connections (its `tcp` transport,
//! the only one compiled into libtorch) and NCCL's bootstrap and socket
//! transport carry no authentication or encryption: a process that can
//! reach their ports while a group forms can connect. Run them on a network
//! only the job's ranks can reach.

use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::Tensor;

use crate::backend::{BackendArgs, CollectiveBackend, OpContext};
use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;

/// The environment variable naming the address Gloo binds to (PyTorch's
/// `GLOO_SOCKET_IFNAME`, interface names, takes precedence; with neither
/// set, Gloo resolves this machine's hostname, as PyTorch does).
pub const GLOO_HOST_ENV: &str = "WASMRPC_GLOO_HOST";

mod collectives;
mod ffi;
pub mod nccl;
mod store_bridge;

use ffi::Out;
use store_bridge::{bridge, store_call, store_drop};

/// The Gloo version of the headers the shim was compiled with
/// (`major * 10000 + minor * 100 + patch`).
pub fn gloo_header_version() -> i32 {
    // SAFETY: no arguments.
    unsafe { ffi::wrc_gloo_header_version() }
}

/// `sizeof(c10d::ProcessGroupGloo)` as the shim's headers declare it.
pub fn gloo_sizeof_process_group() -> usize {
    // SAFETY: no arguments.
    unsafe { ffi::wrc_gloo_sizeof_process_group() }
}

/// Whether `ProcessGroupNCCL` is compiled into this build (its library,
/// [`nccl`], was built).
pub fn nccl_compiled() -> bool {
    nccl::compiled()
}

/// What a work's completion callback sends: the status and the message.
type Outcome = (i32, String);

unsafe extern "C" fn work_done(
    ctx: *mut c_void,
    status: i32,
    msg: *const std::ffi::c_char,
    len: usize,
) {
    // SAFETY: ctx is the Box<Sender> `on_done` registered, taken back once.
    let tx = unsafe { Box::from_raw(ctx as *mut tokio::sync::oneshot::Sender<Outcome>) };
    let text = if msg.is_null() || len == 0 {
        String::new()
    } else {
        // SAFETY: the shim passes `len` bytes valid during the call.
        String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(msg as *const u8, len) })
            .into_owned()
    };
    // The receiver may be gone (the caller stopped waiting): nothing to do.
    let _ = tx.send((status, text));
}

/// Registers a completion callback on `work`'s future; `None` if the work
/// has none (then wait with `wrc_work_wait`).
fn on_done(work: &RawWork) -> Option<tokio::sync::oneshot::Receiver<Outcome>> {
    let (tx, rx) = tokio::sync::oneshot::channel::<Outcome>();
    let ctx = Box::into_raw(Box::new(tx)) as *mut c_void;
    // SAFETY: the work is live; when registered, `work_done` takes `ctx`
    // back exactly once.
    if unsafe { ffi::wrc_work_on_done(work.0, work_done, ctx) } != 0 {
        Some(rx)
    } else {
        // SAFETY: not registered: the callback will never run.
        drop(unsafe { Box::from_raw(ctx as *mut tokio::sync::oneshot::Sender<Outcome>) });
        None
    }
}

/// A constructed engine (`c10::intrusive_ptr<c10d::Backend>`).
struct Raw(*mut ffi::wrc_backend);
// SAFETY: c10d backends are called from any thread; issuing is serialised
// by the mutex `Engine::raw` holds it in.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: freed once. ProcessGroupGloo's destructor drains its queue
        // and joins its threads, which may wait for a peer up to the
        // timeout: do it off the async threads.
        let ptr = self.0 as usize;
        std::thread::spawn(move || unsafe { ffi::wrc_backend_free(ptr as *mut ffi::wrc_backend) });
    }
}

/// An issued engine operation (`c10::intrusive_ptr<c10d::Work>`).
struct RawWork(*mut ffi::wrc_work);
// SAFETY: `Work::wait` may be called from any thread.
unsafe impl Send for RawWork {}

impl Drop for RawWork {
    fn drop(&mut self) {
        // SAFETY: freed once.
        unsafe { ffi::wrc_work_free(self.0) }
    }
}

/// One group member's libtorch engine (`gloo` or `nccl`).
#[derive(Debug)]
pub struct Engine {
    name: String,
    /// Whether the engine has the list form of all-to-all; without it
    /// (libtorch 2.11's Gloo) `alltoall` goes through `alltoall_base`.
    has_alltoall: bool,
    rank: usize,
    size: usize,
    group: String,
    raw: Arc<Mutex<Option<Arc<Raw>>>>,
}

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "c10d::Backend@{:p}", self.0)
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The constructor registered under [`crate::Backend::GLOO`]:
/// `c10d::ProcessGroupGloo` on the group's store.
///
/// # Errors
/// [`Error::Backend`] with libtorch's message when the members do not all
/// connect within the group's timeout or a device cannot be created.
pub async fn create_gloo(args: BackendArgs) -> Result<Arc<dyn CollectiveBackend>> {
    let host = std::env::var(GLOO_HOST_ENV).ok();
    create(args, "gloo", move |ctx, rank, size, ms, err| {
        let host = host.and_then(|h| CString::new(h).ok());
        let host_ptr = host.as_ref().map_or(std::ptr::null(), |h| h.as_ptr());
        // SAFETY: ctx is a fresh bridge the shim takes over; host_ptr is
        // null or a live C string.
        unsafe { ffi::wrc_gloo_new(ctx, store_call, store_drop, rank, size, ms, host_ptr, err) }
    })
    .await
}

/// The constructor registered under [`crate::Backend::NCCL`]:
/// `c10d::ProcessGroupNCCL` on the group's store (CUDA tensors).
///
/// # Errors
/// [`Error::Backend`] when NCCL is not compiled in, its library cannot be
/// loaded (no CUDA in this process: no GPU, or `WASMRPC_LOAD_CUDA=0`), or
/// construction fails.
pub async fn create_nccl(args: BackendArgs) -> Result<Arc<dyn CollectiveBackend>> {
    // The library (and CUDA) first, on the blocking pool: loading maps
    // hundreds of MiB.
    let factory = tokio::task::spawn_blocking(nccl::factory)
        .await
        .map_err(|e| Error::Runtime(format!("loading NCCL's library panicked: {e}")))?
        .map_err(|detail| Error::Backend {
            backend: "nccl".to_owned(),
            rank: args.group_rank,
            group: args.group_name.clone(),
            op: "init".to_owned(),
            detail,
        })?;
    create(args, "nccl", move |ctx, rank, size, ms, err| {
        // SAFETY: ctx is a fresh bridge the shim takes over; `factory` is
        // the NCCL library's `wrc_nccl_construct`, kept loaded.
        unsafe { ffi::wrc_nccl_new(ctx, store_call, store_drop, rank, size, ms, factory, err) }
    })
    .await
}

async fn create(
    args: BackendArgs,
    name: &'static str,
    construct: impl FnOnce(*mut c_void, i32, i32, i64, *mut ffi::wrc_out) -> *mut ffi::wrc_backend
    + Send
    + 'static,
) -> Result<Arc<dyn CollectiveBackend>> {
    let (rank, size) = (args.group_rank, args.group_size);
    let group = args.group_name.clone();
    let ms = millis(args.timeout);
    let ctx = bridge(args.store.clone()) as usize;
    // Construction rendezvouses with every peer through the store: it
    // blocks, so it runs on the blocking pool.
    let made = tokio::task::spawn_blocking(move || {
        let err = Out::new();
        let raw = construct(ctx as *mut c_void, rank as i32, size as i32, ms, err.0);
        if raw.is_null() {
            Err(err.message())
        } else {
            Ok(Raw(raw))
        }
    })
    .await
    .map_err(|e| Error::Runtime(format!("constructing {name} panicked: {e}")))?;
    let raw = made.map_err(|detail| Error::Backend {
        backend: name.to_owned(),
        rank,
        group: group.clone(),
        op: "init".to_owned(),
        detail,
    })?;
    // Gloo's full mesh is complete on one rank before it is on its peer: a
    // rank that went on and destroyed its group at once would close a pair
    // its peer is still finishing ("Connection closed by peer" there). So
    // no rank returns before every rank's engine is up.
    let ready = |r: usize| format!("wasmrpc_engine_ready/{r}");
    args.store.set(&ready(rank), b"1").await?;
    let keys: Vec<String> = (0..size).map(ready).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    args.store
        .wait(&keys, args.timeout)
        .await
        .map_err(|e| Error::Backend {
            backend: name.to_owned(),
            rank,
            group: group.clone(),
            op: "init".to_owned(),
            detail: format!(
                "not every rank's engine was up within {:?}: {e}",
                args.timeout
            ),
        })?;
    // The name is the engine's own `getBackendName()`: a virtual call
    // through the vtable the shim's headers declare.
    let out = Out::new();
    // SAFETY: raw is live.
    unsafe { ffi::wrc_backend_name(raw.0, out.0) };
    let engine_name = out.message();
    if engine_name != name {
        return Err(Error::Runtime(format!(
            "rank {rank} of group {group}: libtorch's {name} engine calls itself {engine_name:?}"
        )));
    }
    // SAFETY: raw is live.
    let has_alltoall = unsafe { ffi::wrc_backend_has_alltoall(raw.0) } != 0;
    Ok(Arc::new(Engine {
        name: engine_name,
        has_alltoall,
        rank,
        size,
        group,
        raw: Arc::new(Mutex::new(Some(Arc::new(raw)))),
    }))
}

/// Pointers to tensors, as the shim takes them.
fn ptrs(ts: &[Tensor]) -> Vec<ffi::T> {
    ts.iter()
        .map(|t| ffi::T(t.as_ptr() as *const c_void))
        .collect()
}

/// A rectangular list of lists, row by row: (pointers, outer, inner).
fn nested(ts: &[Vec<Tensor>]) -> Option<(Vec<ffi::T>, usize, usize)> {
    let inner = ts.first().map_or(0, Vec::len);
    if ts.iter().any(|row| row.len() != inner) {
        return None;
    }
    Some((ts.iter().flat_map(|r| ptrs(r)).collect(), ts.len(), inner))
}

impl Engine {
    fn error(&self, ctx: &OpContext, detail: String) -> Error {
        Error::Backend {
            backend: self.name.clone(),
            rank: self.rank,
            group: self.group.clone(),
            op: ctx.op.to_owned(),
            detail,
        }
    }

    /// The engine's number for `op` (`c10d::ReduceOp::RedOpType`).
    fn red_op(&self, ctx: &OpContext, op: ReduceOp) -> Result<i32> {
        Ok(match op {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Band => 5,
            ReduceOp::Bor => 6,
            ReduceOp::Bxor => 7,
            ReduceOp::PremulSum(_) => {
                // PyTorch's text; the scale is not passed to the engine.
                let engine = if self.name == "gloo" { "Gloo" } else { "NCCL" };
                return Err(
                    self.error(ctx, format!("Cannot use ReduceOp.PREMUL_SUM with {engine}"))
                );
            }
        })
    }

    fn nested(&self, ctx: &OpContext, ts: &[Vec<Tensor>]) -> Result<(Vec<ffi::T>, usize, usize)> {
        nested(ts).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {} of group {}: {}: tensor lists of different lengths",
                self.rank, self.group, ctx.op
            ))
        })
    }

    /// Issues an operation now (under the issue lock, so tags follow program
    /// order), then waits for it on the blocking pool.
    async fn run(
        &self,
        ctx: &OpContext,
        issue: impl FnOnce(*mut ffi::wrc_backend, *mut ffi::wrc_out) -> *mut ffi::wrc_work,
    ) -> Result<()> {
        let work = {
            let guard = self.raw.lock().unwrap_or_else(|e| e.into_inner());
            let Some(raw) = guard.as_ref() else {
                return Err(Error::Runtime(format!(
                    "rank {} of group {}: {}: the process group has been destroyed",
                    self.rank, self.group, ctx.op
                )));
            };
            let err = Out::new();
            let work = issue(raw.0, err.0);
            if work.is_null() {
                return Err(self.error(ctx, err.message()));
            }
            (RawWork(work), raw.clone())
        };
        // Gloo completes a work's future on its own thread: a callback on it
        // wakes this task directly, with no thread blocked in `wait` (one
        // thread hop fewer, which matters on a loaded machine). NCCL's
        // `wait` also orders the caller's CUDA stream after the collective,
        // so NCCL waits on the blocking pool.
        if self.name == "gloo"
            && let Some(done) = on_done(&work.0)
        {
            let outcome = done.await;
            drop(work);
            return match outcome {
                Ok((ffi::OK, _)) => Ok(()),
                Ok((_, detail)) => Err(self.error(ctx, detail)),
                Err(_) => Err(self.error(
                    ctx,
                    "the engine dropped the operation without completing it".to_owned(),
                )),
            };
        }
        let waited = tokio::task::spawn_blocking(move || {
            let (work, _engine) = work;
            let err = Out::new();
            // As PyTorch's `work.wait()`: no timeout of its own (kNoTimeout),
            // the engine fails the operation after the group's timeout with
            // its own message; `crate::Work::wait` bounds this wait too.
            // SAFETY: work is live until RawWork drops after this.
            let status = unsafe { ffi::wrc_work_wait(work.0, 0, err.0) };
            (status, err.message())
        })
        .await
        .map_err(|e| Error::Runtime(format!("{} failed: {e}", ctx.op)))?;
        match waited {
            (ffi::OK, _) => Ok(()),
            (_, detail) => Err(self.error(ctx, detail)),
        }
    }
}

impl Engine {
    /// The engine's `int` tag for a point-to-point operation.
    fn tag(&self, ctx: &OpContext, tag: u64) -> Result<i32> {
        i32::try_from(tag).map_err(|_| {
            Error::InvalidArgument(format!(
                "rank {} of group {}: {}: tag {tag} does not fit the engine's int tag",
                self.rank, self.group, ctx.op
            ))
        })
    }
}

#[cfg(test)]
mod tests;
