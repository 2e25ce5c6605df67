//! Tensor hooks (`tensor.register_hook(fn)`) as distributed backward sees
//! them: a hook on a leaf maps every gradient a backward pass computes for
//! that leaf on this process before it accumulates in the context.
//!
//! libtorch's own hooks are not reachable through tch, so the engine
//! applies these itself where it accumulates leaf gradients (DA-6). Only
//! leaves are hooked; local autograd (`Tensor::backward`) does not see
//! these hooks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::error::Result;
use crate::tensor::impl_id;

type HookFn = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

struct Hook {
    id: u64,
    // Keeps the tensor alive, so its identity is not reused while hooked.
    _tensor: Tensor,
    f: HookFn,
}

static HOOKS: Mutex<Option<HashMap<usize, Vec<Hook>>>> = Mutex::new(None);
static NEXT: AtomicU64 = AtomicU64::new(1);

/// A registered hook; dropping it (or [`remove`](Self::remove)) removes the
/// hook, unlike PyTorch's `RemovableHandle`, so a hook never outlives its
/// owner's interest in it.
#[must_use = "dropping the handle removes the hook"]
pub struct HookHandle {
    key: usize,
    id: u64,
}

impl std::fmt::Debug for HookHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookHandle").field("id", &self.id).finish()
    }
}

impl HookHandle {
    /// Removes the hook.
    pub fn remove(self) {}
}

impl Drop for HookHandle {
    fn drop(&mut self) {
        let mut hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(map) = hooks.as_mut()
            && let Some(v) = map.get_mut(&self.key)
        {
            v.retain(|h| h.id != self.id);
            if v.is_empty() {
                map.remove(&self.key);
            }
        }
    }
}

/// `tensor.register_hook(f)` for distributed backward: every gradient a
/// pass computes for the leaf `tensor` becomes `f(grad)` before it
/// accumulates in the context. Hooks run in registration order.
pub fn register_hook(
    tensor: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> HookHandle {
    let key = impl_id(tensor);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    HOOKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .entry(key)
        .or_default()
        .push(Hook {
            id,
            _tensor: tensor.shallow_clone(),
            f: Arc::new(f),
        });
    HookHandle { key, id }
}

/// Whether any hook is registered: hooks are user code, which may block, so
/// a pass with hooks around never runs on a runtime thread.
pub(crate) fn any_registered() -> bool {
    HOOKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .is_some_and(|m| !m.is_empty())
}

/// `grad` after the hooks of `leaf`.
pub(crate) fn apply(leaf: &Tensor, grad: Tensor) -> Result<Tensor> {
    let fs: Vec<HookFn> = {
        let hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
        match hooks.as_ref().and_then(|m| m.get(&impl_id(leaf))) {
            Some(v) => v.iter().map(|h| h.f.clone()).collect(),
            None => return Ok(grad),
        }
    };
    fs.iter().try_fold(grad, |g, f| f(&g))
}
