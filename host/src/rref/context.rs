//! The per-agent RRef context: ids, the owner's table of values and forks,
//! pending users and children, the protocol messages, the wire form of
//! RRefs, shutdown deletion and the leak check.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use super::message::RRefMessage;
use super::{OwnerState, RRef, RRefId, UserState, id_from_value, malformed};
use crate::abi::{Value, WorkerInfo};
use crate::agent::{Dest, Future, RpcAgent};
use crate::error::{Error, RREF_FORK_AFTER_DELETION, Result, leaking_rref_message};
use crate::value::{Handle, Payload, map_values};

/// The name of the record an RRef travels as (a fork record).
pub(crate) const RREF_RECORD: &str = "wasmrpc::RRef";

/// How often a protocol message is sent before giving up (RREF-4).
const SEND_ATTEMPTS: u32 = 8;
/// The timeout of one protocol message.
const PROTOCOL_TIMEOUT: Duration = Duration::from_secs(30);

/// What runs once a protocol message is answered (or given up on).
type Done = Box<dyn FnOnce(&RpcAgent, Result<()>) + Send>;

#[derive(Default)]
struct Tables {
    owners: HashMap<RRefId, Arc<OwnerState>>,
    forks: HashMap<RRefId, HashSet<RRefId>>,
    pending_users: HashMap<RRefId, Arc<UserState>>,
    pending_children: HashMap<RRefId, RRef>,
    confirmed_users: HashMap<RRefId, Weak<UserState>>,
    /// Forks deleted before the owner learnt of them (RREF-4).
    tombstones: HashSet<(RRefId, RRefId)>,
}

/// One agent's RRef bookkeeping (a per-worker state of the agent).
#[derive(Default)]
pub(crate) struct RRefContext {
    next_id: AtomicU64,
    tables: Mutex<Tables>,
    changed: Notify,
    pending_futures: AtomicUsize,
    destroyed: AtomicBool,
    /// `_ignore_rref_leak` is true unless turned off (PyTorch's default).
    check_leaks: AtomicBool,
    keep_on_shutdown: AtomicBool,
}

/// The context of `agent`.
pub(crate) fn context(agent: &RpcAgent) -> Arc<RRefContext> {
    agent.state::<RRefContext>()
}

