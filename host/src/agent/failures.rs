//! Failed workers: the peers this worker declared failed, what that does
//! to calls, and who is told.
//!
//! A peer is declared failed when its connection went silent for the
//! failure window (`transport` TR-11, [`RpcBackendOptions::failure_timeout`](super::RpcBackendOptions::failure_timeout)):
//! a stopped process, a machine off the network; or when its side closed or
//! broke a connection, while this worker runs, with calls still waiting on
//! it (a killed process: the calls fail with the close, TR-4, and the
//! worker is declared failed with the close's cause). A connection that
//! closes with nothing pending on it declares nothing (peers leaving a
//! dynamic group, or shutting down, close theirs that way), and neither
//! does a close this worker decided (a frame it could not read: the peer
//! is alive, and the next call dials it again).
//!
//! Invariants:
//! - FAIL-1: a worker is declared failed at most once. From then on every
//!   call pending to it fails at once with "worker2 failed: no heartbeat
//!   for 2.0 s", and every new call to it fails with the same text before
//!   anything is sent.
//! - FAIL-2: watchers ([`RpcAgent::watch_failures`],
//!   [`RpcAgent::next_failure`], the [`NEXT_FAILURE`] function plugins call)
//!   see every failure, in the order declared.
//! - FAIL-3: graceful shutdown does not wait for a failed worker: it ends
//!   with an error naming the failure, and the agent stops at once, as a
//!   shutdown that is not graceful does (its running functions, which may
//!   wait on the failed worker, are not waited for), so a worker whose
//!   peer stalled exits in bounded time.
//! - FAIL-4: the cost to calls while nothing failed is one relaxed atomic
//!   load.
//! - FAIL-5: every feature hears of the failure once
//!   ([`Extension::worker_failed`](super::Extension::worker_failed)) and
//!   releases what it holds for the failed worker: RRefs forget the forks
//!   it held, distributed autograd releases the contexts it made and fails
//!   the backward passes that reach it.
//!
//! - FAIL-6: a wait that expects a message from a peer this worker has no
//!   connection to (an all-gather's, AG-8) dials that peer every
//!   [`PROBE_EVERY`]: a peer that died before it ever connected has no
//!   connection whose close or silence could tell, and its address refuses
//!   the dial, which declares it failed. A dial that succeeds leaves a
//!   connection that watches the peer from then on. Off without a failure
//!   window, as all failure detection is.
//!
//! This module owns the record of failures, the functions that report
//! them, and FAIL-6's dials; detecting silence is the transport's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use super::{FunctionRegistry, RpcAgent};
use crate::error::Error;
use crate::value::Payload;

/// A function every agent serves: the workers it declared failed, as a
/// list of `{"worker": name, "cause": text}`.
pub const FAILED_WORKERS: &str = "wasmrpc::failed_workers";

/// A function every agent serves: answers `{"worker": name, "cause": text}`
/// once a worker other than those in its argument (a list of names, the
/// failures the caller already knows of; none: any) is declared failed.
/// Called with `rpc_async` and no timeout, it is a plugin's watch on the
/// group.
pub const NEXT_FAILURE: &str = "wasmrpc::next_worker_failure";

/// A function every agent serves: how many times its group was restarted
/// (`TORCHELASTIC_RESTART_COUNT`, [`RpcAgent::restart_count`]): 0 on a
/// first start.
pub const RESTART_COUNT: &str = "wasmrpc::restart_count";

/// A worker this worker declared failed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFailure {
    /// The failed worker's name.
    pub worker: String,
    /// Why, e.g. "no heartbeat for 2.0 s".
    pub cause: String,
}

impl std::fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {}", self.worker, self.cause)
    }
}

impl WorkerFailure {
    /// As a value: `{"worker": name, "cause": text}`.
    fn payload(&self) -> Payload {
        Payload::dict([
            (Payload::from("worker"), Payload::from(self.worker.clone())),
            (Payload::from("cause"), Payload::from(self.cause.clone())),
        ])
    }
}

/// The failures one agent declared (FAIL-1).
pub(super) struct Failures {
    /// Whether any worker failed (FAIL-4).
    any: AtomicBool,
    /// Every failure, from its declaration on (FAIL-1).
    failed: std::sync::Mutex<Vec<WorkerFailure>>,
    /// What watchers see: a failure once the features released what they
    /// held for it (FAIL-2, FAIL-5).
    announced: watch::Sender<Vec<WorkerFailure>>,
}

impl Default for Failures {
    fn default() -> Self {
        Failures {
            any: AtomicBool::new(false),
            failed: std::sync::Mutex::default(),
            announced: watch::Sender::new(Vec::new()),
        }
    }
}

impl Failures {
    fn failed(&self) -> std::sync::MutexGuard<'_, Vec<WorkerFailure>> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl RpcAgent {
    /// How many times this worker's group has been restarted
    /// ([`RpcBackendOptions::restart_count`](super::RpcBackendOptions::restart_count)).
    pub fn restart_count(&self) -> u32 {
        self.inner.options.restart_count
    }

