//! What a worker's connections carried and which connections it refused:
//! the operator's traffic counters (exported by `crate::metrics`, shown by
//! `wasmrpc top`), kept by the transport from its start and never reset.
//!
//! Counted where the transport already looks: a frame is counted sent when
//! it is queued on its connection, with the bytes it puts on the socket
//! (its header and the storages it carries itself; after TLS decryption
//! and before TLS encryption, so the frames' own bytes on either
//! channel); received bytes are those its reader read, and a frame is
//! counted received once it is whole. Storages that cross in shared
//! memory count under [`Channel::SharedMemory`], by their sender only.
//!
//! Invariants:
//! - TRAFFIC-1: totals per peer and channel never go down: a closing
//!   connection's counts move into the ledger as it closes, before it is
//!   forgotten.
//! - TRAFFIC-2: label sets stay bounded whatever peers send: peers are
//!   names that passed the handshake (TR-2), channels and refusal reasons
//!   are fixed sets, and a refused connection is counted by reason only
//!   (its claimed name or address never becomes a label).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The channel a peer's bytes crossed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Channel {
    /// A TCP connection with the cluster secret's handshake.
    Tcp,
    /// A TCP connection under mutual TLS.
    Tls,
    /// Same-host shared-memory segments (storages only; their frames go
    /// over the connection).
    SharedMemory,
}

impl Channel {
    /// The channel's label: `tcp`, `tls`, `shm`.
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Tcp => "tcp",
            Channel::Tls => "tls",
            Channel::SharedMemory => "shm",
        }
    }
}

/// What this worker exchanged with one peer over one channel since it
/// started ([`crate::RpcAgent::traffic`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerTraffic {
    /// The peer's worker name.
    pub peer: String,
    /// The channel.
    pub channel: Channel,
    /// Frames sent (heartbeats included); zero for shared memory, whose
    /// storages travel with frames counted on the connection.
    pub frames_sent: u64,
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Frames received (zero for shared memory: its storages are counted
    /// by the sender).
    pub frames_received: u64,
    /// Bytes received (zero for shared memory, as above).
    pub bytes_received: u64,
}

impl PeerTraffic {
    /// Nothing yet, to `peer` over `channel`.
    pub fn new(peer: impl Into<String>, channel: Channel) -> Self {
        PeerTraffic {
            peer: peer.into(),
            channel,
            frames_sent: 0,
            bytes_sent: 0,
            frames_received: 0,
            bytes_received: 0,
        }
    }

    fn add(&mut self, other: &PeerTraffic) {
        self.frames_sent += other.frames_sent;
        self.bytes_sent += other.bytes_sent;
        self.frames_received += other.frames_received;
        self.bytes_received += other.bytes_received;
    }
}

/// Why a connection was refused before its first frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RefusalReason {
    /// The TLS handshake failed: no certificate of the cluster CA, or not
    /// TLS at all.
    Tls,
    /// The agent's handshake failed: a wrong cluster secret, or bytes that
    /// are not the handshake.
    Handshake,
    /// The peer announced a name its certificate does not give (TLS-3).
    CertificateName,
    /// The handshake did not end in time.
    Timeout,
    /// Still in its handshake when newer sockets needed its place (TR-8).
    Displaced,
}

impl RefusalReason {
    /// Every reason, in label order.
    pub const ALL: [RefusalReason; 5] = [
        RefusalReason::Tls,
        RefusalReason::Handshake,
        RefusalReason::CertificateName,
        RefusalReason::Timeout,
        RefusalReason::Displaced,
    ];

    /// The reason's label: `tls`, `handshake`, `certificate_name`,
    /// `timeout`, `displaced`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::Tls => "tls",
            RefusalReason::Handshake => "handshake",
            RefusalReason::CertificateName => "certificate_name",
            RefusalReason::Timeout => "timeout",
            RefusalReason::Displaced => "displaced",
        }
    }
}

/// The transport's running totals: closed connections' traffic by peer
/// and channel (TRAFFIC-1) and refusals by reason.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    retired: Mutex<BTreeMap<(String, Channel), PeerTraffic>>,
    refused: [AtomicU64; RefusalReason::ALL.len()],
}

impl Ledger {
    /// Counts a refused connection.
    pub(crate) fn refused(&self, reason: RefusalReason) {
        self.refused[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals since the start, by reason (every reason, zeros included).
    pub(crate) fn refusals(&self) -> Vec<(RefusalReason, u64)> {
        RefusalReason::ALL
            .iter()
            .map(|r| (*r, self.refused[*r as usize].load(Ordering::Relaxed)))
            .collect()
    }

    /// Refusals since the start, all reasons together.
    pub(crate) fn refused_total(&self) -> u64 {
        self.refusals().iter().map(|(_, n)| n).sum()
    }

    /// Keeps a closing connection's counts (TRAFFIC-1).
    pub(crate) fn retire(&self, counts: impl IntoIterator<Item = PeerTraffic>) {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        for c in counts {
            retired
                .entry((c.peer.clone(), c.channel))
                .or_insert_with(|| PeerTraffic::new(c.peer.clone(), c.channel))
                .add(&c);
        }
    }

    /// The totals: the retired ones plus `live` (the open connections'
    /// counts), one entry per peer and channel, in order.
    pub(crate) fn totals(&self, live: impl IntoIterator<Item = PeerTraffic>) -> Vec<PeerTraffic> {
        let mut all = self
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for c in live {
            all.entry((c.peer.clone(), c.channel))
                .or_insert_with(|| PeerTraffic::new(c.peer.clone(), c.channel))
                .add(&c);
        }
        all.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traffic(peer: &str, channel: Channel, sent: u64, received: u64) -> PeerTraffic {
        PeerTraffic {
            peer: peer.into(),
            channel,
            frames_sent: 1,
            bytes_sent: sent,
            frames_received: 1,
            bytes_received: received,
        }
    }

    #[test]
    fn totals_add_the_closed_connections_to_the_open_ones_by_peer_and_channel() {
        let ledger = Ledger::default();
        ledger.retire([traffic("worker1", Channel::Tcp, 10, 20)]);
        ledger.retire([traffic("worker1", Channel::Tcp, 1, 2)]);
        let totals = ledger.totals([
            traffic("worker1", Channel::Tcp, 100, 200),
            traffic("worker1", Channel::SharedMemory, 5, 0),
            traffic("worker2", Channel::Tls, 7, 8),
        ]);
        let rows: Vec<(&str, Channel, u64, u64, u64)> = totals
            .iter()
            .map(|t| {
                (
                    t.peer.as_str(),
                    t.channel,
                    t.frames_sent,
                    t.bytes_sent,
                    t.bytes_received,
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("worker1", Channel::Tcp, 3, 111, 222),
                ("worker1", Channel::SharedMemory, 1, 5, 0),
                ("worker2", Channel::Tls, 1, 7, 8),
            ]
        );
    }

    #[test]
    fn refusals_are_counted_by_reason_and_every_reason_is_listed() {
        let ledger = Ledger::default();
        ledger.refused(RefusalReason::Handshake);
        ledger.refused(RefusalReason::Handshake);
        ledger.refused(RefusalReason::Displaced);
        let by_reason: Vec<(&str, u64)> = ledger
            .refusals()
            .into_iter()
            .map(|(r, n)| (r.as_str(), n))
            .collect();
        assert_eq!(
            by_reason,
            [
                ("tls", 0),
                ("handshake", 2),
                ("certificate_name", 0),
                ("timeout", 0),
                ("displaced", 1)
            ]
        );
        assert_eq!(ledger.refused_total(), 3);
    }
}
