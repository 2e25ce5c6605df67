//! Contexts: the per-worker container, ids (DA-1), the task-local current
//! context (DA-2), what RPCs record in a context (DA-3, DA-4) and release
//! (DA-8; the requests that tell peers are `cleanup`'s).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::Tensor;

use super::engine::{CustomFunction, Pass};
use super::graph::{CutPoint, Node, RecvFunction, SendFunction};
use super::wire::AutogradEnvelope;
use crate::agent::RpcAgent;
use crate::error::{
    ALREADY_HAVE_AUTOGRAD_CONTEXT, Error, NO_CURRENT_AUTOGRAD_CONTEXT, Result,
    unknown_autograd_context_message,
};
use crate::tensor::impl_id;

/// Bits of an id that hold the per-worker counter (DA-1).
const COUNTER_BITS: u32 = 48;
const COUNTER_MASK: i64 = (1 << COUNTER_BITS) - 1;

tokio::task_local! {
    static CURRENT: i64;
}

/// The worker's contexts and id counters, in the agent's per-worker state.
#[derive(Default)]
pub(crate) struct Container {
    contexts: Mutex<HashMap<i64, DistAutogradContext>>,
    next_context: AtomicI64,
    next_message: AtomicI64,
    /// Cleanups of released contexts still to be sent to peers (DA-8).
    pub(super) cleanups: super::cleanup::Outbox,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn container(agent: &RpcAgent) -> Arc<Container> {
    agent.state::<Container>()
}

fn make_id(rank: u32, counter: i64) -> Result<i64> {
    if counter > COUNTER_MASK {
        return Err(Error::runtime(
            "distributed autograd ids of this worker are exhausted",
        ));
    }
    Ok((i64::from(rank) << COUNTER_BITS) | counter)
}

impl Container {
    fn new_context_id(&self, rank: u32) -> Result<i64> {
        make_id(rank, self.next_context.fetch_add(1, Ordering::Relaxed))
    }

