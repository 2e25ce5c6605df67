//! Call deadlines: one timer task per agent, instead of a task per call.
//!
//! A call with a timeout puts `(deadline, request id)` here when it is sent
//! and takes it out when its reply (or any other end) arrives. The agent's
//! sweeper task sleeps until the earliest deadline and fails the calls
//! whose deadlines have passed. A per-call timer task would cost a spawn
//! and an extra wake-up of another task on every reply, on the path every
//! small call takes.
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
    set: Mutex<BTreeSet<(Instant, u64)>>,
    changed: Notify,
    stopped: AtomicBool,
}

impl Deadlines {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<(Instant, u64)>> {
        self.set.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Call `id` expires at `at`.
    pub(crate) fn insert(&self, at: Instant, id: u64) {
        let earliest = {
            let mut set = self.lock();
            let earliest = set.first().is_none_or(|first| (at, id) < *first);
            set.insert((at, id));
            earliest
        };
        if earliest {
            // The sweeper may be sleeping until a later deadline.
            self.changed.notify_one();
        }
    }

    /// Call `id` ended before its deadline `at`.
    pub(crate) fn remove(&self, at: Instant, id: u64) {
        self.lock().remove(&(at, id));
    }

    /// Ends the sweeper (the agent is gone).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    /// Takes every deadline passed at `now`.
    fn take_expired(&self, now: Instant) -> Vec<u64> {
        let mut set = self.lock();
        let mut expired = Vec::new();
        while let Some(&(at, id)) = set.first() {
            if at > now {
                break;
            }
            set.pop_first();
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
            let next = self.lock().first().map(|&(at, _)| at);
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

    #[tokio::test(start_paused = true)]
    async fn expires_in_deadline_order_and_skips_removed_calls() {
        let d = Arc::new(Deadlines::default());
        let fired = Arc::new(Mutex::new(Vec::new()));
        let f = fired.clone();
        let sweeper = tokio::spawn(d.clone().sweep(move |id| {
            f.lock().unwrap().push((id, Instant::now()));
            true
        }));
        let start = Instant::now();
        d.insert(start + Duration::from_millis(30), 3);
        d.insert(start + Duration::from_millis(10), 1);
        d.insert(start + Duration::from_millis(20), 2);
        d.remove(start + Duration::from_millis(20), 2);
        tokio::time::sleep(Duration::from_millis(50)).await;
        // An earlier deadline inserted while the sweeper sleeps on a later one.
        d.insert(Instant::now() + Duration::from_millis(100), 5);
        d.insert(Instant::now() + Duration::from_millis(5), 4);
        tokio::time::sleep(Duration::from_millis(10)).await;
        let got: Vec<(u64, Duration)> = fired
            .lock()
            .unwrap()
            .iter()
            .map(|(id, at)| (*id, *at - start))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, Duration::from_millis(10)),
                (3, Duration::from_millis(30)),
                (4, Duration::from_millis(55)),
            ]
        );
        d.stop();
        sweeper.await.unwrap();
    }
}
