//! The C++ shim's interface (`shim/c10d_shim.h`): its types and functions,
//! and [`Out`], the shim's output collector as Rust owns it.
#![allow(non_camel_case_types, reason = "the shim's C type names")]

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
    pub(super) fn wrc_nccl_new(
        ctx: *mut c_void,
        call: StoreCall,
        drop: StoreDrop,
        rank: i32,
        size: i32,
        timeout_ms: i64,
        factory: super::nccl::Factory,
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

/// A `wrc_out` owned by Rust.
pub(super) struct Out(pub(super) *mut wrc_out);

impl Out {
    pub(super) fn new() -> Out {
        // SAFETY: allocates a fresh collector.
        Out(unsafe { wrc_out_new() })
    }

    pub(super) fn items(&self) -> Vec<Vec<u8>> {
        // SAFETY: self.0 is live; each returned slice lives as long as it.
        unsafe {
            (0..wrc_out_len(self.0))
                .map(|i| {
                    let b = wrc_out_get(self.0, i);
                    if b.len == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(b.ptr, b.len).to_vec()
                    }
                })
                .collect()
        }
    }

    pub(super) fn message(&self) -> String {
        self.items()
            .first()
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .unwrap_or_else(|| "unknown error".to_owned())
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        // SAFETY: allocated by wrc_out_new, freed once.
        unsafe { wrc_out_free(self.0) }
    }
}
