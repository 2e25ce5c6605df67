//! [`RRef`]: remote references, with PyTorch's ownership and
//! reference-counting protocol.
//!
//! `remote()` runs a function on its destination, the **owner**, and keeps
//! the result there; the caller gets a **user** RRef naming it. Users fetch
//! the value ([`RRef::to_here`]), pass the RRef on in arguments and results
//! (each copy is a new user, a **fork**), and call methods on the value
//! through proxies ([`RRef::rpc_sync`], [`RRef::rpc_async`],
//! [`RRef::remote`]). The owner keeps the value while any user can reach it
//! and forgets it once none can.
//!
//! What it owns: the per-agent RRef context (`context`): id allocation, the
//! owner's table of values and their forks, users waiting for the owner's
//! confirmation, forks sent and not yet accepted, the deletion of users at
//! graceful shutdown and the leak check; the wire form of an RRef inside a
//! [`Payload`] (a fork record); the handlers of `RRefFork`,
//! `RRefChildAccept` and `RRefUserDelete`; the owner-side functions behind
//! `remote`, `to_here`, `_get_type` and the proxies (`proxy`); what an
//! owner holds (`object`): a payload, or an object (a plugin class's) that
//! is never copied, serves the proxies' method calls, and is dropped (so
//! disposed of) when the owner forgets the value. It leaves sending and
//! timeouts to the agent, the meaning of a function to the registry, and
//! running an object's methods to the object (`crate::plugin`).
//!
//! # Protocol
//!
//! Ids are [`GloballyUniqueId`]s `(rank, counter)`; one counter per worker
//! serves RRef ids and fork ids alike (so a local `RRef::new` consumes an
//! id, as the seeds' `__str__` tests pin).
//!
//! - `remote(dst)` with `dst` another worker: the caller allocates an RRef id
//!   and a fork id, keeps its user RRef *pending*, and calls `dst`; the owner
//!   registers the fork before running the function; the reply confirms the
//!   user. With `dst` the caller itself the RRef is an owner RRef holding a
//!   *self fork* (fork id = RRef id) until its last handle drops.
//! - Sending an RRef (a fork): the sender allocates a fork id. An owner
//!   sender adds the fork to its table at once; a user sender keeps its own
//!   user alive as a *pending child* until the receiver accepts.
//! - Receiving a fork: the owner gets its own RRef back (and accepts toward
//!   a user sender, or drops the fork it sent itself); a user receiving from
//!   the owner is confirmed at once; a user receiving from another user is
//!   pending until the owner acknowledges its `RRefFork`, and then sends
//!   `RRefChildAccept` to the sender.
//! - Dropping the last handle of a user sends `RRefUserDelete`; the owner
//!   removes the fork and forgets the value when no fork is left.
//!
//! Invariants:
//! - RREF-1: the owner knows a fork before any user of it can send
//!   `RRefUserDelete`: a pending user (remote creation or user-to-user fork)
//!   is held by the context until the owner answered, and a sender's user
//!   is held as a pending child until the receiver's fork is known.
//! - RREF-2: a fork record that reaches the owner always finds the value's
//!   entry (a fork of it exists: the sender holds one), so the owner never
//!   creates a second value for a live RRef.
//! - RREF-3: the owner forgets a value exactly when its fork set becomes
//!   empty once its creating function has run (a value still being created
//!   is kept, so that the creation finds the entry a fork made first, and is
//!   forgotten when it completes with no fork left); handles held on the
//!   owner keep the value itself alive, and a later fork re-registers the
//!   same value.
//! - RREF-4: every protocol message is retried on send failure (fault
//!   injection) and answered with `RRefAck`; a deletion that arrives before
//!   the fork it deletes leaves a tombstone, so the late fork is not
//!   counted.
//! - RREF-5: graceful shutdown waits for pending users and children,
//!   deletes every user (marking it deleted, so later use fails with the
//!   seeds' texts) and every self fork, waits until its owners have no
//!   forks left, and then reports forks still known as "Leaking RRef"
//!   unless leaks are ignored.
//! - RREF-6: nothing a peer sends panics: malformed fork records and
//!   messages about unknown RRefs are errors or tombstones.
//! - RREF-7: a called function runs only once the user RRefs among its
//!   arguments are confirmed by their owners (PyTorch's thread-local pending
//!   RRefs), so `confirmed_by_owner()` holds inside it.

