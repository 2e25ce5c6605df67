//! The entry points of distributed backward: `backward` on the worker that
//! starts a pass, the gradient and cleanup requests peers send (DA-7,
//! DA-8), the gradients a context accumulated, custom functions, and the
//! debug info, and running a pass's pieces (on the blocking pool or in
//! place) and waiting for it. The pass itself is the parent module's.

use super::{CustomFunction, Entry, Pass, ReplyGradients, lock};
use crate::abi::Value;
use crate::agent::{Future, RpcAgent};
use crate::dist_autograd::context::{DistAutogradContext, container, current_context};
use crate::dist_autograd::graph::{CutPoint, Gradients, Tensors};
use crate::dist_autograd::wire::{AutogradEnvelope, AutogradMessage};
use crate::error::{
    ERROR_ON_NODE_PREFIX, Error, NO_TENSORS_FOR_GRADIENT, ROOT_NO_GRAD_FN, ROOT_NOT_SCALAR,
    ROOT_REQUIRES_GRAD_NOT_SET, Result, error_on_node,
};
use crate::profiler::Recording;
use crate::tensor::impl_id;
use crate::value::Payload;
use std::collections::BTreeMap;
use std::sync::Arc;
use tch::Tensor;

/// Runs distributed backward from `roots` in context `context_id`
/// (`dist_autograd.backward`), across every worker the context reached
/// (DA-5 .. DA-7). Gradients accumulate in the context on each worker
/// ([`get_gradients`]), never in `.grad`. Passes run with the graph kept
/// (`retain_graph` is carried for PyTorch parity), so repeated passes
/// accumulate.
///
/// # Errors
/// - "Could not find autograd context with id: {id}";
/// - "No tensors provided for gradient computation.", "requires_grad not set
///   on root", "... is not a scalar, all roots need to be scalar", "...
///   does not have a valid gradient function.";
/// - any worker's failure ("Error on Node N: ..."), a dead peer or a timeout
///   of a gradient request; a pass already running in the context.
pub fn backward(
    agent: &RpcAgent,
    context_id: i64,
    roots: &[Tensor],
    retain_graph: bool,
) -> impl std::future::Future<Output = Result<()>> + Send + use<> {
    let agent = agent.clone();
    // The roots are taken now, so the future does not borrow them.
    let roots: Vec<Tensor> = roots.iter().map(Tensor::shallow_clone).collect();
    let roots = crate::dist_autograd::graph::Tensors::new(roots);
    async move {
        // The whole pass, until every worker is done, in the caller's
        // profiling scope.
        let _event = Recording::active()
            .map(|p| p.range(crate::profiler::DIST_AUTOGRAD_BACKWARD_PROFILING_KEY));
        let roots = roots.get();
        let started = start_backward(&agent, context_id, &roots, retain_graph);
        drop(roots);
        let (pass, seeds) = started?;
        if let Err(e) = fire(&pass, Entry::Roots, seeds, None).await {
            pass.fail(e.clone());
            return Err(e);
        }
        finish(&pass).await
    }
}

fn start_backward(
    agent: &RpcAgent,
    context_id: i64,
    roots: &[Tensor],
    retain_graph: bool,
) -> Result<(Arc<Pass>, Vec<Option<Tensor>>)> {
    let ctx = container(agent).retrieve(context_id)?;
    validate_roots(&ctx, roots)?;
    let pass = Pass::start(agent, &ctx, Some(roots), retain_graph);
    let (pass, mine) = install(&ctx, pass);
    if !mine {
        return Err(Error::runtime(format!(
            "autograd context {context_id} is already running a backward pass"
        )));
    }
    let seeds = roots
        .iter()
        .map(|r| r.f_ones_like().map(Some))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            let e = Error::from(e);
            pass.fail(e.clone());
            e
        })?;
    Ok((pass, seeds))
}

