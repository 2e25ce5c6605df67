// The C interface between wasmrpc-c10d (Rust) and libtorch's c10d engines
// (`c10d::ProcessGroupGloo`, and `c10d::ProcessGroupNCCL` in a CUDA build,
// constructed by a library of its own: nccl.cpp).
//
// Tensors cross as `at::Tensor*` (the pointers tch's `C_tensor` wraps),
// borrowed for the duration of the call; the engine keeps its own
// references. A store crosses as a context pointer and one callback that
// Rust implements (`wrc_store_call`), so any Rust `Store` (file, hash, TCP,
// prefixed) backs the engine's rendezvous. Every entry point catches every
// exception: failures come back as a status and a message in a `wrc_out`.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// A borrowed byte string.
typedef struct wrc_bytes {
  const uint8_t* ptr;
  size_t len;
} wrc_bytes;

// What a call returns besides its status: byte strings (results, or the
// error message) and a number. Owned by C++; Rust fills it through
// `wrc_out_push` / `wrc_out_set_num` and reads it through the getters.
typedef struct wrc_out wrc_out;

wrc_out* wrc_out_new(void);
void wrc_out_free(wrc_out* out);
void wrc_out_push(wrc_out* out, const uint8_t* ptr, size_t len);
void wrc_out_set_num(wrc_out* out, int64_t num);
size_t wrc_out_len(const wrc_out* out);
wrc_bytes wrc_out_get(const wrc_out* out, size_t i);
int64_t wrc_out_num(const wrc_out* out);

// Store operations a `wrc_store_call` serves. Arguments are byte strings;
// `num` is the delta (ADD) or the timeout in milliseconds (WAIT).
enum {
  WRC_STORE_SET = 0,         // args: key, value
  WRC_STORE_GET = 1,         // args: key; out: value
  WRC_STORE_ADD = 2,         // args: key; num: delta; out num: new value
  WRC_STORE_COMPARE_SET = 3, // args: key, expected, desired; out: value
  WRC_STORE_DELETE = 4,      // args: key; out num: 1 if deleted
  WRC_STORE_CHECK = 5,       // args: keys; out num: 1 if all exist
  WRC_STORE_NUM_KEYS = 6,    // out num: count
  WRC_STORE_WAIT = 7,        // args: keys; num: timeout ms
  WRC_STORE_APPEND = 8,      // args: key, value
  WRC_STORE_MULTI_GET = 9,   // args: keys; out: values
  WRC_STORE_MULTI_SET = 10,  // args: key0, value0, key1, value1, ...
};

// Statuses of a store call and of the entry points below.
enum {
  WRC_OK = 0,
  WRC_ERROR = 1,    // out[0]: the message
  WRC_TIMEOUT = 2,  // out[0]: the message
};

// Serves one store operation; must not unwind.
typedef int32_t (*wrc_store_call)(
    void* ctx, int32_t op, const wrc_bytes* args, size_t nargs, int64_t num,
    wrc_out* out);
// Releases `ctx` once no engine holds the store any more.
typedef void (*wrc_store_drop)(void* ctx);

// An engine (`c10::intrusive_ptr<c10d::Backend>`) and an issued operation
// (`c10::intrusive_ptr<c10d::Work>`).
typedef struct wrc_backend wrc_backend;
typedef struct wrc_work wrc_work;

// The Gloo version of the headers the shim was compiled with
// (`GLOO_VERSION`: major * 10000 + minor * 100 + patch).
int32_t wrc_gloo_header_version(void);
// `sizeof(c10d::ProcessGroupGloo)` as the shim's headers declare it.
size_t wrc_gloo_sizeof_process_group(void);

// Constructs `c10d::ProcessGroupGloo(store, rank, size, options)` with the
// devices PyTorch's Python binding picks: one per interface in
// `GLOO_SOCKET_IFNAME` (comma separated) if set, else `hostname` if not
// null, else `createDefaultDevice()`. Connects to every peer before it
// returns (or times out after `timeout_ms`). On failure returns null and
// the message in `err[0]`; `drop(ctx)` has then been called.
wrc_backend* wrc_gloo_new(
    void* ctx, wrc_store_call call, wrc_store_drop drop, int32_t rank,
    int32_t size, int64_t timeout_ms, const char* hostname, wrc_out* err);

// `wrc_nccl_construct` of libwasmrpc_c10d_nccl.so (nccl.cpp): constructs
// `c10d::ProcessGroupNCCL(*store, rank, size, options)` into `*backend`
// (`store` points at a `c10::intrusive_ptr<c10d::Store>`, `backend` at a
// `c10::intrusive_ptr<c10d::Backend>`); 1, or 0 with a NUL-terminated
// message of at most `cap` bytes in `err`.
typedef int32_t (*wrc_nccl_factory)(
    const void* store, int32_t rank, int32_t size, int64_t timeout_ms,
    void* backend, char* err, size_t cap);
