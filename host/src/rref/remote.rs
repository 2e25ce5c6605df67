//! `remote()`: running a function on its owner-to-be and returning an RRef
//! to the result at once, and the agent's view of its RRef context.

use std::collections::BTreeMap;
use std::time::Duration;

use super::context::context;
use super::{REMOTE, RRef, id_value};
use crate::abi::Value;
use crate::agent::{CallKind, CallOptions, Dest, Future, RpcAgent};
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

/// What the RRef feature adds to an agent: PyTorch's `remote()`, and the
/// controls of the agent's RRef context. In scope with
/// `use wasmrpc::prelude::*`.
pub trait Remote {
    /// Runs `function` on `to` and keeps the result there, returning an
    /// RRef to it at once (`remote`). With `to` this worker, the RRef is an
    /// owner RRef. Errors of the function surface on `to_here` and
    /// `local_value`; the creation's own failure (timeout, lost peer) on
    /// `get_future()` and `to_here`. Uses the default timeout.
    ///
    /// # Errors
    /// "RPC has not been initialized ..." after shutdown, and the
    /// destination errors of [`RpcAgent::resolve`].
    fn remote(&self, to: impl Into<Dest>, function: &str, args: Args) -> Result<RRef>;

    /// [`remote`](Self::remote) with its own timeout for the creation;
    /// zero means none.
    ///
    /// # Errors
    /// As [`remote`](Self::remote).
    fn remote_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Result<RRef>;

    /// The RRef context's debug information (`_rref_context_get_debug_info`):
    /// `num_owner_rrefs`, `num_pending_users`, `num_pending_futures`,
    /// `num_forks`.
    fn rref_context_debug_info(&self) -> BTreeMap<String, String>;

    /// Whether graceful shutdown tolerates RRef leaks (`_ignore_rref_leak`,
    /// true by default as in PyTorch; the seeds' harness turns it off).
    fn set_ignore_rref_leak(&self, ignore: bool);

    /// Test hook mirroring the seeds' mock of
    /// `_delete_all_user_and_unforked_owner_rrefs`: with `false`, graceful
    /// shutdown does not delete users and self forks (so the leak check sees
    /// them).
    fn set_delete_rrefs_on_shutdown(&self, delete: bool);
}

impl Remote for RpcAgent {
    fn remote(&self, to: impl Into<Dest>, function: &str, args: Args) -> Result<RRef> {
        remote_profiled(self, to.into(), function, args, None)
    }

    fn remote_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Result<RRef> {
        remote_profiled(self, to.into(), function, args, Some(timeout))
    }

    fn rref_context_debug_info(&self) -> BTreeMap<String, String> {
        context(self).debug_info()
    }

    fn set_ignore_rref_leak(&self, ignore: bool) {
        context(self).set_ignore_leak(ignore);
    }

    fn set_delete_rrefs_on_shutdown(&self, delete: bool) {
        context(self).set_delete_on_shutdown(delete);
    }
}

/// [`remote_inner`], reported to an enclosing profiling scope until the
/// value is created (`crate::profiler`).
fn remote_profiled(
    agent: &RpcAgent,
    to: Dest,
    function: &str,
    args: Args,
    timeout: Option<Duration>,
) -> Result<RRef> {
    let mode = crate::profiler::RpcExecMode::Remote;
    let (made, recorded) = crate::profiler::rpc(
        agent,
        mode,
        &to,
        function,
        || remote_inner(agent, to.clone(), function, args, timeout),
        |r| r.as_ref().ok().map(RRef::get_future),
    );
    made.map(|mut r| {
        r.profiling = recorded;
        r
    })
}

/// Creates the RRef of a `remote()` (RREF-1): the owner's, for a call to
/// this worker, else a pending user confirmed by the owner's reply.
pub(super) fn remote_inner(
    agent: &RpcAgent,
    to: Dest,
    function: &str,
    args: Args,
    timeout: Option<Duration>,
) -> Result<RRef> {
    if !agent.is_running() {
        return Err(Error::not_initialized());
    }
    let dst = agent.resolve(to)?;
    let ctx = context(agent);
    let rref_id = ctx.new_id(agent);
    let Args {
        positional,
        kwargs,
        tensors,
        rrefs,
    } = args;
    let mut wire_positional = vec![
        id_value(rref_id),
        Value::None,
        Value::Str(function.to_string()),
    ];
    if dst.id == agent.rank() {
        // A self fork keeps the value registered until the handle drops.
        let state = ctx.register_self_owner(agent, rref_id);
        wire_positional[1] = id_value(rref_id);
        wire_positional.extend(positional);
        let call = Args {
            positional: wire_positional,
            kwargs,
            tensors,
            rrefs,
        };
        let fut = agent.call(Dest::Info(dst), REMOTE, call, running_user_code(timeout));
        let value = state.value.clone();
        fut.add_done_callback(move |f| {
            if let Some(Err(e)) = f.try_value() {
                // The call never ran the function: the value cannot come.
                let _ = value.set_error(e);
            }
        });
        return Ok(RRef::from_owner(state, Some(agent)));
    }
    // A CUDA tensor with no device map toward the owner can never leave:
    // PyTorch's agent finds that while sending, inside `rpc.remote()`, which
    // raises; so does this, before any RRef state exists (the send's own
    // failure would surface only as a fetch that times out).
    crate::device::devices_for(
        agent,
        &dst.name,
        crate::device::MapDirection::Request,
        &tensors,
    )
    .map_err(|e| e.context_line(format!("remote() of {function} on {}", dst.name)))?;
    let fork_id = ctx.new_id(agent);
    wire_positional[1] = id_value(fork_id);
    wire_positional.extend(positional);
    let call = Args {
        positional: wire_positional,
        kwargs,
        tensors,
        rrefs,
    };
    let creation = Future::new();
    let (rref, user) = RRef::user(
        agent,
        dst.clone(),
        rref_id,
        fork_id,
        false,
        creation.clone(),
    );
    ctx.add_pending_user(fork_id, user);
    let fut = agent.call(Dest::Info(dst), REMOTE, call, running_user_code(timeout));
    let this = agent.downgrade();
    fut.add_done_callback(move |f| {
        let result = f
            .try_value()
            .unwrap_or_else(|| Err(Error::runtime("remote() call completed without a result")));
        if let Some(agent) = this.upgrade() {
            // Confirmed or failed, the user is now an ordinary user: it
            // is deleted on drop (RREF-1 holds: the owner answered, or
            // the creation is lost and its fork tombstoned on arrival).
            context(&RpcAgent::from_inner(agent)).confirm_pending_user(fork_id);
        }
        let _ = creation.complete(result.map(|_| Payload::none()));
    });
    Ok(rref)
}

/// The options of the RRef protocol's calls that run a user's function
/// (`remote()`, a proxy's method): internal, carrying user values, with
/// `timeout` if given.
pub(super) fn running_user_code(timeout: Option<Duration>) -> CallOptions {
    CallOptions {
        timeout,
        ..CallOptions::new(CallKind::Internal)
    }
    .carrying_user_values()
}
