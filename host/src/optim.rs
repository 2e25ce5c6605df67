//! The distributed optimizer (`torch.distributed.optim.DistributedOptimizer`):
//! one optimizer over parameters that live on many workers, stepped with the
//! gradients a distributed autograd context accumulated on each owner.
//!
//! What it owns: the optimizer configurations ([`Sgd`], [`Adam`]), the
//! caller-side [`DistributedOptimizer`] handle, and on every owner the local
//! optimizers (parameters, momentum and moment buffers) keyed by optimizer
//! id, with the agent's internal functions that create, step and delete
//! them. It leaves gradients to [`crate::dist_autograd`] (a step reads
//! [`get_gradients`](crate::dist_autograd::get_gradients) of the given context on
//! the owner) and parameter ownership to [`RRef`]s (parameters are
//! given as RRefs; an owner keeps handles to their local values).
//!
//! # Example
//!
//! ```no_run
//! use wasmrpc::optim::{DistributedOptimizer, Sgd};
//! use wasmrpc::{RRef, RpcAgent, dist_autograd};
//! # async fn run(agent: RpcAgent, params: Vec<RRef>, loss: tch::Tensor) -> wasmrpc::Result<()> {
//! let opt = DistributedOptimizer::new(&agent, Sgd::new(0.05).momentum(0.9), &params).await?;
//! dist_autograd::context(&agent, |ctx| {
//!     let (agent, opt) = (agent.clone(), &opt);
//!     async move {
//!         dist_autograd::backward(&agent, ctx, &[loss], false).await?;
//!         opt.step(ctx).await
//!     }
//! })
//! .await??;
//! opt.close().await?;
//! # Ok(()) }
//! ```
//!
//! # Invariants
//!
//! - OPT-1: an optimizer id holds the creating worker's rank in its top 16
//!   bits and a per-worker counter in the low 48 (as autograd ids, DA-1), so
//!   ids never collide across creators; each owner keeps one local optimizer
//!   per id, created once by [`DistributedOptimizer::new`].
//! - OPT-2: steps of one local optimizer run one at a time (an async lock
//!   held across reading the gradients and updating the parameters); steps
//!   on different owners run concurrently.
//! - OPT-3: parameters are updated in place under `no_grad`, so the RRefs'
//!   values (the same tensors) see the update and no graph is recorded; a
//!   parameter without a gradient in the context is left as it is, and its
//!   state does not advance (as PyTorch skips parameters whose grad is
//!   `None`).
//! - OPT-4: local optimizers are released when their [`DistributedOptimizer`]
//!   is closed or dropped (a delete request to every owner), and all of a
//!   worker's at its graceful shutdown; nothing else keeps them.
//! - OPT-5: nothing a peer sends panics: unknown ids, malformed
//!   configurations and parameters not owned by the receiver are errors,
//!   and so is a state to load that does not fit the local optimizer
//!   (`state`: its kind, count, shapes), which then changes nothing.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::agent::{FunctionRegistry, RpcAgent};
use crate::error::{Error, Result};
use crate::rref::RRef;
use crate::value::{Args, Payload};

mod config;
mod state;

pub use config::{Adam, OptimizerConfig, Sgd};

/// Internal function: create a local optimizer on its parameters' owner.
pub(crate) const CREATE: &str = "wasmrpc::_optim_create";
/// Internal function: step a local optimizer with a context's gradients.
pub(crate) const STEP: &str = "wasmrpc::_optim_step";
/// Internal function: release a local optimizer.
pub(crate) const DELETE: &str = "wasmrpc::_optim_delete";

/// Per-parameter state of a local optimizer.
enum ParamState {
    /// Nothing yet (no step with a gradient so far).
    Fresh,
    /// SGD's momentum buffer.
    Momentum(Tensor),
    /// Adam's step count and moment estimates.
    Adam {
        step: i32,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
    },
}

/// The optimizer an owner runs over its own parameters
/// (`_LocalOptimizer`).
struct LocalOptimizer {
    config: OptimizerConfig,
    params: Vec<Tensor>,
    state: Vec<ParamState>,
}