    /// The workers this worker declared failed, in order.
    pub fn failed_workers(&self) -> Vec<WorkerFailure> {
        self.inner.failures.announced.borrow().clone()
    }

    /// A watch on the failures declared (FAIL-2): its value is
    /// [`failed_workers`](Self::failed_workers), and `changed()` wakes on
    /// each new one.
    pub fn watch_failures(&self) -> watch::Receiver<Vec<WorkerFailure>> {
        self.inner.failures.announced.subscribe()
    }

    /// The first failure of a worker not in `known`, once there is one.
    pub async fn next_failure(&self, known: &[String]) -> WorkerFailure {
        let mut watch = self.watch_failures();
        loop {
            if let Some(f) = watch
                .borrow_and_update()
                .iter()
                .find(|f| !known.contains(&f.worker))
            {
                return f.clone();
            }
            if watch.changed().await.is_err() {
                // The agent is gone; nothing more will fail.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The failure of `worker`, if it was declared failed (FAIL-1).
    pub(crate) fn failure_of(&self, worker: &str) -> Option<WorkerFailure> {
        if !self.inner.failures.any.load(Ordering::Relaxed) {
            return None;
        }
        self.inner
            .failures
            .failed()
            .iter()
            .find(|f| f.worker == worker)
            .cloned()
    }

    /// Declares `worker` failed with `cause` (FAIL-1): fails the calls
    /// pending to it and tells the watchers. A second declaration of the
    /// same worker does nothing.
    pub(crate) fn declare_failed(&self, worker: &str, cause: &str) {
        let failure = WorkerFailure {
            worker: worker.to_string(),
            cause: cause.to_string(),
        };
        {
            let mut failed = self.inner.failures.failed();
            if failed.iter().any(|f| f.worker == worker) {
                return;
            }
            failed.push(failure.clone());
        }
        self.inner.failures.any.store(true, Ordering::Relaxed);
        tracing::error!(worker = %self.name(), "{failure}");
        self.fail_pending_where(
            |p| p.peer == worker,
            |_| Error::runtime(failure.to_string()),
        );
        // FAIL-5.
        if let Ok(info) = self.member_by_name(worker).map(|m| m.info) {
            for extension in self.inner.extensions.iter() {
                extension.worker_failed(self, &info, cause);
            }
        }
        self.inner
            .failures
            .announced
            .send_modify(|all| all.push(failure));
    }
}

/// FAIL-6: how often a wait dials the awaited peers it has no connection
/// to.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The longest one FAIL-6 dial may take; one that takes longer proves
/// nothing (a loaded peer accepts late) and is tried again.
const PROBE_DIAL_TIMEOUT: Duration = Duration::from_secs(5);

impl RpcAgent {
    /// FAIL-6: never ends; until dropped, every [`PROBE_EVERY`] dials each
    /// of `peers` that `awaited` still holds for and that this worker has
    /// no open connection to, and declares failed a peer whose dial fails.
    pub(crate) async fn probe_unconnected(
        &self,
        peers: &std::collections::BTreeSet<String>,
        awaited: impl Fn(&str) -> bool,
    ) {
        if self.inner.options.failure_timeout.is_none() {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            let Ok(transport) = self.transport() else {
                continue;
            };
            for peer in peers {
                if !awaited(peer)
                    || transport.open_connection(peer).is_some()
                    || self.failure_of(peer).is_some()
                {
                    continue;
                }
                let Ok(addr) = self.member_by_name(peer).map(|m| m.addr) else {
                    continue;
                };
                let dial =
                    tokio::time::timeout(PROBE_DIAL_TIMEOUT, transport.connection(peer, addr));
                if let Ok(Err(e)) = dial.await {
                    let cause = format!("not connected, and {}", e.message());
                    self.declare_failed(peer, &cause);
                }
            }
        }
    }
}

/// Registers [`FAILED_WORKERS`], [`NEXT_FAILURE`] and [`RESTART_COUNT`].
pub(super) fn register_functions(r: &FunctionRegistry) {
    r.register_native(FAILED_WORKERS, |ctx, _args| async move {
        let failed = ctx.agent().failed_workers();
        Ok(Payload::list(failed.iter().map(WorkerFailure::payload)))
    });
    r.register_native(NEXT_FAILURE, |ctx, args| async move {
        let known = match args.get(0) {
            Err(_) => Vec::new(),
            Ok(p) if p.is_none() => Vec::new(),
            Ok(p) => p
                .items()
                .and_then(|items| items.iter().map(|i| i.as_str().map(String::from)).collect())
                .map_err(|_| {
                    Error::type_error(format!(
                        "{NEXT_FAILURE} takes a list of worker names (the failures already known)"
                    ))
                })?,
        };
        Ok(ctx.agent().next_failure(&known).await.payload())
    });
    r.register_native(RESTART_COUNT, |ctx, _args| async move {
        Ok(Payload::from(i64::from(ctx.agent().restart_count())))
    });
}
