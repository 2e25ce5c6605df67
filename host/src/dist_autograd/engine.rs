//! The distributed backward pass (DA-5 .. DA-7), custom functions and the
//! gradients a context holds.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;
use wasmrpc_torch_sys::{GradOptions, grad};

use super::context::DistAutogradContext;
use super::graph::{
    CutPoint, RECV_RPC_BACKWARD_NAME, Reachable, RecvFunction, SEND_RPC_BACKWARD_NAME, Tensors,
    walk,
};
use super::wire::{AutogradEnvelope, AutogradMessage};
use crate::abi::Value;
use crate::agent::{Future, RpcAgent};
use crate::error::{Error, Result, error_on_node};
use crate::profiler::Recording;
use crate::tensor::impl_id;
use crate::value::Payload;

mod accumulate;
mod requests;

use requests::fire;

pub(crate) use requests::handle_request;
pub use requests::{apply_function, backward, get_debug_info, get_gradients};

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
    reach: std::sync::OnceLock<Arc<Reachable>>,
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
    reach: HashMap<Entry, Arc<Reachable>>,
    outputs: HashMap<Entry, Vec<Tensor>>,
    /// For each cut, how many unfired entries reach it.
    remaining: HashMap<CutPoint, usize>,
    /// Which entries reach each cut's leaves, to count down.
    cut_grads: HashMap<usize, Tensor>,
    local: HashMap<usize, (Tensor, Tensor)>,
}

/// One backward pass of a context on this worker.
pub(crate) struct Pass {
    ctx: DistAutogradContext,
    agent: RpcAgent,
    retain_graph: bool,
    /// Every piece this worker fires is small and no custom function (user
    /// code) runs: firing on the runtime thread beats the hop to the
    /// blocking pool.
    cheap: bool,
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
        let mut remaining: HashMap<CutPoint, usize> = HashMap::new();
        for r in reach.values() {
            for c in &r.cuts {
                *remaining.entry(*c).or_default() += 1;
            }
        }
        let pending = reach.keys().copied().collect();
        let cheap = customs.is_empty() && reach.values().all(|r| r.is_cheap());
        Arc::new(Pass {
            ctx: ctx.clone(),
            agent: agent.clone(),
            retain_graph,
            cheap,
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
                |e| matches!(e, Entry::Custom(c) if !st.remaining.contains_key(&CutPoint::Custom(*c))),
            )
            .map(|e| (*e, Vec::new()))
            .collect()
    }

