//! Autograd from inside a plugin: local autograd on host tensors
//! (`local_sgd_step`), a distributed autograd context opened by the guest
//! (`dist_add_grads`, `nested_context`), and a trainer that is a plugin
//! (`train`): forward through RPCs to the parameters' owners, distributed
//! backward, and a distributed optimizer step, once per input.

use wasmrpc_guest::dist_autograd;
use wasmrpc_guest::optim::{DistributedOptimizer, Optimizer};
use wasmrpc_guest::{Error, RRef, Result, Tensor, Value, no_grad, remote, rpc_sync};

/// One SGD step of `w` on `sum(tanh(w @ x))` with local autograd; returns
/// the updated weight (detached) and the gradient.
#[remote]
fn local_sgd_step(w: Tensor, x: Tensor, lr: f64) -> Result<(Tensor, Tensor)> {
    let w = w.detach()?.requires_grad_(true)?;
    if !w.requires_grad()? {
        return Err(Error::runtime_error("requires_grad_(true) did not stick"));
    }
    let m = w.matmul(&x)?;
    let loss = Tensor::call("aten::tanh", (&m,))?.sum()?;
    loss.backward()?;
    let g = w
        .grad()?
        .ok_or_else(|| Error::runtime_error("backward left no gradient"))?;
    no_grad(|| w.sub_(&g.mul(lr)?))?;
    Ok((w.detach()?, g))
}

/// `w.sub_(...)` on a leaf that requires grad, outside `no_grad`: libtorch
/// refuses it.
#[remote]
fn in_place_on_leaf(w: Tensor) -> Result<()> {
    let w = w.detach()?.requires_grad_(true)?;
    w.sub_(1.0)
}

/// In a context the guest opens: `add(t1, t2)` on `to`, backward from its
/// sum, and this worker's gradients of `t1` and `t2` (looked up by the
/// tensors themselves), plus the context id.
#[remote]
fn dist_add_grads(to: String, t1: Tensor, t2: Tensor) -> Result<(i64, Tensor, Tensor)> {
    let ctx = dist_autograd::context()?;
    if dist_autograd::current_context_id()? != Some(ctx.id()) {
        return Err(Error::runtime_error("the opened context is not current"));
    }
    let ret: Tensor = rpc_sync(&to, "aten::add", (&t1, &t2))?;
    let loss = ret.sum()?;
    dist_autograd::backward(ctx.id(), &[&loss], false)?;
    let grads = dist_autograd::get_gradients(ctx.id())?;
    if grads.len() != 2 {
        return Err(Error::runtime_error(format!(
            "{} gradients, want 2",
            grads.len()
        )));
    }
    let g1 = grads
        .get(&t1)?
        .ok_or_else(|| Error::runtime_error("no gradient for t1"))?
        .try_clone()?;
    let g2 = grads
        .get(&t2)?
        .ok_or_else(|| Error::runtime_error("no gradient for t2"))?
        .try_clone()?;
    Ok((ctx.id(), g1, g2))
}

/// Opens a context while one is current: the second one fails.
#[remote]
fn nested_context() -> Result<()> {
    let _outer = dist_autograd::context()?;
    let _inner = dist_autograd::context()?;
    Ok(())
}

/// A trainer: for each input `x`, in a context of its own, the loss
/// `sum_p sum(forward(p, x))` with `forward` run by each parameter's owner
/// (`optim::forward`, a host function of the test suite), distributed
/// backward, and one step of an SGD distributed optimizer.
#[remote]
fn train(params: Vec<RRef>, inputs: Vec<Tensor>, lr: f64, momentum: f64) -> Result<i64> {
    let opt = sgd(&params, lr, momentum)?;
    run_steps(&opt, &params, &inputs)
}

/// [`train`] resumed: the optimizer starts from `state` (what an earlier
/// call returned; `None` for a fresh one) and the call returns the
/// optimizer's state after its steps (`DistributedOptimizer::state_dict`),
/// as a job's checkpoint keeps it.
#[remote]
fn train_resuming(
    params: Vec<RRef>,
    inputs: Vec<Tensor>,
    lr: f64,
    momentum: f64,
    state: Value,
) -> Result<Value> {
    let opt = sgd(&params, lr, momentum)?;
    if !matches!(state, Value::None) {
        opt.load_state_dict(&state)?;
    }
    run_steps(&opt, &params, &inputs)?;
    opt.state_dict()
}

fn sgd(params: &[RRef], lr: f64, momentum: f64) -> Result<DistributedOptimizer> {
    let refs: Vec<&RRef> = params.iter().collect();
    DistributedOptimizer::new(
        Optimizer::Sgd {
            lr,
            momentum,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
        &refs,
    )
}

/// One step of `opt` per input (see [`train`]); returns the steps taken.
fn run_steps(opt: &DistributedOptimizer, params: &[RRef], inputs: &[Tensor]) -> Result<i64> {
    let mut steps = 0;
    for x in inputs {
        let ctx = dist_autograd::context()?;
        let mut loss: Option<Tensor> = None;
        for p in params {
            let owner = p.owner()?.name;
            let out: Tensor = rpc_sync(&owner, "optim::forward", (p, x))?;
            let s = out.sum()?;
            loss = Some(match loss {
                Some(l) => l.add(&s)?,
                None => s,
            });
        }
        let loss = loss.ok_or_else(|| Error::value_error("no parameters"))?;
        dist_autograd::backward(ctx.id(), &[&loss], false)?;
        opt.step(ctx.id())?;
        steps += 1;
    }
    Ok(steps)
}
