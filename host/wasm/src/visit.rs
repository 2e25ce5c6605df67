//! Calls served while their instance waits: a single-instance plugin's
//! instance ([`Object::module`](crate::Object::module)) that waits on a
//! future runs the plugin's other calls meanwhile, as a Python process's
//! other threads run while one waits.
//!
//! What it owns: the [`Inbox`] of calls waiting for a busy instance
//! ([`Visit`]s), the hand-over of one visit to the guest waiting in that
//! instance, and the routing of the visit's host requests back to the
//! visitor's task. It leaves running guest code to the instance, and what
//! a visit's requests do to [`crate::imports::dispatch`].
//!
//! Invariants:
//! - VIS-1: a visit is run once, either by the call that takes the
//!   instance's lock or by a guest waiting in it, whichever claims it
//!   first ([`Visit::claim`]); the other lets it go.
//! - VIS-2: a visit's host requests run in the visitor's own task, with
//!   its own [`CallCtx`] (its task-locals, distributed autograd context,
//!   trace, locks), as they would if it held the instance itself; only the
//!   guest code runs in the waiting call's store.
//! - VIS-3: a guest is handed a visit only while it waits on a future
//!   (`future-wait-serving`), never in the middle of other host requests,
//!   and visits nest: a visit that waits may be handed another.
//! - VIS-4: a visit the guest never finishes fails when the waiting call
//!   ends (its result sender is dropped); the visitor sees an error, never
//!   waits for ever.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{Notify, mpsc, oneshot};
use wasmrpc_abi::protocol::{CallArgs, HostCall, HostReply, Outcome};

use crate::host::HostResult;
use crate::instance::CallCtx;

/// A host request of a visit, sent from the waiting call's store to the
/// visitor's task, with where its reply goes.
pub(crate) type Routed = (HostCall, oneshot::Sender<HostResult<HostReply>>);

/// What a visit runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum VisitTarget {
    /// The plugin's function `name`.
    Function(String),
    /// The constructor of class `name` (the new object is a sibling).
    Constructor(String),
    /// `method` of object `object` of class `class`.
    Method {
        object: u32,
        class: String,
        method: String,
    },
}

/// A call waiting for a busy instance, offered to a guest waiting in it.
pub(crate) struct Visit {
    pub(crate) target: VisitTarget,
    pub(crate) args: CallArgs,
    claimed: AtomicBool,
    /// Where the guest's requests during the visit go (VIS-2).
    route: mpsc::UnboundedSender<Routed>,
    /// Where its outcome goes; taken by the guest side when it claims it.
    done: Mutex<Option<oneshot::Sender<std::result::Result<Outcome, String>>>>,
}

impl Visit {
    /// Claims the visit for whoever calls first (VIS-1).
    pub(crate) fn claim(&self) -> bool {
        self.claimed
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn is_claimed(&self) -> bool {
        self.claimed.load(Ordering::Acquire)
    }
}

/// The visits waiting for one instance, shared by the objects of a
/// single-instance plugin on a worker.
#[derive(Default)]
pub(crate) struct Inbox {
    queue: Mutex<VecDeque<Arc<Visit>>>,
    arrived: Notify,
}

impl Inbox {
    fn push(&self, visit: Arc<Visit>) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(visit);
        // A waiter registers (`enable`) before it looks at the queue, so
        // one that is not yet waiting finds the visit there.
        self.arrived.notify_waiters();
    }

    fn remove(&self, visit: &Arc<Visit>) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|v| !Arc::ptr_eq(v, visit));
    }

    /// The next visit no one has claimed, claimed for a waiting guest,
    /// once one arrives.
    pub(crate) async fn next(&self) -> ActiveVisit {
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            while let Some(visit) = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                q.pop_front()
            } {
                if visit.claim() {
                    let done = visit.done.lock().unwrap_or_else(|p| p.into_inner()).take();
                    return ActiveVisit {
                        visit,
                        done,
                        started: Instant::now(),
                        saved_ctx: None,
                    };
                }
            }
            arrived.await;
        }
    }
}

