//! libtorch's own c10d engines behind [`CollectiveBackend`]: `gloo` is
//! `c10d::ProcessGroupGloo` and `nccl` is `c10d::ProcessGroupNCCL` (in a
//! CUDA build), both compiled into the libtorch this crate links and reached
//! through the C++ shim (`shim/c10d_shim.cpp`).
//!
//! This module owns the FFI to the shim, the bridge that serves the engine's
//! rendezvous from the group's Rust [`Store`] (any store: file, hash, TCP,
//! prefixed; the engine calls back into Rust for every store operation), and
//! the mapping of each collective onto the engine's `c10d::Backend` virtual
//! call and `Work::wait`. Tensors cross as the `at::Tensor*` tch holds, so
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
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tch::Tensor;
use wasmrpc_store::Store;

use crate::backend::{BackendArgs, CollectiveBackend, OpContext};
use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;

/// The environment variable naming the address Gloo binds to (PyTorch's
/// `GLOO_SOCKET_IFNAME`, interface names, takes precedence; with neither
/// set, Gloo resolves this machine's hostname, as PyTorch does).
pub const GLOO_HOST_ENV: &str = "WASMRPC_GLOO_HOST";

#[allow(non_camel_case_types, reason = "the shim's C type names")]
mod ffi {
    use std::ffi::{c_char, c_void};

    #[repr(C)]
    pub(super) struct wrc_out {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub(super) struct wrc_backend {
        _private: [u8; 0],
    }
    #[repr(C)]
    pub(super) struct wrc_work {
        _private: [u8; 0],
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub(super) struct wrc_bytes {
        pub(super) ptr: *const u8,
        pub(super) len: usize,
    }

    pub(super) const OK: i32 = 0;
    pub(super) const ERROR: i32 = 1;
    pub(super) const TIMEOUT: i32 = 2;

    pub(super) const STORE_SET: i32 = 0;
    pub(super) const STORE_GET: i32 = 1;
    pub(super) const STORE_ADD: i32 = 2;
    pub(super) const STORE_COMPARE_SET: i32 = 3;
    pub(super) const STORE_DELETE: i32 = 4;
    pub(super) const STORE_CHECK: i32 = 5;
    pub(super) const STORE_NUM_KEYS: i32 = 6;
    pub(super) const STORE_WAIT: i32 = 7;
    pub(super) const STORE_APPEND: i32 = 8;
    pub(super) const STORE_MULTI_GET: i32 = 9;
    pub(super) const STORE_MULTI_SET: i32 = 10;

    pub(super) type StoreCall = unsafe extern "C" fn(
        ctx: *mut c_void,
        op: i32,
        args: *const wrc_bytes,
        nargs: usize,
        num: i64,
        out: *mut wrc_out,
    ) -> i32;
    pub(super) type StoreDrop = unsafe extern "C" fn(ctx: *mut c_void);
    pub(super) type Done =
        unsafe extern "C" fn(ctx: *mut c_void, status: i32, msg: *const c_char, len: usize);

    /// A borrowed `at::Tensor*`. Send and Sync so that a collective's
    /// future, which holds the pointers while it issues, stays Send.
    #[repr(transparent)]
    #[derive(Clone, Copy)]
    pub(super) struct T(pub *const c_void);
    // SAFETY: only dereferenced by the shim during a call, while the tensor
    // it points at is alive.
    unsafe impl Send for T {}
    // SAFETY: as above.
    unsafe impl Sync for T {}

