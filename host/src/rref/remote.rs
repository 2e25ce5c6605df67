//! `remote()`: running a function on its owner-to-be and returning an RRef
//! to the result at once, and the agent's view of its RRef context.

use std::time::Duration;

use super::context::context;
use super::{REMOTE, RRef, id_value};
use crate::abi::Value;
use crate::agent::{CallKind, CallOptions, Dest, Future, RpcAgent};
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

impl RpcAgent {
    /// Runs `function` on `to` and keeps the result there, returning an
    /// RRef to it at once (`remote`). With `to` this worker, the RRef is an
    /// owner RRef. Errors of the function surface on `to_here` and
    /// `local_value`; the creation's own failure (timeout, lost peer) on
    /// `get_future()` and `to_here`. Uses the default timeout.
    ///
    /// # Errors
    /// "RPC has not been initialized ..." after shutdown, and the
    /// destination errors of [`resolve`](Self::resolve).
    pub fn remote(&self, to: impl Into<Dest>, function: &str, args: Args) -> Result<RRef> {
        self.remote_profiled(to.into(), function, args, None)
    }

    /// [`remote_inner`](Self::remote_inner), reported to an enclosing
    /// profiling scope until the value is created (`crate::profiler`).
    fn remote_profiled(
        &self,
        to: Dest,
        function: &str,
        args: Args,
        timeout: Option<Duration>,
    ) -> Result<RRef> {
        let mode = crate::profiler::RpcExecMode::Remote;
        let (made, recorded) = crate::profiler::rpc(
            self,
            mode,
            &to,
            function,
            || self.remote_inner(to.clone(), function, args, timeout),
            |r| r.as_ref().ok().map(RRef::get_future),
        );
        made.map(|mut r| {
            r.profiling = recorded;
            r
        })
    }

    /// [`remote`](Self::remote) with its own timeout for the creation;
    /// zero means none.
    ///
    /// # Errors
    /// As [`remote`](Self::remote).
    pub fn remote_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Result<RRef> {
        self.remote_profiled(to.into(), function, args, Some(timeout))
    }

    pub(super) fn remote_inner(
        &self,
        to: Dest,
        function: &str,
        args: Args,
        timeout: Option<Duration>,
    ) -> Result<RRef> {
        if !self.is_running() {
            return Err(Error::not_initialized());
        }
        let dst = self.resolve(to)?;
        let ctx = context(self);
        let rref_id = ctx.new_id(self);
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
        if dst.id == self.rank() {
            // A self fork keeps the value registered until the handle drops.
            let state = ctx.register_self_owner(self, rref_id);
            wire_positional[1] = id_value(rref_id);
            wire_positional.extend(positional);
            let call = Args {
                positional: wire_positional,
                kwargs,
                tensors,
                rrefs,
            };
            let fut = self.call(Dest::Info(dst), REMOTE, call, internal(timeout));
            let value = state.value.clone();
            fut.add_done_callback(move |f| {
                if let Some(Err(e)) = f.try_value() {
                    // The call never ran the function: the value cannot come.
                    let _ = value.set_error(e);
                }
            });
            return Ok(RRef::from_owner(state, Some(self)));
        }
        let fork_id = ctx.new_id(self);
        wire_positional[1] = id_value(fork_id);
        wire_positional.extend(positional);
        let call = Args {
            positional: wire_positional,
            kwargs,
            tensors,
            rrefs,
        };
        let creation = Future::new();
        let (rref, user) = RRef::user(self, dst.clone(), rref_id, fork_id, false, creation.clone());
        ctx.add_pending_user(fork_id, user);
        let fut = self.call(Dest::Info(dst), REMOTE, call, internal(timeout));
        let this = self.downgrade();
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

    /// The RRef context's debug information (`_rref_context_get_debug_info`):
    /// `num_owner_rrefs`, `num_pending_users`, `num_pending_futures`,
    /// `num_forks`.
    pub fn rref_context_debug_info(&self) -> std::collections::BTreeMap<String, String> {
        context(self).debug_info()
    }

    /// Whether graceful shutdown tolerates RRef leaks (`_ignore_rref_leak`,
    /// true by default as in PyTorch; the seeds' harness turns it off).
    pub fn set_ignore_rref_leak(&self, ignore: bool) {
        context(self).set_ignore_leak(ignore);
    }

    /// Test hook mirroring the seeds' mock of
    /// `_delete_all_user_and_unforked_owner_rrefs`: with `false`, graceful
    /// shutdown does not delete users and self forks (so the leak check sees
    /// them).
    pub fn set_delete_rrefs_on_shutdown(&self, delete: bool) {
        context(self).set_delete_on_shutdown(delete);
    }
}

/// The options of RRef protocol calls: internal, with `timeout` if given.
pub(super) fn internal(timeout: Option<Duration>) -> CallOptions {
    CallOptions {
        timeout,
        ..CallOptions::new(CallKind::Internal)
    }
}
