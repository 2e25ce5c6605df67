//! [`Transport`]: the listener and the authenticated connections of one
//! worker: plain TCP with the HMAC handshake, or TLS with mutual
//! authentication (`tls`) then the same handshake, whose announced name
//! must be one the peer's certificate names (TLS-3).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tch::Tensor;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::fault::FaultInjection;
use super::frame::OutFrame;
use super::handshake::{self, HANDSHAKE_TIMEOUT};
use super::shm::{ShmListener, ShmSlot};
use super::tls::TlsEndpoints;
use super::traffic::{Channel, Ledger, PeerTraffic, RefusalReason};
use crate::error::{Error, Result};

mod admission;
mod busy_poll;
pub(crate) use busy_poll::busy_poll_back_offs;
mod coalesce;
mod liveness;
mod refusals;
mod tasks;
mod write_half;

pub(crate) use coalesce::Work;
pub(crate) use refusals::RefusalLog;
use tasks::{READ_BUFFER, accept_loop, reader_loop, writer_loop};
pub use wasmrpc_net::liveness::DEFAULT_FAILURE_TIMEOUT;
use write_half::WriteHalf;

/// What the transport tells its owner (the agent).
pub(crate) trait Handler: Send + Sync + 'static {
    /// A frame arrived on `conn`: its message's bytes and its tensors. An
    /// error (a message that does not decode) closes the connection (TR-1).
    fn on_frame(
        &self,
        conn: &Arc<Connection>,
        message: Vec<u8>,
        tensors: Vec<Tensor>,
    ) -> std::result::Result<(), String>;
    /// A frame arrived on `conn` whose tensors would have exceeded the
    /// tensor memory budget: it was read and its tensors dropped, and the
    /// connection carries on. The handler answers the message (a request
    /// with an error, a response by failing its call).
    fn on_over_budget(
        &self,
        conn: &Arc<Connection>,
        message: Vec<u8>,
        refusal: wasmrpc_torch_sys::BudgetRefusal,
    );
    /// `conn` closed (TR-4: called once per connection).
    fn on_close(&self, conn: &Arc<Connection>, reason: &str);
    /// Nothing came from `conn`'s peer for the failure window (LIVE-2,
    /// `liveness`): called once, just before the connection closes, with
    /// the cause ("no heartbeat for 2.0 s").
    fn on_silent(&self, _conn: &Arc<Connection>, _cause: &str) {}
}

/// How a transport is set up.
#[derive(Debug, Clone)]
pub(crate) struct TransportConfig {
    pub(crate) name: String,
    pub(crate) rank: u32,
    pub(crate) secret: Arc<Vec<u8>>,
    pub(crate) max_frame_size: u64,
    pub(crate) faults: FaultInjection,
    /// What received tensors are charged to (BUDGET-1).
    pub(crate) receive_budget: Option<wasmrpc_torch_sys::MemoryBudget>,
    /// TLS for every connection, when the worker has TLS credentials.
    pub(crate) tls: Option<TlsEndpoints>,
    /// Whether large storages to peers on the same host may cross in
    /// shared memory (TR-9).
    pub(crate) shared_memory: bool,
    /// How long a reader busy-polls between close frames (BUSY-2).
    pub(crate) busy_poll: std::time::Duration,
    /// How long a peer may stay silent before its connection fails
    /// (`liveness`, LIVE-1 to LIVE-3); `None`: no heartbeats.
    pub(crate) failure_timeout: Option<std::time::Duration>,
}

use wasmrpc_credentials::TlsStream;

/// An authenticated stream, before it is split.
enum Stream {
    Tcp(TcpStream),
    /// With the work count its socket reader was given (BUSY-4).
    Tls(Box<TlsStream>, busy_poll::InProgress),
}

enum WriterCmd {
    /// A frame to write after those before it.
    Frame(OutFrame),
    /// The write half, handed over by a sender whose direct write stopped
    /// at `offset` of `frame` (the socket was full, or TLS could not flush
    /// at once): the writer owns the half until its queue is empty again.
    Resume(WriteHalf, OutFrame, usize),
    Close,
}