    unsafe extern "C" {
        pub(super) fn wrc_out_new() -> *mut wrc_out;
        pub(super) fn wrc_out_free(out: *mut wrc_out);
        pub(super) fn wrc_out_push(out: *mut wrc_out, ptr: *const u8, len: usize);
        pub(super) fn wrc_out_set_num(out: *mut wrc_out, num: i64);
        pub(super) fn wrc_out_len(out: *const wrc_out) -> usize;
        pub(super) fn wrc_out_get(out: *const wrc_out, i: usize) -> wrc_bytes;

        pub(super) fn wrc_gloo_header_version() -> i32;
        pub(super) fn wrc_gloo_sizeof_process_group() -> usize;
        pub(super) fn wrc_gloo_new(
            ctx: *mut c_void,
            call: StoreCall,
            drop: StoreDrop,
            rank: i32,
            size: i32,
            timeout_ms: i64,
            hostname: *const c_char,
            err: *mut wrc_out,
        ) -> *mut wrc_backend;
        pub(super) fn wrc_nccl_compiled() -> i32;
        pub(super) fn wrc_nccl_new(
            ctx: *mut c_void,
            call: StoreCall,
            drop: StoreDrop,
            rank: i32,
            size: i32,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_backend;
        pub(super) fn wrc_backend_name(b: *mut wrc_backend, out: *mut wrc_out);
        pub(super) fn wrc_backend_has_alltoall(b: *mut wrc_backend) -> i32;
        pub(super) fn wrc_backend_shutdown(b: *mut wrc_backend);
        pub(super) fn wrc_backend_free(b: *mut wrc_backend);

        pub(super) fn wrc_broadcast(
            b: *mut wrc_backend,
            ts: *const T,
            n: usize,
            root: i64,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_allreduce(
            b: *mut wrc_backend,
            ts: *const T,
            n: usize,
            op: i32,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_allreduce_coalesced(
            b: *mut wrc_backend,
            ts: *const T,
            n: usize,
            op: i32,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_reduce(
            b: *mut wrc_backend,
            ts: *const T,
            n: usize,
            root: i64,
            op: i32,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_allgather(
            b: *mut wrc_backend,
            outputs: *const T,
            outer: usize,
            inner: usize,
            inputs: *const T,
            n: usize,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_gather(
            b: *mut wrc_backend,
            outputs: *const T,
            outer: usize,
            inner: usize,
            inputs: *const T,
            n: usize,
            root: i64,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_scatter(
            b: *mut wrc_backend,
            outputs: *const T,
            n: usize,
            inputs: *const T,
            outer: usize,
            inner: usize,
            root: i64,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_reduce_scatter(
            b: *mut wrc_backend,
            outputs: *const T,
            n: usize,
            inputs: *const T,
            outer: usize,
            inner: usize,
            op: i32,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_alltoall_base(
            b: *mut wrc_backend,
            output: T,
            input: T,
            output_split: *const i64,
            n_output_split: usize,
            input_split: *const i64,
            n_input_split: usize,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_alltoall(
            b: *mut wrc_backend,
            outputs: *const T,
            n_outputs: usize,
            inputs: *const T,
            n_inputs: usize,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_barrier(
            b: *mut wrc_backend,
            timeout_ms: i64,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_send(
            b: *mut wrc_backend,
            ts: *const T,
            n: usize,
            dst: i32,
            tag: i32,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_recv(
            b: *mut wrc_backend,
            ts: *const T,
            n: usize,
            src: i32,
            tag: i32,
            err: *mut wrc_out,
        ) -> *mut wrc_work;
        pub(super) fn wrc_work_wait(w: *mut wrc_work, timeout_ms: i64, err: *mut wrc_out) -> i32;
        pub(super) fn wrc_work_free(w: *mut wrc_work);
        pub(super) fn wrc_work_on_done(w: *mut wrc_work, done: Done, ctx: *mut c_void) -> i32;
    }
}

/// A `wrc_out` owned by Rust.
struct Out(*mut ffi::wrc_out);

impl Out {
    fn new() -> Out {
        // SAFETY: allocates a fresh collector.
        Out(unsafe { ffi::wrc_out_new() })
    }

    fn items(&self) -> Vec<Vec<u8>> {
        // SAFETY: self.0 is live; each returned slice lives as long as it.
        unsafe {
            (0..ffi::wrc_out_len(self.0))
                .map(|i| {
                    let b = ffi::wrc_out_get(self.0, i);
                    if b.len == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(b.ptr, b.len).to_vec()
                    }
                })
                .collect()
        }
    }

    fn message(&self) -> String {
        self.items()
            .first()
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .unwrap_or_else(|| "unknown error".to_owned())
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        // SAFETY: allocated by wrc_out_new, freed once.
        unsafe { ffi::wrc_out_free(self.0) }
    }
}

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

/// Whether `ProcessGroupNCCL` is compiled into this build.
pub fn nccl_compiled() -> bool {
    // SAFETY: no arguments.
    unsafe { ffi::wrc_nccl_compiled() != 0 }
}

/// What the store callback needs: the group's store and the runtime its
/// futures run on.
struct StoreBridge {
    store: Arc<dyn Store>,
    runtime: tokio::runtime::Handle,
}

fn bytes_of(args: &[ffi::wrc_bytes], i: usize) -> &[u8] {
    match args.get(i) {
        // SAFETY: the shim passes byte strings that outlive the call.
        Some(b) if b.len > 0 => unsafe { std::slice::from_raw_parts(b.ptr, b.len) },
        _ => &[],
    }
}

fn key_of(args: &[ffi::wrc_bytes], i: usize) -> String {
    String::from_utf8_lossy(bytes_of(args, i)).into_owned()
}

fn push(out: *mut ffi::wrc_out, bytes: &[u8]) {
    // SAFETY: `out` is the shim's live collector.
    unsafe { ffi::wrc_out_push(out, bytes.as_ptr(), bytes.len()) }
}

fn set_num(out: *mut ffi::wrc_out, num: i64) {
    // SAFETY: `out` is the shim's live collector.
    unsafe { ffi::wrc_out_set_num(out, num) }
}

impl StoreBridge {
    /// Serves one store operation for the engine (on one of its threads, or
    /// the blocking-pool thread that constructs it).
    fn call(&self, op: i32, args: &[ffi::wrc_bytes], num: i64, out: *mut ffi::wrc_out) -> i32 {
        let store = &self.store;
        let keys: Vec<String> = (0..args.len()).map(|i| key_of(args, i)).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let served = async {
            match op {
                ffi::STORE_SET => store.set(&keys[0], bytes_of(args, 1)).await,
                ffi::STORE_GET => {
                    let v = store.get(&keys[0]).await?;
                    push(out, &v);
                    Ok(())
                }
                ffi::STORE_ADD => {
                    set_num(out, store.add(&keys[0], num).await?);
                    Ok(())
                }
                ffi::STORE_COMPARE_SET => {
                    let v = store
                        .compare_set(&keys[0], bytes_of(args, 1), bytes_of(args, 2))
                        .await?;
                    push(out, &v);
                    Ok(())
                }
                ffi::STORE_DELETE => {
                    set_num(out, i64::from(store.delete_key(&keys[0]).await?));
                    Ok(())
                }
                ffi::STORE_CHECK => {
                    set_num(out, i64::from(store.check(&key_refs).await?));
                    Ok(())
                }
                ffi::STORE_NUM_KEYS => {
                    set_num(out, store.num_keys().await?);
                    Ok(())
                }
                ffi::STORE_WAIT => {
                    let timeout = Duration::from_millis(u64::try_from(num).unwrap_or(0));
                    store.wait(&key_refs, timeout).await
                }
                ffi::STORE_APPEND => store.append(&keys[0], bytes_of(args, 1)).await,
                ffi::STORE_MULTI_GET => {
                    for v in store.multi_get(&key_refs).await? {
                        push(out, &v);
                    }
                    Ok(())
                }
                ffi::STORE_MULTI_SET => {
                    let ks: Vec<&str> = key_refs.iter().step_by(2).copied().collect();
                    let vs: Vec<&[u8]> = (1..args.len())
                        .step_by(2)
                        .map(|i| bytes_of(args, i))
                        .collect();
                    store.multi_set(&ks, &vs).await
                }
                _ => Ok(()),
            }
        };
        // On a thread outside the runtime (the engine's own threads, the
        // blocking pool) block_on is enough. On a worker thread of a
        // multi-thread runtime (NCCL creates its communicator at the first
        // collective, which is issued on the caller's task) the worker first
        // hands its other tasks away. A current-thread runtime's own thread
        // cannot wait for itself: that panics, and the panic becomes an
        // error below.
        let on_worker = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let result: std::result::Result<(), wasmrpc_store::Error> = if on_worker {
            tokio::task::block_in_place(|| self.runtime.block_on(served))
        } else {
            self.runtime.block_on(served)
        };
        match result {
            Ok(()) => ffi::OK,
            Err(e) => {
                let text = e.to_string();
                push(out, text.as_bytes());
                if e.python_kind() == "DistStoreError" && text.contains("imeout") {
                    ffi::TIMEOUT
                } else {
                    ffi::ERROR
                }
            }
        }
    }
}

unsafe extern "C" fn store_call(
    ctx: *mut c_void,
    op: i32,
    args: *const ffi::wrc_bytes,
    nargs: usize,
    num: i64,
    out: *mut ffi::wrc_out,
) -> i32 {
    // SAFETY: ctx is the Box<StoreBridge> given to the shim, alive until
    // store_drop; args points at nargs byte strings.
    let bridge = unsafe { &*(ctx as *const StoreBridge) };
    let args = if nargs == 0 {
        &[][..]
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(args, nargs) }
    };
    match std::panic::catch_unwind(AssertUnwindSafe(|| bridge.call(op, args, num, out))) {
        Ok(status) => status,
        Err(_) => {
            push(
                out,
                b"the store bridge panicked (is the tokio runtime that created the group gone?)",
            );
            ffi::ERROR
        }
    }
}

unsafe extern "C" fn store_drop(ctx: *mut c_void) {
    // SAFETY: ctx came from Box::into_raw in `bridge`, dropped once.
    drop(unsafe { Box::from_raw(ctx as *mut StoreBridge) });
}

fn bridge(store: Arc<dyn Store>) -> *mut c_void {
    Box::into_raw(Box::new(StoreBridge {
        store,
        runtime: tokio::runtime::Handle::current(),
    })) as *mut c_void
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
/// [`Error::Backend`] when NCCL is not compiled in or construction fails.
pub async fn create_nccl(args: BackendArgs) -> Result<Arc<dyn CollectiveBackend>> {
    create(args, "nccl", |ctx, rank, size, ms, err| {
        // SAFETY: ctx is a fresh bridge the shim takes over.
        unsafe { ffi::wrc_nccl_new(ctx, store_call, store_drop, rank, size, ms, err) }
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

#[async_trait::async_trait]
impl CollectiveBackend for Engine {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    async fn broadcast(&self, ctx: &OpContext, tensors: Vec<Tensor>, root: usize) -> Result<()> {
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: b is live; ts are live tensors for the call.
            ffi::wrc_broadcast(b, ts.as_ptr(), ts.len(), root as i64, ms, err)
        })
        .await
    }

    async fn allreduce(&self, ctx: &OpContext, tensors: Vec<Tensor>, op: ReduceOp) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_allreduce(b, ts.as_ptr(), ts.len(), op, ms, err)
        })
        .await
    }

    async fn allreduce_coalesced(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_allreduce_coalesced(b, ts.as_ptr(), ts.len(), op, ms, err)
        })
        .await
    }

    async fn reduce(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_reduce(b, ts.as_ptr(), ts.len(), root as i64, op, ms, err)
        })
        .await
    }

    async fn allgather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        let (outs, outer, inner) = self.nested(ctx, &outputs)?;
        let ins = ptrs(&inputs);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_allgather(
                b,
                outs.as_ptr(),
                outer,
                inner,
                ins.as_ptr(),
                ins.len(),
                ms,
                err,
            )
        })
        .await
    }

    async fn gather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
        root: usize,
    ) -> Result<()> {
        let (outs, outer, inner) = self.nested(ctx, &outputs)?;
        let ins = ptrs(&inputs);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_gather(
                b,
                outs.as_ptr(),
                outer,
                inner,
                ins.as_ptr(),
                ins.len(),
                root as i64,
                ms,
                err,
            )
        })
        .await
    }

