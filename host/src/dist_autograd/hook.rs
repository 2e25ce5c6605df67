//! Tensor hooks (`tensor.register_hook(fn)`): a hook maps every gradient a
//! backward pass computes for its tensor, in local autograd
//! (`Tensor::backward`) and in distributed backward alike.
//!
//! The hooks are libtorch's own (registered through the shim,
//! [`wasmrpc_torch_sys::register_hook`]), so libtorch's engine applies them
//! wherever it computes the tensor's gradient: in a local pass, and in the
//! `grad` call through which the distributed engine reaches a worker's
//! leaves, before the gradient accumulates in the pass (DA-6). This
//! module adds the host's error type and the count of live hooks, which the
//! engine reads to keep passes with user code off the runtime's threads.

use std::sync::atomic::{AtomicUsize, Ordering};

use tch::Tensor;
use wasmrpc_torch_sys::TensorHook;

use crate::error::{Error, Result};

/// How many hooks are registered in this process.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// A registered hook; dropping it (or [`remove`](Self::remove)) removes the
/// hook, unlike PyTorch's `RemovableHandle`, so a hook never outlives its
/// owner's interest in it.
#[must_use = "dropping the handle removes the hook"]
#[derive(Debug)]
pub struct HookHandle {
    hook: Option<TensorHook>,
}

impl HookHandle {
    /// Removes the hook.
    pub fn remove(self) {}
}

impl Drop for HookHandle {
    fn drop(&mut self) {
        if let Some(hook) = self.hook.take() {
            hook.remove();
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// `tensor.register_hook(f)`: every gradient a backward pass computes for
/// `tensor` becomes `f(grad)`, in local backward and, before it
/// accumulates in the context, in distributed backward. Hooks run in
/// registration order, on the thread that runs the pass; an error fails
/// the pass with its message.
///
/// # Errors
/// libtorch's `RuntimeError` for a tensor that does not require grad
/// ("cannot register a hook on a tensor that doesn't require gradient").
pub fn register_hook(
    tensor: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<HookHandle> {
    let hook = wasmrpc_torch_sys::register_hook(tensor, move |g| {
        // The pass fails as a `RuntimeError`; another kind keeps its name.
        f(g).map_err(|e| match e.kind() {
            crate::abi::ErrorKind::RuntimeError => e.message().to_owned(),
            kind => format!("{kind}: {}", e.message()),
        })
    })
    .map_err(|e| Error::new(e.kind(), e.to_string()))?;
    LIVE.fetch_add(1, Ordering::Relaxed);
    Ok(HookHandle { hook: Some(hook) })
}

/// Whether any hook (a tensor's, or a node's post hook) is registered:
/// hooks are user code, which may block, so a pass with hooks around never
/// runs on a runtime thread.
pub(crate) fn any_registered() -> bool {
    LIVE.load(Ordering::Relaxed) > 0 || super::post_hook::any_registered()
}

/// The gradients of leaves that were sent themselves, after their hooks:
/// run through libtorch's engine (`grad` of each leaf with respect to
/// itself, seeded with what arrived), which applies a leaf's hooks as it
/// does for any gradient it computes for the leaf. A leaf sent more than
/// once gets the sum of its seeds, hooked once.
pub(crate) fn hooked_leaf_gradients(
    direct: Vec<(Tensor, Tensor)>,
) -> Result<Vec<(Tensor, Tensor)>> {
    if direct.is_empty() {
        return Ok(direct);
    }
    let mut leaves: Vec<Tensor> = Vec::new();
    let mut outputs = Vec::with_capacity(direct.len());
    let mut seeds = Vec::with_capacity(direct.len());
    for (leaf, g) in direct {
        if !leaves
            .iter()
            .any(|l| crate::tensor::impl_id(l) == crate::tensor::impl_id(&leaf))
        {
            leaves.push(leaf.shallow_clone());
        }
        outputs.push(leaf);
        seeds.push(g);
    }
    let computed = wasmrpc_torch_sys::grad(
        &outputs,
        &seeds,
        &leaves,
        wasmrpc_torch_sys::GradOptions {
            retain_graph: Some(true),
            create_graph: false,
            allow_unused: true,
        },
    )
    .map_err(|e| Error::new(e.kind(), e.to_string()))?;
    Ok(leaves
        .into_iter()
        .zip(computed)
        .filter_map(|(leaf, g)| g.map(|g| (leaf, g)))
        .collect())
}
