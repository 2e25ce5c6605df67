//! Write coalescing (TR-10): while other work is in progress on a
//! connection, a frame waits in the connection's backlog for a flush task
//! instead of being written by its sender, so that a burst of frames (the
//! responses to a batch of requests read in one go, or a caller's calls
//! while earlier ones are in flight) leaves in one vectored write.
//!
//! What counts as work in progress is the transport owner's to say, with
//! [`Work`] guards: the agent holds one for each call awaiting a response
//! on the connection and for each call it serves from it. A frame sent
//! while its sender's guard is the only one is written at once (TR-5): a
//! lone call pays nothing for coalescing. Nor do frames with storages in
//! shared memory (TR-9), whose segments are filled right after queueing.
//!
//! What this module must not do: delay a frame without bound. The flush
//! task defers itself once with `tokio::task::yield_now`, which tokio
//! resumes when the worker thread it runs on has no other task ready, or
//! after at most 61 other tasks (its `event_interval`, the same delay it
//! gives any socket's readiness), then writes the whole backlog.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Connection;
use crate::transport::frame::OutFrame;

/// One piece of work in progress on a connection (TR-10): a call awaiting
/// its response there, or a call being served from it. Dropping it ends
/// the work.
#[must_use = "the work ends when the guard is dropped"]
pub(crate) struct Work {
    conn: Arc<Connection>,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("conn", &self.conn.id).finish()
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        self.conn.work.end();
    }
}

impl Connection {
    /// Counts a piece of work in progress on this connection until the
    /// guard is dropped (TR-10).
    pub(crate) fn start_work(self: &Arc<Self>) -> Work {
        self.work.begin();
        Work { conn: self.clone() }
    }

    /// Whether a frame sent now waits for a flush task (TR-10): other work
    /// than the sender's is in progress.
    pub(super) fn coalesces(&self) -> bool {
        self.work.count() > 1
    }

    /// Leaves `frame` in the backlog and makes sure a flush task will write
    /// it: the one already scheduled, or a new one.
    pub(super) fn defer(self: &Arc<Self>, frame: OutFrame) {
        super::lock(&self.backlog).push(frame);
        // The flag is cleared before the flush takes the backlog, so a frame
        // pushed after that take finds it clear and schedules another flush.
        if !self.flush_scheduled.swap(true, Ordering::AcqRel) {
            self.runtime.spawn(flush(self.clone()));
        }
    }
}

/// The flush task: lets the tasks ready on this worker send their frames
/// first, then writes the backlog (TR-10).
async fn flush(conn: Arc<Connection>) {
    tokio::task::yield_now().await;
    conn.flush_scheduled.store(false, Ordering::Release);
    // A connection closed meanwhile wrote its backlog when it closed (or
    // dropped it, aborted); its writer is gone and there is nothing to do.
    let _ = conn.drain_backlog();
}
