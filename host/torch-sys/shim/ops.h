// The C ABI between `wasmrpc-torch-sys` (Rust) and its C++ shim over
// libtorch's JIT operator registry.
//
// Values cross the boundary as a pre-order array of `wrs_value` nodes: a list
// or tuple node is followed by its `len` children (each a whole subtree).
// Tensors cross as `at::Tensor*` (the same pointers tch's `C_tensor` wraps):
// inputs are borrowed, outputs are `new at::Tensor(...)` owned by the caller.
//
// No C++ exception crosses this boundary: every entry point catches
// everything and reports it through a status code and a message.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum wrs_tag {
  WRS_NONE = 0,
  WRS_BOOL = 1,    // i: 0 or 1
  WRS_INT = 2,     // i
  WRS_FLOAT = 3,   // f
  WRS_STR = 4,     // p: UTF-8 bytes, len: byte length
  WRS_TENSOR = 5,  // p: at::Tensor*
  WRS_LIST = 6,    // len: number of children
  WRS_TUPLE = 7,   // len: number of children
  WRS_DTYPE = 8,   // i: c10::ScalarType code
  WRS_DEVICE = 9,  // i: c10::DeviceType code, len: device index + 1 (0: none)
};

typedef struct wrs_value {
  uint32_t tag;
  uint32_t len;
  int64_t i;
  double f;
  const void* p;
} wrs_value;

typedef struct wrs_str {
  const char* ptr;
  size_t len;
} wrs_str;

// Status codes of the entry points.
enum wrs_status {
  WRS_OK = 0,
  WRS_ERR_SCHEMA = 1,       // no overload accepts the arguments
  WRS_ERR_OP = 2,           // the op ran and raised
  WRS_ERR_UNKNOWN_OP = 3,   // no operator registered under the name
  WRS_ERR_INTERNAL = 4,     // anything else (unsupported output, bad input)
};

// Python exception class of a WRS_ERR_OP error (from c10's error subclasses).
enum wrs_error_class {
  WRS_CLASS_RUNTIME = 0,
  WRS_CLASS_INDEX = 1,
  WRS_CLASS_VALUE = 2,
  WRS_CLASS_TYPE = 3,
  WRS_CLASS_NOT_IMPLEMENTED = 4,
};

// Results of a call. The nodes and strings they point at live in
// thread-local storage of the shim and stay valid until the next call into
// the shim on the same thread.
typedef struct wrs_out {
  const wrs_value* nodes;
  size_t n_nodes;
  size_t n_outputs;  // top-level values among `nodes`
  const char* err;
  size_t err_len;
  int32_t err_class;
} wrs_out;

// A resolved operator name: its overloads in matching order.
typedef struct wrs_op wrs_op;

// Resolves a qualified name (`aten::add`). On success `*op` owns a handle
// to free with `wrs_op_free`.
int32_t wrs_op_resolve(const char* name, size_t name_len, wrs_op** op,
                       wrs_out* out);
void wrs_op_free(wrs_op* op);
size_t wrs_op_num_overloads(const wrs_op* op);
// The schema text of overload `index`, in thread-local storage (see wrs_out).
int32_t wrs_op_schema(const wrs_op* op, size_t index, wrs_str* schema);

// Every registered operator name (`aten::add`, once however many overloads
// it has), joined with '\n', in thread-local storage (see wrs_out).
int32_t wrs_all_op_names(wrs_str* names);

// Matches the arguments against the overloads, runs the first that accepts
// them, and converts its outputs. `nodes` holds `n_args` positional values
// followed by `n_kwargs` keyword values whose names are `kw_names`.
// `method_varargs` enables Python's `Tensor.view(2, 3)` packing of trailing
// ints into the one `int[]` parameter of a method.
int32_t wrs_op_call(const wrs_op* op, const wrs_value* nodes, size_t n_nodes,
                    size_t n_args, const wrs_str* kw_names, size_t n_kwargs,
                    int32_t method_varargs, wrs_out* out);

// Like wrs_op_call without running anything: the index of the overload the
// call would run, in `*index`.
int32_t wrs_op_match(const wrs_op* op, const wrs_value* nodes, size_t n_nodes,
                     size_t n_args, const wrs_str* kw_names, size_t n_kwargs,
                     int32_t method_varargs, size_t* index, wrs_out* out);

// The name of the autograd node that produced `tensor` (`MulBackward0`).
// Returns 1 and sets `name` (thread-local storage) if it has one, 0 if not,
// and a negative value on error.
int32_t wrs_grad_fn_name(const void* tensor, wrs_str* name);

// An autograd graph node (`torch::autograd::Node`), held by reference.
typedef struct wrs_node wrs_node;

// The node that produced `tensor` (its grad_fn): returns 1 and sets `*node`
// (free it with wrs_node_free) if there is one, 0 if not, negative on error.
int32_t wrs_tensor_grad_fn(const void* tensor, wrs_node** node);
void wrs_node_free(wrs_node* node);
// The node's name (thread-local storage, see wrs_out), e.g. `MulBackward0`.
int32_t wrs_node_name(const wrs_node* node, wrs_str* name);
// An identity for the node: equal for handles to the same node.
uintptr_t wrs_node_id(const wrs_node* node);
size_t wrs_node_num_next(const wrs_node* node);
// Edge `index` of the node: `*next` is null for an edge to nothing (an input
// that needs no gradient), else a handle to free; `*input_nr` is the input of
// that node the edge feeds.
int32_t wrs_node_next(const wrs_node* node, size_t index, wrs_node** next,
                      uint32_t* input_nr);
