//! The data path of the CPU backend: one TCP connection between every pair of
//! group members, and a mailbox that sorts incoming frames by sender and tag.
//!
//! Members exchange listening addresses through the group's (prefixed)
//! store; tensors never go through the store. With TLS ([`MeshTls`]) every
//! connection is TLS 1.3 with mutual authentication first: each member
//! publishes the worker name its certificate names as `name/{rank}` before
//! its address, a dialer asks for the certificate of the name published for
//! the rank it dials, and an acceptor checks that the dialer's certificate
//! names the worker published for the rank it announces. Then every
//! connection opens with [`crate::handshake`] (the dialer's rank and, with a
//! cluster secret, mutual proof of it); a connection that fails either is
//! closed and logged, and the member keeps waiting for its real peers.
//! What a published name can do is limited to what the store can do: the
//! store is unauthenticated, but only a holder of a certificate of the
//! cluster CA completes TLS. Rank `r` connects to every
//! lower rank and accepts from every higher one, so each pair has exactly one
//! connection. A reader task per connection drains the socket into the
//! [`Mailbox`], so sends never block on a peer that has not started
//! receiving yet, and a receiver waits only for its own frame (or the
//! timeout, or the peer's connection closing).
//!
//! Liveness ([`Mesh::watch_liveness`], the network layer's rules LIVE-1 to
//! LIVE-3 in `wasmrpc_net::liveness`): a connection that carried nothing
//! for a tick gets a heartbeat frame, and a peer silent for the failure
//! window (a stopped process, a dropped link) is failed like a closed
//! connection: every `recv` from it fails at once with "no heartbeat for
//! 2.0 s" instead of waiting for the collective's timeout.
//!
//! Frame: `kind u8, op u8, seq u64, sub u32, step u32, len u64`, then `len`
//! bytes (little endian). A frame's buffer grows with the bytes that
//! arrive, so a header announcing a huge length allocates nothing until the
//! bytes are there. `kind` separates collectives (tagged with the
//! group's sequence number) from point-to-point messages (tagged by the
//! user); `op` names the collective, so ranks that issue different
//! collectives as the same sequence number get an error that says so
//! instead of garbled tensors.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use wasmrpc_net::frame;
use wasmrpc_net::liveness::{Activity, Watch, silence_cause, tick_interval};
use wasmrpc_store::Store;

use crate::error::{Error, Result};

mod connect;

use connect::{Conn, ReadHalf, WriteHalf, accept_one, dial_one, name_key};
pub(crate) use connect::{MeshAuth, MeshTls};

/// Which stream of messages a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub(crate) enum Kind {
    /// A collective, tagged by the group's sequence number.
    Collective = 0,
    /// A point-to-point message, tagged by the user's tag.
    P2p = 1,
    /// A heartbeat (LIVE-1): no tag, no payload, never delivered.
    Heartbeat = 2,
}

/// A frame's tag: which message of which operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Tag {
    pub(crate) kind: Kind,
    pub(crate) seq: u64,
    pub(crate) sub: u32,
    pub(crate) step: u32,
}

const HEADER: usize = 1 + 1 + 8 + 4 + 4 + 8;

/// The collectives a frame may belong to, by their code on the wire.
const OPS: [&str; 16] = [
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "send",
    "recv",
    "connect",
    "all_gather_object",
];

fn op_code(op: &str) -> u8 {
    OPS.iter()
        .position(|o| *o == op)
        .map_or(u8::MAX, |i| i as u8)
}

fn op_name(code: u8) -> &'static str {
    OPS.get(usize::from(code))
        .copied()
        .unwrap_or("an unknown operation")
}

/// A received frame: the sender's op code and the payload.
type Frame = (u8, Vec<u8>);

#[derive(Default)]
struct Slots {
    queues: HashMap<(usize, Tag), VecDeque<Frame>>,
    /// Peers whose connection ended, with the reason.
    closed: HashMap<usize, String>,
    shut_down: bool,
}

/// Frames received and not yet taken, by sender and tag.
#[derive(Default)]
struct Mailbox {
    slots: Mutex<Slots>,
    changed: Notify,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, from: usize, tag: Tag, op: u8, payload: Vec<u8>) {
        self.lock()
            .queues
            .entry((from, tag))
            .or_default()
            .push_back((op, payload));
        self.changed.notify_waiters();
    }

    fn close(&self, peer: usize, why: String) {
        self.lock().closed.entry(peer).or_insert(why);
        self.changed.notify_waiters();
    }

    fn shut_down(&self) {
        self.lock().shut_down = true;
        self.changed.notify_waiters();
    }
}

