//! Distributed autograd: gradients that flow back across workers through
//! every RPC made inside a distributed autograd context, as PyTorch's FAST
//! mode does (`torch.distributed.autograd`).
//!
//! What it owns: the per-worker container of contexts (ids, the task-local
//! current context, release and its propagation to every worker a context
//! reached), the send/recv records that RPCs leave in a context, the
//! gradients a context accumulates, and the distributed backward pass
//! (local gradient computation, the propagate-gradients requests, their
//! completion and errors), tensor hooks on leaves ([`register_hook`]) and
//! `RRef.backward` ([`RRef::backward`](crate::RRef::backward)). The
//! distributed optimizer that consumes a context's gradients is
//! [`crate::optim`]; plugins reach all of this through
//! `plugin::host_functions::autograd`. It owns its wire types (`wire`: the
//! [`AutogradEnvelope`] calls carry, the [`PROPAGATE_GRADIENTS`] and
//! [`CLEANUP_AUTOGRAD_CONTEXT`] requests) and plugs into the agent as an
//! extension (`DistAutograd`): the agent asks it what to add to each call
//! and what to run each served call in, and knows nothing more of it.
//!
//! # Design: the graph is cut at every RPC
//!
//! Tensors received in a context are fresh leaves on the receiver (a *recv*
//! record groups the leaves of one message); tensors sent that require grad
//! are kept in a *send* record on the sender. A gradient arriving for a
//! send record is pushed through the local libtorch graph with
//! `torch::autograd::grad` seeded with that gradient
//! ([`wasmrpc_torch_sys::grad`]), asking for the gradients of the local
//! leaves and of the recv leaves the graph reaches (found by walking
//! `next_functions`). Custom functions ([`apply_function`]) cut the local
//! graph the same way, with a Rust backward. Nothing ever accumulates into
//! `.grad`. Graph inspection ([`Node`]) shows a recv leaf's
//! `AccumulateGrad` as the `RecvRpcBackward` it stands for.
//!
//! # Example
//!
//! ```no_run
//! use wasmrpc::{RpcAgent, args, dist_autograd};
//! # async fn run(agent: RpcAgent, t1: tch::Tensor, t2: tch::Tensor) -> wasmrpc::Result<()> {
//! let grads = dist_autograd::context(&agent, |ctx| {
//!     let agent = agent.clone();
//!     async move {
//!         let ret = agent.rpc_sync("worker1", "aten::add", args![t1, t2]).await?;
//!         let loss = ret.as_tensor()?.sum(None);
//!         dist_autograd::backward(&agent, ctx, &[loss], false).await?;
//!         dist_autograd::get_gradients(&agent, ctx)
//!     }
//! })
//! .await??;
//! # let _ = grads; Ok(()) }
//! ```
//!
//! # Invariants
//!
//! - DA-1: a context id (and an autograd message id) holds the creating
//!   worker's rank in its top 16 bits and a per-worker counter in the low 48;
//!   ids never repeat on a worker.
//! - DA-2: the current context is task-local: set by [`context`] (or
//!   [`with_context`]) for its body, by the agent for the function a call
//!   inside a context runs, and by a plugin call around the RPCs it makes
//!   while the context it opened is open. A task has at most one.
//! - DA-3: a call made inside a context carries the envelope
//!   `{context_id, message_id, from_worker}` when it is forced (every
//!   function that is not a builtin op) or when one of its tensors requires
//!   grad (RRef creation, `remote`, and fetching, `to_here`, are forced
//!   too); a send record is added only if one requires grad; the destination
//!   always joins the known workers. The callee gets or creates the context
//!   with the caller's id, and adds a recv record if a received tensor
//!   requires grad. A response carries an envelope (and leaves a send record
//!   on the callee and a recv record on the caller) when a result tensor
//!   requires grad.
//! - DA-4: send and recv records are ordered by message id.
//! - DA-5 (FAST mode): a backward pass on a worker starts from its roots (on
//!   the worker that called [`backward`]) plus every send record and custom
//!   function of the context, and completes only when each of them has
//!   fired once. A recv record's gradients are sent exactly once per pass,
//!   when every entry that reaches its leaves has fired. An unused RPC result
//!   therefore makes the pass wait, as in PyTorch.
//! - DA-6: gradients of local leaves accumulate in the pass and are added to
//!   the context only when the pass completes; a failed pass adds nothing and
//!   leaves the context usable.
//! - DA-7: the request that starts a pass on a worker is answered when the
//!   pass has completed and every gradient request it sent has been
//!   answered; later requests of the same pass are answered when the pass
//!   completes. [`backward`] returns after both. Any error (local, or in a
//!   request sent) fails the whole pass at once, so a dead peer makes
//!   `backward` fail (within the RPC timeout) rather than hang. Errors of a
//!   worker reach the caller as "Error on Node N: ...".
//! - DA-8: releasing a context removes it locally, fails its running pass,
//!   and sends a cleanup request to every known worker (retried), which
//!   release theirs if present and forward it to their own known workers.
//!   A request carries every context released for that worker within
//!   `cleanup::BATCH_WINDOW` (5 ms) of the first; a graceful shutdown
//!   sends what is queued at once and waits for the answers.
//! - DA-9: nothing a peer sends panics: unknown contexts, message ids,
//!   gradient counts and shapes are errors.

