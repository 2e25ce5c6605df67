//! Autograd inspection of tensors that ops produce: which node recorded
//! them, and the graph behind it.
//!
//! Ops called through [`crate::Operator`] go through libtorch's dispatcher,
//! so autograd records them like any other call; this module only reads the
//! graph (`grad_fn`, `next_functions`, an `AccumulateGrad`'s variable), as
//! the seeds' distributed-autograd tests inspect it. Building
//! distributed-autograd nodes is left to the host's `autograd` module.

use crate::error::OpError;
use crate::ffi::{self, RawNode, RawOut, RawStr};
use std::ffi::c_void;
use std::ptr::NonNull;
use tch::Tensor;
use wasmrpc_abi::ErrorKind;

/// Options of [`grad`], as `torch.autograd.grad` names them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GradOptions {
    /// Keep the graph for another backward pass; `None` means
    /// `create_graph`'s value, as in PyTorch.
    pub retain_graph: Option<bool>,
    /// Record the backward pass itself, for higher-order gradients.
    pub create_graph: bool,
    /// Give `None` for inputs the outputs do not depend on, instead of an
    /// error.
    pub allow_unused: bool,
}

/// `torch.autograd.grad`: the gradients of `outputs` with respect to
/// `inputs`, seeded with `grad_outputs` (one per output, or empty for
/// implicit ones, which only scalar outputs allow). Nothing accumulates into
/// `.grad`, which is what distributed autograd needs: gradients arriving for
/// the tensors a worker sent are pushed through its local graph to the
/// leaves and received tensors that need them.
///
/// Runs libtorch's engine on the calling thread for CPU graphs, or, for
/// a graph of one node of libtorch's own whose edges lead straight to
/// `inputs` (one output, its seed of its shape and dtype, `retain_graph:
/// Some(true)`, no `create_graph`, on the CPU, with no hook, anomaly mode
/// or profiler callback anywhere), what the
/// engine would do for it without the engine: the seed and the node's
/// gradients checked as the engine checks them, the node run with grad
/// mode off. The engine's fixed cost is most of a small distributed
/// backward (`cargo bench -p wasmrpc-torch-sys --bench engine`);
/// [`engine_bypasses`] counts the calls that skipped it.
///
/// # Errors
///
/// [`OpError::Raised`] with libtorch's message (`One of the differentiated
/// Tensors appears to not have been used in the graph...`, `element 0 of
/// tensors does not require grad...`, a shape mismatch of a seed).
pub fn grad(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
    options: GradOptions,
) -> Result<Vec<Option<Tensor>>, OpError> {
    let ptrs = |ts: &[Tensor]| {
        ts.iter()
            .map(|t| t.as_ptr().cast::<c_void>())
            .collect::<Vec<_>>()
    };
    let (outs, seeds, ins) = (ptrs(outputs), ptrs(grad_outputs), ptrs(inputs));
    let mut results: Vec<*mut c_void> = vec![std::ptr::null_mut(); inputs.len()];
    let mut out = RawOut::empty();
    let retain = options.retain_graph.map_or(-1, i32::from);
    // SAFETY: the pointer arrays hold live `at::Tensor*` borrowed from the
    // slices for the call; `results` has one writable slot per input; `out`
    // is writable; the shim catches every exception.
    let status = unsafe {
        ffi::wrs_autograd_grad(
            outs.as_ptr(),
            outs.len(),
            seeds.as_ptr(),
            seeds.len(),
            ins.as_ptr(),
            ins.len(),
            retain,
            i32::from(options.create_graph),
            i32::from(options.allow_unused),
            results.as_mut_ptr(),
            &mut out,
        )
    };
    if status != ffi::STATUS_OK {
        return Err(engine_error("torch.autograd.grad", &out));
    }
    Ok(results
        .into_iter()
        .map(|p| {
            (!p.is_null()).then(|| {
                // SAFETY: on success each non-null slot is a fresh
                // `new at::Tensor` that the caller owns.
                unsafe { Tensor::from_ptr(p.cast::<torch_sys::C_tensor>()) }
            })
        })
        .collect())
}

/// How many [`grad`] calls on this thread ran their one node without
/// libtorch's engine.
pub fn engine_bypasses() -> u64 {
    // SAFETY: reads an atomic counter.
    unsafe { ffi::wrs_autograd_engine_bypasses() }
}

