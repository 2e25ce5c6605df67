//! A guest's fetches of RRef values (`rref.to_here()`), waited for in place
//! or handed back as a future, in the guest's own distributed autograd
//! context, as PyTorch's `to_here` inside `dist_autograd.context()`.

use wasmrpc_wasm::{HostResult, Value};

use super::{GuestCall, remote};
use crate::agent::Future;
use crate::error::Result;
use crate::value::Payload;

impl GuestCall {
    /// The fetch of the value `rref` holds, from its owner, in the guest's
    /// autograd context when the task has none of its own.
    fn fetch(
        &self,
        rref: u32,
    ) -> HostResult<impl std::future::Future<Output = Result<Payload>> + Send + 'static> {
        let r = self.handles().rref(rref)?;
        let agent = self.agent.clone();
        let context = self.autograd.context();
        Ok(async move {
            let fetch = r.to_here(&agent, None);
            match context {
                Some(id) if crate::dist_autograd::current_context_id().is_none() => {
                    crate::dist_autograd::scope(Some(id), fetch).await
                }
                _ => fetch.await,
            }
        })
    }

    /// `rref.to_here()`: the value, once fetched.
    pub(super) async fn fetch_value(&self, rref: u32) -> HostResult<Value> {
        let payload = self.fetch(rref)?.await.map_err(remote)?;
        self.handles().import(payload)
    }

    /// `rref.to_here()` as a future the guest waits on (a single-instance
    /// plugin's wait serves its other calls meanwhile).
    pub(super) fn fetch_future(&self, rref: u32) -> HostResult<u32> {
        let fetch = self.fetch(rref)?;
        let out = Future::new();
        let done = out.clone();
        drop(self.agent.spawn_inheriting(async move {
            let _ = done.complete(fetch.await);
        }));
        Ok(self.handles().insert_future(out))
    }
}
