//! How often a peer's calls may put a WARN line in this worker's log.
//!
//! Every call that raises is logged at WARN on the callee (the seeds check
//! that line), and so is a frame refused by the tensor memory budget. A
//! peer that sends a flood of bad calls (a buggy loop, an attacker, the op
//! fuzzer) would otherwise fill the log and the disk under it, and bury
//! other peers' lines. So each peer gets at most [`BURST`] lines every
//! [`WINDOW`]; the first line after a window in which some were held back
//! says how many. What this module must not do: drop the calls' errors
//! themselves, which always reach their callers.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines one peer may cause in one window.
pub(crate) const BURST: u32 = 10;
/// The window.
pub(crate) const WINDOW: Duration = Duration::from_secs(10);
/// Past this many peers tracked, windows that have ended are forgotten (a
/// dynamic group's members come and go).
const PRUNE_ABOVE: usize = 1024;

#[derive(Debug)]
struct Window {
    start: Instant,
    logged: u32,
    held_back: u64,
}

/// Per-peer rate limits of WARN lines (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct WarnLimiter {
    by_peer: Mutex<HashMap<String, Window>>,
}

impl WarnLimiter {
    /// Whether a line that `peer` caused may be logged now: `Some(n)` if
    /// so, where `n` lines of that peer were held back since the last one
    /// logged; `None` if this one is held back.
    pub(crate) fn admit(&self, peer: &str) -> Option<u64> {
        self.admit_at(peer, Instant::now())
    }

    fn admit_at(&self, peer: &str, now: Instant) -> Option<u64> {
        let mut by_peer = self.by_peer.lock().unwrap_or_else(|p| p.into_inner());
        if by_peer.len() > PRUNE_ABOVE {
            by_peer.retain(|_, w| now.duration_since(w.start) < WINDOW);
        }
        let window = by_peer.entry(peer.to_owned()).or_insert(Window {
            start: now,
            logged: 0,
            held_back: 0,
        });
        if now.duration_since(window.start) >= WINDOW {
            window.start = now;
            window.logged = 0;
        }
        if window.logged >= BURST {
            window.held_back += 1;
            return None;
        }
        window.logged += 1;
        Some(std::mem::take(&mut window.held_back))
    }
}

/// The words a logged line ends with when `held_back` lines were not
/// logged before it.
pub(crate) fn held_back_note(held_back: u64) -> String {
    if held_back == 0 {
        String::new()
    } else {
        format!(
            " ({held_back} earlier lines from this peer not logged: at most {BURST} every {}s)",
            WINDOW.as_secs()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_gets_a_burst_per_window_then_a_count_of_what_was_held_back() {
        let limiter = WarnLimiter::default();
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(limiter.admit_at("worker1", t0), Some(0));
        }
        for _ in 0..25 {
            assert_eq!(limiter.admit_at("worker1", t0), None);
        }
        // Another peer is not silenced by the first one's flood.
        assert_eq!(limiter.admit_at("worker2", t0), Some(0));
        // The next window logs again and says how many were held back.
        let later = t0 + WINDOW;
        assert_eq!(limiter.admit_at("worker1", later), Some(25));
        assert_eq!(limiter.admit_at("worker1", later), Some(0));
        assert!(held_back_note(25).contains("25 earlier lines"));
        assert_eq!(held_back_note(0), "");
    }
}
