//! Objects held by RRefs: values an owner keeps by reference and serves
//! method calls on, instead of payloads it can copy (a plugin class's
//! objects, [`crate::plugin`]).
//!
//! What it owns: the [`RRefObject`] trait, the [`Owned`] view of an owner's
//! value, and the hand-over of an object from the function that makes it
//! to the owner-side `remote()` ([`keep_object`]). It leaves running
//! methods and disposing of objects to the implementors, and the fork and
//! delete protocol to the context (an object is one more kind of value:
//! the protocol does not look at values).
//!
//! Invariants:
//! - OBJ-1: only the function of an owner-side `remote()` can make an
//!   object ([`can_keep_object`]); everywhere else (`rpc_sync`,
//!   `rpc_async`, a proxy's method) there is no owner to keep it, and
//!   object-making functions refuse to run.
//! - OBJ-2: an object itself is never copied: its methods run on the owner
//!   through the proxies. `to_here`, `local_value` and the fetch behind
//!   them answer the object's state, a value its class makes with
//!   [`OBJECT_STATE_METHOD`] (Python's `__getstate__`, what pickling a
//!   module copies), and `TypeError` for a class without one.
//! - OBJ-3: the owner drops its reference to an object when it forgets the
//!   value (RREF-3: last fork deleted, or shutdown) and no handle on the
//!   owner holds it; the implementor disposes of the object on drop.
//! - OBJ-4: a function that reaches objects (its plugin's manifest names
//!   it: a Python function whose code calls `local_value`), called on the
//!   worker that owns an object of its plugin with the object's RRef among
//!   its arguments, runs beside the object: in its instance, queued with
//!   its methods, so `rref.local_value()` there is the object itself
//!   (PyTorch's `_call_method(method, rref)` idiom). Elsewhere the object
//!   stays out of reach as OBJ-2 says ([`crate::plugin`] routes the call).
//! - OBJ-5: in a single-instance plugin every call on a worker (functions,
//!   constructors, methods) runs in its one instance; an object one of its
//!   functions offers is kept only by the owner-side `remote()` that
//!   function serves (OBJ-1), and only if the plugin exports its class
//!   (`crate::plugin`'s `module`).
//! - OBJ-6: besides `remote()`, one more owner may keep an object: a call
//!   of a single-instance plugin that makes `RRef(obj)` of one of its
//!   objects in place. The object stays in the worker's one instance (the
//!   only instance that outlives the call), and the new RRef, owned by
//!   this worker, holds it itself; in a pooled or an object's instance it
//!   is refused (`crate::plugin`'s `module`).

use std::sync::{Arc, Mutex};

use crate::abi::WorkerInfo;
use crate::agent::RpcAgent;
use crate::error::Result;
use crate::value::{Args, Payload};

/// The method a plugin class defines to let `to_here()` and
/// `local_value()` copy its objects out of the owner: it returns the
/// object's state as a value (`{"param1": tensor, "training": true}` for a
/// module), as Python's `__getstate__` gives what pickling copies.
pub const OBJECT_STATE_METHOD: &str = "__getstate__";

/// An object an RRef holds on its owner, whose methods the owner runs for
/// proxies (`rref.rpc_sync().method(...)`).
///
/// The owner keeps it behind an `Arc` while it keeps the value; dropping
/// the last reference is the object's end (OBJ-3): implementors release
/// what the object holds in `Drop` (a plugin object runs its guest
/// destructor).
#[async_trait::async_trait]
pub(crate) trait RRefObject: std::any::Any + Send + Sync {
    /// The type `_get_type` answers, e.g. `seed_fns::MyClass`.
    fn type_name(&self) -> &str;

    /// Whether the object has an instance method `method`.
    fn has_method(&self, method: &str) -> bool;

    /// Runs `method` with `args` for `caller`, on `agent` (the owner).
    ///
    /// # Errors
    /// `AttributeError` "'Class' object has no attribute 'method'" for an
    /// unknown method, and the method's own errors.
    async fn call_method(
        &self,
        agent: &RpcAgent,
        caller: &WorkerInfo,
        method: &str,
        args: Args,
    ) -> Result<Payload>;

