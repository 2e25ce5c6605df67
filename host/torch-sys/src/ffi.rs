//! The raw C ABI of the shim (`shim/ops.h`), nothing else.
//!
//! Safe wrappers live in [`crate::op`] and [`crate::value`]; this module only
//! declares the layout of the structs and the extern functions.

use std::ffi::c_void;

pub(crate) const TAG_NONE: u32 = 0;
pub(crate) const TAG_BOOL: u32 = 1;
pub(crate) const TAG_INT: u32 = 2;
pub(crate) const TAG_FLOAT: u32 = 3;
pub(crate) const TAG_STR: u32 = 4;
pub(crate) const TAG_TENSOR: u32 = 5;
pub(crate) const TAG_LIST: u32 = 6;
pub(crate) const TAG_TUPLE: u32 = 7;
pub(crate) const TAG_DTYPE: u32 = 8;
pub(crate) const TAG_DEVICE: u32 = 9;

pub(crate) const STATUS_OK: i32 = 0;
pub(crate) const STATUS_SCHEMA: i32 = 1;
pub(crate) const STATUS_OP: i32 = 2;
pub(crate) const STATUS_UNKNOWN_OP: i32 = 3;

pub(crate) const CLASS_INDEX: i32 = 1;
pub(crate) const CLASS_VALUE: i32 = 2;
pub(crate) const CLASS_TYPE: i32 = 3;
pub(crate) const CLASS_NOT_IMPLEMENTED: i32 = 4;

/// One node of a pre-order value tree (`wrs_value`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawValue {
    pub(crate) tag: u32,
    pub(crate) len: u32,
    pub(crate) i: i64,
    pub(crate) f: f64,
    pub(crate) p: *const c_void,
}

impl RawValue {
    pub(crate) const fn new(tag: u32) -> Self {
        Self {
            tag,
            len: 0,
            i: 0,
            f: 0.0,
            p: std::ptr::null(),
        }
    }
}

/// A borrowed UTF-8 string (`wrs_str`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawStr {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

/// Results of a call (`wrs_out`): they point into the shim's thread-local
/// storage and stay valid until the next shim call on the same thread.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RawOut {
    pub(crate) nodes: *const RawValue,
    pub(crate) n_nodes: usize,
    pub(crate) n_outputs: usize,
    pub(crate) err: *const u8,
    pub(crate) err_len: usize,
    pub(crate) err_class: i32,
}

impl RawOut {
    pub(crate) const fn empty() -> Self {
        Self {
            nodes: std::ptr::null(),
            n_nodes: 0,
            n_outputs: 0,
            err: std::ptr::null(),
            err_len: 0,
            err_class: 0,
        }
    }
}

/// An opaque autograd node handle (`wrs_node`).
#[repr(C)]
pub(crate) struct RawNode {
    _private: [u8; 0],
}

/// An opaque resolved operator (`wrs_op`).
#[repr(C)]
pub(crate) struct RawOp {
    _private: [u8; 0],
}

/// One op of a profiling window (`wrs_op_event`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawOpEvent {
    pub(crate) name: *const u8,
    pub(crate) name_len: usize,
    pub(crate) start_ns: i64,
    pub(crate) end_ns: i64,
    pub(crate) ranks: *const i64,
    pub(crate) dims: *const i64,
    pub(crate) n_inputs: usize,
    pub(crate) cpu_memory_bytes: i64,
}

/// `WRS_PROFILE_SHAPES`: a window records its ops' input shapes.
pub(crate) const WRS_PROFILE_SHAPES: u32 = 1;
/// `WRS_PROFILE_MEMORY`: a window records its ops' CPU memory.
pub(crate) const WRS_PROFILE_MEMORY: u32 = 2;