/// Allows (the default) or forbids [`grad`]'s run of a one-node graph
/// without libtorch's engine, in the whole process: for measuring one
/// against the other, and as a way around the bypass should it ever
/// differ from the engine.
pub fn set_engine_bypass(enabled: bool) {
    // SAFETY: stores an atomic flag.
    unsafe { ffi::wrs_autograd_set_engine_bypass(i32::from(enabled)) }
}

/// `torch.autograd.backward(roots, retain_graph=retain_graph)`: runs
/// libtorch's engine from the scalar `roots` and accumulates into the
/// leaves' `.grad`, keeping the graph for another pass if asked (tch's
/// `backward` always frees it).
///
/// # Errors
///
/// [`OpError::Raised`] with libtorch's message (`element 0 of tensors does
/// not require grad...`, `grad can be implicitly created only for scalar
/// outputs`, `Trying to backward through the graph a second time...`).
pub fn backward(roots: &[Tensor], retain_graph: bool) -> Result<(), OpError> {
    let ptrs = roots
        .iter()
        .map(|t| t.as_ptr().cast::<c_void>())
        .collect::<Vec<_>>();
    let mut out = RawOut::empty();
    // SAFETY: `ptrs` holds live `at::Tensor*` borrowed from `roots` for the
    // call; `out` is writable; the shim catches every exception.
    let status = unsafe {
        ffi::wrs_autograd_backward(ptrs.as_ptr(), ptrs.len(), i32::from(retain_graph), &mut out)
    };
    if status != ffi::STATUS_OK {
        return Err(engine_error("torch.autograd.backward", &out));
    }
    Ok(())
}

/// `tensor.grad = grad` (`None`: `tensor.grad = None`), with the checks
/// and texts of PyTorch's setter.
///
/// # Errors
///
/// `RuntimeError` "assigned grad has data of a different type" (or "of a
/// different size", "located on a different device"), as PyTorch raises.
pub fn set_grad(tensor: &Tensor, grad: Option<&Tensor>) -> Result<(), OpError> {
    let mut out = RawOut::empty();
    let grad_ptr = grad.map_or(std::ptr::null(), |g| g.as_ptr().cast::<c_void>());
    // SAFETY: both pointers are live `at::Tensor*` borrowed for the call
    // (the shim assigns the gradient through the tensor's shared
    // implementation, which `tensor` keeps alive); `out` is writable; the
    // shim catches every exception.
    let status = unsafe {
        ffi::wrs_tensor_set_grad(
            tensor.as_ptr().cast_mut().cast::<c_void>(),
            grad_ptr,
            &mut out,
        )
    };
    if status != ffi::STATUS_OK {
        return Err(engine_error("Tensor.grad", &out));
    }
    Ok(())
}

/// What a tensor hook does to a gradient: the gradient to use instead, or
/// an error message that fails the backward pass.
pub type HookResult = Result<Tensor, String>;

type BoxedHook = Box<dyn Fn(&Tensor) -> HookResult + Send + Sync>;

/// A hook registered with [`register_hook`]; dropping it (or
/// [`remove`](Self::remove)) removes it from the tensor.
#[must_use = "dropping the hook removes it"]
pub struct TensorHook {
    // A handle to the same tensor (libtorch keeps hooks on the tensor's
    // autograd metadata, shared by its shallow copies). Behind a mutex so
    // the hook is `Sync` as well as `Send`.
    tensor: std::sync::Mutex<Tensor>,
    index: u32,
}

impl std::fmt::Debug for TensorHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorHook")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl TensorHook {
    /// Removes the hook.
    pub fn remove(self) {}
}

impl Drop for TensorHook {
    fn drop(&mut self) {
        let tensor = self
            .tensor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = RawOut::empty();
        // SAFETY: `tensor` is a live `at::Tensor*`; the shim catches every
        // exception. Removing can only fail for an index libtorch no longer
        // has, which leaves nothing to remove.
        let _ = unsafe {
            ffi::wrs_tensor_remove_hook(tensor.as_ptr().cast::<c_void>(), self.index, &mut out)
        };
    }
}

