//! The distributed optimizer from inside a plugin
//! (`torch.distributed.optim.DistributedOptimizer`), so that a trainer can
//! be a plugin: one optimizer over parameter RRefs owned by many workers,
//! stepped with one distributed autograd context's gradients.

use crate::autograd::request;
use crate::convert::mismatch;
use crate::{RRef, Result};
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::AutogradCall;

/// The local optimizer each owner runs, with PyTorch's hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// `torch.optim.SGD(lr, momentum, dampening, weight_decay, nesterov)`.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor.
        momentum: f64,
        /// Dampening of the momentum.
        dampening: f64,
        /// L2 penalty.
        weight_decay: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// `torch.optim.Adam(lr, betas, eps, weight_decay)`.
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay rates of the moment estimates.
        betas: (f64, f64),
        /// Added to the denominator.
        eps: f64,
        /// L2 penalty.
        weight_decay: f64,
    },
}

impl Optimizer {
    /// Plain SGD.
    pub fn sgd(lr: f64) -> Optimizer {
        Optimizer::Sgd {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Adam with PyTorch's defaults (betas `(0.9, 0.999)`, eps `1e-8`).
    pub fn adam(lr: f64) -> Optimizer {
        Optimizer::Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    fn to_value(self) -> Value {
        match self {
            Optimizer::Sgd {
                lr,
                momentum,
                dampening,
                weight_decay,
                nesterov,
            } => Value::Tuple(vec![
                Value::Str("sgd".into()),
                Value::Float(lr),
                Value::Float(momentum),
                Value::Float(dampening),
                Value::Float(weight_decay),
                Value::Bool(nesterov),
            ]),
            Optimizer::Adam {
                lr,
                betas,
                eps,
                weight_decay,
            } => Value::Tuple(vec![
                Value::Str("adam".into()),
                Value::Float(lr),
                Value::Float(betas.0),
                Value::Float(betas.1),
                Value::Float(eps),
                Value::Float(weight_decay),
            ]),
        }
    }
}

/// An optimizer over parameters on many workers; dropping it releases
/// every owner's state (so does the end of the call that made it).
#[derive(Debug)]
pub struct DistributedOptimizer {
    id: i64,
}

impl DistributedOptimizer {
    /// Creates a local optimizer on every owner of `params`.
    ///
    /// # Errors
    /// `ValueError` for invalid hyperparameters ("Invalid learning rate:
    /// ..."); an owner's failure, naming the worker.
    pub fn new(optimizer: Optimizer, params: &[&RRef]) -> Result<DistributedOptimizer> {
        let call = AutogradCall::OptimizerNew {
            config: optimizer.to_value(),
            params: params.iter().map(|r| r.handle()).collect(),
        };
        match request(call)? {
            Value::Int(id) => Ok(DistributedOptimizer { id }),
            other => Err(mismatch("int", &other)),
        }
    }

    /// Steps every owner's parameters with the gradients of `context_id`,
    /// all owners at once.
    ///
    /// # Errors
    /// The first owner's failure, naming the worker.
    pub fn step(&self, context_id: i64) -> Result<()> {
        request(AutogradCall::OptimizerStep {
            optimizer: self.id,
            context_id,
        })
        .map(|_| ())
    }
}

impl DistributedOptimizer {
    /// Every owner's state (momentum buffers, Adam's step counts and
    /// moments), as a dict of owner name to a list with one entry per
    /// parameter: `None`, `("momentum", buffer)` or `("adam", step,
    /// exp_avg, exp_avg_sq)`. Its tensors are copies: save them with the
    /// parameters to resume a job (see [`crate::checkpoint`]).
    ///
    /// # Errors
    /// An owner's failure, naming the worker.
    pub fn state_dict(&self) -> Result<Value> {
        request(AutogradCall::OptimizerState(self.id))
    }

    /// Replaces every owner's state with what `state` (from
    /// [`state_dict`](Self::state_dict) of an optimizer of the same kind over
    /// the same parameters) holds for it.
    ///
    /// # Errors
    /// A `ValueError` for a state that does not fit an owner's optimizer
    /// (its kind, the number of parameters, a shape); nothing changes on
    /// that owner then.
    pub fn load_state_dict(&self, state: &Value) -> Result<()> {
        request(AutogradCall::OptimizerLoadState {
            optimizer: self.id,
            state: state.clone(),
        })
        .map(|_| ())
    }
}

impl Drop for DistributedOptimizer {
    fn drop(&mut self) {
        // A failure means the host already released it.
        let _ = request(AutogradCall::OptimizerDrop(self.id));
    }
}