mod context;
mod extension;
mod functions;
mod message;
mod object;
mod owner;
mod proxy;
mod remote;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::abi::{ErrorKind, Value, WorkerInfo};
use crate::agent::{AgentInner, Dest, Future, RpcAgent};
use crate::error::{
    CURRENT_AGENT_NOT_SET, Error, RPC_TIMEOUT_PREFIX, RREF_CREATION_TIMED_OUT,
    RREF_TO_HERE_AFTER_DELETION, Result, local_value_not_on_owner_message,
};
use crate::value::Payload;

pub(crate) use context::context;
pub(crate) use extension::RRefs;
pub use message::{GloballyUniqueId, RREF_CHILD_ACCEPT, RREF_FORK, RREF_USER_DELETE, RRefMessage};
pub use object::OBJECT_STATE_METHOD;
pub(crate) use object::{
    Owned, RRefObject, can_keep_object, discard_kept_object, keep_object, kept_object,
};
pub(crate) use owner::OwnerState;
pub use proxy::{RRefProxy, RRefProxyMode};
pub use remote::Remote;

/// The id of an RRef (`RRefId`) or of one of its forks (`ForkId`).
pub type RRefId = GloballyUniqueId;

/// The function `remote()` calls on the owner (internal).
pub(crate) const REMOTE: &str = "wasmrpc::_rref_remote";
/// The owner-side fetch behind `to_here` (internal).
pub(crate) const FETCH: &str = "wasmrpc::_rref_fetch";
/// The owner-side type query behind `_get_type` (internal; the profiler
/// name the seeds look for contains `_rref_typeof_on_owner`).
pub(crate) const TYPEOF: &str = "wasmrpc::_rref_typeof_on_owner";
/// The RRef context's debug info, for peers (internal; the seeds'
/// `get_num_owners_and_forks`).
pub(crate) const DEBUG_INFO: &str = "wasmrpc::_rref_context_debug_info";

/// The internal function that answers a worker's RRef debug info (a dict of
/// str to str), for harness helpers that poll peers.
pub fn rref_debug_info_function() -> &'static str {
    DEBUG_INFO
}

/// The owner-side method call behind the proxies (internal).
pub(crate) const LOCAL_INVOKE: &str = "wasmrpc::_rref_local_invoke";

/// A reference to a value that lives on its owner: PyTorch's `RRef`.
///
/// Cheap to clone; clones are the same RRef object (one fork), as Python
/// references to one `RRef` are. The owner's value stays alive while any
/// user RRef anywhere can reach it.
#[derive(Clone)]
pub struct RRef {
    inner: Arc<Kind>,
    /// For an RRef `remote()` made in a profiling scope: completes once the
    /// call's event is recorded (`crate::profiler`).
    profiling: Option<Future>,
}

/// PyTorch's refusal of an RRef pickled outside RPC.
pub const RREF_PICKLE_OUTSIDE_RPC: &str =
    "Can not pickle rref in python pickler, rref can only be pickled when using RPC";

/// An RRef crosses the network only inside a call, where the agent forks
/// it (its handle codec); any other serializer (serde's, the counterpart
/// of Python's pickler) is refused, with PyTorch's text, so no RRef is
/// written where its reference count cannot follow it.
impl serde::Serialize for RRef {
    fn serialize<S: serde::Serializer>(&self, _: S) -> std::result::Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(RREF_PICKLE_OUTSIDE_RPC))
    }
}

enum Kind {
    Owner(OwnerHandle),
    User(Arc<UserState>),
}