unsafe extern "C" {
    pub(crate) fn wrs_libtorch_cpu_path(buf: *mut std::ffi::c_char, cap: usize) -> i32;
    pub(crate) fn wrs_cuda_hooks_registered() -> i32;
    pub(crate) fn wrs_cuda_hooks_in_effect(buf: *mut std::ffi::c_char, cap: usize) -> i32;
    pub(crate) fn wrs_cuda_stream_get(
        which: i32,
        device: i8,
        id: *mut i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_stream_exchange(
        device: i8,
        id: i64,
        previous: *mut i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_stream_synchronize(
        device: i8,
        id: i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_stream_query(
        device: i8,
        id: i64,
        done: *mut i32,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_event_new(
        timing: i32,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> *mut std::ffi::c_void;
    pub(crate) fn wrs_cuda_event_free(event: *mut std::ffi::c_void);
    pub(crate) fn wrs_cuda_event_record(
        event: *mut std::ffi::c_void,
        device: i8,
        id: i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_event_device(event: *mut std::ffi::c_void) -> i8;
    pub(crate) fn wrs_cuda_event_block(
        event: *mut std::ffi::c_void,
        device: i8,
        id: i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_event_synchronize(
        event: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_event_query(
        event: *mut std::ffi::c_void,
        done: *mut i32,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_event_elapsed_ms(
        start: *mut std::ffi::c_void,
        end: *mut std::ffi::c_void,
        ms: *mut f64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_record_stream(
        tensor: *const std::ffi::c_void,
        device: i8,
        id: i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_cuda_sleep(
        device: i8,
        cycles: i64,
        err: *mut std::ffi::c_char,
        cap: usize,
    ) -> i32;
    pub(crate) fn wrs_profile_start(options: u32) -> i32;
    pub(crate) fn wrs_profile_stop(events: *mut *const RawOpEvent) -> usize;
    pub(crate) fn wrs_op_resolve(
        name: *const u8,
        name_len: usize,
        op: *mut *mut RawOp,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_op_free(op: *mut RawOp);
    pub(crate) fn wrs_all_op_names(names: *mut RawStr) -> i32;
    pub(crate) fn wrs_op_num_overloads(op: *const RawOp) -> usize;
    pub(crate) fn wrs_op_schema(op: *const RawOp, index: usize, schema: *mut RawStr) -> i32;
    pub(crate) fn wrs_op_call(
        op: *const RawOp,
        nodes: *const RawValue,
        n_nodes: usize,
        n_args: usize,
        kw_names: *const RawStr,
        n_kwargs: usize,
        method_varargs: i32,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_op_match(
        op: *const RawOp,
        nodes: *const RawValue,
        n_nodes: usize,
        n_args: usize,
        kw_names: *const RawStr,
        n_kwargs: usize,
        method_varargs: i32,
        index: *mut usize,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_grad_fn_name(tensor: *const c_void, name: *mut RawStr) -> i32;
    pub(crate) fn wrs_tensor_grad_fn(tensor: *const c_void, node: *mut *mut RawNode) -> i32;
    pub(crate) fn wrs_node_free(node: *mut RawNode);
    pub(crate) fn wrs_node_name(node: *const RawNode, name: *mut RawStr) -> i32;
    pub(crate) fn wrs_node_id(node: *const RawNode) -> usize;
    pub(crate) fn wrs_node_num_next(node: *const RawNode) -> usize;
    pub(crate) fn wrs_node_next(
        node: *const RawNode,
        index: usize,
        next: *mut *mut RawNode,
        input_nr: *mut u32,
    ) -> i32;
    pub(crate) fn wrs_node_variable(node: *const RawNode, tensor: *mut *mut c_void) -> i32;
    pub(crate) fn wrs_autograd_engine_bypasses() -> u64;
    pub(crate) fn wrs_autograd_set_engine_bypass(enabled: i32);
    pub(crate) fn wrs_autograd_grad(
        outputs: *const *const c_void,
        n_outputs: usize,
        grad_outputs: *const *const c_void,
        n_grad_outputs: usize,
        inputs: *const *const c_void,
        n_inputs: usize,
        retain_graph: i32,
        create_graph: i32,
        allow_unused: i32,
        results: *mut *mut c_void,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_tensor_set_grad(
        tensor: *mut c_void,
        grad: *const c_void,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_autograd_backward(
        roots: *const *const c_void,
        n_roots: usize,
        retain_graph: i32,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_tensor_register_hook(
        tensor: *const c_void,
        hook: HookFn,
        ctx: *mut c_void,
        drop: HookDrop,
        index: *mut u32,
        out: *mut RawOut,
    ) -> i32;
    pub(crate) fn wrs_tensor_remove_hook(
        tensor: *const c_void,
        index: u32,
        out: *mut RawOut,
    ) -> i32;
}

/// `wrs_hook_fn`: maps a borrowed gradient to a new `at::Tensor*`, or
/// returns null with an error message.
pub(crate) type HookFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    grad: *const c_void,
    err: *mut *const u8,
    err_len: *mut usize,
) -> *mut c_void;

/// `wrs_hook_drop`: frees a hook's context.
pub(crate) type HookDrop = unsafe extern "C" fn(ctx: *mut c_void);

/// An opaque tensor memory budget (`wrs_budget`, `shim/budget.h`).
#[repr(C)]
pub(crate) struct RawBudget {
    _private: [u8; 0],
}

/// Why an allocation was refused (`wrs_budget_refusal`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawBudgetRefusal {
    pub(crate) asked: u64,
    pub(crate) limit: u64,
    pub(crate) used: u64,
    pub(crate) depth: u32,
}

/// The recycling pool's figures (`wrs_recycle_stats_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawRecycleStats {
    pub(crate) idle_bytes: u64,
    pub(crate) limit: u64,
    pub(crate) reused: u64,
}

unsafe extern "C" {
    pub(crate) fn wrs_overwrite_enter() -> bool;
    pub(crate) fn wrs_overwrite_exit(previous: bool);
    pub(crate) fn wrs_recycle_stats(stats: *mut RawRecycleStats);
    pub(crate) fn wrs_recycle_set_limit(limit: u64);
    pub(crate) fn wrs_recycle_trim();
    pub(crate) fn wrs_budget_install() -> i32;
    pub(crate) fn wrs_budget_new(limit: u64, parent: *mut RawBudget) -> *mut RawBudget;
    pub(crate) fn wrs_budget_retain(budget: *mut RawBudget);
    pub(crate) fn wrs_budget_release(budget: *mut RawBudget);
    pub(crate) fn wrs_budget_used(budget: *const RawBudget) -> u64;
    pub(crate) fn wrs_budget_limit(budget: *const RawBudget) -> u64;
    pub(crate) fn wrs_budget_set_limit(budget: *mut RawBudget, limit: u64);
    pub(crate) fn wrs_budget_enter(budget: *mut RawBudget) -> *mut RawBudget;
    pub(crate) fn wrs_budget_exit(previous: *mut RawBudget);
    pub(crate) fn wrs_budget_take_refusal(refusal: *mut RawBudgetRefusal) -> i32;
}
