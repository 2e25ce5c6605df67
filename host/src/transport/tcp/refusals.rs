//! TR-6: the log of refused connections, which a flood of bad connections
//! cannot flood.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use super::{Transport, lock};
use crate::transport::traffic::RefusalReason;

impl Transport {
    /// Counts and logs a refused connection from `from` (TR-6).
    pub(super) fn refused(self: &Arc<Self>, from: SocketAddr, reason: RefusalReason, why: &str) {
        self.ledger.refused(reason);
        let name = &self.cfg.name;
        let suppressed = match self.refusals.note(std::time::Instant::now()) {
            Refusal::Log(n) => n,
            Refusal::Suppressed => return,
            Refusal::FirstSuppressed => {
                let t = Arc::downgrade(self);
                tokio::spawn(async move {
                    tokio::time::sleep(REFUSAL_LOG_INTERVAL).await;
                    let Some(t) = t.upgrade() else { return };
                    if let Some(n) = t.refusals.flush(std::time::Instant::now()) {
                        tracing::warn!(
                            worker = %t.cfg.name,
                            listen = %t.addr,
                            "refused {n} more connections in the last second"
                        );
                    }
                });
                return;
            }
        };
        let listen = self.addr;
        if suppressed == 0 {
            tracing::warn!(worker = %name, %listen, %from, "refused connection: {why}");
        } else {
            tracing::warn!(
                worker = %name,
                %listen,
                %from,
                "refused connection: {why} ({suppressed} more refused since the last such line)"
            );
        }
    }
}

/// TR-6: refused connections are logged as WARN lines, at most one per
/// [`REFUSAL_LOG_INTERVAL`]; refusals in between are counted, and the count
/// is logged one interval after the first of them, so a flood of bad
/// connections cannot flood the log and is still reported.
#[derive(Default)]
pub(crate) struct RefusalLog {
    /// When the last line was logged, and how many refusals since.
    state: Mutex<(Option<std::time::Instant>, u64)>,
}

/// The shortest time between two refusal lines.
pub(crate) const REFUSAL_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl RefusalLog {
    /// Notes a refusal at `now`.
    pub(crate) fn note(&self, now: std::time::Instant) -> Refusal {
        let mut state = lock(&self.state);
        let (last, suppressed) = &mut *state;
        if last.is_some_and(|l| now.duration_since(l) < REFUSAL_LOG_INTERVAL) {
            *suppressed += 1;
            return if *suppressed == 1 {
                Refusal::FirstSuppressed
            } else {
                Refusal::Suppressed
            };
        }
        *last = Some(now);
        Refusal::Log(std::mem::take(suppressed))
    }

    /// At `now`, one interval after a first suppressed refusal: the number
    /// suppressed since the last line, if any (they count as a line).
    pub(crate) fn flush(&self, now: std::time::Instant) -> Option<u64> {
        let mut state = lock(&self.state);
        let (last, suppressed) = &mut *state;
        if *suppressed == 0 {
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(suppressed))
    }
}

/// What [`RefusalLog::note`] says to do with a refusal.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Log it, with the number suppressed since the last line.
    Log(u64),
    /// Count it; it is the first counted since the last line, so schedule
    /// a [`RefusalLog::flush`].
    FirstSuppressed,
    /// Count it.
    Suppressed,
}