/// An owner RRef handle; a remote-to-self RRef also holds its self fork.
struct OwnerHandle {
    state: Arc<OwnerState>,
    self_fork: Option<std::sync::Weak<AgentInner>>,
}

impl Drop for OwnerHandle {
    fn drop(&mut self) {
        if let Some(agent) = self.self_fork.take().and_then(|w| w.upgrade()) {
            let agent = RpcAgent::from_inner(agent);
            context(&agent).del_fork(&agent, self.state.id, self.state.id);
        }
    }
}

/// A user RRef: one fork of a value owned elsewhere.
pub(crate) struct UserState {
    agent: std::sync::Weak<AgentInner>,
    pub(crate) owner: WorkerInfo,
    pub(crate) rref_id: RRefId,
    pub(crate) fork_id: RRefId,
    confirmed: AtomicBool,
    deleted: AtomicBool,
    /// The `remote()` call that created it (ready for forks).
    creation: Future,
    /// The cached `_get_type` future.
    type_future: Mutex<Option<Future>>,
}

impl UserState {
    pub(crate) fn confirm(&self) {
        self.confirmed.store(true, Ordering::Release);
    }

    /// Marks the user deleted; true if it was not already.
    pub(crate) fn mark_deleted(&self) -> bool {
        !self.deleted.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }
}

impl Drop for UserState {
    fn drop(&mut self) {
        if self.is_deleted() {
            return;
        }
        if let Some(agent) = self.agent.upgrade() {
            let agent = RpcAgent::from_inner(agent);
            context(&agent).del_user(&agent, &self.owner, self.rref_id, self.fork_id);
        }
    }
}

impl fmt::Display for RRef {
    /// The seeds' formats: `OwnerRRef(GloballyUniqueId(...))` and
    /// `UserRRef(RRefId = GloballyUniqueId(...), ForkId = GloballyUniqueId(...))`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.inner {
            Kind::Owner(o) => write!(f, "OwnerRRef({})", o.state.id),
            Kind::User(u) => write!(
                f,
                "UserRRef(RRefId = {}, ForkId = {})",
                u.rref_id, u.fork_id
            ),
        }
    }
}

impl fmt::Debug for RRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The Python type name of a value held by an RRef (`_get_type`): `Tensor`
/// for tensors, a record's (plugin object's) type name, else the value's.
pub(crate) fn type_name_of(p: &Payload) -> String {
    match &p.value {
        Value::Tensor(_) => "Tensor".into(),
        Value::Record { name, .. } => name.clone(),
        v => v.type_name().into(),
    }
}

impl RRef {
    /// A local owner RRef holding `value` (`RRef(value)`); it consumes an
    /// id of `agent`'s counter and is registered with the owner's table only
    /// once it is shared.
    pub fn new(agent: &RpcAgent, value: impl Into<Payload>) -> RRef {
        let ctx = context(agent);
        let state = OwnerState::new(ctx.new_id(agent), agent.info().clone());
        let _ = state.value.set_result(value.into());
        RRef::from_owner(state, None)
    }

    /// `RRef(value)` without an agent at hand: [`new`](Self::new) on the
    /// process-wide current agent ([`crate::set_current_agent`]), as
    /// PyTorch's constructor finds its agent.
    ///
    /// # Errors
    /// `RuntimeError` "Current RPC agent is not set! Did you initialize the
    /// RPC framework" when no running agent is current (a process that
    /// only joined a store rendezvous, or whose agent shut down).
    pub fn on_current_agent(value: impl Into<Payload>) -> Result<RRef> {
        let agent = crate::current_agent().map_err(|_| {
            Error::runtime(format!(
                "{CURRENT_AGENT_NOT_SET} (e.g. calling `init_rpc`, then `set_current_agent`)?"
            ))
        })?;
        Ok(RRef::new(&agent, value))
    }