mod cleanup;
mod context;
mod engine;
mod graph;
mod hook;
mod post_hook;
mod rref;
mod wire;

pub use context::{
    DistAutogradContext, context, current_context, current_context_id, get_max_id, new_context,
    release_context, retrieve_context, with_context,
};
pub use engine::{apply_function, backward, get_debug_info, get_gradients};
pub use graph::{
    ACCUMULATE_GRAD_NAME, Gradients, Node, RECV_RPC_BACKWARD_NAME, RecvFunction,
    SEND_RPC_BACKWARD_NAME, SendFunction,
};

pub(crate) use context::{release_if_present, scope, sync_scope};
pub use hook::{HookHandle, register_hook};
pub use post_hook::{PostHookFn, PostHookHandle};
pub use rref::{RREF_BACKWARD_NOT_TENSOR, USER_RREF_BACKWARD_NEEDS_CONTEXT};
pub use wire::{AutogradEnvelope, AutogradMessage, CLEANUP_AUTOGRAD_CONTEXT, PROPAGATE_GRADIENTS};

use std::collections::BTreeMap;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::agent::{
    CallScope, Extension, FunctionRegistry, IncomingCall, IncomingReply, Inherit, OutgoingCall,
    Request, RpcAgent, Run, ServeScope,
};
use crate::error::Result;
use crate::transport::MessageKind;
use crate::value::Payload;

/// Distributed autograd on the agent: the envelope on calls and responses
/// made in a context (DA-3), the context a served call runs in (DA-2), the
/// gradient and cleanup requests (DA-7, DA-8), `RRef.backward` on owners,
/// and the `num_autograd_contexts` / `num_current_backward_passes` debug
/// info.
pub(crate) struct DistAutograd;

/// An envelope decided before the call's request id is known.
struct Envelope(Vec<u8>);

impl CallScope for Envelope {
    fn field(&mut self, _id: u64) -> Option<Vec<u8>> {
        Some(std::mem::take(&mut self.0))
    }
}

/// A served call made inside a caller's context: run in it, and answered
/// with an envelope when a result tensor requires grad.
struct Served {
    agent: RpcAgent,
    context_id: i64,
    caller: u32,
}

impl ServeScope for Served {
    fn wrap(&mut self, run: Run) -> Run {
        scope(Some(self.context_id), run).boxed()
    }

    fn reply_field(self: Box<Self>, result: &Result<Payload>) -> Option<Vec<u8>> {
        let payload = result.as_ref().ok()?;
        context::outgoing_response(&self.agent, self.context_id, self.caller, &payload.tensors)
            .map(|e| e.encode())
    }
}

impl Extension for DistAutograd {
    fn name(&self) -> &'static str {
        wire::FEATURE
    }

    fn register(&self, functions: &FunctionRegistry) {
        rref::register(functions);
    }

    fn on_call(&self, call: &OutgoingCall<'_>) -> Option<Box<dyn CallScope>> {
        // DA-3: user calls, and the features' calls that carry user values
        // (those behind `remote`, `to_here` and the RRef proxies).
        if !call.user_values {
            return None;
        }
        context::outgoing_call(call.agent, call.to.id, call.function, call.tensors)
            .map(|e| Box::new(Envelope(e.encode())) as Box<dyn CallScope>)
    }

    fn inherit(&self) -> Option<Inherit> {
        let context = current_context_id()?;
        Some(Box::new(move |task| scope(Some(context), task).boxed()))
    }

    fn on_serve(&self, call: &IncomingCall<'_>) -> Option<Box<dyn ServeScope>> {
        let envelope = AutogradEnvelope::decode(call.field?).ok()?;
        let context_id = context::incoming_call(call.agent, &envelope, &call.args.tensors);
        Some(Box::new(Served {
            agent: call.agent.clone(),
            context_id,
            caller: call.caller.id,
        }))
    }

    fn on_reply(&self, reply: &IncomingReply<'_>) {
        if reply.ok
            && let Ok(envelope) = AutogradEnvelope::decode(reply.field)
        {
            context::incoming_response(reply.agent, &envelope, reply.tensors);
        }
    }

    fn message_kinds(&self) -> &'static [MessageKind] {
        wire::KINDS
    }

    fn serve_request(&self, agent: &RpcAgent, request: Request) -> Run {
        let agent = agent.clone();
        async move {
            let message = request.decode(AutogradMessage::kind)?;
            engine::handle_request(&agent, message, request.tensors).await
        }
        .boxed()
    }

    fn shutdown(&self, agent: &RpcAgent) -> Option<BoxFuture<'static, Result<()>>> {
        // DA-8: the peers are still connected (the all-gather is done, the
        // join is not): the last releases reach them now rather than never.
        let requests = context::container(agent).cleanups.flush(agent);
        if requests.is_empty() {
            return None;
        }
        Some(
            async move {
                for request in requests {
                    // A failed cleanup is retried in the background and
                    // never fails the shutdown.
                    let _ = request.wait().await;
                }
                Ok(())
            }
            .boxed(),
        )
    }

    fn debug_info(&self, agent: &RpcAgent) -> BTreeMap<String, String> {
        get_debug_info(agent)
    }

    fn worker_failed(&self, agent: &RpcAgent, failed: &crate::abi::WorkerInfo, cause: &str) {
        let failure = format!("{} failed: {cause}", failed.name);
        context::worker_failed(agent, failed.id, &failure);
    }
}