/// The gradients of a request, as sent: one per tensor of the send record.
fn gradients_of_request(grads: Vec<Value>, tensors: Vec<Tensor>) -> Result<Vec<Option<Tensor>>> {
    grads
        .into_iter()
        .map(|v| match v {
            Value::None => Ok(None),
            Value::Tensor(i) => tensors
                .get(i as usize)
                .map(|t| Some(t.shallow_clone()))
                .ok_or_else(|| Error::runtime(format!("gradient refers to missing tensor {i}"))),
            other => Err(Error::type_error(format!(
                "a gradient must be a tensor or None, not {}",
                other.type_name()
            ))),
        })
        .collect()
}

/// Fires the gradients `envelope.from_worker` sent for this worker's send
/// record `envelope.message_id`, joining the context's running pass or
/// starting one; returns once this worker's part is done, with the
/// gradients that ride back to `requester` (see [`Pass::fire`]).
async fn propagate(
    agent: &RpcAgent,
    envelope: AutogradEnvelope,
    grads: Vec<Option<Tensor>>,
    retain_graph: bool,
    requester: Option<u32>,
) -> Result<Vec<ReplyGradients>> {
    let ctx = container(agent).retrieve(envelope.context_id)?;
    let (pass, first) = {
        let running = ctx.state().pass.clone();
        match running {
            Some(p) => (p, false),
            None => install(&ctx, Pass::start(agent, &ctx, None, retain_graph)),
        }
    };
    let reply_gradients =
        match fire(&pass, Entry::Send(envelope.message_id), grads, requester).await {
            Ok(p) => p,
            Err(e) => {
                let e = error_on_node(agent.rank(), &e);
                pass.fail(e.clone());
                return Err(e);
            }
        };
    if first {
        finish(&pass).await?;
    } else {
        pass.done.wait().await?;
    }
    Ok(reply_gradients)
}

/// Serves the autograd requests a peer sends: gradients for a send record,
/// and context cleanup (DA-7, DA-8).
pub(crate) async fn handle_request(
    agent: &RpcAgent,
    message: AutogradMessage,
    tensors: Vec<Tensor>,
) -> Result<Payload> {
    match message {
        AutogradMessage::PropagateGradients {
            envelope,
            grads,
            retain_graph,
        } => {
            let requester = envelope.from_worker;
            let reply_gradients = async {
                let grads = gradients_of_request(grads, tensors)?;
                propagate(agent, envelope, grads, retain_graph, Some(requester)).await
            }
            .await
            .map_err(|e| {
                if e.message().starts_with(ERROR_ON_NODE_PREFIX) {
                    e
                } else {
                    error_on_node(agent.rank(), &e)
                }
            })?;
            Ok(ReplyGradients::encode(reply_gradients))
        }
        AutogradMessage::CleanupAutogradContext { context_ids } => {
            for id in context_ids {
                crate::dist_autograd::context::release_if_present(agent, id);
            }
            Ok(Payload::none())
        }
    }
}

/// The gradients context `context_id` accumulated on this worker
/// (`dist_autograd.get_gradients`).
///
/// # Errors
/// "Could not find autograd context with id: {id}".
pub fn get_gradients(agent: &RpcAgent, context_id: i64) -> Result<Gradients> {
    let ctx = container(agent).retrieve(context_id)?;
    let st = ctx.state();
    Ok(Gradients::new(
        st.grads
            .values()
            .map(|(k, g)| (k.shallow_clone(), g.shallow_clone()))
            .collect(),
    ))
}

/// `dist_autograd._get_debug_info()`: exactly `num_current_backward_passes`
/// and `num_autograd_contexts`.
pub fn get_debug_info(agent: &RpcAgent) -> BTreeMap<String, String> {
    let c = container(agent);
    let contexts = c.contexts();
    let passes = contexts.iter().filter(|x| x.state().pass.is_some()).count();
    BTreeMap::from([
        (
            "num_current_backward_passes".to_string(),
            passes.to_string(),
        ),
        ("num_autograd_contexts".to_string(), c.len().to_string()),
    ])
}