/// A visit a guest is running: popped when it says it is done.
pub(crate) struct ActiveVisit {
    pub(crate) visit: Arc<Visit>,
    done: Option<oneshot::Sender<std::result::Result<Outcome, String>>>,
    /// When the guest was handed it (its guest time is not the waiting
    /// call's).
    pub(crate) started: Instant,
    /// The waiting call's context, restored when the visit ends.
    pub(crate) saved_ctx: Option<Arc<CallCtx>>,
}

impl ActiveVisit {
    /// The context the guest's requests use during the visit: they go to
    /// the visitor's task (VIS-2), and a wait in it may serve further
    /// visits (VIS-3).
    pub(crate) fn routed_ctx(&self, waiting: &CallCtx) -> Arc<CallCtx> {
        Arc::new(CallCtx {
            host: waiting.host.clone(),
            plugin: waiting.plugin.clone(),
            runtime: waiting.runtime.clone(),
            locks: Mutex::new(Vec::new()),
            inbox: waiting.inbox.clone(),
            route: Some(self.visit.route.clone()),
        })
    }

    /// Hands the visit's outcome to the visitor.
    pub(crate) fn finish(mut self, outcome: Outcome) {
        if let Some(done) = self.done.take() {
            let _ = done.send(Ok(outcome));
        }
    }
}

impl Drop for ActiveVisit {
    fn drop(&mut self) {
        // VIS-4: the waiting call ended (or trapped) before the guest
        // finished the visit.
        if let Some(done) = self.done.take() {
            let _ = done.send(Err(
                "the call of the instance that was running it ended before it finished".into(),
            ));
        }
    }
}

/// How a call that wanted the instance got through.
pub(crate) enum Entered<G> {
    /// It holds the instance's lock, and runs as usual.
    Locked(G),
    /// A guest waiting in the instance ran it: its outcome, or why not.
    Visited(std::result::Result<Outcome, String>),
}

/// Takes the instance behind `lock`, or, while a call holds it, offers the
/// call to a guest waiting in it through `inbox`: whichever comes first
/// (VIS-1). Meanwhile the visit's host requests run here, on `ctx`
/// (VIS-2). `busy` bounds the wait for the lock while no guest has taken
/// the visit (`None`: no bound); past it, `Err(())`.
pub(crate) async fn enter<'a, T>(
    lock: &'a tokio::sync::Mutex<T>,
    inbox: &Inbox,
    target: VisitTarget,
    args: &CallArgs,
    ctx: Arc<CallCtx>,
    busy: Option<std::time::Duration>,
) -> std::result::Result<Entered<tokio::sync::MutexGuard<'a, T>>, ()> {
    if let Ok(guard) = lock.try_lock() {
        return Ok(Entered::Locked(guard));
    }
    let (route, mut routed) = mpsc::unbounded_channel();
    let (done, mut outcome) = oneshot::channel();
    let visit = Arc::new(Visit {
        target,
        args: args.clone(),
        claimed: AtomicBool::new(false),
        route,
        done: Mutex::new(Some(done)),
    });
    inbox.push(visit.clone());
    let locked = lock.lock();
    tokio::pin!(locked);
    let deadline = async {
        match busy {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    let mut lock_given_up = false;
    loop {
        tokio::select! {
            guard = &mut locked, if !lock_given_up => {
                if visit.claim() {
                    inbox.remove(&visit);
                    return Ok(Entered::Locked(guard));
                }
                // A waiting guest runs it: let the lock go.
                lock_given_up = true;
            }
            () = &mut deadline, if !visit.is_claimed() => {
                if visit.claim() {
                    inbox.remove(&visit);
                    return Err(());
                }
            }
            Some((call, reply)) = routed.recv() => {
                let _ = reply.send(crate::imports::dispatch(&ctx, call).await);
            }
            result = &mut outcome => {
                crate::instance::release_locks(Some(ctx)).await;
                return Ok(Entered::Visited(result.unwrap_or_else(|_| {
                    Err("the instance dropped the call".into())
                })));
            }
        }
    }
}
