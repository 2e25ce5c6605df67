//! A distributed optimizer's state (momentum buffers, Adam's step counts
//! and moments) read from and written back to its owners, so a job's
//! checkpoint can hold it and a resumed job continue where it stopped
//! (`DistributedOptimizer::state_dict` / `load_state_dict`).
//!
//! The state of one owner is a list with one entry per parameter, in the
//! order the parameters were given for that owner: `None` (no step yet),
//! `("momentum", buffer)` or `("adam", step, exp_avg, exp_avg_sq)`. The
//! whole state is a dict of owner name to that list. Loading checks every
//! entry against the owner's optimizer (its kind, each tensor's shape and
//! dtype against its parameter) before changing anything (OPT-5).

use tch::Tensor;

use super::{DistributedOptimizer, LocalOptimizer, LocalOptimizers, OptimizerConfig, ParamState};
use crate::agent::FunctionRegistry;
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

/// Internal function: a local optimizer's state.
pub(crate) const STATE: &str = "wasmrpc::_optim_state";
/// Internal function: replace a local optimizer's state.
pub(crate) const LOAD_STATE: &str = "wasmrpc::_optim_load_state";

fn copy(t: &Tensor) -> Result<Tensor> {
    Ok(t.f_detach_copy()?)
}

impl LocalOptimizer {
    fn state_payload(&self) -> Result<Payload> {
        let entries = self
            .state
            .iter()
            .map(|s| {
                Ok(match s {
                    ParamState::Fresh => Payload::none(),
                    ParamState::Momentum(buf) => Payload::tuple(vec![
                        Payload::from("momentum".to_string()),
                        Payload::from(copy(buf)?),
                    ]),
                    ParamState::Adam {
                        step,
                        exp_avg,
                        exp_avg_sq,
                    } => Payload::tuple(vec![
                        Payload::from("adam".to_string()),
                        Payload::from(i64::from(*step)),
                        Payload::from(copy(exp_avg)?),
                        Payload::from(copy(exp_avg_sq)?),
                    ]),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Payload::list(entries))
    }

    /// The state `list` describes, checked against this optimizer.
    fn parse_state(&self, list: &Payload, worker: &str) -> Result<Vec<ParamState>> {
        let items = list.items()?;
        if items.len() != self.params.len() {
            return Err(Error::value(format!(
                "the optimizer state for worker {worker} has {} entries, and its optimizer {} \
                 parameters",
                items.len(),
                self.params.len()
            )));
        }
        let tensor_like = |t: Tensor, i: usize, what: &str| -> Result<Tensor> {
            let p = &self.params[i];
            if t.size() != p.size() || t.kind() != p.kind() {
                return Err(Error::value(format!(
                    "the optimizer state's {what} of parameter {i} on worker {worker} is {:?} \
                     {:?}, and the parameter {:?} {:?}",
                    t.kind(),
                    t.size(),
                    p.kind(),
                    p.size()
                )));
            }
            copy(&t)
        };
        let mut states = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            if item.is_none() {
                states.push(ParamState::Fresh);
                continue;
            }
            let fields = item.items()?;
            let kind = fields
                .first()
                .map(Payload::as_str)
                .transpose()?
                .unwrap_or_default();
            states.push(match (kind, self.config, fields.len()) {
                ("momentum", OptimizerConfig::Sgd(_), 2) => {
                    ParamState::Momentum(tensor_like(fields[1].as_tensor()?, i, "momentum buffer")?)
                }
                ("adam", OptimizerConfig::Adam(_), 4) => ParamState::Adam {
                    step: i32::try_from(fields[1].as_int()?).map_err(|_| {
                        Error::value(format!(
                            "an Adam step count out of range on worker {worker}"
                        ))
                    })?,
                    exp_avg: tensor_like(fields[2].as_tensor()?, i, "exp_avg")?,
                    exp_avg_sq: tensor_like(fields[3].as_tensor()?, i, "exp_avg_sq")?,
                },
                _ => {
                    return Err(Error::value(format!(
                        "the optimizer state of parameter {i} on worker {worker} is a {kind:?} \
                         state with {} fields, which a {} optimizer cannot take",
                        fields.len(),
                        match self.config {
                            OptimizerConfig::Sgd(_) => "SGD",
                            OptimizerConfig::Adam(_) => "Adam",
                        }
                    )));
                }
            });
        }
        Ok(states)
    }
}

impl DistributedOptimizer {
    /// Every owner's state, as a dict of owner name to its list (see the
    /// module docs): tensors are copies, safe to save while training goes
    /// on.
    ///
    /// # Errors
    /// An owner's failure, naming the worker.
    pub async fn state_dict(&self) -> Result<Payload> {
        let futures: Vec<_> = self
            .owners
            .iter()
            .map(|owner| {
                self.agent
                    .rpc_async(owner.as_str(), STATE, Args::new().arg(self.id))
            })
            .collect();
        let mut entries = Vec::with_capacity(futures.len());
        for (owner, f) in self.owners.iter().zip(futures) {
            let state = f.wait().await.map_err(|e| {
                e.context_line(format!("reading the optimizer state on worker {owner}"))
            })?;
            entries.push((Payload::from(owner.clone()), state));
        }
        Ok(Payload::dict(entries))
    }

    /// Replaces every owner's state with what `state` (from
    /// [`state_dict`](Self::state_dict), of an optimizer of the same kind
    /// over the same parameters) holds for it.
    ///
    /// # Errors
    /// `ValueError` for a state that names no entry for an owner, or whose
    /// entries do not fit the owner's optimizer (count, kind, shapes);
    /// nothing changes on that owner then.
    pub async fn load_state_dict(&self, state: Payload) -> Result<()> {
        let mut futures = Vec::with_capacity(self.owners.len());
        for owner in &self.owners {
            let list = state.get(owner)?.ok_or_else(|| {
                Error::value(format!(
                    "the optimizer state has no entry for worker {owner}, which owns parameters \
                     of this optimizer"
                ))
            })?;
            futures.push(self.agent.rpc_async(
                owner.as_str(),
                LOAD_STATE,
                Args::new().arg(self.id).arg(list),
            ));
        }
        // Sent: not held across the waits (a payload's tensors are not
        // `Sync`).
        drop(state);
        for (owner, f) in self.owners.iter().zip(futures) {
            f.wait().await.map_err(|e| {
                e.context_line(format!("loading the optimizer state on worker {owner}"))
            })?;
        }
        Ok(())
    }
}

/// Registers the owner side of reading and loading state.
pub(super) fn register(r: &FunctionRegistry) {
    r.register_native(STATE, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let local = agent
            .state::<LocalOptimizers>()
            .get(&agent, args.get(0)?.as_int()?)?;
        let local = local.lock().await;
        local.state_payload()
    });
    r.register_native(LOAD_STATE, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let local = agent
            .state::<LocalOptimizers>()
            .get(&agent, args.get(0)?.as_int()?)?;
        let mut local = local.lock().await;
        let states = local.parse_state(&args.get(1)?, agent.name())?;
        local.state = states;
        Ok(Payload::none())
    });
}