/// Applies a function with its own backward inside the current context
/// (PyTorch's custom `autograd.Function`): `forward` runs on detached
/// inputs without recording; when an input requires grad its outputs are
/// fresh leaves that cut the local graph, and in a distributed backward
/// `backward` maps the outputs' gradients to the inputs' (one per input,
/// `None` for none). An error it returns fails the pass.
///
/// # Errors
/// No current context ("Current thread doesn't have a valid autograd
/// context..."), or `forward`'s error.
pub fn apply_function<F, B>(
    agent: &RpcAgent,
    inputs: &[Tensor],
    forward: F,
    backward: B,
) -> Result<Vec<Tensor>>
where
    F: FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
    B: Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
{
    let ctx = current_context(agent)?;
    let detached: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
    let outputs = {
        let _no_grad = tch::no_grad_guard();
        forward(&detached)?
    };
    if !inputs.iter().any(|t| t.defined() && t.requires_grad()) {
        return Ok(outputs);
    }
    let outputs: Vec<Tensor> = outputs
        .into_iter()
        .map(|o| o.detach().f_set_requires_grad(true))
        .collect::<std::result::Result<_, _>>()?;
    let id = container(agent).new_message_id(agent.rank())?;
    let custom = Arc::new(CustomFunction {
        id,
        inputs: Tensors::new(inputs.iter().map(Tensor::shallow_clone).collect()),
        outputs: Tensors::new(outputs.iter().map(Tensor::shallow_clone).collect()),
        backward: Box::new(backward),
        reach: std::sync::OnceLock::new(),
    });
    let mut st = ctx.state();
    for o in &outputs {
        st.cut_leaves.insert(impl_id(o), CutPoint::Custom(id));
    }
    st.customs.insert(id, custom);
    Ok(outputs)
}

/// Runs [`Pass::fire`] on a blocking thread (libtorch's engine blocks),
/// or in place when the pass is cheap and no hook (user code) may run.
pub(super) async fn fire(
    pass: &Arc<Pass>,
    entry: Entry,
    grads: Vec<Option<Tensor>>,
    requester: Option<u32>,
) -> Result<Vec<ReplyGradients>> {
    if pass.cheap && !crate::dist_autograd::hook::any_registered() {
        return pass.fire(entry, grads, requester);
    }
    let p = pass.clone();
    tokio::task::spawn_blocking(move || {
        crate::ops::adopt_intra_op_threads();
        p.fire(entry, grads, requester)
    })
    .await
    .map_err(|e| Error::runtime(format!("the backward pass task failed: {e}")))?
}

/// Waits for the pass, then for every gradient request it sent (DA-7).
async fn finish(pass: &Arc<Pass>) -> Result<()> {
    pass.done.wait().await?;
    let outstanding: Vec<Future> = lock(&pass.outstanding).clone();
    for f in outstanding {
        f.wait().await?;
    }
    Ok(())
}

fn validate_roots(ctx: &DistAutogradContext, roots: &[Tensor]) -> Result<()> {
    if roots.is_empty() {
        return Err(Error::runtime(NO_TENSORS_FOR_GRADIENT));
    }
    for r in roots {
        if !r.defined() || !r.requires_grad() {
            return Err(Error::runtime(ROOT_REQUIRES_GRAD_NOT_SET));
        }
        if r.numel() != 1 {
            return Err(Error::runtime(ROOT_NOT_SCALAR));
        }
        let cut = ctx.state().cut_leaves.contains_key(&impl_id(r));
        if !cut && wasmrpc_torch_sys::GradFn::of(r).is_none() {
            return Err(Error::runtime(ROOT_NO_GRAD_FN));
        }
    }
    Ok(())
}

/// Installs `pass` as `ctx`'s running pass, unless one runs; returns the
/// running one and whether it is `pass`.
fn install(ctx: &DistAutogradContext, pass: Arc<Pass>) -> (Arc<Pass>, bool) {
    let mut st = ctx.state();
    match &st.pass {
        Some(p) => (p.clone(), false),
        None => {
            st.pass = Some(pass.clone());
            (pass, true)
        }
    }
}