/// One authenticated connection to a peer, used in both directions.
pub(crate) struct Connection {
    /// Unique within the transport.
    pub(crate) id: u64,
    /// The peer's name, as its handshake proved.
    pub(crate) peer: String,
    /// The peer's rank, as it announced.
    pub(crate) peer_rank: u32,
    tx: mpsc::UnboundedSender<WriterCmd>,
    /// The write half while the writer task has nothing queued (TR-5): the
    /// sender that holds this lock writes the backlog itself, with no task
    /// switch, as long as the socket takes it without waiting. Only ever
    /// `try_lock`ed by senders, so none waits for another's write.
    direct: Mutex<Option<WriteHalf>>,
    /// Sent frames, in order, for whoever holds `direct` next (TR-3): a
    /// sender's own, and those of senders that found `direct` held.
    backlog: Mutex<Vec<OutFrame>>,
    /// The same-host shared-memory link, if there is one (TR-9).
    shm: ShmSlot,
    closed: AtomicBool,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Work in progress on the connection ([`Work`] guards, TR-10); its
    /// reader reads it too (BUSY-4).
    work: busy_poll::InProgress,
    /// Whether a flush task will write the backlog (TR-10).
    flush_scheduled: AtomicBool,
    /// Where flush tasks run: the runtime the connection's tasks run on.
    runtime: tokio::runtime::Handle,
    /// Frames queued to send, and socket reads that brought bytes
    /// (LIVE-3): what the liveness watchdog looks at, and the traffic
    /// counters.
    activity: wasmrpc_net::liveness::Activity,
    /// TCP or TLS, for the traffic counters.
    channel: Channel,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .finish()
    }
}

impl Connection {
    /// Whether the connection has closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// What it carried so far: on its channel, and in shared memory.
    fn traffic(&self) -> impl Iterator<Item = PeerTraffic> {
        let a = &self.activity;
        let own = PeerTraffic {
            frames_sent: a.frames_sent(),
            bytes_sent: a.bytes_sent(),
            frames_received: a.frames_received(),
            bytes_received: a.bytes_read(),
            ..PeerTraffic::new(&self.peer, self.channel)
        };
        let shm = self.shm.get().map(|link| PeerTraffic {
            bytes_sent: link.sent_bytes(),
            ..PeerTraffic::new(&self.peer, Channel::SharedMemory)
        });
        std::iter::once(own).chain(shm)
    }
}

/// A worker's listener and connections.
pub(crate) struct Transport {
    cfg: TransportConfig,
    addr: SocketAddr,
    handler: Weak<dyn Handler>,
    conns: Mutex<HashMap<String, Arc<Connection>>>,
    all: Mutex<HashMap<u64, Arc<Connection>>>,
    dial_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    accept_task: Mutex<Option<JoinHandle<()>>>,
    /// The liveness watchdog, with a failure window (`liveness`).
    watchdog: Mutex<Option<JoinHandle<()>>>,
    next_id: AtomicU64,
    shut: AtomicBool,
    refusals: RefusalLog,
    /// Closed connections' traffic, and refusals by reason (TRAFFIC-1).
    ledger: Ledger,
    /// Where same-host dialers join their shared-memory link (TR-9).
    shm: Option<Arc<ShmListener>>,
}

impl Transport {
    /// The cluster secret every connection is authenticated with.
    pub(crate) fn secret(&self) -> &[u8] {
        &self.cfg.secret
    }

