//! Post hooks of `AccumulateGrad` nodes (`node.register_hook(fn)` on a
//! leaf's `a.grad_fn.next_functions[i][0]`): each runs, in registration
//! order, every time a distributed backward pass computes the leaf's
//! gradient, before it accumulates in the context, as
//! `fn(output_grads, input_grads)`: an `AccumulateGrad` has no outputs, and
//! its one input is the gradient.
//!
//! libtorch's engine does not run the `AccumulateGrad` of a leaf whose
//! gradient a `grad` call captures (the distributed engine reaches leaves
//! that way), so these hooks live here, keyed by the leaf, which each
//! registration keeps alive.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::error::Result;
use crate::tensor::impl_id;

/// A post hook: `f(output_grads, input_grads)`.
pub type PostHookFn = dyn Fn(&[Option<Tensor>], &[Option<Tensor>]) -> Result<()> + Send + Sync;

struct Registered {
    id: u64,
    leaf: Tensor,
    hook: Arc<PostHookFn>,
}

static HOOKS: Mutex<Vec<Registered>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(0);
/// How many post hooks are registered (read without the lock).
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn hooks() -> std::sync::MutexGuard<'static, Vec<Registered>> {
    HOOKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A registered post hook; dropping it (or [`remove`](Self::remove))
/// removes the hook, as [`HookHandle`](super::HookHandle) does.
#[must_use = "dropping the handle removes the hook"]
#[derive(Debug)]
pub struct PostHookHandle {
    id: u64,
}

impl PostHookHandle {
    /// Removes the hook.
    pub fn remove(self) {}
}

impl Drop for PostHookHandle {
    fn drop(&mut self) {
        let mut hooks = hooks();
        let before = hooks.len();
        hooks.retain(|r| r.id != self.id);
        LIVE.fetch_sub(before - hooks.len(), Ordering::Relaxed);
    }
}

/// Registers `hook` on the `AccumulateGrad` of `leaf`.
pub(crate) fn register(leaf: Tensor, hook: Arc<PostHookFn>) -> PostHookHandle {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    hooks().push(Registered { id, leaf, hook });
    LIVE.fetch_add(1, Ordering::Relaxed);
    PostHookHandle { id }
}

/// Whether any post hook is registered: they are user code.
pub(crate) fn any_registered() -> bool {
    LIVE.load(Ordering::Relaxed) > 0
}

/// Runs the post hooks of `leaf`'s `AccumulateGrad` for its gradient
/// `grad`, in registration order; the first error fails the pass.
pub(crate) fn run(leaf: &Tensor, grad: &Tensor) -> Result<()> {
    if !any_registered() {
        return Ok(());
    }
    let id = impl_id(leaf);
    // Run outside the lock: a hook may register or drop hooks.
    let due: Vec<Arc<PostHookFn>> = hooks()
        .iter()
        .filter(|r| impl_id(&r.leaf) == id)
        .map(|r| r.hook.clone())
        .collect();
    let inputs = [Some(grad.shallow_clone())];
    for hook in due {
        hook(&[], &inputs)?;
    }
    Ok(())
}
