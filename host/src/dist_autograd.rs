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
//! `plugin::host_functions::autograd`. It leaves the wire to `transport` (the reserved
//! [`AutogradEnvelope`](crate::transport::AutogradEnvelope),
//! `PropagateGradients` and `CleanupAutogradContext` messages) and calling
//! functions to the agent, which asks this module what to record.
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
//! - DA-9: nothing a peer sends panics: unknown contexts, message ids,
//!   gradient counts and shapes are errors.

mod context;
mod engine;
mod graph;
mod hook;
mod rref;

pub use context::{
    DistAutogradContext, context, current_context, current_context_id, get_max_id, new_context,
    release_context, retrieve_context, with_context,
};
pub use engine::{apply_function, backward, get_debug_info, get_gradients};
pub use graph::{
    ACCUMULATE_GRAD_NAME, Gradients, Node, RECV_RPC_BACKWARD_NAME, RecvFunction,
    SEND_RPC_BACKWARD_NAME, SendFunction,
};

pub(crate) use context::{
    incoming_call, incoming_response, outgoing_call, outgoing_response, release_if_present, scope,
    sync_scope,
};
pub(crate) use engine::handle_request;
pub use hook::{HookHandle, register_hook};
pub use rref::{RREF_BACKWARD_NOT_TENSOR, USER_RREF_BACKWARD_NEEDS_CONTEXT};

/// Registers distributed autograd's internal functions (`RRef.backward` on
/// the owner of a user's RRef).
pub(crate) fn register(r: &crate::agent::FunctionRegistry) {
    rref::register(r);
}