    async fn scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        root: usize,
    ) -> Result<()> {
        let outs = ptrs(&outputs);
        let (ins, outer, inner) = self.nested(ctx, &inputs)?;
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_scatter(
                b,
                outs.as_ptr(),
                outs.len(),
                ins.as_ptr(),
                outer,
                inner,
                root as i64,
                ms,
                err,
            )
        })
        .await
    }

    async fn reduce_scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let outs = ptrs(&outputs);
        let (ins, outer, inner) = self.nested(ctx, &inputs)?;
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_reduce_scatter(
                b,
                outs.as_ptr(),
                outs.len(),
                ins.as_ptr(),
                outer,
                inner,
                op,
                ms,
                err,
            )
        })
        .await
    }

    async fn alltoall_base(
        &self,
        ctx: &OpContext,
        output: Tensor,
        input: Tensor,
        output_split: Vec<i64>,
        input_split: Vec<i64>,
    ) -> Result<()> {
        let o = ffi::T(output.as_ptr() as *const c_void);
        let i = ffi::T(input.as_ptr() as *const c_void);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast; the split vectors outlive the call.
            ffi::wrc_alltoall_base(
                b,
                o,
                i,
                output_split.as_ptr(),
                output_split.len(),
                input_split.as_ptr(),
                input_split.len(),
                ms,
                err,
            )
        })
        .await
    }

    async fn alltoall(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        if !self.has_alltoall {
            return self.alltoall_through_base(ctx, outputs, inputs).await;
        }
        let (outs, ins) = (ptrs(&outputs), ptrs(&inputs));
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_alltoall(
                b,
                outs.as_ptr(),
                outs.len(),
                ins.as_ptr(),
                ins.len(),
                ms,
                err,
            )
        })
        .await
    }

    async fn barrier(&self, ctx: &OpContext) -> Result<()> {
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: b is live.
            ffi::wrc_barrier(b, ms, err)
        })
        .await
    }

    async fn send(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        dst: usize,
        tag: u64,
    ) -> Result<()> {
        let ts = ptrs(&tensors);
        let tag = self.tag(ctx, tag)?;
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_send(b, ts.as_ptr(), ts.len(), dst as i32, tag, err)
        })
        .await
    }

    async fn recv(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        src: usize,
        tag: u64,
    ) -> Result<()> {
        let ts = ptrs(&tensors);
        let tag = self.tag(ctx, tag)?;
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_recv(b, ts.as_ptr(), ts.len(), src as i32, tag, err)
        })
        .await
    }

    fn completes_without_polling(&self) -> bool {
        // Issued at the first poll; then a completion callback (gloo) or a
        // blocking-pool wait (nccl) finishes the future without polling.
        true
    }

    /// Drops this side's reference (see the module docs: no abort).
    fn shutdown(&self) {
        let raw = self.raw.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(raw) = raw {
            // SAFETY: raw is live; shutdown fails pending operations.
            unsafe { ffi::wrc_backend_shutdown(raw.0) }
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
mod tests {
    use super::*;

    /// Serves one store call through the FFI entry point, as the shim does.
    fn call(ctx: *mut c_void, op: i32, args: &[&[u8]], num: i64) -> (i32, Vec<Vec<u8>>) {
        let bytes: Vec<ffi::wrc_bytes> = args
            .iter()
            .map(|a| ffi::wrc_bytes {
                ptr: a.as_ptr(),
                len: a.len(),
            })
            .collect();
        let out = Out::new();
        // SAFETY: ctx is a live bridge; bytes outlive the call.
        let status = unsafe { store_call(ctx, op, bytes.as_ptr(), bytes.len(), num, out.0) };
        (status, out.items())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_bridge_serves_calls_from_a_runtime_worker() {
        let ctx = bridge(Arc::new(wasmrpc_store::HashStore::new())) as usize;
        // On a worker thread, as NCCL's lazy communicator set-up would call.
        let on_worker = tokio::spawn(async move {
            let ctx = ctx as *mut c_void;
            assert_eq!(call(ctx, ffi::STORE_SET, &[b"k", b"v"], 0).0, ffi::OK);
            let (status, got) = call(ctx, ffi::STORE_GET, &[b"k"], 0);
            assert_eq!((status, got), (ffi::OK, vec![b"v".to_vec()]));
            let (status, _) = call(ctx, ffi::STORE_ADD, &[b"n"], 5);
            assert_eq!(status, ffi::OK);
        });
        on_worker.await.unwrap();
        // On a thread outside the runtime, as Gloo's threads call.
        std::thread::spawn(move || {
            let ctx = ctx as *mut c_void;
            let (status, got) = call(ctx, ffi::STORE_GET, &[b"k"], 0);
            assert_eq!((status, got), (ffi::OK, vec![b"v".to_vec()]));
            let (status, got) = call(ctx, ffi::STORE_WAIT, &[b"missing"], 50);
            assert_eq!(status, ffi::TIMEOUT, "{got:?}");
        })
        .join()
        .unwrap();
        // SAFETY: created by `bridge` above, dropped once.
        unsafe { store_drop(ctx as *mut c_void) };
    }
}
