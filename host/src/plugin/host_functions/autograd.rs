//! A plugin call's autograd requests ([`AutogradCall`]): local autograd on
//! its tensor handles, the distributed autograd context it opens, and the
//! distributed optimizers it creates.
//!
//! What it owns, per call: whether the call's ops record gradients
//! (`no_grad`), the id of the context the guest opened (the guest's RPCs,
//! `remote`s and `to_here`s carry it, DA-3, unless the call already runs in
//! a context of its caller's), and the optimizers the guest made. Whatever
//! the guest leaves open when the call ends (a context, an optimizer) is
//! released then, so a trapped guest leaks nothing. Contexts, backward and
//! gradients belong to [`crate::dist_autograd`], optimizers to [`crate::optim`].

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use wasmrpc_wasm::{AutogradCall, ErrorKind, HostResult, RemoteError, Value};

use super::{GuestCall, remote, tch_error};
use crate::agent::RpcAgent;
use crate::dist_autograd;
use crate::error::{ALREADY_HAVE_AUTOGRAD_CONTEXT, Error};
use crate::ops::run_blocking;
use crate::optim::{DistributedOptimizer, OptimizerConfig};
use crate::value::Payload;

/// The autograd state of one plugin call.
pub(super) struct GuestAutograd {
    grad_enabled: AtomicBool,
    context: Mutex<Option<i64>>,
    optimizers: Mutex<HashMap<i64, Arc<DistributedOptimizer>>>,
}

impl Default for GuestAutograd {
    fn default() -> Self {
        GuestAutograd {
            grad_enabled: AtomicBool::new(true),
            context: Mutex::new(None),
            optimizers: Mutex::new(HashMap::new()),
        }
    }
}

impl GuestAutograd {
    /// Whether the call's ops record gradients.
    pub(super) fn grad_enabled(&self) -> bool {
        self.grad_enabled.load(Ordering::Acquire)
    }

    /// The context the guest opened, if it is still open.
    pub(super) fn context(&self) -> Option<i64> {
        *self.context.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases what the guest left open (at the end of the call).
    pub(super) fn release(&self, agent: &RpcAgent) {
        if let Some(id) = self
            .context
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            dist_autograd::release_if_present(agent, id);
        }
        // Dropping them sends their owners the release (OPT-4).
        self.optimizers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    fn optimizer(&self, id: i64) -> HostResult<Arc<DistributedOptimizer>> {
        self.optimizers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| {
                RemoteError::new(
                    ErrorKind::RuntimeError,
                    format!("no distributed optimizer with id {id} in this call"),
                )
            })
    }
}

/// An opaque identity of a tensor object: a keyed hash of its
/// `TensorImpl`, so that the guest never sees a host address.
fn identity(t: &tch::Tensor) -> i64 {
    static KEY: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    let mut h = KEY.get_or_init(Default::default).build_hasher();
    h.write_usize(crate::tensor::impl_id(t));
    // The bits, reinterpreted: an opaque id.
    h.finish() as i64
}