    pub(crate) fn from_owner(state: Arc<OwnerState>, self_fork: Option<&RpcAgent>) -> RRef {
        RRef {
            inner: Arc::new(Kind::Owner(OwnerHandle {
                state,
                self_fork: self_fork.map(RpcAgent::downgrade),
            })),
            profiling: None,
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "a user is its owner, its two ids, its agent and its creation"
    )]
    pub(crate) fn user(
        agent: &RpcAgent,
        owner: WorkerInfo,
        rref_id: RRefId,
        fork_id: RRefId,
        confirmed: bool,
        creation: Future,
    ) -> (RRef, Arc<UserState>) {
        let state = Arc::new(UserState {
            agent: agent.downgrade(),
            owner,
            rref_id,
            fork_id,
            confirmed: AtomicBool::new(confirmed),
            deleted: AtomicBool::new(false),
            creation,
            type_future: Mutex::new(None),
        });
        (
            RRef {
                inner: Arc::new(Kind::User(state.clone())),
                profiling: None,
            },
            state,
        )
    }

    pub(crate) fn owner_state(&self) -> Option<&Arc<OwnerState>> {
        match &*self.inner {
            Kind::Owner(o) => Some(&o.state),
            Kind::User(_) => None,
        }
    }

    pub(crate) fn user_state(&self) -> Option<&Arc<UserState>> {
        match &*self.inner {
            Kind::Owner(_) => None,
            Kind::User(u) => Some(u),
        }
    }

    /// The RRef's id.
    pub fn id(&self) -> RRefId {
        match &*self.inner {
            Kind::Owner(o) => o.state.id,
            Kind::User(u) => u.rref_id,
        }
    }

    /// This handle's fork id: the RRef id on the owner.
    pub fn fork_id(&self) -> RRefId {
        match &*self.inner {
            Kind::Owner(o) => o.state.id,
            Kind::User(u) => u.fork_id,
        }
    }

    /// The owner's worker info (`owner()`).
    pub fn owner_info(&self) -> &WorkerInfo {
        match &*self.inner {
            Kind::Owner(o) => &o.state.owner,
            Kind::User(u) => &u.owner,
        }
    }

    /// The owner's worker info (`owner()`), as a value.
    pub fn owner(&self) -> WorkerInfo {
        self.owner_info().clone()
    }

    /// The owner's name (`owner_name()`).
    pub fn owner_name(&self) -> &str {
        &self.owner_info().name
    }

    /// Whether this worker owns the value (`is_owner()`).
    pub fn is_owner(&self) -> bool {
        matches!(&*self.inner, Kind::Owner(_))
    }

    /// Whether the owner has confirmed this user (`confirmed_by_owner()`);
    /// always true on the owner.
    pub fn confirmed_by_owner(&self) -> bool {
        match &*self.inner {
            Kind::Owner(_) => true,
            Kind::User(u) => u.confirmed.load(Ordering::Acquire),
        }
    }

    /// Whether two handles are the same RRef object.
    pub fn ptr_eq(&self, other: &RRef) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The future of the RRef's creation (`_get_future()`): the `remote()`
    /// call on a user created by it, the value on the owner (`None` once an
    /// object is made), an already completed future on a user created by a
    /// fork.
    pub fn get_future(&self) -> Future {
        match &*self.inner {
            Kind::Owner(o) => o.state.value.clone(),
            Kind::User(u) => u.creation.clone(),
        }
    }

    /// The future that completes once the `remote()` that made this RRef in
    /// a profiling scope has its event recorded, with the callee's events
    /// (`_get_profiling_future()`): the creation on a user, the response to
    /// the call on an owner made by a `remote()` to self (its value exists
    /// earlier). An already completed future for any other RRef.
    pub fn get_profiling_future(&self) -> Future {
        match &self.profiling {
            Some(f) => f.clone(),
            None => {
                let f = Future::new();
                let _ = f.set_result(Payload::none());
                f
            }
        }
    }