/// `tensor.register_hook(f)`: every gradient libtorch computes for
/// `tensor` becomes `f(grad)`, in every backward pass: local
/// (`Tensor::backward`, [`backward`]) and [`grad`] (which applies a leaf's
/// hooks before it returns the leaf's gradient). Hooks run in registration
/// order, on the thread that runs the pass; an error fails the pass with
/// its message.
///
/// # Errors
///
/// [`OpError::Raised`] with libtorch's message for a tensor that does not
/// require grad ("cannot register a hook on a tensor that doesn't require
/// gradient").
pub fn register_hook(
    tensor: &Tensor,
    f: impl Fn(&Tensor) -> HookResult + Send + Sync + 'static,
) -> Result<TensorHook, OpError> {
    let boxed: Box<BoxedHook> = Box::new(Box::new(f));
    let ctx = Box::into_raw(boxed).cast::<c_void>();
    let mut index = 0u32;
    let mut out = RawOut::empty();
    // SAFETY: `tensor` is a live `at::Tensor*`; `ctx` is a leaked
    // `Box<BoxedHook>` that the shim owns from here on and frees through
    // `drop_hook` exactly once (also on failure); `index` and `out` are
    // writable; the shim catches every exception.
    let status = unsafe {
        ffi::wrs_tensor_register_hook(
            tensor.as_ptr().cast::<c_void>(),
            call_hook,
            ctx,
            drop_hook,
            &mut index,
            &mut out,
        )
    };
    if status != ffi::STATUS_OK {
        return Err(engine_error("Tensor.register_hook", &out));
    }
    Ok(TensorHook {
        tensor: std::sync::Mutex::new(tensor.shallow_clone()),
        index,
    })
}

thread_local! {
    /// The message of the last hook that failed on this thread, which the
    /// shim copies before the thread runs another hook.
    static HOOK_ERROR: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// `wrs_hook_fn`: runs the boxed closure, catching panics.
unsafe extern "C" fn call_hook(
    ctx: *mut c_void,
    grad: *const c_void,
    err: *mut *const u8,
    err_len: *mut usize,
) -> *mut c_void {
    // SAFETY: `ctx` is the `Box<BoxedHook>` leaked by `register_hook`,
    // alive until `drop_hook`, which libtorch cannot call during a call.
    let f = unsafe { &*ctx.cast::<BoxedHook>() };
    // SAFETY: `grad` is a live `at::Tensor*` for the call; the shallow copy
    // shares it without taking it.
    let grad = unsafe { Tensor::clone_from_ptr(grad.cast_mut().cast::<torch_sys::C_tensor>()) };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&grad)))
        .unwrap_or_else(|_| Err("a tensor hook panicked".to_owned()));
    match result {
        Ok(mapped) => {
            let ptr = mapped.as_ptr().cast_mut().cast::<c_void>();
            // The shim takes the `at::Tensor*` and deletes it.
            std::mem::forget(mapped);
            ptr
        }
        Err(message) => HOOK_ERROR.with(|e| {
            let mut e = e.borrow_mut();
            *e = message;
            // SAFETY: `err` and `err_len` are writable out-pointers; the
            // message stays in this thread's slot until the next failure.
            unsafe {
                *err = e.as_ptr();
                *err_len = e.len();
            }
            std::ptr::null_mut()
        }),
    }
}

/// `wrs_hook_drop`: frees the closure.
unsafe extern "C" fn drop_hook(ctx: *mut c_void) {
    // SAFETY: `ctx` came from `Box::into_raw` in `register_hook`, and the
    // shim calls this once.
    drop(unsafe { Box::from_raw(ctx.cast::<BoxedHook>()) });
}

/// The error of a failed engine call, with the shim's message.
fn engine_error(op: &str, out: &RawOut) -> OpError {
    let message = if out.err.is_null() {
        String::new()
    } else {
        // SAFETY: the shim set `err` to its thread-local message, valid
        // until the next shim call on this thread.
        String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(out.err, out.err_len) })
            .into_owned()
    };
    OpError::Raised {
        op: op.to_owned(),
        kind: ErrorKind::RuntimeError,
        message,
    }
}

/// The name of the autograd node that produced `tensor` (Python's
/// `t.grad_fn.name()`, e.g. `MulBackward0`), or `None` for a leaf, a tensor
/// that does not require grad, or one made under `no_grad`.
pub fn grad_fn_name(tensor: &Tensor) -> Option<String> {
    let mut name = RawStr {
        ptr: std::ptr::null(),
        len: 0,
    };
    // SAFETY: `as_ptr` is the live `at::Tensor*` behind `tensor`, borrowed for
    // the call; `name` is writable; the shim catches every exception.
    let status = unsafe { ffi::wrs_grad_fn_name(tensor.as_ptr().cast::<c_void>(), &mut name) };
    if status != 1 || name.ptr.is_null() {
        return None;
    }
    // SAFETY: on success the shim points `name` at its thread-local string,
    // valid until the next shim call on this thread.
    let bytes = unsafe { std::slice::from_raw_parts(name.ptr, name.len) };
    Some(String::from_utf8_lossy(bytes).into_owned())
}

