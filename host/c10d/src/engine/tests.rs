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