    /// Fires `entry` with `grads` (one per output; `None` for none) and
    /// whatever becomes ready after it, then completes the pass if nothing
    /// is left (DA-5, DA-6). Blocking: runs libtorch's engine.
    ///
    /// `requester` is the worker whose gradient request this firing serves:
    /// gradients due to it are returned, to travel in the reply, instead of
    /// being sent in a request of their own (one round trip less per hop).
    fn fire(
        self: &Arc<Self>,
        entry: Entry,
        grads: Vec<Option<Tensor>>,
        requester: Option<u32>,
    ) -> Result<Vec<ReplyGradients>> {
        // In place or on the pool, the pass's ops use the process's op
        // thread count (OPS-1, `ops::threads`).
        crate::ops::adopt_intra_op_threads();
        let mut reply_gradients = Vec::new();
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
                        if let Some(next) =
                            self.dispatch(st, *cut, requester, &mut reply_gradients)?
                        {
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
        // Gradients ride on the reply only when this worker has nothing left
        // to wait for: otherwise the reply waits, and what it waits for may
        // need the requester to have these gradients first.
        let idle = complete && lock(&self.outstanding).iter().all(Future::done);
        if idle {
            return Ok(reply_gradients
                .into_iter()
                .map(|(recv, grads)| ReplyGradients {
                    message_id: recv.message_id(),
                    grads,
                })
                .collect());
        }
        for (recv, grads) in reply_gradients {
            let fut = self.send_gradients(&recv, grads);
            lock(&self.outstanding).push(fut);
        }
        Ok(Vec::new())
    }

    fn run_engine(
        &self,
        st: &mut PassState,
        outputs: &[Tensor],
        grads: Vec<Option<Tensor>>,
        reach: &Reachable,
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
        // A leaf's gradient is its seed: no engine run for it.
        let mut direct: Vec<(Tensor, Tensor)> = Vec::new();
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
            if wasmrpc_torch_sys::GradFn::of(t).is_none() {
                direct.push((t.shallow_clone(), g));
            } else {
                outs.push(t.shallow_clone());
                seeds.push(g);
            }
        }
        let mut results: Vec<(Tensor, Tensor)> = if super::hook::any_registered() {
            super::hook::hooked_leaf_gradients(direct)?
        } else {
            direct
        };
        let leaves = reach.leaves.get();
        if !outs.is_empty() && !leaves.is_empty() {
            let computed = grad(
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
            results.extend(
                leaves
                    .into_iter()
                    .zip(computed)
                    .filter_map(|(leaf, g)| g.map(|g| (leaf, g))),
            );
        }
        let is_cut: Vec<bool> = {
            let cst = self.ctx.state();
            results
                .iter()
                .map(|(leaf, _)| cst.cut_leaves.contains_key(&impl_id(leaf)))
                .collect()
        };
        let held = accumulate::holders(results.iter().map(|(_, g)| g));
        for ((leaf, g), is_cut) in results.into_iter().zip(is_cut) {
            let id = impl_id(&leaf);
            if is_cut {
                let acc = st.cut_grads.remove(&id);
                st.cut_grads.insert(id, accumulate::add_grad(acc, g)?);
            } else {
                // The leaf's hooks ran in `grad` (libtorch applies them
                // before it returns a leaf's gradient); its node's now.
                super::post_hook::run(&leaf, &g)?;
                let g = match st.local.remove(&id) {
                    Some((_, acc)) => acc.f_add(&g)?,
                    None => {
                        let shared = held.get(&impl_id(&g)).is_some_and(|&n| n > 1);
                        accumulate::first_grad(&leaf, g, shared)?
                    }
                };
                st.local.insert(id, (leaf, g));
            }
        }
        Ok(())
    }

    /// A cut whose gradients are final: a recv record sends them back (or
    /// leaves them in `reply_gradients` when they are due to `requester`); a
    /// custom function runs its backward and fires its inputs.
    fn dispatch(
        self: &Arc<Self>,
        st: &mut PassState,
        cut: CutPoint,
        requester: Option<u32>,
        reply_gradients: &mut Vec<(RecvFunction, Vec<Option<Tensor>>)>,
    ) -> Result<Option<(Entry, Vec<Option<Tensor>>)>> {
        match cut {
            CutPoint::Recv(m) => {
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
                // A reply travels with the inverse of the requester's map,
                // as gradients of a received request must.
                let rides_back = requester == Some(recv.from_worker())
                    && recv.inner.grads_map == crate::device::MapDirection::Response;
                if rides_back {
                    reply_gradients.push((recv, grads));
                } else {
                    let fut = self.send_gradients(&recv, grads);
                    lock(&self.outstanding).push(fut);
                }
                Ok(None)
            }
            CutPoint::Custom(c) => {
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

    /// Sends `recv`'s gradients to the worker its message came from, with
    /// the inverse of that message's device map (PyTorch's
    /// `RecvRpcBackward`): they land on the devices the sender's tensors
    /// were on.
    fn send_gradients(self: &Arc<Self>, recv: &RecvFunction, grads: Vec<Option<Tensor>>) -> Future {
        let (message_id, to) = (recv.message_id(), recv.from_worker());
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
        let message = AutogradMessage::PropagateGradients {
            envelope,
            grads: values,
            retain_graph,
        };
        let body = match message.encode() {
            Ok(b) => b,
            Err(e) => return Future::ready(Err(e)),
        };
        let fut = self.agent.request_mapped(
            i64::from(to),
            message.kind(),
            body,
            &tensors,
            None,
            recv.inner.grads_map,
        );
        let pass = Arc::downgrade(self);
        fut.add_done_callback(move |f| {
            let Some(pass) = pass.upgrade() else { return };
            match f.try_value() {
                Some(Err(e)) => pass.fail(e),
                Some(Ok(reply)) => pass.take_reply_gradients(&reply),
                None => {}
            }
        });
        fut
    }

    /// Fires the gradients a worker returned in its reply to a gradient
    /// request (they are for this worker's sends to it): in the reply's
    /// callback when the pass is cheap, on a task of their own otherwise.
    fn take_reply_gradients(self: Arc<Self>, reply: &Payload) {
        let batches = match ReplyGradients::decode(reply) {
            Ok(b) if b.is_empty() => return,
            Ok(b) => b,
            Err(e) => return self.fail(e),
        };
        // In place when cheap, unless the state is locked: this thread may
        // be inside `fire` itself (a reply that came before its callback
        // was added runs the callback there).
        let in_place =
            self.cheap && !super::hook::any_registered() && self.state.try_lock().is_ok();
        let failed = |pass: &Pass, e: Error| pass.fail(error_on_node(pass.agent.rank(), &e));
        if in_place {
            for b in batches {
                if let Err(e) = self.fire(Entry::Send(b.message_id), b.grads, None) {
                    return failed(&self, e);
                }
            }
            return;
        }
        tokio::spawn(async move {
            for b in batches {
                if let Err(e) = fire(&self, Entry::Send(b.message_id), b.grads, None).await {
                    return failed(&self, e);
                }
            }
        });
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

/// Gradients for the recv record `message_id` of the worker they go to,
/// carried in the reply to that worker's gradient request.
struct ReplyGradients {
    message_id: i64,
    grads: Vec<Option<Tensor>>,
}

impl ReplyGradients {
    /// The reply to a gradient request: a list of `(message_id, [grad or
    /// None, ...])`.
    fn encode(batches: Vec<ReplyGradients>) -> Payload {
        Payload::list(batches.into_iter().map(|b| {
            let grads = b.grads.into_iter().map(|g| match g {
                Some(g) => Payload::from(g),
                None => Payload::none(),
            });
            Payload::tuple([Payload::from(b.message_id), Payload::list(grads)])
        }))
    }

    fn decode(reply: &Payload) -> Result<Vec<ReplyGradients>> {
        if reply.is_none() {
            return Ok(Vec::new());
        }
        reply
            .items()?
            .into_iter()
            .map(|item| {
                let [m, grads]: [Payload; 2] = item
                    .items()?
                    .try_into()
                    .map_err(|_| Error::runtime("a malformed gradient reply"))?;
                let grads = grads
                    .items()?
                    .into_iter()
                    .map(|g| (!g.is_none()).then(|| g.as_tensor()).transpose())
                    .collect::<Result<_>>()?;
                Ok(ReplyGradients {
                    message_id: m.as_int()?,
                    grads,
                })
            })
            .collect()
    }
}