/// The connections of one group member to all the others.
pub(crate) struct Mesh {
    rank: usize,
    size: usize,
    group: String,
    writers: Vec<Option<Arc<tokio::sync::Mutex<WriteHalf>>>>,
    /// What each connection sent and read (LIVE-3), by peer.
    activity: Vec<Option<Arc<Activity>>>,
    readers: Vec<JoinHandle<()>>,
    /// The liveness watchdog, once started.
    watchdog: Option<JoinHandle<()>>,
    mailbox: Arc<Mailbox>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for r in self.readers.iter().chain(&self.watchdog) {
            r.abort();
        }
    }
}

impl Mesh {
    /// Connects `rank` to every other member of a group of `size`, publishing
    /// this member's address as `addr/{rank}` (and with TLS its worker name
    /// as `name/{rank}`) in `store`.
    pub(crate) async fn connect(
        store: &Arc<dyn Store>,
        host: &str,
        auth: MeshAuth,
        rank: usize,
        size: usize,
        group: &str,
        timeout: Duration,
    ) -> Result<Mesh> {
        let peer_error = |peer: usize, detail: String| Error::Peer {
            rank,
            group: group.to_owned(),
            op: "connect".into(),
            peer,
            detail,
        };
        let listener = TcpListener::bind((host, 0))
            .await
            .map_err(|e| peer_error(rank, format!("cannot listen on {host}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| peer_error(rank, e.to_string()))?;
        if let Some(tls) = &auth.tls {
            store.set(&name_key(rank), tls.name.as_bytes()).await?;
        }
        store
            .set(&format!("addr/{rank}"), addr.to_string().as_bytes())
            .await?;
        let auth = Arc::new(auth);

        // Higher ranks connect to us and prove who they are; each handshake
        // runs on its own, so a connection that stalls holds up no other.
        let expected = size - 1 - rank;
        let (accept_auth, accept_store) = (Arc::clone(&auth), Arc::clone(store));
        let accept_group = group.to_owned();
        let mut accept = AbortOnDrop(tokio::spawn(async move {
            let mut accepted: Vec<(usize, Conn)> = Vec::with_capacity(expected);
            let mut handshakes = tokio::task::JoinSet::new();
            while accepted.len() < expected {
                tokio::select! {
                    conn = listener.accept() => {
                        let (stream, from) = conn?;
                        let (auth, store) = (Arc::clone(&accept_auth), Arc::clone(&accept_store));
                        let group = accept_group.clone();
                        handshakes.spawn(async move {
                            let shake = accept_one(stream, &auth, store.as_ref(), &group, rank, size);
                            match tokio::time::timeout(crate::handshake::HANDSHAKE_TIMEOUT, shake).await {
                                Ok(Ok(accepted)) => Ok(accepted),
                                Ok(Err(why)) => Err(format!("{from}: {why}")),
                                Err(_) => Err(format!("{from}: no handshake within {:?}", crate::handshake::HANDSHAKE_TIMEOUT)),
                            }
                        });
                    }
                    Some(done) = handshakes.join_next(), if !handshakes.is_empty() => {
                        match done {
                            Ok(Ok((peer, conn))) => {
                                if accepted.iter().any(|(p, _)| *p == peer) {
                                    tracing::warn!(rank, group = %accept_group, peer, "c10d tcp: refused a second connection announcing the same rank");
                                    continue;
                                }
                                accepted.push((peer, conn));
                            }
                            Ok(Err(why)) => {
                                tracing::warn!(rank, group = %accept_group, "c10d tcp: refused a connection: {why}");
                            }
                            Err(e) => {
                                tracing::warn!(rank, group = %accept_group, "c10d tcp: handshake task failed: {e}");
                            }
                        }
                    }
                }
            }
            Ok::<_, std::io::Error>(accepted)
        }));

        let mut conns: Vec<Option<Conn>> = (0..size).map(|_| None).collect();
        for (peer, slot) in conns.iter_mut().enumerate().take(rank) {
            let key = format!("addr/{peer}");
            store.wait(&[key.as_str()], timeout).await?;
            let addr = String::from_utf8_lossy(&store.get(&key).await?).into_owned();
            let connect = dial_one(&addr, &auth, store.as_ref(), group, rank, peer);
            let conn = tokio::time::timeout(timeout, connect)
                .await
                .map_err(|_| {
                    peer_error(peer, format!("no connection to {addr} within {timeout:?}"))
                })?
                .map_err(|why| peer_error(peer, format!("connecting to {addr}: {why}")))?;
            *slot = Some(conn);
        }
        let accepted = match tokio::time::timeout(timeout, &mut accept.0).await {
            Ok(Ok(Ok(accepted))) => accepted,
            Ok(Ok(Err(e))) => return Err(peer_error(rank, format!("accepting peers: {e}"))),
            Ok(Err(e)) => return Err(peer_error(rank, format!("accepting peers: {e}"))),
            Err(_) => {
                return Err(peer_error(
                    rank,
                    format!("not every higher rank connected within {timeout:?}"),
                ));
            }
        };
        for (peer, conn) in accepted {
            conns[peer] = Some(conn);
        }

        let mailbox = Arc::new(Mailbox::default());
        let mut writers = Vec::with_capacity(size);
        let mut activities = Vec::with_capacity(size);
        let mut readers = Vec::new();
        for (peer, conn) in conns.into_iter().enumerate() {
            match conn {
                Some(conn) => {
                    let (read, write) = conn.split();
                    let activity = Arc::new(Activity::default());
                    let read: ReadHalf = Box::new(activity.counting(read));
                    writers.push(Some(Arc::new(tokio::sync::Mutex::new(write))));
                    activities.push(Some(activity));
                    readers.push(tokio::spawn(read_frames(peer, read, Arc::clone(&mailbox))));
                }
                None => {
                    writers.push(None);
                    activities.push(None);
                }
            }
        }
        Ok(Mesh {
            rank,
            size,
            group: group.to_owned(),
            writers,
            activity: activities,
            readers,
            watchdog: None,
            mailbox,
        })
    }

    /// Starts the liveness watchdog with failure window `window` (LIVE-1,
    /// LIVE-2): heartbeats on idle connections, and a silent peer failed
    /// like a closed connection, so a `recv` from it fails at once.
    pub(crate) fn watch_liveness(&mut self, window: Duration) {
        let peers: Vec<(usize, Arc<Activity>, Arc<tokio::sync::Mutex<WriteHalf>>)> = self
            .activity
            .iter()
            .zip(&self.writers)
            .enumerate()
            .filter_map(|(peer, (a, w))| {
                Some((peer, Arc::clone(a.as_ref()?), Arc::clone(w.as_ref()?)))
            })
            .collect();
        let mailbox = Arc::clone(&self.mailbox);
        let (rank, group) = (self.rank, self.group.clone());
        let watchdog = async move {
            let mut ticks = tokio::time::interval(tick_interval(window));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let now = std::time::Instant::now();
            let mut watches: Vec<Watch> = peers
                .iter()
                .map(|(_, activity, _)| Watch::new(activity, window, now))
                .collect();
            let mut failed = vec![false; peers.len()];
            loop {
                ticks.tick().await;
                let now = std::time::Instant::now();
                for (i, (peer, activity, writer)) in peers.iter().enumerate() {
                    if failed[i] {
                        continue;
                    }
                    let seen = watches[i].tick(activity, now);
                    if seen.heartbeat_due {
                        activity.sent();
                        // A writer in use is sending a frame: proof enough.
                        if let Ok(mut w) = Arc::clone(writer).try_lock_owned() {
                            tokio::spawn(async move {
                                let mut header = [0u8; HEADER];
                                header[0] = Kind::Heartbeat as u8;
                                if w.write_all(&header).await.is_ok() {
                                    let _ = w.flush().await;
                                }
                            });
                        }
                    }
                    if seen.silent {
                        failed[i] = true;
                        let cause = silence_cause(window);
                        tracing::warn!(rank, group = %group, peer, "c10d tcp: rank {peer} failed: {cause}");
                        mailbox.close(*peer, format!("rank {peer} failed: {cause}"));
                    }
                }
            }
        };
        self.watchdog = Some(tokio::spawn(watchdog));
    }

    /// Sends one frame to `peer`, failing after `timeout` if the peer
    /// stops reading.
    pub(crate) async fn send(
        &self,
        op: &str,
        peer: usize,
        tag: Tag,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        let writer = self.writer(op, peer)?;
        if let Some(activity) = self.activity.get(peer).and_then(Option::as_ref) {
            activity.sent();
        }
        let mut header = [0u8; HEADER];
        header[0] = tag.kind as u8;
        header[1] = op_code(op);
        header[2..10].copy_from_slice(&tag.seq.to_le_bytes());
        header[10..14].copy_from_slice(&tag.sub.to_le_bytes());
        header[14..18].copy_from_slice(&tag.step.to_le_bytes());
        header[18..26].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        let write = async {
            let mut w = writer.lock().await;
            w.write_all(&header).await?;
            w.write_all(payload).await?;
            // TLS holds the last record until flushed; TCP's flush is free.
            w.flush().await
        };
        match tokio::time::timeout(timeout, write).await {
            Ok(result) => {
                result.map_err(|e| self.peer_error(op, peer, format!("send failed: {e}")))
            }
            Err(_) => Err(Error::Timeout {
                rank: self.rank,
                group: self.group.clone(),
                op: op.to_owned(),
                peer,
                timeout,
            }),
        }
    }

    /// Waits for the frame `tag` from `peer`.
    pub(crate) async fn recv(
        &self,
        op: &str,
        peer: usize,
        tag: Tag,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.writer(op, peer)?;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.mailbox.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut slots = self.mailbox.lock();
                if let Some(queue) = slots.queues.get_mut(&(peer, tag))
                    && let Some((their_op, payload)) = queue.pop_front()
                {
                    if queue.is_empty() {
                        slots.queues.remove(&(peer, tag));
                    }
                    if tag.kind == Kind::Collective && their_op != op_code(op) {
                        return Err(self.peer_error(
                            op,
                            peer,
                            format!(
                                "collective #{} of the group is {op} here but {} on rank {peer}",
                                tag.seq,
                                op_name(their_op)
                            ),
                        ));
                    }
                    return Ok(payload);
                }
                if slots.shut_down {
                    return Err(self.peer_error(
                        op,
                        peer,
                        "the process group was destroyed".into(),
                    ));
                }
                if let Some(why) = slots.closed.get(&peer) {
                    return Err(self.peer_error(op, peer, why.clone()));
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(Error::Timeout {
                    rank: self.rank,
                    group: self.group.clone(),
                    op: op.to_owned(),
                    peer,
                    timeout,
                });
            }
        }
    }

    /// Makes every waiting and later `recv` fail. The readers keep
    /// draining the sockets until the mesh is dropped, so a peer's last
    /// frames are never refused (closing a socket with unread data would
    /// reset the connection under the peer's feet).
    pub(crate) fn shut_down(&self) {
        self.mailbox.shut_down();
    }

    fn writer(&self, op: &str, peer: usize) -> Result<&tokio::sync::Mutex<WriteHalf>> {
        self.writers
            .get(peer)
            .and_then(Option::as_deref)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "rank {} of group {}: {op} with rank {peer}: not a peer in a group of size {}",
                    self.rank, self.group, self.size
                ))
            })
    }

    fn peer_error(&self, op: &str, peer: usize, detail: String) -> Error {
        Error::Peer {
            rank: self.rank,
            group: self.group.clone(),
            op: op.to_owned(),
            peer,
            detail,
        }
    }
}

