//! Call deadlines: one timer task per agent, instead of a task per call.
//!
//! A call with a timeout puts `(deadline, request id)` here when it is sent
//! and takes it out when its reply (or any other end) arrives. The agent's
//! sweeper task sleeps until the earliest deadline and fails the calls
//! whose deadlines have passed. A per-call timer task would cost a spawn
//! and an extra wake-up of another task on every reply, on the path every
//! small call takes.
//!
//! DL-1: an insert wakes the sweeper only when the new deadline comes before
//! the one the sweeper sleeps until. A reply does not wake it either: the
//! sweeper wakes at the deadline it slept on, finds it gone and sleeps on the
//! earliest one left. One caller making calls one after another (each
//! deadline later than the last) so wakes it once per timeout period, not
//! once per call: a wake-up of another thread was a tenth of the caller's
//! time in a small call's profile.
//!
//! This module owns only the set and the sweeper's loop; what expiring a
//! call means (its error, its future) is the agent's (`on_expired`).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio::time::Instant;

/// The deadlines of one agent's pending calls.
#[derive(Default)]
pub(crate) struct Deadlines {
    state: Mutex<State>,
    changed: Notify,
    stopped: AtomicBool,
}

#[derive(Default)]
struct State {
    set: BTreeSet<(Instant, u64)>,
    /// When the sweeper wakes by itself next (`None`: only when notified),
    /// or, after a notification, the deadline it was notified of.
    wakes_at: Option<Instant>,
}

impl Deadlines {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Call `id` expires at `at`.
    pub(crate) fn insert(&self, at: Instant, id: u64) {
        let wake = {
            let mut state = self.lock();
            state.set.insert((at, id));
            // DL-1: a sweeper that wakes by `at` sees this deadline then.
            let wake = state.wakes_at.is_none_or(|wakes_at| at < wakes_at);
            if wake {
                state.wakes_at = Some(at);
            }
            wake
        };
        if wake {
            self.changed.notify_one();
        }
    }

    /// Call `id` ended before its deadline `at`.
    pub(crate) fn remove(&self, at: Instant, id: u64) {
        self.lock().set.remove(&(at, id));
    }

    /// Ends the sweeper (the agent is gone).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    /// Takes every deadline passed at `now`.
    fn take_expired(&self, now: Instant) -> Vec<u64> {
        let mut state = self.lock();
        let mut expired = Vec::new();
        while let Some(&(at, id)) = state.set.first() {
            if at > now {
                break;
            }
            state.set.pop_first();
            expired.push(id);
        }
        expired
    }

    /// The sweeper: until [`stop`](Self::stop), sleeps until the earliest
    /// deadline and hands every expired call to `on_expired` (which returns
    /// `false` once the agent is gone).
    pub(crate) async fn sweep(self: Arc<Self>, mut on_expired: impl FnMut(u64) -> bool) {
        loop {
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            let next = {
                let mut state = self.lock();
                state.wakes_at = state.set.first().map(|&(at, _)| at);
                state.wakes_at
            };
            match next {
                None => self.changed.notified().await,
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => {}
                        () = self.changed.notified() => continue,
                    }
                }
            }
            for id in self.take_expired(Instant::now()) {
                if !on_expired(id) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::task::JoinHandle;

    // Real time, not tokio's paused clock: `test-util` would make this
    // crate's tokio differ from the binary's, and the test build would
    // compile tokio and everything above it a second time. So each test
    // asserts the order of expiries and that none comes early, which a
    // loaded machine cannot break, not the exact instant.

    /// A sweeper over fresh deadlines, recording which calls it expired
    /// and when.
    struct Sweeping {
        deadlines: Arc<Deadlines>,
        fired: Arc<Mutex<Vec<(u64, Instant)>>>,
        sweeper: JoinHandle<()>,
    }

    impl Sweeping {
        fn start() -> Self {
            let deadlines = Arc::new(Deadlines::default());
            let fired = Arc::new(Mutex::new(Vec::new()));
            let record = fired.clone();
            let sweeper = tokio::spawn(deadlines.clone().sweep(move |id| {
                record.lock().unwrap().push((id, Instant::now()));
                true
            }));
            Sweeping {
                deadlines,
                fired,
                sweeper,
            }
        }

        /// The calls expired so far, with when.
        fn fired(&self) -> Vec<(u64, Instant)> {
            self.fired.lock().unwrap().clone()
        }

        /// Waits (10 s at most) until `n` calls have expired.
        async fn until_fired(&self, n: usize) -> Vec<(u64, Instant)> {
            let give_up = Instant::now() + Duration::from_secs(10);
            loop {
                let fired = self.fired();
                if fired.len() >= n || Instant::now() > give_up {
                    return fired;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }

        async fn stop(self) {
            self.deadlines.stop();
            self.sweeper.await.unwrap();
        }
    }

    /// The ids of `fired`, each checked not to have expired before its
    /// deadline in `deadlines`.
    fn ids_none_early(fired: &[(u64, Instant)], deadlines: &[(u64, Instant)]) -> Vec<u64> {
        for (id, at) in fired {
            let (_, deadline) = deadlines.iter().find(|(d, _)| d == id).unwrap();
            assert!(at >= deadline, "call {id} expired before its deadline");
        }
        fired.iter().map(|(id, _)| *id).collect()
    }

    #[tokio::test]
    async fn expires_in_deadline_order_and_skips_removed_calls() {
        let sweeping = Sweeping::start();
        let d = &sweeping.deadlines;
        let start = Instant::now();
        let mut deadlines = vec![
            (3, start + Duration::from_millis(30)),
            (1, start + Duration::from_millis(10)),
            (2, start + Duration::from_millis(20)),
        ];
        for &(id, at) in &deadlines {
            d.insert(at, id);
        }
        d.remove(deadlines[2].1, 2);
        let fired = sweeping.until_fired(2).await;
        assert_eq!(ids_none_early(&fired, &deadlines), [1, 3]);
        // An earlier deadline inserted while the sweeper sleeps on a later one.
        let now = Instant::now();
        let later = (5, now + Duration::from_secs(3600));
        let sooner = (4, now + Duration::from_millis(5));
        deadlines.extend([later, sooner]);
        d.insert(later.1, later.0);
        d.insert(sooner.1, sooner.0);
        let fired = sweeping.until_fired(3).await;
        assert_eq!(ids_none_early(&fired, &deadlines), [1, 3, 4]);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(
            sweeping.fired().len(),
            3,
            "call 2 was removed, 5 is an hour away"
        );
        sweeping.stop().await;
    }

    #[tokio::test]
    async fn a_later_deadline_expires_on_time_without_waking_the_sweeper() {
        let sweeping = Sweeping::start();
        let d = &sweeping.deadlines;
        let start = Instant::now();
        let first = start + Duration::from_millis(1000);
        // Calls one after another: each ends before the next starts.
        d.insert(first, 1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(d.lock().wakes_at, Some(first));
        d.remove(first, 1);
        let (second, third) = (
            start + Duration::from_millis(1100),
            start + Duration::from_millis(1040),
        );
        d.insert(second, 2);
        d.insert(third, 3);
        d.remove(third, 3);
        // Neither later deadline moved the sweeper's wake-up (DL-1).
        assert_eq!(d.lock().wakes_at, Some(first));
        let fired = sweeping.until_fired(1).await;
        assert_eq!(ids_none_early(&fired, &[(2, second)]), [2]);
        sweeping.stop().await;
    }
}