// For an AccumulateGrad node: returns 1 and its variable as a new
// `at::Tensor*` owned by the caller; 0 for other nodes.
int32_t wrs_node_variable(const wrs_node* node, void** tensor);

// torch::autograd::grad: the gradients of `outputs` (seeded with
// `grad_outputs`, n_outputs of them, or none for implicit ones) with respect
// to `inputs`. `retain_graph`: -1 for the default, else 0/1. On success
// `results[i]` is a new `at::Tensor*` owned by the caller, or null for an
// input the outputs do not depend on (allowed only with `allow_unused`).
// How many `wrs_autograd_grad` calls on this thread ran without libtorch's
// engine (a graph of one node whose edges lead straight to the inputs).
uint64_t wrs_autograd_engine_bypasses(void);
// Allows (nonzero) or forbids (0) that bypass, for the whole process.
void wrs_autograd_set_engine_bypass(int32_t enabled);

int32_t wrs_autograd_grad(const void* const* outputs, size_t n_outputs,
                          const void* const* grad_outputs, size_t n_grad_outputs,
                          const void* const* inputs, size_t n_inputs,
                          int32_t retain_graph, int32_t create_graph,
                          int32_t allow_unused, void** results, wrs_out* out);

// `torch.autograd.backward(roots, retain_graph=...)`: runs the local engine
// from the (scalar) `roots`, accumulating into the leaves' `.grad`.
// `tensor.grad = grad` (null: `tensor.grad = None`), checked as PyTorch's
// Python setter checks it (size, dtype, device).
int32_t wrs_tensor_set_grad(void* tensor, const void* grad, wrs_out* out);

int32_t wrs_autograd_backward(const void* const* roots, size_t n_roots, int32_t retain_graph,
                              wrs_out* out);

// ---- Tensor hooks (`tensor.register_hook(fn)`): a gradient hook that
// calls back into Rust, seen by every backward pass libtorch runs (local
// `backward`, and `grad`, which applies a leaf's hooks before capturing).

// The Rust side of a hook: maps `grad` (an `at::Tensor*` borrowed for the
// call) to a new `at::Tensor*` the shim takes, or returns null and points
// `err` at a message (valid until the next call of the hook on this thread).
typedef void* (*wrs_hook_fn)(void* ctx, const void* grad, const uint8_t** err, size_t* err_len);
// Frees `ctx` once libtorch drops the hook (removed, or its tensor freed).
typedef void (*wrs_hook_drop)(void* ctx);

// Registers the hook on `tensor` (which must require grad); `*index` is
// what wrs_tensor_remove_hook takes. On failure `ctx` is dropped.
int32_t wrs_tensor_register_hook(const void* tensor, wrs_hook_fn hook, void* ctx,
                                 wrs_hook_drop drop, uint32_t* index, wrs_out* out);

// Removes the hook `index` of `tensor`.
int32_t wrs_tensor_remove_hook(const void* tensor, uint32_t index, wrs_out* out);

// ---- Op profiling: the aten ops libtorch runs on this thread, nested ones
// included (RecordFunction, function scope), between wrs_profile_start and
// wrs_profile_stop. Nothing is installed outside such a window.

// What a window records besides names and times (bits of `options`).
// The shapes of each op's inputs (PyTorch's `record_shapes`).
#define WRS_PROFILE_SHAPES 1u
// The CPU memory each op allocated minus what it freed (PyTorch's
// `profile_memory`).
#define WRS_PROFILE_MEMORY 2u

// One op: its name (valid until the next wrs_profile_start on this thread)
// and its start and end in nanoseconds since wrs_profile_start. With
// WRS_PROFILE_SHAPES, its `n_inputs` inputs' shapes: input i has `ranks[i]`
// dimensions (0 for an input that is not a defined tensor), all of them
// one after the other in `dims`; without it, `n_inputs` is 0. With
// WRS_PROFILE_MEMORY, `cpu_memory_bytes` is what the CPU allocator handed
// out minus what it took back while the op ran, its nested ops included;
// without it, 0.
typedef struct wrs_op_event {
  const char* name;
  size_t name_len;
  int64_t start_ns;
  int64_t end_ns;
  const int64_t* ranks;
  const int64_t* dims;
  size_t n_inputs;
  int64_t cpu_memory_bytes;
} wrs_op_event;

// libtorch's CUDA side (cuda.cpp), which src/cuda.rs loads at run time.
// Each writes a NUL-terminated text of at most `cap` bytes into `buf`.
//
// The path of the libtorch_cpu.so this process runs (1), or why it is not
// known (0).
int32_t wrs_libtorch_cpu_path(char* buf, size_t cap);
// 1 if a CUDA hooks implementation is registered (libtorch_cuda.so's static
// initialisers ran), 0 if not. Does not settle libtorch's choice of hooks.
int32_t wrs_cuda_hooks_registered(void);
// 1 if the hooks libtorch uses are CUDA's (`buf`: the CUDA runtime version
// they were built with), 0 if they are the placeholder that says "without
// ATen_cuda library" (`buf`: its message). The first call settles libtorch's
// choice for the life of the process: call it only after loading.
int32_t wrs_cuda_hooks_in_effect(char* buf, size_t cap);

// Starts recording on this thread (clearing what an earlier window kept),
// with the WRS_PROFILE_* bits of `options`. Returns 0, or a negative value
// if a window is already open (-1) or it could not start (-2).
int32_t wrs_profile_start(uint32_t options);
// Stops recording on this thread: `*events` points at the ops in the order
// they started (thread-local storage, valid until the next
// wrs_profile_start); returns how many.
size_t wrs_profile_stop(const wrs_op_event** events);

#ifdef __cplusplus
}
#endif