impl LocalOptimizer {
    /// One step with `grads[i]` for `params[i]` (OPT-3). Runs under
    /// `no_grad`.
    fn step(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        tch::no_grad(|| {
            for (i, grad) in grads.iter().enumerate() {
                let Some(grad) = grad else { continue };
                let (param, state) = (&self.params[i], &mut self.state[i]);
                match self.config {
                    OptimizerConfig::Sgd(s) => sgd_step(&s, param, grad, state)?,
                    OptimizerConfig::Adam(a) => adam_step(&a, param, grad, state)?,
                }
            }
            Ok(())
        })
    }
}

fn dense(grad: &Tensor) -> Result<Tensor> {
    Ok(if grad.is_sparse() {
        grad.f_to_dense(None, false)?
    } else {
        grad.shallow_clone()
    })
}

fn sgd_step(s: &Sgd, param: &Tensor, grad: &Tensor, state: &mut ParamState) -> Result<()> {
    let mut param = param.shallow_clone();
    if grad.is_sparse() && s.momentum == 0.0 && s.weight_decay == 0.0 {
        // A sparse gradient touches only its rows, as PyTorch's SGD does.
        let _ = param.f_add_(&grad.f_mul_scalar(-s.lr)?)?;
        return Ok(());
    }
    let mut d_p = dense(grad)?;
    if s.weight_decay != 0.0 {
        d_p = d_p.f_add(&param.f_mul_scalar(s.weight_decay)?)?;
    }
    if s.momentum != 0.0 {
        let buf = match state {
            ParamState::Momentum(buf) => {
                let mut b = buf.shallow_clone();
                let _ = b.f_mul_scalar_(s.momentum)?;
                let _ = b.f_add_(&d_p.f_mul_scalar(1.0 - s.dampening)?)?;
                b
            }
            _ => {
                let b = d_p.f_detach_copy()?;
                *state = ParamState::Momentum(b.shallow_clone());
                b
            }
        };
        d_p = if s.nesterov {
            d_p.f_add(&buf.f_mul_scalar(s.momentum)?)?
        } else {
            buf
        };
    }
    let _ = param.f_add_(&d_p.f_mul_scalar(-s.lr)?)?;
    Ok(())
}

fn adam_step(a: &Adam, param: &Tensor, grad: &Tensor, state: &mut ParamState) -> Result<()> {
    if grad.is_sparse() {
        return Err(Error::runtime(
            "Adam does not support sparse gradients, please consider SparseAdam instead",
        ));
    }
    let mut param = param.shallow_clone();
    if matches!(state, ParamState::Fresh | ParamState::Momentum(_)) {
        *state = ParamState::Adam {
            step: 0,
            exp_avg: param.f_zeros_like()?,
            exp_avg_sq: param.f_zeros_like()?,
        };
    }
    let ParamState::Adam {
        step,
        exp_avg,
        exp_avg_sq,
    } = state
    else {
        // Invariant: set just above.
        return Err(Error::runtime("Adam state missing"));
    };
    *step += 1;
    let mut g = grad.shallow_clone();
    if a.weight_decay != 0.0 {
        g = g.f_add(&param.f_mul_scalar(a.weight_decay)?)?;
    }
    let (b1, b2) = a.betas;
    let _ = exp_avg.f_mul_scalar_(b1)?;
    let _ = exp_avg.f_add_(&g.f_mul_scalar(1.0 - b1)?)?;
    let _ = exp_avg_sq.f_mul_scalar_(b2)?;
    let _ = exp_avg_sq.f_add_(&g.f_mul(&g)?.f_mul_scalar(1.0 - b2)?)?;
    let bias1 = 1.0 - b1.powi(*step);
    let bias2 = 1.0 - b2.powi(*step);
    let denom = exp_avg_sq
        .f_sqrt()?
        .f_div_scalar(bias2.sqrt())?
        .f_add_scalar(a.eps)?;
    let _ = param.f_add_(&exp_avg.f_div(&denom)?.f_mul_scalar(-a.lr / bias1)?)?;
    Ok(())
}

/// A worker's local optimizers, by optimizer id (OPT-1).
#[derive(Default)]
struct LocalOptimizers {
    by_id: Mutex<HashMap<i64, Arc<tokio::sync::Mutex<LocalOptimizer>>>>,
}