/// A node of the autograd graph (Python's `t.grad_fn` and the nodes its
/// `next_functions` reach). Holds a reference: the node lives while any
/// handle does. Two handles are equal when they name the same node.
pub struct GradFn {
    raw: NonNull<RawNode>,
}

// SAFETY: the handle owns one reference of an intrusive, atomically counted
// `Node`; it only reads the node (name, edges, an AccumulateGrad's variable),
// which libtorch allows from any thread.
unsafe impl Send for GradFn {}

impl Drop for GradFn {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim, is owned by this handle and freed
        // only here.
        unsafe { ffi::wrs_node_free(self.raw.as_ptr()) }
    }
}

impl GradFn {
    /// The node that produced `tensor`, or `None` as for [`grad_fn_name`].
    pub fn of(tensor: &Tensor) -> Option<GradFn> {
        let mut raw: *mut RawNode = std::ptr::null_mut();
        // SAFETY: the tensor pointer is live for the call; `raw` is writable.
        let status = unsafe { ffi::wrs_tensor_grad_fn(tensor.as_ptr().cast::<c_void>(), &mut raw) };
        if status == 1 {
            NonNull::new(raw).map(|raw| GradFn { raw })
        } else {
            None
        }
    }

    /// The node's name: `MulBackward0`, `torch::autograd::AccumulateGrad`,
    /// `torch::distributed::autograd::RecvRpcBackward`, ...
    pub fn name(&self) -> String {
        let mut name = RawStr {
            ptr: std::ptr::null(),
            len: 0,
        };
        // SAFETY: `raw` is live; `name` is writable.
        let status = unsafe { ffi::wrs_node_name(self.raw.as_ptr(), &mut name) };
        if status != ffi::STATUS_OK || name.ptr.is_null() {
            return String::new();
        }
        // SAFETY: the shim points `name` at its thread-local string, valid
        // until the next shim call on this thread.
        let bytes = unsafe { std::slice::from_raw_parts(name.ptr, name.len) };
        String::from_utf8_lossy(bytes).into_owned()
    }

    /// An identity of the node, equal for handles to the same node.
    pub fn id(&self) -> usize {
        // SAFETY: `raw` is live.
        unsafe { ffi::wrs_node_id(self.raw.as_ptr()) }
    }

    /// Python's `next_functions`: for each input of the op this node
    /// differentiates, the node its gradient flows to (`None` if that input
    /// needs no gradient) and which of that node's inputs it feeds.
    pub fn next_functions(&self) -> Vec<(Option<GradFn>, u32)> {
        // SAFETY: `raw` is live.
        let count = unsafe { ffi::wrs_node_num_next(self.raw.as_ptr()) };
        (0..count)
            .map(|index| {
                let mut next: *mut RawNode = std::ptr::null_mut();
                let mut input_nr = 0_u32;
                // SAFETY: `raw` is live, `index` is in range, both out
                // places are writable.
                let status = unsafe {
                    ffi::wrs_node_next(self.raw.as_ptr(), index, &mut next, &mut input_nr)
                };
                if status == ffi::STATUS_OK {
                    (NonNull::new(next).map(|raw| GradFn { raw }), input_nr)
                } else {
                    (None, 0)
                }
            })
            .collect()
    }

    /// For an `AccumulateGrad` node, the leaf tensor it accumulates into
    /// (Python's `node.variable`); `None` for other nodes.
    pub fn variable(&self) -> Option<Tensor> {
        let mut tensor: *mut c_void = std::ptr::null_mut();
        // SAFETY: `raw` is live; `tensor` is writable.
        let status = unsafe { ffi::wrs_node_variable(self.raw.as_ptr(), &mut tensor) };
        if status != 1 || tensor.is_null() {
            return None;
        }
        // SAFETY: the shim returned a fresh `new at::Tensor` that nobody else
        // owns; `C_tensor` is that type.
        Some(unsafe { Tensor::from_ptr(tensor.cast::<torch_sys::C_tensor>()) })
    }
}

impl PartialEq for GradFn {
    fn eq(&self, other: &Self) -> bool {
        self.id() == other.id()
    }
}

impl Eq for GradFn {}

impl std::fmt::Debug for GradFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("GradFn").field(&self.name()).finish()
    }
}
