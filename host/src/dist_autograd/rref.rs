//! `RRef.backward(dist_autograd_ctx_id=None, retain_graph=False)`: backward
//! from the tensor an RRef holds, run by its owner.
//!
//! On the owner, without a context it is local autograd (`.grad` of the
//! leaves), with one it is [`backward`](super::backward) in that context. A
//! user RRef needs a context and asks the owner to run it there through
//! the agent's internal function [`RREF_BACKWARD`].

use crate::agent::{FunctionRegistry, RpcAgent};
use crate::error::{Error, Result};
use crate::rref::RRef;
use crate::value::{Args, Payload};

/// Internal function: `RRef.backward` on the owner of a user's RRef.
pub(crate) const RREF_BACKWARD: &str = "wasmrpc::_rref_backward";

/// `RRef.backward` on an RRef that does not hold a tensor.
pub const RREF_BACKWARD_NOT_TENSOR: &str = "RRef should contain a tensor for .backward()";
/// `RRef.backward` on a user RRef without a context id.
pub const USER_RREF_BACKWARD_NEEDS_CONTEXT: &str =
    "User RRefs require 'dist_autograd_ctx_id' to be specified";

impl RRef {
    /// `rref.backward(dist_autograd_ctx_id, retain_graph)`: backward from
    /// the (scalar) tensor the RRef holds, on its owner. Without a context
    /// (owner RRefs only) it is local autograd and fills `.grad`; with one
    /// it is a distributed backward pass in that context.
    ///
    /// # Errors
    /// "RRef should contain a tensor for .backward()"; "User RRefs require
    /// 'dist_autograd_ctx_id' to be specified"; "Could not find autograd
    /// context with id: N"; libtorch's texts for a tensor without a graph or
    /// that is not a scalar, or for a second pass over a graph that was
    /// not retained.
    pub async fn backward(
        &self,
        agent: &RpcAgent,
        context_id: Option<i64>,
        retain_graph: bool,
    ) -> Result<()> {
        if self.is_owner() {
            return owner_backward(agent, self, context_id, retain_graph).await;
        }
        let ctx = context_id.ok_or_else(|| Error::runtime(USER_RREF_BACKWARD_NEEDS_CONTEXT))?;
        agent
            .rpc_sync(
                self.owner_name(),
                RREF_BACKWARD,
                Args::new().arg(ctx).arg(self).arg(retain_graph),
            )
            .await
            .map(drop)
    }
}

async fn owner_backward(
    agent: &RpcAgent,
    rref: &RRef,
    context_id: Option<i64>,
    retain_graph: bool,
) -> Result<()> {
    let value = rref.local_value(agent).await?;
    let t = value
        .as_tensor()
        .map_err(|_| Error::runtime(RREF_BACKWARD_NOT_TENSOR))?;
    match context_id {
        Some(ctx) => super::backward(agent, ctx, &[t], retain_graph).await,
        None => crate::ops::run_blocking(move || wasmrpc_torch_sys::backward(&[t], retain_graph))
            .await?
            .map_err(crate::ops::op_error),
    }
}

/// Registers the owner side among the agent's internal functions.
pub(crate) fn register(r: &FunctionRegistry) {
    r.register_native(RREF_BACKWARD, |ctx, args: Args| async move {
        let context_id = args.get(0)?.as_int()?;
        let rref = args.get(1)?.as_rref()?;
        let retain_graph = args.get(2)?.as_bool()?;
        owner_backward(ctx.agent(), &rref, Some(context_id), retain_graph).await?;
        Ok(Payload::none())
    });
}