    /// The value, on the owner (`local_value()`); waits until the function
    /// that creates it has run.
    ///
    /// # Errors
    /// On a user, `RuntimeError` "For UserRRef(...), can't call
    /// localValue() on user ... Call it on owner ..."; on the owner, the
    /// error of the function that created the value; for an object (a
    /// plugin class's), its state ([`OBJECT_STATE_METHOD`]) or, for a class
    /// without one, a `TypeError`: objects are not copied out of the
    /// owner's table, even on the owner; call their methods through the
    /// proxies ([`rpc_sync`](Self::rpc_sync), ...), which work on the owner
    /// too.
    pub async fn local_value(&self, agent: &RpcAgent) -> Result<Payload> {
        match &*self.inner {
            Kind::Owner(o) => o.state.payload("local_value()", agent, agent.info()).await,
            Kind::User(u) => Err(Error::runtime(local_value_not_on_owner_message(
                &u.rref_id.to_string(),
                &u.fork_id.to_string(),
                agent.info(),
                &u.owner,
            ))),
        }
    }

    /// A copy of the value (`to_here(timeout)`): the value itself on the
    /// owner, fetched from the owner on a user. `timeout` `None` uses the
    /// agent's default, zero means none.
    ///
    /// # Errors
    /// `RuntimeError` "Cannot call to_here() on it after deletion." after
    /// shutdown deleted the user; "RRef creation via rpc.remote() timed out
    /// ..." when the `remote()` that created it timed out; the error of the
    /// function that created the value; for an object (a plugin class's),
    /// its state ([`OBJECT_STATE_METHOD`]) or, for a class without one, a
    /// `TypeError` (objects stay on their owner: use the proxies); a
    /// timeout or a failure of the owner (naming the owner and the RRef).
    pub async fn to_here(&self, agent: &RpcAgent, timeout: Option<Duration>) -> Result<Payload> {
        let u = match &*self.inner {
            Kind::Owner(o) => {
                return o.state.payload("to_here()", agent, agent.info()).await;
            }
            Kind::User(u) => u,
        };
        if u.is_deleted() {
            return Err(Error::runtime(RREF_TO_HERE_AFTER_DELETION)
                .context_line(format!("to_here() on {self}")));
        }
        if let Some(Err(e)) = u.creation.try_value()
            && e.message().contains(RPC_TIMEOUT_PREFIX)
        {
            return Err(Error::runtime(RREF_CREATION_TIMED_OUT)
                .context_line(format!("to_here() on {self} owned by {}", u.owner.name)));
        }
        let fut = agent.call(
            Dest::Info(u.owner.clone()),
            FETCH,
            crate::args![id_value(u.rref_id)],
            crate::agent::CallOptions {
                timeout,
                ..crate::agent::CallOptions::new(crate::agent::CallKind::Internal)
            }
            .carrying_user_values(),
        );
        let value = fut.wait().await.map_err(|e| {
            e.context_line(format!(
                "to_here() on {self} owned by worker {}",
                u.owner.name
            ))
        })?;
        // The owner answers `remote()` and the fetch when the value is set,
        // as two replies that may arrive in either order: once the value is
        // here, the creation reply is too (`_get_future().done()`, as the
        // seeds check). Its own outcome was the value's, so it is not
        // looked at again.
        let _ = u.creation.wait().await;
        Ok(value)
    }