impl LocalOptimizers {
    fn get(&self, agent: &RpcAgent, id: i64) -> Result<Arc<tokio::sync::Mutex<LocalOptimizer>>> {
        self.by_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| {
                Error::runtime(format!(
                    "no local optimizer with id {id} on worker {}",
                    agent.name()
                ))
            })
    }

    fn clear(&self) {
        self.by_id.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// The per-worker counter behind optimizer ids (OPT-1).
#[derive(Default)]
struct NextOptimizerId(AtomicI64);

/// How many local optimizers `agent` holds for distributed optimizers (its
/// own or peers'): zero once every one was closed or dropped (OPT-4).
pub fn num_local_optimizers(agent: &RpcAgent) -> usize {
    agent
        .state::<LocalOptimizers>()
        .by_id
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .len()
}

/// An optimizer over parameters owned by several workers
/// (`DistributedOptimizer`): each owner runs a local optimizer over its
/// own parameters; [`step`](Self::step) steps them all, concurrently, with
/// the gradients of one distributed autograd context.
///
/// Dropping it releases every owner's local optimizer (fire and forget);
/// [`close`](Self::close) does the same and waits for the owners.
pub struct DistributedOptimizer {
    agent: RpcAgent,
    id: i64,
    config: OptimizerConfig,
    owners: Vec<String>,
    closed: bool,
}

impl std::fmt::Debug for DistributedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("id", &self.id)
            .field("config", &self.config)
            .field("owners", &self.owners)
            .finish()
    }
}

impl DistributedOptimizer {
    /// Creates a local optimizer of kind `config` on every worker that owns
    /// some of `params`, over its parameters (in the order given), and
    /// waits until all exist.
    ///
    /// # Errors
    /// Invalid hyperparameters ([`OptimizerConfig::validate`]); an owner's
    /// failure (a value that is not a tensor, an unreachable worker), named
    /// "creating the local optimizer on worker NAME". Local optimizers
    /// already created are released again.
    pub async fn new(
        agent: &RpcAgent,
        config: impl Into<OptimizerConfig>,
        params: &[RRef],
    ) -> Result<Self> {
        let config = config.into();
        config.validate()?;
        let counter = agent.state::<NextOptimizerId>();
        let n = counter.0.fetch_add(1, Ordering::Relaxed) & ((1i64 << 48) - 1);
        let id = (i64::from(agent.rank()) << 48) | n;
        let mut by_owner: BTreeMap<String, Vec<&RRef>> = BTreeMap::new();
        for p in params {
            by_owner
                .entry(p.owner_name().to_string())
                .or_default()
                .push(p);
        }
        let mut opt = DistributedOptimizer {
            agent: agent.clone(),
            id,
            config,
            owners: by_owner.keys().cloned().collect(),
            closed: false,
        };
        let futures: Vec<_> = by_owner
            .iter()
            .map(|(owner, rrefs)| {
                let list = Payload::list(rrefs.iter().map(|r| Payload::from(*r)));
                let args = Args::new().arg(id).arg(config.to_payload()).arg(list);
                agent.rpc_async(owner.as_str(), CREATE, args)
            })
            .collect();
        let mut first_err = None;
        for (owner, f) in opt.owners.iter().zip(futures) {
            if let Err(e) = f.wait().await {
                first_err.get_or_insert_with(|| {
                    e.context_line(format!("creating the local optimizer on worker {owner}"))
                });
            }
        }
        match first_err {
            None => Ok(opt),
            Some(e) => {
                opt.closed = true;
                let _ = opt.release().await;
                Err(e)
            }
        }
    }

    /// The optimizer's id (OPT-1).
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The local optimizers' kind and hyperparameters.
    pub fn config(&self) -> OptimizerConfig {
        self.config
    }

    /// The workers that own parameters, by name.
    pub fn owners(&self) -> &[String] {
        &self.owners
    }

    /// Steps every owner's parameters with the gradients that context
    /// `context_id` accumulated on that owner, all owners at once, and
    /// waits for all (OPT-2, OPT-3).
    ///
    /// # Errors
    /// The first owner's failure (unknown context there, a gradient of the
    /// wrong shape, an unreachable worker), named "stepping the local
    /// optimizer on worker NAME"; the other owners' steps still complete.
    pub async fn step(&self, context_id: i64) -> Result<()> {
        let futures: Vec<_> = self
            .owners
            .iter()
            .map(|owner| {
                self.agent.rpc_async(
                    owner.as_str(),
                    STEP,
                    Args::new().arg(self.id).arg(context_id),
                )
            })
            .collect();
        let results = wait_all_results(futures).await;
        for (owner, r) in self.owners.iter().zip(results) {
            r.map_err(|e| {
                e.context_line(format!("stepping the local optimizer on worker {owner}"))
            })?;
        }
        Ok(())
    }