/// Aborts a task when dropped: the accept loop must not outlive a failed
/// connect.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The largest payload a frame may announce: what this machine can
/// address (a larger one is a protocol error, as it always was); what a
/// payload reserves before its bytes arrive is capped by the network layer
/// (FRAME-2).
const MAX_PAYLOAD: u64 = usize::MAX as u64;

async fn read_frames(peer: usize, mut read: ReadHalf, mailbox: Arc<Mailbox>) {
    let why = loop {
        // Prefix and payload are read by the network layer's rules
        // (`wasmrpc_net::frame`, FRAME-1 to FRAME-3), as the agent reads
        // its frames.
        let header = match frame::read_prefix::<_, HEADER>(&mut read).await {
            Ok(Some(header)) => header,
            // Over TLS a peer that ends without closing TLS is an error of
            // this kind; it is the same end.
            Ok(None) => break "connection closed by the peer".to_owned(),
            Err(frame::FrameError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break "connection closed by the peer".to_owned();
            }
            Err(frame::FrameError::Truncated { got, len }) => {
                break format!(
                    "connection closed by the peer inside a frame header ({got} of {len} bytes)"
                );
            }
            Err(e) => break format!("receive failed: {e}"),
        };
        let u64_at = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap_or([0; 8]));
        let kind = match header[0] {
            0 => Kind::Collective,
            1 => Kind::P2p,
            // LIVE-1: that it came is the news; it carries nothing.
            2 if u64_at(18) == 0 => continue,
            2 => break "protocol error: a heartbeat with a payload".to_owned(),
            other => break format!("protocol error: unknown frame kind {other}"),
        };
        let u32_at = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap_or([0; 4]));
        let op = header[1];
        let tag = Tag {
            kind,
            seq: u64_at(2),
            sub: u32_at(10),
            step: u32_at(14),
        };
        let len = u64_at(18);
        let payload = match frame::read_body(&mut read, len, MAX_PAYLOAD).await {
            Ok(payload) => payload,
            Err(frame::FrameError::Truncated { got, len }) => {
                break format!("receive failed mid-frame: {got} of {len} bytes, then the end");
            }
            Err(frame::FrameError::TooLarge { .. }) => {
                break "protocol error: frame too large".to_owned();
            }
            Err(e) => break format!("receive failed mid-frame: {e}"),
        };
        mailbox.push(peer, tag, op, payload);
    };
    mailbox.close(peer, why);
}

#[cfg(test)]
mod tests;
