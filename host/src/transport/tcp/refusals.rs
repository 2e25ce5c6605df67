//! TR-6: the log of refused connections, which a flood of bad connections
//! cannot flood.

use std::sync::Mutex;

use super::lock;

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