    /// Moves every tensor the object holds to `device`, in place: each
    /// keeps its identity (as `nn.Module.to(device)` sets `param.data`), so
    /// the object's fields and RRefs to them see the moved tensors. Used to
    /// place a module on its owner's device (`RemoteModule` on `cuda:N`).
    ///
    /// # Errors
    /// The move's error (the caller checks the device exists first).
    fn to_device(&self, device: crate::device::Device) -> Result<()>;
}

impl super::RRef {
    /// A local owner RRef holding `object` itself (`RRef(obj)` of a plugin
    /// object made in place, OBJ-6): its methods run through the proxies,
    /// as those of an object `remote()` made.
    pub(crate) fn holding_object(agent: &RpcAgent, object: Arc<dyn RRefObject>) -> super::RRef {
        let state =
            super::OwnerState::new(super::context(agent).new_id(agent), agent.info().clone());
        state.complete(Ok(Payload::none()), Some(object));
        super::RRef::from_owner(state, None)
    }
}

/// What an owner holds once the creating function has run.
pub(crate) enum Owned {
    /// A value: copied by `to_here`, methods by name for tensors.
    Value(Payload),
    /// An object: used in place through its methods.
    Object(Arc<dyn RRefObject>),
}

impl Owned {
    /// The type name `_get_type` answers.
    pub(crate) fn type_name(&self) -> String {
        match self {
            Owned::Value(p) => super::type_name_of(p),
            Owned::Object(o) => o.type_name().to_owned(),
        }
    }
}

type Slot = Arc<Mutex<Option<Arc<dyn RRefObject>>>>;

tokio::task_local! {
    /// Set while the function of an owner-side `remote()` runs.
    static OBJECT_SLOT: Slot;
}

/// Whether the running function may make an object, i.e. runs as the
/// function of an owner-side `remote()` (OBJ-1).
pub(crate) fn can_keep_object() -> bool {
    OBJECT_SLOT.try_with(|_| ()).is_ok()
}

/// Hands `object` to the owner-side `remote()` the running function serves;
/// the RRef holds it instead of the function's payload.
///
/// # Errors
/// Gives the object back outside a `remote()` ([`can_keep_object`]).
pub(crate) fn keep_object(
    object: Arc<dyn RRefObject>,
) -> std::result::Result<(), Arc<dyn RRefObject>> {
    let mut object = Some(object);
    let _ = OBJECT_SLOT.try_with(|slot| {
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = object.take();
    });
    match object {
        None => Ok(()),
        Some(o) => Err(o),
    }
}

/// Runs `f` (the function of an owner-side `remote()`) where it may keep
/// an object; returns its result and the object it kept.
pub(crate) async fn keeping_objects<F>(f: F) -> (F::Output, Option<Arc<dyn RRefObject>>)
where
    F: std::future::Future,
{
    let slot: Slot = Arc::new(Mutex::new(None));
    let out = OBJECT_SLOT.scope(slot.clone(), f).await;
    let object = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    (out, object)
}

/// The object the running function of an owner-side `remote()` has kept so
/// far, if any (for wrappers that check what a constructor made, e.g.
/// [`crate::RemoteModule`]'s `_create_module`).
pub(crate) fn kept_object() -> Option<Arc<dyn RRefObject>> {
    OBJECT_SLOT
        .try_with(|slot| slot.lock().unwrap_or_else(|p| p.into_inner()).clone())
        .ok()
        .flatten()
}

/// Drops the object kept so far (it is disposed of): the wrapper rejected
/// it and the RRef holds the wrapper's error instead.
pub(crate) fn discard_kept_object() {
    let object = OBJECT_SLOT
        .try_with(|slot| slot.lock().unwrap_or_else(|p| p.into_inner()).take())
        .ok()
        .flatten();
    drop(object);
}