    /// Binds `listen` and starts accepting connections.
    pub(crate) async fn bind(
        mut cfg: TransportConfig,
        listen: SocketAddr,
        handler: Weak<dyn Handler>,
    ) -> Result<Arc<Self>> {
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| Error::runtime(format!("cannot listen on {listen}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::runtime(format!("listener has no address: {e}")))?;
        let shm = if cfg.shared_memory {
            ShmListener::bind()
                .map_err(|e| tracing::warn!("no shared memory with peers on this host: {e}"))
                .ok()
        } else {
            None
        };
        // BUSY-*: TLS records are read from the socket through the same
        // busy poll as plain frames.
        let window = cfg.busy_poll;
        cfg.tls = cfg.tls.map(|tls| {
            tls.reading_sockets_through(move |half| Box::new(busy_poll::reader_of(half, window)))
        });
        let t = Arc::new(Transport {
            cfg,
            addr,
            handler,
            conns: Mutex::default(),
            all: Mutex::default(),
            dial_locks: Mutex::default(),
            accept_task: Mutex::new(None),
            watchdog: Mutex::new(None),
            next_id: AtomicU64::new(1),
            shut: AtomicBool::new(false),
            refusals: RefusalLog::default(),
            ledger: Ledger::default(),
            shm,
        });
        let weak = Arc::downgrade(&t);
        let task = tokio::spawn(accept_loop(listener, weak));
        *lock(&t.accept_task) = Some(task);
        *lock(&t.watchdog) = liveness::start(&t);
        Ok(t)
    }

    /// The address peers dial.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many connections were refused since the start (TR-6).
    pub(crate) fn refused_connections(&self) -> u64 {
        self.ledger.refused_total()
    }

    /// Connections refused since the start, by reason.
    pub(crate) fn refusals(&self) -> Vec<(RefusalReason, u64)> {
        self.ledger.refusals()
    }

    /// What every connection carried since the start, by peer and channel
    /// (TRAFFIC-1: the open ones' counts are read under the lock a closing
    /// one retires under).
    pub(crate) fn traffic(&self) -> Vec<PeerTraffic> {
        let all = lock(&self.all);
        self.ledger.totals(all.values().flat_map(|c| c.traffic()))
    }

    /// The number of live connections.
    pub(crate) fn num_connections(&self) -> usize {
        lock(&self.all).len()
    }

    /// How many connections have a shared-memory link, the storage bytes
    /// sent through those links (TR-9), and how many of those bytes went
    /// through CUDA segments (SHM-6).
    pub(crate) fn shared_memory(&self) -> (usize, u64, u64) {
        lock(&self.all).values().filter_map(|c| c.shm.get()).fold(
            (0, 0, 0),
            |(links, bytes, cuda), l| {
                (
                    links + 1,
                    bytes + l.sent_bytes(),
                    cuda + l.sent_cuda_bytes(),
                )
            },
        )
    }

    /// The connection used to send to `peer`, dialing `addr` if there is
    /// none yet.
    pub(crate) async fn connection(
        self: &Arc<Self>,
        peer: &str,
        addr: SocketAddr,
    ) -> Result<Arc<Connection>> {
        if let Some(c) = self.open_connection(peer) {
            return Ok(c);
        }
        let gate = lock(&self.dial_locks)
            .entry(peer.to_string())
            .or_default()
            .clone();
        let _guard = gate.lock().await;
        if let Some(c) = self.open_connection(peer) {
            return Ok(c);
        }
        if self.shut.load(Ordering::Acquire) {
            return Err(Error::runtime(format!(
                "transport of {} is shut down",
                self.cfg.name
            )));
        }
        let stream = TcpStream::connect(addr).await.map_err(|e| {
            Error::runtime(format!("cannot connect to worker {peer} at {addr}: {e}"))
        })?;
        let _ = stream.set_nodelay(true);
        let dial = async {
            match &self.cfg.tls {
                None => {
                    let mut stream = stream;
                    let who = handshake::client(
                        &mut stream,
                        &self.cfg.secret,
                        &self.cfg.name,
                        self.cfg.rank,
                    )
                    .await?;
                    Ok((Stream::Tcp(stream), who))
                }
                Some(tls) => {
                    // TLS-2: the certificate must name `peer`.
                    let in_progress = busy_poll::InProgress::default();
                    let mut stream = busy_poll::HANDSHAKING
                        .scope(in_progress.clone(), tls.connect(stream, peer))
                        .await?;
                    let who = handshake::client(
                        &mut stream,
                        &self.cfg.secret,
                        &self.cfg.name,
                        self.cfg.rank,
                    )
                    .await?;
                    Ok::<_, Error>((Stream::Tls(Box::new(stream), in_progress), who))
                }
            }
        };
        let (stream, who) = tokio::time::timeout(HANDSHAKE_TIMEOUT, dial)
            .await
            .map_err(|_| {
                Error::runtime(format!("handshake with worker {peer} at {addr} timed out"))
            })??;
        if who.name != peer {
            return Err(Error::runtime(format!(
                "dialed worker {peer} at {addr} but {} answered",
                who.name
            )));
        }
        let shm = match (&who.shm, &self.shm) {
            (Some(offer), Some(_)) => super::shm::join(offer).await.map(ShmSlot::joined),
            _ => None,
        };
        Ok(self.start(stream, who, shm.unwrap_or_else(ShmSlot::none)))
    }

    /// The open connection to `peer`, if there is one.
    pub(crate) fn open_connection(&self, peer: &str) -> Option<Arc<Connection>> {
        lock(&self.conns)
            .get(peer)
            .filter(|c| !c.is_closed())
            .cloned()
    }

    /// Sends `frame` on `conn` at once, from the calling thread (TR-5), when
    /// no fault is configured; gives the frame back otherwise, for
    /// [`send_on`](Self::send_on).
    pub(crate) fn send_now(
        &self,
        conn: &Arc<Connection>,
        frame: OutFrame,
    ) -> std::result::Result<Result<()>, OutFrame> {
        if !self.cfg.faults.is_empty() {
            return Err(frame);
        }
        Ok(self
            .check_size(conn, &frame)
            .and_then(|()| conn.enqueue(frame)))
    }

    fn check_size(&self, conn: &Connection, frame: &OutFrame) -> Result<()> {
        if frame.len() > self.cfg.max_frame_size {
            return Err(Error::runtime(format!(
                "message of {} bytes to worker {} exceeds the maximum frame size of {} bytes",
                frame.len(),
                conn.peer,
                self.cfg.max_frame_size
            )));
        }
        Ok(())
    }

    /// Sends `frame` on `conn`, after the configured faults.
    pub(crate) async fn send_on(
        &self,
        conn: &Arc<Connection>,
        frame: OutFrame,
        function: Option<&str>,
    ) -> Result<()> {
        self.check_size(conn, &frame)?;
        self.cfg.faults.apply(frame.kind, function).await?;
        conn.enqueue(frame)
    }

    fn start(
        self: &Arc<Self>,
        stream: Stream,
        who: handshake::Peer,
        shm: ShmSlot,
    ) -> Arc<Connection> {
        let activity = wasmrpc_net::liveness::Activity::default();
        let channel = match stream {
            Stream::Tcp(_) => Channel::Tcp,
            Stream::Tls(..) => Channel::Tls,
        };
        type Read = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
        let (read, direct, work): (Read, _, _) = match stream {
            Stream::Tcp(stream) => {
                let (read, write) = stream.into_split();
                let work = busy_poll::InProgress::default();
                let read = busy_poll::BusyPollRead::new(read, self.cfg.busy_poll, work.clone());
                (
                    Box::new(activity.counting(read)),
                    WriteHalf::Tcp(write),
                    work,
                )
            }
            Stream::Tls(stream, work) => {
                let (read, write) = stream.into_split();
                (
                    Box::new(activity.counting(read)),
                    WriteHalf::Tls(Box::new(write)),
                    work,
                )
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Connection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            peer: who.name,
            peer_rank: who.rank,
            tx,
            direct: Mutex::new(Some(direct)),
            backlog: Mutex::new(Vec::new()),
            shm,
            closed: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            work,
            flush_scheduled: AtomicBool::new(false),
            runtime: tokio::runtime::Handle::current(),
            activity,
            channel,
        });
        lock(&self.all).insert(conn.id, conn.clone());
        lock(&self.conns)
            .entry(conn.peer.clone())
            .and_modify(|c| {
                if c.is_closed() {
                    *c = conn.clone();
                }
            })
            .or_insert_with(|| conn.clone());
        let writer = tokio::spawn(writer_loop(rx, Arc::downgrade(self), conn.clone()));
        // Small frames arrive in one read instead of one per part.
        let read = tokio::io::BufReader::with_capacity(READ_BUFFER, read);
        let reader = tokio::spawn(reader_loop(
            read,
            Arc::downgrade(self),
            conn.clone(),
            self.cfg.max_frame_size,
            self.cfg.receive_budget.clone(),
        ));
        lock(&conn.tasks).extend([writer.abort_handle(), reader.abort_handle()]);
        if self.shut.load(Ordering::Acquire) {
            self.close(&conn, "transport shut down");
        }
        conn
    }

    /// Closes `conn`: stops it, forgets it, and tells the handler (once).
    pub(crate) fn close(&self, conn: &Arc<Connection>, reason: &str) {
        if conn.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            // Frames sent before the close, and left in the backlog by
            // senders that found `direct` held (by this thread, say), go
            // out first: written now, or queued ahead of the close.
            let mut direct = lock(&conn.direct);
            let frames = std::mem::take(&mut *lock(&conn.backlog));
            if !frames.is_empty() {
                let _ = conn.write_or_queue(&mut direct, frames);
            }
            let _ = conn.tx.send(WriterCmd::Close);
            // A half still parked for direct writes has nothing queued
            // behind it: dropping it shuts the socket's write side now (the
            // writer task, if it holds the half instead, does so after its
            // queue).
            drop(direct.take());
        }
        conn.shm.close();
        {
            // TRAFFIC-1: retired and forgotten under one lock, so that a
            // reader of `traffic` sees it in one place or the other.
            let mut all = lock(&self.all);
            self.ledger.retire(conn.traffic());
            all.remove(&conn.id);
        }
        {
            let mut conns = lock(&self.conns);
            if conns.get(&conn.peer).is_some_and(|c| c.id == conn.id) {
                conns.remove(&conn.peer);
            }
        }
        if let Some(h) = self.handler.upgrade() {
            h.on_close(conn, reason);
        }
    }

    /// Stops accepting, flushes and closes every connection.
    pub(crate) async fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        for t in [&self.accept_task, &self.watchdog] {
            if let Some(t) = lock(t).take() {
                t.abort();
            }
        }
        let conns: Vec<Arc<Connection>> = lock(&self.all).values().cloned().collect();
        for c in &conns {
            self.close(c, "worker shut down");
        }
        // Give writers a moment to flush what was queued before the close,
        // then stop every task.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
        for c in &conns {
            let tasks: Vec<_> = lock(&c.tasks).clone();
            while tokio::time::Instant::now() < deadline && tasks.iter().any(|t| !t.is_finished()) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                if tasks.first().is_some_and(|w| w.is_finished()) {
                    break;
                }
            }
            tasks.iter().for_each(|t| t.abort());
        }
    }

    /// Aborts everything at once, without flushing: the worker vanishes.
    pub(crate) fn abort(&self) {
        self.shut.store(true, Ordering::Release);
        for t in [&self.accept_task, &self.watchdog] {
            if let Some(t) = lock(t).take() {
                t.abort();
            }
        }
        let conns: Vec<Arc<Connection>> = lock(&self.all).values().cloned().collect();
        for c in &conns {
            lock(&c.tasks).iter().for_each(|t| t.abort());
            // Nothing more goes out: the worker vanishes.
            lock(&c.backlog).clear();
            self.close(c, "worker aborted");
        }
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        for t in [&self.accept_task, &self.watchdog] {
            if let Some(t) = lock(t).take() {
                t.abort();
            }
        }
        for c in lock(&self.all).values() {
            lock(&c.tasks).iter().for_each(|t| t.abort());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
