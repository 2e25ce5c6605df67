//! What an owner holds for an RRef ([`OwnerState`]): the value, or the
//! object a plugin class made, once the creating function has run.

use std::sync::Arc;

use super::{OBJECT_STATE_METHOD, Owned, RRefId, RRefObject};
use crate::abi::{ErrorKind, WorkerInfo};
use crate::agent::{Future, RpcAgent};
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

/// The value of an RRef on its owner: a [`Payload`] or an object
/// ([`Owned`]).
///
/// Dropping the last reference to it (the owner forgot the value and no
/// handle on the owner holds it, RREF-3) drops the object, which disposes
/// of it ([`RRefObject`]).
pub(crate) struct OwnerState {
    pub(crate) id: RRefId,
    pub(crate) owner: WorkerInfo,
    /// Completed once with the value or the error of the function; with
    /// `None` when the function made an object (set first, in `object`).
    pub(crate) value: Future,
    object: std::sync::OnceLock<Arc<dyn RRefObject>>,
}

impl OwnerState {
    pub(crate) fn new(id: RRefId, owner: WorkerInfo) -> Arc<Self> {
        Arc::new(OwnerState {
            id,
            owner,
            value: Future::new(),
            object: std::sync::OnceLock::new(),
        })
    }

    /// Completes the value with the outcome of the creating function: the
    /// object it made, else its payload or error.
    pub(crate) fn complete(&self, result: Result<Payload>, object: Option<Arc<dyn RRefObject>>) {
        let result = match object {
            Some(o) => {
                let _ = self.object.set(o);
                Ok(Payload::none())
            }
            None => result,
        };
        let _ = self.value.complete(result);
    }

    /// What the owner holds, once the creating function has run.
    ///
    /// # Errors
    /// The error of the function that created the value.
    pub(crate) async fn owned(&self) -> Result<Owned> {
        let payload = self.value.wait().await?;
        Ok(self.owned_from(payload))
    }

    /// The object the creating function made, once it has run; `None` for
    /// a value or while the function runs.
    pub(crate) fn object(&self) -> Option<&Arc<dyn RRefObject>> {
        self.object.get()
    }

    pub(crate) fn owned_from(&self, payload: Payload) -> Owned {
        match self.object.get() {
            Some(o) => Owned::Object(o.clone()),
            None => Owned::Value(payload),
        }
    }

    /// The value as a payload, for the copying APIs (`to_here`,
    /// `local_value`) asked by `caller`: an object's state if its class
    /// defines [`OBJECT_STATE_METHOD`].
    ///
    /// # Errors
    /// The creating function's error; the state method's error; `TypeError`
    /// for an object whose class has no state method
    /// ([`object_not_copyable`]).
    pub(crate) async fn payload(
        &self,
        api: &str,
        agent: &RpcAgent,
        caller: &WorkerInfo,
    ) -> Result<Payload> {
        match self.owned().await? {
            Owned::Value(p) => Ok(p),
            Owned::Object(o) if o.has_method(OBJECT_STATE_METHOD) => o
                .call_method(agent, caller, OBJECT_STATE_METHOD, Args::new())
                .await
                .map_err(|e| {
                    e.context_line(format!(
                        "{api} of RRef {}: the state of its {} object on worker {}",
                        self.id,
                        o.type_name(),
                        self.owner.name
                    ))
                }),
            Owned::Object(o) => Err(object_not_copyable(
                api,
                self.id,
                o.type_name(),
                &self.owner.name,
            )),
        }
    }
}

/// The `TypeError` of `to_here()` / `local_value()` on an RRef holding an
/// object whose class has no state method: objects stay on their owner
/// and are used through proxies.
pub(crate) fn object_not_copyable(api: &str, id: RRefId, class: &str, owner: &str) -> Error {
    Error::new(
        ErrorKind::TypeError,
        format!(
            "{api} of RRef {id}: it holds an object of class {class} on worker {owner}, and \
             objects stay on their owner; call its methods through rref.rpc_sync(), \
             rref.rpc_async() or rref.remote(), or give the class a {OBJECT_STATE_METHOD} \
             method to copy its state"
        ),
    )
}
