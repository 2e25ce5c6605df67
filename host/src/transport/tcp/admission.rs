//! Admission of accepted sockets into their handshake (TR-8): how many may
//! be in their handshake at once, in all and from one address.
//!
//! Why: a socket in its handshake holds a task, a file descriptor and (over
//! TLS) a handshake buffer for up to the handshake timeout, before the peer
//! has proved anything. Without a bound, anyone who can reach the port can
//! open sockets and send nothing until the worker runs out of file
//! descriptors (`accept` fails, and real peers cannot connect) or memory.
//!
//! The rule: a new socket always starts its handshake. When that makes more
//! than [`MAX_HANDSHAKES_PER_ADDRESS`] from its address, or more than
//! [`MAX_HANDSHAKES`] in all, the oldest handshake of that address (or of
//! all) is ended and its socket closed. A real peer's handshake takes
//! milliseconds, so the oldest are those of peers that stall; a flood from
//! one address only ever ends handshakes of that address, and the
//! worker's descriptors and memory stay bounded whatever arrives.
//!
//! An address is an IPv4 address, or the /64 prefix of an IPv6 address
//! (one host usually holds a whole /64).
//!
//! This module owns the counting only; the accept loop (`tasks`) asks it
//! before every handshake and ends what it says to end.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::task::AbortHandle;

/// The most sockets in their handshake at once, from all addresses.
pub(crate) const MAX_HANDSHAKES: usize = 512;
/// The most sockets in their handshake at once from one address (a cluster
/// on one host dials from one address: at most one per other worker).
pub(crate) const MAX_HANDSHAKES_PER_ADDRESS: usize = 128;

/// Where a socket comes from, as far as the limits are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    V4([u8; 4]),
    /// The /64 prefix.
    V6([u8; 8]),
}

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Source::V4(v4.octets()),
            IpAddr::V6(v6) => {
                let octets = v6.octets();
                let mut prefix = [0u8; 8];
                prefix.copy_from_slice(&octets[..8]);
                Source::V6(prefix)
            }
        }
    }
}

/// One socket in its handshake, oldest first in [`Admission::pending`].
struct Pending {
    id: u64,
    from: SocketAddr,
    source: Source,
    /// Set once the handshake's task is spawned.
    task: Option<AbortHandle>,
}

/// The sockets of one listener that are in their handshake.
pub(crate) struct Admission {
    limits: (usize, usize),
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    pending: VecDeque<Pending>,
}

/// A socket's place among those in their handshake; dropping it (the
/// handshake ended, however) gives the place back.
pub(crate) struct Ticket {
    admission: Arc<Admission>,
    id: u64,
}

impl Ticket {
    /// What [`Admission::started`] takes.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

/// A handshake ended to make room for a newer socket.
pub(crate) struct Displaced {
    /// Its peer's address.
    pub(crate) from: SocketAddr,
    /// Its task, when it had started; aborting it closes the socket.
    pub(crate) task: Option<AbortHandle>,
}

impl Admission {
    /// An admission with the limits [`MAX_HANDSHAKES`] and
    /// [`MAX_HANDSHAKES_PER_ADDRESS`].
    pub(crate) fn new() -> Arc<Self> {
        Self::with_limits(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS)
    }

    fn with_limits(total: usize, per_address: usize) -> Arc<Self> {
        Arc::new(Admission {
            limits: (total.max(1), per_address.max(1)),
            state: Mutex::default(),
        })
    }

    /// Admits a socket from `from`: its ticket, and the handshakes it
    /// displaces (their peers, and their tasks, which the caller aborts).
    /// Call [`started`](Self::started) once its task is spawned.
    pub(crate) fn admit(self: &Arc<Self>, from: SocketAddr) -> (Ticket, Vec<Displaced>) {
        let source = Source::from(from.ip());
        let (total, per_address) = self.limits;
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.pending.push_back(Pending {
            id,
            from,
            source,
            task: None,
        });
        let mut displaced = Vec::new();
        let from_source = state.pending.iter().filter(|p| p.source == source).count();
        if from_source > per_address
            && let Some(oldest) = state.pending.iter().position(|p| p.source == source)
        {
            displaced.extend(state.pending.remove(oldest));
        }
        while state.pending.len() > total {
            displaced.extend(state.pending.pop_front());
        }
        drop(state);
        let ticket = Ticket {
            admission: Arc::clone(self),
            id,
        };
        let displaced = displaced
            .into_iter()
            .map(|p| Displaced {
                from: p.from,
                task: p.task,
            })
            .collect();
        (ticket, displaced)
    }

