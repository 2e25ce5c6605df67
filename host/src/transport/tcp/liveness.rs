//! Liveness: telling, within a bounded window, that a peer stopped
//! answering: a process stopped (`SIGSTOP`), a machine that dropped off the
//! network, anything that leaves a connection open and silent. A peer that
//! dies outright closes its connections and needs none of this (TR-4).
//!
//! The rules:
//! - LIVE-1: once per tick (a fifth of the failure window), every
//!   connection this worker sent nothing on since the previous tick gets a
//!   heartbeat frame ([`OutFrame::heartbeat`], four zero bytes). A
//!   connection that carries frames sends none: the frames are the proof.
//! - LIVE-2: a connection from which no byte was read for the whole window
//!   *and* over at least [`TICKS`] ticks of this watchdog in a row is
//!   failed: the handler hears [`Handler::on_silent`] with the cause ("no
//!   heartbeat for 2.0 s"), then the connection closes. Counting this
//!   worker's own ticks, not only the clock, keeps a worker whose threads
//!   were starved (its readers not run for a while) from blaming its
//!   peers: readers run between two ticks.
//! - LIVE-3: the call path pays one relaxed atomic add per frame sent and
//!   one per socket read; all the rest runs in this module's one task per
//!   transport.
//!
//! This module owns the heartbeats and the silence check; what a silent
//! peer means for calls, RRefs and the group is the handler's.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::{Instant, MissedTickBehavior};

use super::{Connection, Transport, lock};
use crate::transport::frame::OutFrame;

/// How many watchdog ticks one failure window spans (LIVE-1, LIVE-2).
pub(crate) const TICKS: u32 = 5;

/// The failure window of `wasmrpc worker` and [`crate::RpcBackendOptions`]
/// by default.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection's read half that counts the reads that brought bytes
/// (LIVE-3), for the watchdog to see that the peer is alive.
pub(super) struct CountedRead<R> {
    inner: R,
    reads: Arc<AtomicU64>,
}

impl<R> CountedRead<R> {
    pub(super) fn new(inner: R, reads: Arc<AtomicU64>) -> Self {
        CountedRead { inner, reads }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for CountedRead<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.reads.fetch_add(1, Ordering::Relaxed);
        }
        polled
    }
}

/// What the watchdog saw of one connection at its previous tick.
struct Seen {
    sent: u64,
    reads: u64,
    /// When `reads` last moved (or the connection was first seen).
    since: Instant,
    /// Ticks in a row with no read.
    quiet_ticks: u32,
}

/// The transport's watchdog (LIVE-1, LIVE-2); ends with the transport.
pub(super) async fn watchdog(t: Weak<Transport>, window: Duration) {
    let tick = (window / TICKS).max(Duration::from_millis(5));
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    loop {
        ticks.tick().await;
        let Some(tr) = t.upgrade() else { return };
        if tr.shut.load(Ordering::Acquire) {
            return;
        }
        let conns: Vec<Arc<Connection>> = lock(&tr.all).values().cloned().collect();
        seen.retain(|id, _| conns.iter().any(|c| c.id == *id));
        let now = Instant::now();
        for conn in conns {
            let s = seen.entry(conn.id).or_insert_with(|| Seen {
                sent: u64::MAX,
                reads: conn.reads.load(Ordering::Relaxed),
                since: now,
                quiet_ticks: 0,
            });
            // LIVE-1. A failed send closes the connection by itself.
            if conn.sent.load(Ordering::Relaxed) == s.sent {
                let _ = conn.enqueue(OutFrame::heartbeat());
            }
            s.sent = conn.sent.load(Ordering::Relaxed);
            // LIVE-2.
            let reads = conn.reads.load(Ordering::Relaxed);
            if reads != s.reads {
                (s.reads, s.since, s.quiet_ticks) = (reads, now, 0);
                continue;
            }
            s.quiet_ticks += 1;
            if s.quiet_ticks >= TICKS && now - s.since >= window {
                let cause = silence_cause(window);
                tracing::warn!(peer = %conn.peer, "worker {} failed: {cause}", conn.peer);
                if let Some(h) = tr.handler.upgrade() {
                    h.on_silent(&conn, &cause);
                }
                tr.close(&conn, &format!("worker {} failed: {cause}", conn.peer));
            }
        }
    }
}

/// Why a silent peer failed, as errors say it.
fn silence_cause(window: Duration) -> String {
    format!("no heartbeat for {:.1} s", window.as_secs_f64())
}

/// Starts `t`'s watchdog when it has a failure window.
pub(super) fn start(t: &Arc<Transport>) -> Option<tokio::task::JoinHandle<()>> {
    let window = t.cfg.failure_timeout?;
    Some(tokio::spawn(watchdog(Arc::downgrade(t), window)))
}
