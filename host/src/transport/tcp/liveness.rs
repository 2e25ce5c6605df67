//! The agent's side of liveness (`wasmrpc_net::liveness`, LIVE-1 to
//! LIVE-3): one watchdog task per transport that sends a heartbeat frame
//! ([`OutFrame::heartbeat`], a zero length prefix) on every connection idle
//! for a tick, and fails a connection whose peer was silent for the window:
//! the handler hears [`Handler::on_silent`](super::Handler::on_silent)
//! with the cause ("no heartbeat for 2.0 s"), then the connection closes
//! (TR-11).
//!
//! This module owns the watchdog; the rules are the network layer's, and
//! what a silent peer means for calls, RRefs and the group is the
//! handler's.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::MissedTickBehavior;
use wasmrpc_net::liveness::{Watch, silence_cause, tick_interval};

use super::{Connection, Transport, lock};
use crate::transport::frame::OutFrame;

/// The transport's watchdog; ends with the transport.
async fn watchdog(t: Weak<Transport>, window: Duration) {
    let mut ticks = tokio::time::interval(tick_interval(window));
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut watches: HashMap<u64, Watch> = HashMap::new();
    loop {
        ticks.tick().await;
        let Some(tr) = t.upgrade() else { return };
        if tr.shut.load(Ordering::Acquire) {
            return;
        }
        let conns: Vec<Arc<Connection>> = lock(&tr.all).values().cloned().collect();
        watches.retain(|id, _| conns.iter().any(|c| c.id == *id));
        let now = std::time::Instant::now();
        for conn in conns {
            let watch = watches
                .entry(conn.id)
                .or_insert_with(|| Watch::new(&conn.activity, window, now));
            let seen = watch.tick(&conn.activity, now);
            if seen.heartbeat_due {
                // Counted by the enqueue; a failed send closes the
                // connection by itself.
                let _ = conn.enqueue(OutFrame::heartbeat());
            }
            if seen.silent {
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

/// Starts `t`'s watchdog when it has a failure window.
pub(super) fn start(t: &Arc<Transport>) -> Option<tokio::task::JoinHandle<()>> {
    let window = t.cfg.failure_timeout?;
    Some(tokio::spawn(watchdog(Arc::downgrade(t), window)))
}
