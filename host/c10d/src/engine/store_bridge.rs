//! The bridge that serves the engine's rendezvous from the group's Rust
//! [`Store`]: the shim calls back into Rust for every store operation.

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use wasmrpc_store::Store;

use super::ffi;

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

pub(super) unsafe extern "C" fn store_call(
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

pub(super) unsafe extern "C" fn store_drop(ctx: *mut c_void) {
    // SAFETY: ctx came from Box::into_raw in `bridge`, dropped once.
    drop(unsafe { Box::from_raw(ctx as *mut StoreBridge) });
}

pub(super) fn bridge(store: Arc<dyn Store>) -> *mut c_void {
    Box::into_raw(Box::new(StoreBridge {
        store,
        runtime: tokio::runtime::Handle::current(),
    })) as *mut c_void
}