impl RRefContext {
    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self) {
        self.changed.notify_waiters();
    }

    /// A new id from the worker's counter (RRef and fork ids share it).
    pub(crate) fn new_id(&self, agent: &RpcAgent) -> RRefId {
        RRefId {
            created_on: agent.rank(),
            local_id: self.next_id.fetch_add(1, Ordering::AcqRel),
        }
    }

    pub(crate) fn set_ignore_leak(&self, ignore: bool) {
        self.check_leaks.store(!ignore, Ordering::Release);
    }

    pub(crate) fn set_delete_on_shutdown(&self, delete: bool) {
        self.keep_on_shutdown.store(!delete, Ordering::Release);
    }

    pub(crate) fn debug_info(&self) -> BTreeMap<String, String> {
        let t = self.tables();
        let forks: usize = t.forks.values().map(HashSet::len).sum();
        let mut m = BTreeMap::new();
        m.insert("num_owner_rrefs".into(), t.owners.len().to_string());
        m.insert(
            "num_pending_users".into(),
            t.pending_users.len().to_string(),
        );
        m.insert(
            "num_pending_futures".into(),
            self.pending_futures.load(Ordering::Acquire).to_string(),
        );
        m.insert("num_forks".into(), forks.to_string());
        m
    }

    /// The owner's entry for `id`, created (without a value) if absent.
    pub(super) fn get_or_create_owner(&self, agent: &RpcAgent, id: RRefId) -> Arc<OwnerState> {
        self.tables()
            .owners
            .entry(id)
            .or_insert_with(|| OwnerState::new(id, agent.info().clone()))
            .clone()
    }

    /// Registers a remote-to-self RRef with its self fork.
    pub(crate) fn register_self_owner(&self, agent: &RpcAgent, id: RRefId) -> Arc<OwnerState> {
        let state = self.get_or_create_owner(agent, id);
        self.tables().forks.entry(id).or_default().insert(id);
        self.touch();
        state
    }

    /// Adds a fork on the owner, unless it was already deleted (RREF-4).
    pub(super) fn add_fork(&self, state: &Arc<OwnerState>, fork_id: RRefId) {
        let mut t = self.tables();
        if t.tombstones.remove(&(state.id, fork_id)) {
            return;
        }
        t.owners.entry(state.id).or_insert_with(|| state.clone());
        t.forks.entry(state.id).or_default().insert(fork_id);
        drop(t);
        self.touch();
    }

    /// Removes a fork on the owner; forgets the value with its last fork
    /// (RREF-3). An unknown fork leaves a tombstone (RREF-4).
    pub(crate) fn del_fork(&self, _agent: &RpcAgent, rref_id: RRefId, fork_id: RRefId) {
        let removed_owner;
        {
            let mut t = self.tables();
            let known = t
                .forks
                .get_mut(&rref_id)
                .is_some_and(|s| s.remove(&fork_id));
            if !known {
                if rref_id != fork_id {
                    t.tombstones.insert((rref_id, fork_id));
                }
                return;
            }
            if t.forks.get(&rref_id).is_some_and(HashSet::is_empty) {
                t.forks.remove(&rref_id);
                // RREF-3: a value still being created is kept; its creation
                // finds it and forgets it if no fork is left by then.
                let created = t.owners.get(&rref_id).is_none_or(|s| s.value.done());
                removed_owner = if created {
                    t.owners.remove(&rref_id)
                } else {
                    None
                };
            } else {
                removed_owner = None;
            }
        }
        // The value (which may hold RRefs) is dropped outside the lock.
        drop(removed_owner);
        self.touch();
    }

    /// After `remote()`'s creating function has run on the owner: forgets
    /// the value if its forks all went while it was being created (RREF-3).
    pub(super) fn forget_if_unforked(&self, id: RRefId) {
        let removed_owner = {
            let mut t = self.tables();
            if t.forks.get(&id).is_none_or(HashSet::is_empty) {
                t.forks.remove(&id);
                t.owners.remove(&id)
            } else {
                None
            }
        };
        drop(removed_owner);
        self.touch();
    }

    /// FAIL-5 for RRefs: worker `rank` was declared failed, so the forks
    /// it held will never be deleted by it; the owner forgets them as if
    /// they were (RREF-3: a value whose last fork goes is forgotten).
    pub(crate) fn forget_forks_of(&self, agent: &RpcAgent, rank: u32) {
        let held: Vec<(RRefId, RRefId)> = self
            .tables()
            .forks
            .iter()
            .flat_map(|(rref, forks)| {
                forks
                    .iter()
                    .filter(move |f| f.created_on == rank && *f != rref)
                    .map(move |f| (*rref, *f))
            })
            .collect();
        for (rref_id, fork_id) in held {
            self.del_fork(agent, rref_id, fork_id);
        }
    }

    pub(crate) fn add_pending_user(&self, fork_id: RRefId, user: Arc<UserState>) {
        self.tables().pending_users.insert(fork_id, user);
        self.touch();
    }

    /// The owner answered a pending user: it becomes confirmed.
    pub(crate) fn confirm_pending_user(&self, fork_id: RRefId) {
        let user = {
            let mut t = self.tables();
            let user = t.pending_users.remove(&fork_id);
            if let Some(u) = &user {
                u.confirm();
                t.confirmed_users.insert(fork_id, Arc::downgrade(u));
            }
            user
        };
        drop(user);
        self.touch();
    }

    /// Deletes a user on its owner (the last handle dropped, or shutdown).
    pub(crate) fn del_user(
        &self,
        agent: &RpcAgent,
        owner: &WorkerInfo,
        rref_id: RRefId,
        fork_id: RRefId,
    ) {
        self.tables().confirmed_users.remove(&fork_id);
        if self.destroyed.load(Ordering::Acquire) || !agent.is_running() {
            return;
        }
        self.send_protocol(
            agent,
            owner.clone(),
            RRefMessage::UserDelete { rref_id, fork_id },
            None,
        );
    }

    /// Sends a protocol message with retries (RREF-4), counting it as a
    /// pending future until it is answered; then runs `done`.
    fn send_protocol(
        &self,
        agent: &RpcAgent,
        to: WorkerInfo,
        message: RRefMessage,
        done: Option<Done>,
    ) {
        self.pending_futures.fetch_add(1, Ordering::AcqRel);
        let agent = agent.clone();
        let runtime = agent.runtime_handle();
        runtime.spawn(async move {
            let mut last = Ok(());
            for attempt in 0..SEND_ATTEMPTS {
                let r = agent
                    .request(
                        Dest::Info(to.clone()),
                        message.kind(),
                        message.encode(),
                        &[],
                        Some(PROTOCOL_TIMEOUT),
                    )
                    .wait()
                    .await;
                match r {
                    Ok(_) => {
                        last = Ok(());
                        break;
                    }
                    Err(e) => {
                        let retry = agent.is_running()
                            && e.message().starts_with("Send failed")
                            && attempt + 1 < SEND_ATTEMPTS;
                        last = Err(e);
                        if !retry {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10 << attempt.min(6))).await;
                    }
                }
            }
            if let Err(e) = &last {
                tracing::warn!(worker = %agent.name(), peer = %to.name, "RRef protocol message failed: {e}");
            }
            if let Some(done) = done {
                done(&agent, last);
            }
            let ctx = context(&agent);
            ctx.pending_futures.fetch_sub(1, Ordering::AcqRel);
            ctx.touch();
        });
    }

    /// Forks `rref` toward `dst` and returns its wire record.
    fn fork(&self, agent: &RpcAgent, rref: &RRef, dst: &WorkerInfo) -> Result<Value> {
        let fork_id = self.new_id(agent);
        let type_name = match rref.owner_state() {
            Some(state) => {
                // The owner counts the fork at once.
                self.add_fork(state, fork_id);
                state
                    .value
                    .try_value()
                    .and_then(|r| r.ok())
                    .map(|p| state.owned_from(p).type_name())
            }
            None => {
                let u = rref
                    .user_state()
                    .ok_or_else(|| Error::runtime("RRef is neither owner nor user"))?;
                if u.is_deleted() {
                    return Err(Error::runtime(RREF_FORK_AFTER_DELETION)
                        .context_line(format!("sending {rref} to worker {}", dst.name)));
                }
                // RREF-1: the sender's user lives until the child accepts.
                self.tables().pending_children.insert(fork_id, rref.clone());
                None
            }
        };
        Ok(Value::Record {
            name: RREF_RECORD.into(),
            fields: vec![
                ("owner".into(), Value::WorkerInfo(rref.owner())),
                ("rref_id".into(), super::id_value(rref.id())),
                ("fork_id".into(), super::id_value(fork_id)),
                ("parent".into(), Value::WorkerInfo(agent.info().clone())),
                ("type".into(), type_name.map_or(Value::None, Value::Str)),
            ],
        })
    }

    /// Receives a fork record from `parent`.
    fn accept(&self, agent: &RpcAgent, fields: &[(String, Value)]) -> Result<RRef> {
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v)
                .ok_or_else(|| malformed(format!("fork record without {name}")))
        };
        let owner = match field("owner")? {
            Value::WorkerInfo(w) => w.clone(),
            _ => return Err(malformed("owner is not a WorkerInfo")),
        };
        let parent = match field("parent")? {
            Value::WorkerInfo(w) => w.clone(),
            _ => return Err(malformed("parent is not a WorkerInfo")),
        };
        let rref_id = id_from_value(field("rref_id")?)?;
        let fork_id = id_from_value(field("fork_id")?)?;
        let me = agent.rank();
        if owner.id == me {
            // RREF-2: a fork of it exists, so the entry is there.
            let state = self.get_or_create_owner(agent, rref_id);
            if parent.id == me {
                // The owner sent it to itself: drop the fork it added.
                self.del_fork(agent, rref_id, fork_id);
            } else {
                // A user sent it to the owner: no fork to keep (PyTorch's
                // phantom fork id); release the sender's pending child.
                self.send_protocol(agent, parent, RRefMessage::ChildAccept { fork_id }, None);
            }
            return Ok(RRef::from_owner(state, None));
        }
        let confirmed = parent.id == owner.id;
        let (rref, user) = RRef::user(
            agent,
            owner.clone(),
            rref_id,
            fork_id,
            confirmed,
            Future::ready(Ok(Payload::none())),
        );
        if confirmed {
            // The owner counted the fork when it sent it.
            self.tables()
                .confirmed_users
                .insert(fork_id, Arc::downgrade(&user));
            return Ok(rref);
        }
        self.add_pending_user(fork_id, user);
        self.send_protocol(
            agent,
            owner,
            RRefMessage::Fork { rref_id, fork_id },
            Some(Box::new(move |agent: &RpcAgent, _r: Result<()>| {
                let ctx = context(agent);
                ctx.confirm_pending_user(fork_id);
                ctx.send_protocol(agent, parent, RRefMessage::ChildAccept { fork_id }, None);
            })),
        );
        Ok(rref)
    }

    /// Graceful shutdown's deletion step (RREF-5).
    pub(crate) async fn delete_all_users_and_unforked_owners(
        &self,
        agent: &RpcAgent,
        timeout: Duration,
    ) -> Result<()> {
        if self.keep_on_shutdown.load(Ordering::Acquire) {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now()
            + if timeout.is_zero() {
                Duration::from_secs(60)
            } else {
                timeout
            };
        self.wait_until(deadline, |t, _| {
            t.pending_users.is_empty() && t.pending_children.is_empty()
        })
        .await
        .map_err(|()| {
            Error::runtime(format!(
                "worker {}: timed out waiting for pending UserRRefs to be confirmed by owner and parent",
                agent.name()
            ))
        })?;
        let users: Vec<Arc<UserState>> = {
            let t = self.tables();
            t.confirmed_users
                .values()
                .filter_map(Weak::upgrade)
                .collect()
        };
        for u in &users {
            if u.mark_deleted() {
                self.del_user(agent, &u.owner, u.rref_id, u.fork_id);
            }
        }
        drop(users);
        // Self forks: the owner's own handles.
        let self_forks: Vec<RRefId> = {
            let t = self.tables();
            t.forks
                .iter()
                .filter(|(id, s)| s.contains(id))
                .map(|(id, _)| *id)
                .collect()
        };
        for id in self_forks {
            self.del_fork(agent, id, id);
        }
        self.wait_until(deadline, |t, pending| pending == 0 && t.forks.is_empty())
            .await
            .map_err(|()| {
                Error::runtime(format!(
                    "worker {}: timed out waiting for pending UserRRefs to be deleted by owners",
                    agent.name()
                ))
            })?;
        Ok(())
    }

    async fn wait_until(
        &self,
        deadline: tokio::time::Instant,
        pred: impl Fn(&Tables, usize) -> bool,
    ) -> std::result::Result<(), ()> {
        loop {
            let notified = self.changed.notified();
            if pred(&self.tables(), self.pending_futures.load(Ordering::Acquire)) {
                return Ok(());
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                _ = tokio::time::sleep_until(deadline) => return Err(()),
            }
        }
    }

    /// Ends the context at agent shutdown: the leak check (RREF-5), then
    /// every table is cleared without sending anything.
    pub(crate) fn destroy(&self) -> Result<()> {
        self.destroyed.store(true, Ordering::Release);
        let (report, tables) = {
            let mut t = self.tables();
            let mut lines: Vec<String> = Vec::new();
            for (rref_id, forks) in &t.forks {
                for fork_id in forks {
                    lines.push(leaking_rref_message(
                        &rref_id.to_string(),
                        &fork_id.to_string(),
                    ));
                }
            }
            lines.sort();
            (lines, std::mem::take(&mut *t))
        };
        // Handles are dropped outside the lock; `destroyed` keeps them quiet.
        drop(tables);
        self.touch();
        if !report.is_empty() {
            tracing::warn!("Detected RRef Leaks during shutdown: {}", report.join("; "));
            if self.check_leaks.load(Ordering::Acquire) {
                return Err(Error::runtime(report.join("\n")));
            }
        }
        Ok(())
    }

    /// Answers a protocol message (on the owner or the parent).
    pub(crate) fn on_message(&self, agent: &RpcAgent, message: RRefMessage) -> Result<()> {
        match message {
            RRefMessage::Fork { rref_id, fork_id } => {
                // The entry may not exist yet: the remote() that creates it
                // can arrive after a fork of it.
                let state = self.get_or_create_owner(agent, rref_id);
                self.add_fork(&state, fork_id);
                Ok(())
            }
            RRefMessage::ChildAccept { fork_id } => {
                let child = self.tables().pending_children.remove(&fork_id);
                drop(child);
                self.touch();
                Ok(())
            }
            RRefMessage::UserDelete { rref_id, fork_id } => {
                self.del_fork(agent, rref_id, fork_id);
                Ok(())
            }
        }
    }
}