    /// Releases every owner's local optimizer and waits for the owners
    /// (OPT-4).
    ///
    /// # Errors
    /// An owner that could not be told (e.g. it has stopped); the others
    /// are released anyway.
    pub async fn close(mut self) -> Result<()> {
        self.closed = true;
        self.release().await
    }

    async fn release(&self) -> Result<()> {
        let futures: Vec<_> = self
            .owners
            .iter()
            .map(|owner| {
                self.agent
                    .rpc_async(owner.as_str(), DELETE, Args::new().arg(self.id))
            })
            .collect();
        let results = wait_all_results(futures).await;
        for (owner, r) in self.owners.iter().zip(results) {
            r.map_err(|e| {
                e.context_line(format!("releasing the local optimizer on worker {owner}"))
            })?;
        }
        Ok(())
    }
}

impl Drop for DistributedOptimizer {
    fn drop(&mut self) {
        if self.closed || !self.agent.is_running() {
            return;
        }
        for owner in &self.owners {
            // Fire and forget: the agent sends it from its own runtime.
            let _ = self
                .agent
                .rpc_async(owner.as_str(), DELETE, Args::new().arg(self.id));
        }
    }
}

async fn wait_all_results(futures: Vec<crate::agent::Future>) -> Vec<Result<Payload>> {
    let mut out = Vec::with_capacity(futures.len());
    for f in futures {
        out.push(f.wait().await);
    }
    out
}

/// Registers the owner side among the agent's internal functions.
pub(crate) fn register(r: &FunctionRegistry) {
    state::register(r);
    r.register_native(CREATE, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let id = args.get(0)?.as_int()?;
        let config = OptimizerConfig::from_payload(&args.get(1)?)?;
        let mut params = Vec::new();
        for item in args.get(2)?.items()? {
            let rref = item.as_rref()?;
            if !rref.is_owner() {
                return Err(Error::value(format!(
                    "parameter RRef owned by {} was given to worker {}",
                    rref.owner_name(),
                    agent.name()
                )));
            }
            let value = rref.local_value(&agent).await?;
            let t = value.as_tensor().map_err(|_| {
                Error::type_error(format!(
                    "a parameter RRef on worker {} does not hold a tensor",
                    agent.name()
                ))
            })?;
            params.push(t);
        }
        let state = params.iter().map(|_| ParamState::Fresh).collect();
        let local = LocalOptimizer {
            config,
            params,
            state,
        };
        agent
            .state::<LocalOptimizers>()
            .by_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::new(tokio::sync::Mutex::new(local)));
        Ok(Payload::none())
    });
    r.register_native(STEP, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let id = args.get(0)?.as_int()?;
        let context_id = args.get(1)?.as_int()?;
        let local = agent.state::<LocalOptimizers>().get(&agent, id)?;
        // OPT-2: held across reading the gradients and the update.
        let mut local = local.lock().await;
        let grads = crate::dist_autograd::get_gradients(&agent, context_id)?;
        let per_param: Vec<Option<Tensor>> = local.params.iter().map(|p| grads.get(p)).collect();
        local.step(&per_param)?;
        Ok(Payload::none())
    });
    r.register_native(DELETE, |ctx, args: Args| async move {
        let id = args.get(0)?.as_int()?;
        ctx.agent()
            .state::<LocalOptimizers>()
            .by_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        Ok(Payload::none())
    });
}

/// Releases a worker's local optimizers at its graceful shutdown (OPT-4).
/// The distributed optimizer on the agent: its owner-side functions, and
/// graceful shutdown drops the local optimizers.
pub(crate) struct Optimizers;

impl crate::agent::Extension for Optimizers {
    fn name(&self) -> &'static str {
        "optim"
    }

    fn register(&self, functions: &FunctionRegistry) {
        register(functions);
    }

    fn shutdown(
        &self,
        agent: &RpcAgent,
    ) -> Option<futures::future::BoxFuture<'static, Result<()>>> {
        let agent = agent.clone();
        Some(Box::pin(async move {
            agent.state::<LocalOptimizers>().clear();
            Ok(())
        }))
    }
}

#[cfg(test)]
mod tests;