    /// A fresh autograd message id of this worker (DA-1).
    pub(crate) fn new_message_id(&self, rank: u32) -> Result<i64> {
        make_id(rank, self.next_message.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn get(&self, id: i64) -> Option<DistAutogradContext> {
        lock(&self.contexts).get(&id).cloned()
    }

    pub(crate) fn retrieve(&self, id: i64) -> Result<DistAutogradContext> {
        self.get(id)
            .ok_or_else(|| Error::runtime(unknown_autograd_context_message(id)))
    }

    fn get_or_create(&self, id: i64) -> DistAutogradContext {
        lock(&self.contexts)
            .entry(id)
            .or_insert_with(|| DistAutogradContext::new(id))
            .clone()
    }

    fn remove(&self, id: i64) -> Option<DistAutogradContext> {
        lock(&self.contexts).remove(&id)
    }

    pub(crate) fn len(&self) -> usize {
        lock(&self.contexts).len()
    }

    pub(crate) fn contexts(&self) -> Vec<DistAutogradContext> {
        lock(&self.contexts).values().cloned().collect()
    }
}

/// What a context holds; guarded by the context's lock.
#[derive(Default)]
pub(crate) struct ContextState {
    pub(crate) sends: BTreeMap<i64, SendFunction>,
    pub(crate) recvs: BTreeMap<i64, RecvFunction>,
    pub(crate) customs: BTreeMap<i64, Arc<CustomFunction>>,
    /// Tensor identity → the cut (recv record or custom function) whose
    /// output it is.
    pub(crate) cut_leaves: HashMap<usize, CutPoint>,
    pub(crate) known_workers: BTreeSet<u32>,
    /// Accumulated gradients: leaf identity → (leaf, gradient).
    pub(crate) grads: HashMap<usize, (Tensor, Tensor)>,
    pub(crate) pass: Option<Arc<Pass>>,
}

pub(crate) struct ContextInner {
    pub(crate) id: i64,
    pub(crate) state: Mutex<ContextState>,
}

/// A distributed autograd context on one worker (PyTorch's
/// `DistAutogradContext`): cheap to clone, clones are the same context.
#[derive(Clone)]
pub struct DistAutogradContext {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for DistAutogradContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistAutogradContext")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl PartialEq for DistAutogradContext {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl DistAutogradContext {
    fn new(id: i64) -> Self {
        DistAutogradContext {
            inner: Arc::new(ContextInner {
                id,
                state: Mutex::new(ContextState::default()),
            }),
        }
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, ContextState> {
        lock(&self.inner.state)
    }

    pub(crate) fn weak(&self) -> Weak<ContextInner> {
        Arc::downgrade(&self.inner)
    }

    /// The context's id (`_context_id()`).
    pub fn context_id(&self) -> i64 {
        self.inner.id
    }

    /// The send records, ordered by autograd message id (`_send_functions()`,
    /// DA-4).
    pub fn send_functions(&self) -> Vec<(i64, SendFunction)> {
        self.state()
            .sends
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }

    /// The recv records, ordered by autograd message id (`_recv_functions()`).
    pub fn recv_functions(&self) -> Vec<(i64, RecvFunction)> {
        self.state()
            .recvs
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }

    /// The ranks this context sent messages to (`_known_worker_ids()`).
    pub fn known_worker_ids(&self) -> BTreeSet<u32> {
        self.state().known_workers.clone()
    }

    /// The autograd node of `tensor` as this context sees it (Python's
    /// `t.grad_fn`): the recv record for a tensor received in this context,
    /// libtorch's node otherwise, `None` for a leaf.
    pub fn grad_fn(&self, tensor: &Tensor) -> Option<Node> {
        let cut = self.state().cut_leaves.get(&impl_id(tensor)).copied();
        match cut {
            Some(CutPoint::Recv(m)) => self.state().recvs.get(&m).cloned().map(Node::recv),
            _ => wasmrpc_torch_sys::GradFn::of(tensor).map(|g| Node::autograd(g, self.weak())),
        }
    }

    pub(crate) fn add_send(&self, message_id: i64, to: u32, tensors: Vec<Tensor>) {
        let send = SendFunction::new(message_id, to, tensors, self.weak());
        self.state().sends.insert(message_id, send);
    }

    /// Records the tensors requiring grad of a received message;
    /// `grads_map`: the map their gradients travel back with (the inverse
    /// of the message's: `Response` for a request, `Request` for a
    /// response).
    pub(crate) fn add_recv(
        &self,
        message_id: i64,
        from: u32,
        grads_map: crate::device::MapDirection,
        leaves: Vec<Tensor>,
    ) {
        let mut st = self.state();
        for t in &leaves {
            st.cut_leaves.insert(impl_id(t), CutPoint::Recv(message_id));
        }
        st.recvs.insert(
            message_id,
            RecvFunction::new(message_id, from, grads_map, leaves),
        );
    }
}

/// The current task's context id, if it has one (DA-2).
pub fn current_context_id() -> Option<i64> {
    CURRENT.try_with(|id| *id).ok()
}

/// The current task's context on `agent` (`_current_context()`).
///
/// # Errors
/// `RuntimeError` "Current thread doesn't have a valid autograd context..."
/// without one.
pub fn current_context(agent: &RpcAgent) -> Result<DistAutogradContext> {
    current_context_id()
        .and_then(|id| container(agent).get(id))
        .ok_or_else(|| Error::runtime(NO_CURRENT_AUTOGRAD_CONTEXT))
}

fn check_not_nested() -> Result<()> {
    if current_context_id().is_some() {
        return Err(Error::runtime(ALREADY_HAVE_AUTOGRAD_CONTEXT));
    }
    Ok(())
}

/// Creates a context on `agent` with a fresh id, without making it current
/// (`_new_context()`; run code in it with [`with_context`], release it with
/// [`release_context`]).
///
/// # Errors
/// `RuntimeError` "Already have an autograd context id for this thread." when
/// the task already has a current context.
pub fn new_context(agent: &RpcAgent) -> Result<DistAutogradContext> {
    check_not_nested()?;
    let c = container(agent);
    let id = c.new_context_id(agent.rank())?;
    Ok(c.get_or_create(id))
}

/// Releases the context when dropped (the end of a `with` block).
struct ReleaseGuard {
    agent: RpcAgent,
    id: i64,
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        release_if_present(&self.agent, self.id);
    }
}

/// Runs `body` inside a fresh context (`with dist_autograd.context() as
/// context_id:`): the context is current for `body`'s task and everything
/// it calls, and is released on every worker it reached when `body` ends
/// (or is dropped).
///
/// # Errors
/// `RuntimeError` "Already have an autograd context id for this thread."
/// inside another context.
pub fn context<F, Fut, T>(
    agent: &RpcAgent,
    body: F,
) -> impl std::future::Future<Output = Result<T>> + use<F, Fut, T>
where
    F: FnOnce(i64) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    // `body` runs now, so the returned future holds only what it returned.
    let started = new_context(agent).map(|ctx| {
        let id = ctx.context_id();
        let guard = ReleaseGuard {
            agent: agent.clone(),
            id,
        };
        (guard, id, body(id))
    });
    async move {
        let (guard, id, fut) = started?;
        let out = CURRENT.scope(id, fut).await;
        drop(guard);
        Ok(out)
    }
}

/// Runs `fut` with context `id` current (the context must exist on the
/// worker for RPCs to record in it). Used for contexts made with
/// [`new_context`] and to carry a context into a spawned task.
///
/// # Errors
/// `RuntimeError` "Already have an autograd context id for this thread."
/// when another context is current.
pub async fn with_context<Fut: std::future::Future>(id: i64, fut: Fut) -> Result<Fut::Output> {
    match current_context_id() {
        Some(c) if c == id => Ok(fut.await),
        Some(_) => Err(Error::runtime(ALREADY_HAVE_AUTOGRAD_CONTEXT)),
        None => Ok(CURRENT.scope(id, fut).await),
    }
}

/// Runs `f` with `id` current unless the task already has a context (a
/// plugin's own context, opened inside a call that runs in none, DA-2).
pub(crate) fn sync_scope<R>(id: Option<i64>, f: impl FnOnce() -> R) -> R {
    match id {
        Some(id) if current_context_id().is_none() => CURRENT.sync_scope(id, f),
        _ => f(),
    }
}

/// Runs `fut` with `id` current, or with no context for `None`; for the
/// agent's callee tasks.
pub(crate) async fn scope<Fut: std::future::Future>(id: Option<i64>, fut: Fut) -> Fut::Output {
    match id {
        Some(id) => CURRENT.scope(id, fut).await,
        None => fut.await,
    }
}

/// The context `id` on `agent` (`_retrieve_context(id)`).
///
/// # Errors
/// `RuntimeError` "Could not find autograd context with id: {id}".
pub fn retrieve_context(agent: &RpcAgent, id: i64) -> Result<DistAutogradContext> {
    container(agent).retrieve(id)
}

/// The largest context id this worker can make (`_get_max_id()`).
pub fn get_max_id(agent: &RpcAgent) -> i64 {
    (i64::from(agent.rank()) << COUNTER_BITS) | COUNTER_MASK
}

/// Releases context `id` here and on every worker it reached
/// (`_release_context(id)`, DA-8).
///
/// # Errors
/// `RuntimeError` "Could not find autograd context with id: {id}".
pub fn release_context(agent: &RpcAgent, id: i64) -> Result<()> {
    if release_if_present(agent, id) {
        Ok(())
    } else {
        Err(Error::runtime(unknown_autograd_context_message(id)))
    }
}

/// Releases `id` if this worker has it; tells its known workers (in the
/// next batch of cleanups, DA-8). Returns whether it was present.
pub(crate) fn release_if_present(agent: &RpcAgent, id: i64) -> bool {
    let c = container(agent);
    let Some(ctx) = c.remove(id) else {
        return false;
    };
    let (workers, pass) = {
        let mut st = ctx.state();
        (st.known_workers.clone(), st.pass.take())
    };
    if let Some(pass) = pass {
        pass.fail(Error::runtime(format!(
            "autograd context {id} was released during its backward pass"
        )));
    }
    for w in workers {
        c.cleanups.send(agent, w, id);
    }
    true
}

/// FAIL-5 for distributed autograd: worker `rank` was declared failed with
/// `failure`. The contexts it made are released here (it will never release
/// them, DA-8), and the backward passes of other contexts that reach it
/// fail with the failure instead of waiting for gradients it will not send.
pub(crate) fn worker_failed(agent: &RpcAgent, rank: u32, failure: &str) {
    if rank == agent.rank() {
        return;
    }
    for ctx in container(agent).contexts() {
        let id = ctx.context_id();
        if id >> COUNTER_BITS == i64::from(rank) {
            release_if_present(agent, id);
            continue;
        }
        let pass = {
            let st = ctx.state();
            st.known_workers
                .contains(&rank)
                .then(|| st.pass.clone())
                .flatten()
        };
        if let Some(pass) = pass {
            pass.fail(Error::runtime(failure.to_string()));
        }
    }
}

fn requires_grad(tensors: &[Tensor]) -> Vec<Tensor> {
    tensors
        .iter()
        .filter(|t| t.defined() && t.requires_grad())
        .map(Tensor::shallow_clone)
        .collect()
}

/// Whether calls of `function` always carry the envelope inside a context:
/// every function but the builtin ops (DA-3).
fn forced(function: &str) -> bool {
    !(function.starts_with("aten::")
        || function.starts_with("prim::")
        || function.starts_with(wasmrpc_torch_sys::WIRE_PREFIX))
}

/// Called by the agent for a call about to be sent to rank `to`: the
/// envelope to carry, recording a send if a tensor requires grad (DA-3).
pub(crate) fn outgoing_call(
    agent: &RpcAgent,
    to: u32,
    function: &str,
    tensors: &[Tensor],
) -> Option<AutogradEnvelope> {
    let ctx = current_context(agent).ok()?;
    let sent = requires_grad(tensors);
    if sent.is_empty() && !forced(function) {
        return None;
    }
    envelope(agent, &ctx, to, sent)
}

fn envelope(
    agent: &RpcAgent,
    ctx: &DistAutogradContext,
    to: u32,
    sent: Vec<Tensor>,
) -> Option<AutogradEnvelope> {
    let message_id = match container(agent).new_message_id(agent.rank()) {
        Ok(m) => m,
        Err(e) => {
            tracing::error!(worker = %agent.name(), "{e}");
            return None;
        }
    };
    if !sent.is_empty() {
        ctx.add_send(message_id, to, sent);
    }
    ctx.state().known_workers.insert(to);
    Some(AutogradEnvelope {
        context_id: ctx.context_id(),
        message_id,
        from_worker: agent.rank(),
    })
}

/// Called by the agent for a call that arrived with an envelope: gets or
/// creates the context, records a recv if a tensor requires grad; returns
/// the context id to run the function in.
pub(crate) fn incoming_call(agent: &RpcAgent, env: &AutogradEnvelope, tensors: &[Tensor]) -> i64 {
    let ctx = container(agent).get_or_create(env.context_id);
    let received = requires_grad(tensors);
    if !received.is_empty() {
        // The call came with the caller's map toward this worker: its
        // gradients go back with the inverse, as a response would.
        let back = crate::device::MapDirection::Response;
        ctx.add_recv(env.message_id, env.from_worker, back, received);
    }
    env.context_id
}

/// Called by the agent before answering a call that came with an envelope:
/// the response's envelope if a result tensor requires grad (DA-3).
pub(crate) fn outgoing_response(
    agent: &RpcAgent,
    context_id: i64,
    to: u32,
    tensors: &[Tensor],
) -> Option<AutogradEnvelope> {
    let sent = requires_grad(tensors);
    if sent.is_empty() {
        return None;
    }
    let ctx = container(agent).get(context_id)?;
    envelope(agent, &ctx, to, sent)
}

/// Called by the agent for a response that arrived with an envelope: records
/// a recv in the caller's context if it still exists.
pub(crate) fn incoming_response(agent: &RpcAgent, env: &AutogradEnvelope, tensors: &[Tensor]) {
    let Some(ctx) = container(agent).get(env.context_id) else {
        return;
    };
    let received = requires_grad(tensors);
    if !received.is_empty() {
        // The response came with the inverse of this worker's map toward
        // its sender: its gradients go back with that map itself.
        let back = crate::device::MapDirection::Request;
        ctx.add_recv(env.message_id, env.from_worker, back, received);
    }
}