/// The RRefs among `handles`.
fn rrefs_of(handles: &[Handle]) -> Vec<RRef> {
    handles
        .iter()
        .filter_map(|h| h.downcast_ref::<RRef>().cloned())
        .collect()
}

/// Waits until every user among `handles` is confirmed by its owner
/// (RREF-7), at most the protocol timeout.
pub(crate) async fn wait_confirmed(agent: RpcAgent, handles: Vec<Handle>) {
    let rrefs = rrefs_of(&handles);
    if rrefs.iter().all(RRef::confirmed_by_owner) {
        return;
    }
    let ctx = context(&agent);
    let deadline = tokio::time::Instant::now() + PROTOCOL_TIMEOUT;
    let _ = ctx
        .wait_until(deadline, |_, _| rrefs.iter().all(RRef::confirmed_by_owner))
        .await;
}

/// Turns the RRefs of `value` (indexes into `handles`) into fork records
/// toward `dst`.
///
/// # Errors
/// A deleted user ("Cannot call fork an UserRRef after deletion.") or an
/// index outside the table.
pub(crate) fn to_wire(
    agent: &RpcAgent,
    dst: &WorkerInfo,
    value: Value,
    handles: &[Handle],
) -> Result<Value> {
    if handles.is_empty() {
        return Ok(value);
    }
    let ctx = context(agent);
    map_values(value, &mut |v| match v {
        Value::RRef(i) => {
            let rref = handles
                .get(i as usize)
                .and_then(|h| h.downcast_ref::<RRef>())
                .ok_or_else(|| {
                    Error::runtime(format!(
                        "RRef index {i} outside the table of {} RRefs",
                        handles.len()
                    ))
                })?;
            ctx.fork(agent, rref, dst)
        }
        other => Ok(other),
    })
}

/// Turns the fork records of a received `value` into RRefs, appending them
/// to `table`.
///
/// # Errors
/// A malformed record, or an RRef index without a table (RREF-6).
pub(crate) fn from_wire(agent: &RpcAgent, value: Value, table: &mut Vec<Handle>) -> Result<Value> {
    map_values(value, &mut |v| match v {
        Value::RRef(i) => Err(malformed(format!("bare RRef index {i} on the wire"))),
        Value::Record { name, fields } if name == RREF_RECORD => {
            let rref = context(agent).accept(agent, &fields)?;
            table.push(Handle::new(rref));
            Ok(Value::RRef((table.len() - 1) as u32))
        }
        other => Ok(other),
    })
}