impl GuestCall {
    /// Runs one [`AutogradCall`].
    pub(super) async fn run_autograd(&self, call: AutogradCall) -> HostResult<Value> {
        let ag = &self.autograd;
        Ok(match call {
            AutogradCall::SetRequiresGrad(h, flag) => {
                let mut t = self.handles().tensor(h)?;
                let _ = t.f_requires_grad_(flag).map_err(tch_error)?;
                Value::None
            }
            AutogradCall::Grad(h) => {
                let g = self.handles().tensor(h)?.grad();
                if g.defined() {
                    Value::Tensor(self.handles().insert_tensor(g))
                } else {
                    Value::None
                }
            }
            AutogradCall::SetGrad(h, grad) => {
                let (t, g) = {
                    let handles = self.handles();
                    (
                        handles.tensor(h)?,
                        grad.map(|g| handles.tensor(g)).transpose()?,
                    )
                };
                wasmrpc_torch_sys::set_grad(&t, g.as_ref())
                    .map_err(|e| RemoteError::new(ErrorKind::RuntimeError, e.to_string()))?;
                Value::None
            }
            AutogradCall::Backward(h) => {
                let t = self.handles().tensor(h)?;
                run_blocking(move || t.f_backward())
                    .await
                    .map_err(remote)?
                    .map_err(tch_error)?;
                Value::None
            }
            AutogradCall::SetGradEnabled(flag) => {
                Value::Bool(ag.grad_enabled.swap(flag, Ordering::AcqRel))
            }
            AutogradCall::Identity(h) => Value::Int(identity(&self.handles().tensor(h)?)),
            AutogradCall::ContextNew => {
                let mut slot = ag.context.lock().unwrap_or_else(|p| p.into_inner());
                if slot.is_some() || dist_autograd::current_context_id().is_some() {
                    return Err(remote(Error::runtime(ALREADY_HAVE_AUTOGRAD_CONTEXT)));
                }
                let ctx = dist_autograd::new_context(&self.agent).map_err(remote)?;
                *slot = Some(ctx.context_id());
                Value::Int(ctx.context_id())
            }
            AutogradCall::ContextRelease(id) => {
                {
                    let mut slot = ag.context.lock().unwrap_or_else(|p| p.into_inner());
                    if *slot == Some(id) {
                        *slot = None;
                    }
                }
                dist_autograd::release_context(&self.agent, id).map_err(remote)?;
                Value::None
            }
            AutogradCall::CurrentContext => {
                match ag.context().or_else(dist_autograd::current_context_id) {
                    Some(id) => Value::Int(id),
                    None => Value::None,
                }
            }
            AutogradCall::DistBackward {
                context_id,
                roots,
                retain_graph,
            } => {
                let roots = {
                    let handles = self.handles();
                    roots
                        .iter()
                        .map(|h| handles.tensor(*h))
                        .collect::<HostResult<Vec<_>>>()?
                };
                dist_autograd::backward(&self.agent, context_id, &roots, retain_graph)
                    .await
                    .map_err(remote)?;
                Value::None
            }
            AutogradCall::GetGradients(context_id) => {
                let grads =
                    dist_autograd::get_gradients(&self.agent, context_id).map_err(remote)?;
                let mut handles = self.handles();
                Value::List(
                    grads
                        .iter()
                        .map(|(t, g)| {
                            Value::Tuple(vec![
                                Value::Int(identity(t)),
                                Value::Tensor(handles.insert_tensor(t.shallow_clone())),
                                Value::Tensor(handles.insert_tensor(g.shallow_clone())),
                            ])
                        })
                        .collect(),
                )
            }
            AutogradCall::OptimizerNew { config, params } => {
                let config =
                    OptimizerConfig::from_payload(&Payload::from_value(config)).map_err(remote)?;
                let rrefs = {
                    let handles = self.handles();
                    params
                        .iter()
                        .map(|h| handles.rref(*h))
                        .collect::<HostResult<Vec<_>>>()?
                };
                let opt = DistributedOptimizer::new(&self.agent, config, &rrefs)
                    .await
                    .map_err(remote)?;
                let id = opt.id();
                ag.optimizers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, Arc::new(opt));
                Value::Int(id)
            }
            AutogradCall::OptimizerStep {
                optimizer,
                context_id,
            } => {
                let opt = ag.optimizer(optimizer)?;
                opt.step(context_id).await.map_err(remote)?;
                Value::None
            }
            AutogradCall::OptimizerState(id) => {
                let state = ag.optimizer(id)?.state_dict().await.map_err(remote)?;
                self.handles().import(state)?
            }
            AutogradCall::OptimizerLoadState { optimizer, state } => {
                let opt = ag.optimizer(optimizer)?;
                let state = self.handles().borrow_payload(state)?;
                opt.load_state_dict(state).await.map_err(remote)?;
                Value::None
            }
            AutogradCall::OptimizerDrop(id) => {
                ag.optimizers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                Value::None
            }
        })
    }
}