    /// The future of the type of the value (`_get_type(blocking=False)`):
    /// a `str` payload (`Tensor`, a plugin class name, `int`, ...). On a
    /// user, the first call asks the owner (with `timeout`: `None` for the
    /// default, zero for none) and every later call returns the same
    /// future; the owner answers once the value exists. The question is an
    /// `rpc_async` of the owner's `_rref_typeof_on_owner`, as PyTorch's:
    /// a profiling scope records it (`rpc_async#..._rref_typeof_on_owner`).
    pub fn get_type_future(&self, agent: &RpcAgent, timeout: Option<Duration>) -> Future {
        match &*self.inner {
            Kind::Owner(o) => {
                // Not `then`: the value's error keeps its kind.
                let out = Future::new();
                let o2 = out.clone();
                // Weak: the value's future must not keep its own state alive.
                let state = Arc::downgrade(&o.state);
                o.state.value.add_done_callback(move |f| {
                    let r = match (f.try_value(), state.upgrade()) {
                        (Some(Ok(p)), Some(state)) => {
                            Ok(Payload::from(state.owned_from(p).type_name()))
                        }
                        (Some(Ok(p)), None) => Ok(Payload::from(type_name_of(&p))),
                        (Some(Err(e)), _) => Err(e),
                        (None, _) => Err(Error::runtime(
                            "RRef value future completed without a value",
                        )),
                    };
                    let _ = o2.complete(r);
                });
                out
            }
            Kind::User(u) => {
                let mut slot = u.type_future.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(f) = &*slot {
                    return f.clone();
                }
                let f = agent.call(
                    Dest::Info(u.owner.clone()),
                    TYPEOF,
                    crate::args![id_value(u.rref_id)],
                    crate::agent::CallOptions {
                        timeout,
                        ..crate::agent::CallOptions::new(crate::agent::CallKind::Async)
                    },
                );
                *slot = Some(f.clone());
                f
            }
        }
    }

    /// The type of the value (`_get_type(blocking=True)`): see
    /// [`get_type_future`](Self::get_type_future).
    ///
    /// # Errors
    /// The error of the function that created the value, a timeout, or the
    /// owner's failure.
    pub async fn get_type(&self, agent: &RpcAgent, timeout: Option<Duration>) -> Result<String> {
        let p = self.get_type_future(agent, timeout).wait().await?;
        Ok(p.as_str()?.to_string())
    }

    /// A proxy that calls methods of the value on its owner and waits
    /// (`rref.rpc_sync(timeout)`); `timeout` `None` for the default.
    pub fn rpc_sync(&self, agent: &RpcAgent, timeout: Option<Duration>) -> RRefProxy {
        RRefProxy::new(agent, self, RRefProxyMode::Sync, timeout)
    }

    /// A proxy that calls methods of the value on its owner and returns
    /// futures (`rref.rpc_async(timeout)`).
    pub fn rpc_async(&self, agent: &RpcAgent, timeout: Option<Duration>) -> RRefProxy {
        RRefProxy::new(agent, self, RRefProxyMode::Async, timeout)
    }

    /// A proxy that calls methods of the value on its owner and keeps the
    /// results there (`rref.remote(timeout)`).
    pub fn remote(&self, agent: &RpcAgent, timeout: Option<Duration>) -> RRefProxy {
        RRefProxy::new(agent, self, RRefProxyMode::Remote, timeout)
    }
}

pub(crate) fn id_value(id: RRefId) -> Value {
    Value::Tuple(vec![
        Value::Int(i64::from(id.created_on)),
        Value::Int(id.local_id as i64),
    ])
}

pub(crate) fn id_from_value(v: &Value) -> Result<RRefId> {
    match v {
        Value::Tuple(xs) | Value::List(xs) => match xs.as_slice() {
            [Value::Int(c), Value::Int(l)] => Ok(RRefId {
                created_on: u32::try_from(*c)
                    .map_err(|_| Error::runtime(format!("invalid RRef id rank {c}")))?,
                local_id: u64::try_from(*l)
                    .map_err(|_| Error::runtime(format!("invalid RRef local id {l}")))?,
            }),
            _ => Err(Error::runtime("malformed RRef id")),
        },
        _ => Err(Error::runtime("malformed RRef id")),
    }
}

/// Error-kind helper for peers' malformed input (RREF-6).
pub(crate) fn malformed(what: impl fmt::Display) -> Error {
    Error::new(
        ErrorKind::RuntimeError,
        format!("malformed RRef message: {what}"),
    )
}
