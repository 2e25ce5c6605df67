//! The distributed backward pass (DA-5 .. DA-7), custom functions and the
//! gradients a context holds.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;
use wasmrpc_torch_sys::{GradOptions, grad};

use super::context::{DistAutogradContext, container, current_context};
use super::graph::{
    Cut, Gradients, RECV_RPC_BACKWARD_NAME, Reach, SEND_RPC_BACKWARD_NAME, Tensors, walk,
};
use crate::abi::Value;
use crate::agent::{Future, RpcAgent};
use crate::error::{
    ERROR_ON_NODE_PREFIX, Error, NO_TENSORS_FOR_GRADIENT, ROOT_NO_GRAD_FN, ROOT_NOT_SCALAR,
    ROOT_REQUIRES_GRAD_NOT_SET, Result, error_on_node,
};
use crate::profiler::Recording;
use crate::tensor::impl_id;
use crate::transport::{AutogradEnvelope, Message};
use crate::value::Payload;

/// The backward of a custom function: the gradients of its outputs (`None`
/// for an output that got none) to the gradients of its inputs.
pub(crate) type BackwardFn =
    dyn Fn(&[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static;

/// A function with its own backward, recorded in a context: its outputs
/// are leaves that cut the local graph.
pub(crate) struct CustomFunction {
    id: i64,
    inputs: Tensors,
    outputs: Tensors,
    backward: Box<BackwardFn>,
    reach: std::sync::OnceLock<Arc<Reach>>,
}

/// What fires in a pass (DA-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Entry {
    Roots,
    Send(i64),
    Custom(i64),
}

struct PassState {
    /// Entries that have not fired yet.
    pending: BTreeSet<Entry>,
    reach: HashMap<Entry, Arc<Reach>>,
    outputs: HashMap<Entry, Vec<Tensor>>,
    /// For each cut, how many unfired entries reach it.
    remaining: HashMap<Cut, usize>,
    /// Which entries reach each cut's leaves, to count down.
    cut_grads: HashMap<usize, Tensor>,
    local: HashMap<usize, (Tensor, Tensor)>,
}

/// One backward pass of a context on this worker.
pub(crate) struct Pass {
    ctx: DistAutogradContext,
    agent: RpcAgent,
    retain_graph: bool,
    state: Mutex<Option<PassState>>,
    /// Gradient requests this pass sent (DA-7).
    outstanding: Mutex<Vec<Future>>,
    done: Future,
    /// The profiling scope `backward` was called in (`crate::profiler`),
    /// taken at the start since the pass fires on other tasks and threads:
    /// each firing of a send or recv function is an event in it.
    profiler: Option<Recording>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn add_grad(acc: Option<Tensor>, g: Tensor) -> Result<Tensor> {
    match acc {
        None => Ok(g),
        Some(a) => Ok(a.f_add(&g)?),
    }
}

impl Pass {
    /// Starts a pass over every send record and custom function of `ctx`,
    /// plus `roots` if this worker called `backward`.
    fn start(
        agent: &RpcAgent,
        ctx: &DistAutogradContext,
        roots: Option<&[Tensor]>,
        retain_graph: bool,
    ) -> Arc<Pass> {
        let (sends, customs, cut_of) = {
            let st = ctx.state();
            (
                st.sends.values().cloned().collect::<Vec<_>>(),
                st.customs.values().cloned().collect::<Vec<_>>(),
                st.cut_leaves.clone(),
            )
        };
        let cut = |id: usize| cut_of.get(&id).copied();
        let mut reach = HashMap::new();
        let mut outputs = HashMap::new();
        if let Some(roots) = roots {
            reach.insert(Entry::Roots, Arc::new(walk(roots, &cut)));
            outputs.insert(
                Entry::Roots,
                roots.iter().map(Tensor::shallow_clone).collect(),
            );
        }
        for s in &sends {
            let r = s
                .inner
                .reach
                .get_or_init(|| Arc::new(walk(&s.inner.tensors.get(), &cut)))
                .clone();
            reach.insert(Entry::Send(s.message_id()), r);
            outputs.insert(Entry::Send(s.message_id()), s.tensors());
        }
        for c in &customs {
            let r = c
                .reach
                .get_or_init(|| Arc::new(walk(&c.inputs.get(), &cut)))
                .clone();
            reach.insert(Entry::Custom(c.id), r);
            outputs.insert(Entry::Custom(c.id), c.inputs.get());
        }
        let mut remaining: HashMap<Cut, usize> = HashMap::new();
        for r in reach.values() {
            for c in &r.cuts {
                *remaining.entry(*c).or_default() += 1;
            }
        }
        let pending = reach.keys().copied().collect();
        Arc::new(Pass {
            ctx: ctx.clone(),
            agent: agent.clone(),
            retain_graph,
            state: Mutex::new(Some(PassState {
                pending,
                reach,
                outputs,
                remaining,
                cut_grads: HashMap::new(),
                local: HashMap::new(),
            })),
            outstanding: Mutex::new(Vec::new()),
            done: Future::new(),
            profiler: Recording::active(),
        })
    }

    /// Fails the pass (DA-7): every waiter gets `e`; nothing is committed.
    /// Never takes the pass's own lock, so it may run from a callback while
    /// the pass fires.
    pub(crate) fn fail(&self, e: Error) {
        let _ = self.done.set_error(e);
        self.detach();
    }

    fn detach(&self) {
        let mut st = self.ctx.state();
        if let Some(p) = &st.pass
            && std::ptr::eq(Arc::as_ptr(p), self)
        {
            st.pass = None;
        }
    }

    /// The custom functions with no entry reaching them fire at once, with
    /// no gradient.
    fn initial_work(&self) -> Vec<(Entry, Vec<Option<Tensor>>)> {
        let st = lock(&self.state);
        let Some(st) = st.as_ref() else {
            return Vec::new();
        };
        st.pending
            .iter()
            .filter(
                |e| matches!(e, Entry::Custom(c) if !st.remaining.contains_key(&Cut::Custom(*c))),
            )
            .map(|e| (*e, Vec::new()))
            .collect()
    }

    /// Fires `entry` with `grads` (one per output; `None` for none) and
    /// whatever becomes ready after it, then completes the pass if nothing
    /// is left (DA-5, DA-6). Blocking: runs libtorch's engine.
    fn fire(self: &Arc<Self>, entry: Entry, grads: Vec<Option<Tensor>>) -> Result<()> {
        let mut work = std::collections::VecDeque::from([(entry, grads)]);
        if entry == Entry::Roots {
            work.extend(self.initial_work());
        }
        let mut guard = lock(&self.state);
        while let Some((entry, grads)) = work.pop_front() {
            if let Some(Err(e)) = self.done.try_value() {
                return Err(e);
            }
            let Some(st) = guard.as_mut() else {
                return Err(Error::runtime(format!(
                    "the backward pass of autograd context {} has ended",
                    self.ctx.context_id()
                )));
            };
            if !st.pending.remove(&entry) {
                return Err(Error::runtime(match entry {
                    Entry::Send(m) => format!(
                        "autograd message {m} of context {} got gradients twice in one backward pass, or has no send function",
                        self.ctx.context_id()
                    ),
                    _ => "an entry of a backward pass fired twice".to_string(),
                }));
            }
            let reach = st.reach.get(&entry).cloned();
            let outputs = st.outputs.remove(&entry).unwrap_or_default();
            if let Some(reach) = &reach {
                // A send function fires: the gradients for the tensors this
                // worker sent go into its local graph.
                let event = match (&self.profiler, entry) {
                    (Some(p), Entry::Send(_)) => Some(p.range(SEND_RPC_BACKWARD_NAME)),
                    _ => None,
                };
                self.run_engine(st, &outputs, grads, reach)?;
                drop(event);
                for cut in &reach.cuts {
                    let left = st.remaining.get_mut(cut).map(|n| {
                        *n -= 1;
                        *n
                    });
                    if left == Some(0) {
                        st.remaining.remove(cut);
                        if let Some(next) = self.dispatch(st, *cut)? {
                            work.push_back(next);
                        }
                    }
                }
            }
        }
        let complete = guard.as_ref().is_some_and(|st| st.pending.is_empty());
        if complete {
            let st = guard.take();
            drop(guard);
            if let Some(st) = st {
                self.commit(st);
            }
        }
        Ok(())
    }

    fn run_engine(
        &self,
        st: &mut PassState,
        outputs: &[Tensor],
        grads: Vec<Option<Tensor>>,
        reach: &Reach,
    ) -> Result<()> {
        if grads.len() > outputs.len() {
            return Err(Error::runtime(format!(
                "got {} gradients for {} tensors",
                grads.len(),
                outputs.len()
            )));
        }
        let mut outs = Vec::new();
        let mut seeds = Vec::new();
        for (t, g) in outputs.iter().zip(grads) {
            let Some(g) = g else { continue };
            if !g.defined() || !t.requires_grad() {
                continue;
            }
            if g.size() != t.size() && !(g.is_sparse() || t.is_sparse()) {
                return Err(Error::runtime(format!(
                    "gradient of shape {:?} for a tensor of shape {:?}",
                    g.size(),
                    t.size()
                )));
            }
            outs.push(t.shallow_clone());
            seeds.push(g);
        }
        let leaves = reach.leaves.get();
        if outs.is_empty() || leaves.is_empty() {
            return Ok(());
        }
        let results = grad(
            &outs,
            &seeds,
            &leaves,
            GradOptions {
                retain_graph: Some(true),
                create_graph: false,
                allow_unused: true,
            },
        )
        .map_err(|e| Error::new(e.kind(), e.to_string()))?;
        let cut_of: HashMap<usize, Cut> = self.ctx.state().cut_leaves.clone();
        for (leaf, g) in leaves.iter().zip(results) {
            let Some(g) = g else { continue };
            let id = impl_id(leaf);
            if cut_of.contains_key(&id) {
                let acc = st.cut_grads.remove(&id);
                st.cut_grads.insert(id, add_grad(acc, g)?);
            } else {
                let g = super::hook::apply(leaf, g)?;
                let acc = st.local.remove(&id).map(|(_, g)| g);
                st.local
                    .insert(id, (leaf.shallow_clone(), add_grad(acc, g)?));
            }
        }
        Ok(())
    }

    /// A cut whose gradients are final: a recv record sends them back; a
    /// custom function runs its backward and fires its inputs.
    fn dispatch(
        self: &Arc<Self>,
        st: &mut PassState,
        cut: Cut,
    ) -> Result<Option<(Entry, Vec<Option<Tensor>>)>> {
        match cut {
            Cut::Recv(m) => {
                let recv = self.ctx.state().recvs.get(&m).cloned();
                let Some(recv) = recv else {
                    return Ok(None);
                };
                // A recv function fires: the gradients of a received
                // tensor go back to its sender.
                let _event = self
                    .profiler
                    .as_ref()
                    .map(|p| p.range(RECV_RPC_BACKWARD_NAME));
                let grads: Vec<Option<Tensor>> = recv
                    .inner
                    .leaves
                    .get()
                    .iter()
                    .map(|l| st.cut_grads.remove(&impl_id(l)))
                    .collect();
                let fut = self.send_gradients(recv.message_id(), recv.from_worker(), grads);
                lock(&self.outstanding).push(fut);
                Ok(None)
            }
            Cut::Custom(c) => {
                let custom = self.ctx.state().customs.get(&c).cloned();
                let Some(custom) = custom else {
                    return Ok(None);
                };
                let grads: Vec<Option<Tensor>> = custom
                    .outputs
                    .get()
                    .iter()
                    .map(|o| st.cut_grads.remove(&impl_id(o)))
                    .collect();
                let input_grads = if grads.iter().any(Option::is_some) {
                    (custom.backward)(&grads)?
                } else {
                    Vec::new()
                };
                Ok(Some((Entry::Custom(c), input_grads)))
            }
        }
    }

    fn send_gradients(
        self: &Arc<Self>,
        message_id: i64,
        to: u32,
        grads: Vec<Option<Tensor>>,
    ) -> Future {
        let mut tensors = Vec::new();
        let values: Vec<Value> = grads
            .into_iter()
            .map(|g| match g {
                Some(g) => {
                    tensors.push(g);
                    Value::Tensor((tensors.len() - 1) as u32)
                }
                None => Value::None,
            })
            .collect();
        let envelope = AutogradEnvelope {
            context_id: self.ctx.context_id(),
            message_id,
            from_worker: self.agent.rank(),
        };
        let retain_graph = self.retain_graph;
        let fut = self.agent.request(
            i64::from(to),
            |id| Message::PropagateGradients {
                id,
                envelope,
                grads: values,
                retain_graph,
            },
            &tensors,
            None,
        );
        let pass = Arc::downgrade(self);
        fut.add_done_callback(move |f| {
            if let Some(Err(e)) = f.try_value()
                && let Some(pass) = pass.upgrade()
            {
                pass.fail(e);
            }
        });
        fut
    }

    /// The pass completed: its gradients join the context (DA-6).
    fn commit(&self, st: PassState) {
        if self.done.done() {
            return;
        }
        {
            let mut cst = self.ctx.state();
            for (id, (leaf, g)) in st.local {
                let entry = cst.grads.remove(&id);
                let g = match entry {
                    Some((_, acc)) => match acc.f_add(&g) {
                        Ok(sum) => sum,
                        Err(e) => {
                            drop(cst);
                            self.fail(Error::from(e));
                            return;
                        }
                    },
                    None => g,
                };
                cst.grads.insert(id, (leaf, g));
            }
        }
        self.detach();
        let _ = self.done.set_result(Payload::none());
    }
}

/// Runs [`Pass::fire`] on a blocking thread (libtorch's engine blocks).
async fn fire(pass: &Arc<Pass>, entry: Entry, grads: Vec<Option<Tensor>>) -> Result<()> {
    let p = pass.clone();
    tokio::task::spawn_blocking(move || p.fire(entry, grads))
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
    let roots = super::graph::Tensors::new(roots);
    async move {
        // The whole pass, until every worker is done, in the caller's
        // profiling scope.
        let _event = Recording::active()
            .map(|p| p.range(crate::profiler::DIST_AUTOGRAD_BACKWARD_PROFILING_KEY));
        let roots = roots.get();
        let started = start_backward(&agent, context_id, &roots, retain_graph);
        drop(roots);
        let (pass, seeds) = started?;
        if let Err(e) = fire(&pass, Entry::Roots, seeds).await {
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

async fn propagate(
    agent: &RpcAgent,
    envelope: AutogradEnvelope,
    grads: Vec<Value>,
    tensors: Vec<Tensor>,
    retain_graph: bool,
) -> Result<()> {
    let ctx = container(agent).retrieve(envelope.context_id)?;
    let grads = grads
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
        .collect::<Result<Vec<_>>>()?;
    let (pass, first) = {
        let running = ctx.state().pass.clone();
        match running {
            Some(p) => (p, false),
            None => install(&ctx, Pass::start(agent, &ctx, None, retain_graph)),
        }
    };
    if let Err(e) = fire(&pass, Entry::Send(envelope.message_id), grads).await {
        let e = error_on_node(agent.rank(), &e);
        pass.fail(e.clone());
        return Err(e);
    }
    if first {
        finish(&pass).await
    } else {
        pass.done.wait().await.map(|_| ())
    }
}

/// Serves the autograd requests a peer sends: gradients for a send record,
/// and context cleanup (DA-7, DA-8).
pub(crate) async fn handle_request(
    agent: &RpcAgent,
    message: Message,
    tensors: Vec<Tensor>,
) -> Result<Payload> {
    match message {
        Message::PropagateGradients {
            envelope,
            grads,
            retain_graph,
            ..
        } => {
            propagate(agent, envelope, grads, tensors, retain_graph)
                .await
                .map_err(|e| {
                    if e.message().starts_with(ERROR_ON_NODE_PREFIX) {
                        e
                    } else {
                        error_on_node(agent.rank(), &e)
                    }
                })?;
            Ok(Payload::none())
        }
        Message::CleanupAutogradContext { context_id, .. } => {
            super::context::release_if_present(agent, context_id);
            Ok(Payload::none())
        }
        other => Err(Error::runtime(format!(
            "message kind {:?} is not an autograd request",
            other.kind()
        ))),
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
        st.cut_leaves.insert(impl_id(o), Cut::Custom(id));
    }
    st.customs.insert(id, custom);
    Ok(outputs)
}