    /// Records the task running the handshake of the ticket `id`, so that
    /// a later socket can displace it. Returns `false` if it is no longer
    /// pending (displaced before its task existed, or already done): the
    /// caller aborts the task.
    pub(crate) fn started(&self, id: u64, task: AbortHandle) -> bool {
        let mut state = self.lock();
        match state.pending.iter_mut().find(|p| p.id == id) {
            Some(p) => {
                p.task = Some(task);
                true
            }
            None => false,
        }
    }

    /// How many sockets are in their handshake.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every critical section leaves the queue consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.admission.lock();
        if let Some(i) = state.pending.iter().position(|p| p.id == self.id) {
            state.pending.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 40_000)
    }

    fn source(ip: &str) -> Source {
        Source::from(ip.parse::<IpAddr>().unwrap())
    }

    /// Admits a socket from `ip` whose handshake never ends; aborts what it
    /// displaces and returns how many that was.
    fn admit_idle(
        admission: &Arc<Admission>,
        ip: &str,
    ) -> (Ticket, tokio::task::JoinHandle<()>, usize) {
        let (ticket, displaced) = admission.admit(addr(ip));
        for d in &displaced {
            assert_eq!(d.from.port(), 40_000);
            d.task.as_ref().expect("a started handshake").abort();
        }
        let task = tokio::spawn(std::future::pending());
        assert!(admission.started(ticket.id(), task.abort_handle()));
        (ticket, task, displaced.len())
    }

    #[tokio::test]
    async fn a_flood_from_one_address_displaces_only_its_own_oldest_handshakes() {
        let admission = Admission::with_limits(10, 3);
        let (friend, friend_task, _) = admit_idle(&admission, "10.0.0.1");
        let (mut tickets, mut tasks) = (Vec::new(), Vec::new());
        for i in 0..20 {
            let (ticket, task, displaced) = admit_idle(&admission, "10.0.0.66");
            assert_eq!(displaced, usize::from(i >= 3), "socket {i}");
            tickets.push(ticket);
            tasks.push(task);
        }
        // The friend and the flood's three newest remain.
        assert_eq!(admission.pending(), 4);
        let newest = tasks.split_off(17);
        for task in tasks {
            assert!(task.await.unwrap_err().is_cancelled());
        }
        tokio::task::yield_now().await;
        assert!(newest.iter().all(|t| !t.is_finished()));
        assert!(!friend_task.is_finished());
        // Tickets of displaced handshakes give nothing back twice.
        drop(tickets);
        assert_eq!(admission.pending(), 1);
        drop(friend);
        assert_eq!(admission.pending(), 0);
    }

    #[tokio::test]
    async fn over_the_total_the_oldest_of_all_is_displaced() {
        let admission = Admission::with_limits(4, 4);
        let (mut tickets, mut tasks) = (Vec::new(), Vec::new());
        for i in 0..6 {
            let (ticket, task, displaced) = admit_idle(&admission, &format!("10.0.0.{i}"));
            assert_eq!(displaced, usize::from(i >= 4), "socket {i}");
            tickets.push(ticket);
            tasks.push(task);
        }
        assert_eq!(admission.pending(), 4);
        let mut tasks = tasks.into_iter();
        for _ in 0..2 {
            assert!(tasks.next().unwrap().await.unwrap_err().is_cancelled());
        }
    }

    #[test]
    fn a_handshake_displaced_before_its_task_started_is_reported() {
        let admission = Admission::with_limits(1, 1);
        let (first, _) = admission.admit(addr("10.0.0.1"));
        let (_second, displaced) = admission.admit(addr("10.0.0.2"));
        assert_eq!(displaced.len(), 1);
        assert!(displaced[0].task.is_none(), "the first had no task yet");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let task = rt.spawn(std::future::pending::<()>());
        assert!(!admission.started(first.id(), task.abort_handle()));
    }

    #[test]
    fn ipv6_addresses_count_by_their_64_bit_prefix_and_mapped_ipv4_as_ipv4() {
        assert_eq!(source("2001:db8::1"), source("2001:db8::ffff:2"));
        assert_ne!(source("2001:db8::1"), source("2001:db8:0:1::1"));
        assert_eq!(source("::ffff:10.0.0.1"), source("10.0.0.1"));
    }
}