int32_t wrc_nccl_construct(
    const void* store, int32_t rank, int32_t size, int64_t timeout_ms,
    void* backend, char* err, size_t cap);

// Constructs `c10d::ProcessGroupNCCL` on a Rust store through `factory`
// (`wrc_nccl_construct`, which the caller found in the NCCL library); null
// and `err[0]` when construction fails.
wrc_backend* wrc_nccl_new(
    void* ctx, wrc_store_call call, wrc_store_drop drop, int32_t rank,
    int32_t size, int64_t timeout_ms, wrc_nccl_factory factory, wrc_out* err);

// The engine's `getBackendName()` into `out[0]`.
void wrc_backend_name(wrc_backend* b, wrc_out* out);
/* 1 if the engine implements the list form of all-to-all (`alltoall`),
 * 0 if only `alltoall_base` (libtorch 2.11's Gloo). */
int32_t wrc_backend_has_alltoall(wrc_backend* b);
// `shutdown()`: pending and later operations fail.
void wrc_backend_shutdown(wrc_backend* b);
void wrc_backend_free(wrc_backend* b);

// Reduce operations as PyTorch numbers them (`c10d::ReduceOp::RedOpType`).
// Collectives: each returns the issued work, or null and `err[0]`.
// Nested tensor lists are rectangular: `outer` lists of `inner` tensors,
// row by row.
wrc_work* wrc_broadcast(
    wrc_backend* b, const void* const* tensors, size_t n, int64_t root,
    int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_allreduce(
    wrc_backend* b, const void* const* tensors, size_t n, int32_t op,
    int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_allreduce_coalesced(
    wrc_backend* b, const void* const* tensors, size_t n, int32_t op,
    int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_reduce(
    wrc_backend* b, const void* const* tensors, size_t n, int64_t root,
    int32_t op, int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_allgather(
    wrc_backend* b, const void* const* outputs, size_t outer, size_t inner,
    const void* const* inputs, size_t n, int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_gather(
    wrc_backend* b, const void* const* outputs, size_t outer, size_t inner,
    const void* const* inputs, size_t n, int64_t root, int64_t timeout_ms,
    wrc_out* err);
wrc_work* wrc_scatter(
    wrc_backend* b, const void* const* outputs, size_t n,
    const void* const* inputs, size_t outer, size_t inner, int64_t root,
    int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_reduce_scatter(
    wrc_backend* b, const void* const* outputs, size_t n,
    const void* const* inputs, size_t outer, size_t inner, int32_t op,
    int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_alltoall_base(
    wrc_backend* b, const void* output, const void* input,
    const int64_t* output_split, size_t n_output_split,
    const int64_t* input_split, size_t n_input_split, int64_t timeout_ms,
    wrc_out* err);
wrc_work* wrc_alltoall(
    wrc_backend* b, const void* const* outputs, size_t n_outputs,
    const void* const* inputs, size_t n_inputs, int64_t timeout_ms,
    wrc_out* err);
wrc_work* wrc_barrier(wrc_backend* b, int64_t timeout_ms, wrc_out* err);
wrc_work* wrc_send(
    wrc_backend* b, const void* const* tensors, size_t n, int32_t dst,
    int32_t tag, wrc_out* err);
wrc_work* wrc_recv(
    wrc_backend* b, const void* const* tensors, size_t n, int32_t src,
    int32_t tag, wrc_out* err);

// `work->wait(timeout)` (0: no bound of its own, kNoTimeout): WRC_OK, or a
// status and `err[0]`. Blocks.
int32_t wrc_work_wait(wrc_work* w, int64_t timeout_ms, wrc_out* err);
void wrc_work_free(wrc_work* w);

// Called once when an operation completes: `status` WRC_OK, or WRC_ERROR /
// WRC_TIMEOUT with the message in `msg[0..len]` (valid during the call).
// Runs on the engine's thread (or the caller's, if already complete); must
// not unwind.
typedef void (*wrc_done)(void* ctx, int32_t status, const char* msg, size_t len);

// Calls `done(ctx, ...)` when `w` completes, through the work's future
// (`Work::getFuture()`), so no thread has to block in `wait`. Returns 1 if
// the callback was registered (it will be called exactly once), 0 if the
// work has no future (then `done` is never called: use `wrc_work_wait`).
int32_t wrc_work_on_done(wrc_work* w, wrc_done done, void* ctx);

#ifdef __cplusplus
}
#endif
