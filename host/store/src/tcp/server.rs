//! [`TcpStoreServer`]: a tokio TCP server that speaks PyTorch's `TCPStore`
//! protocol, the counterpart of PyTorch's libuv store daemon.
//!
//! It owns the key-value map, the queues, the table of clients waiting for
//! keys, and one task per connection. Invariants (beyond TCP-1 and TCP-2 in
//! `protocol`):
//! - SRV-1: a connection's requests are answered in order; a `WAIT` whose
//!   keys are missing does not block the connection: the `STOP_WAITING` byte
//!   is written when every awaited key has been set (or added, appended,
//!   compare-set) at least once, and `CANCEL_WAIT` withdraws the wait.
//! - SRV-2: a connection that breaks the protocol is closed and logged; no
//!   other connection notices, and nothing a peer sends can panic the server.
//! - SRV-3: dropping the server (or [`TcpStoreServer::shutdown`]) stops
//!   accepting and closes every connection, so waiting clients fail at once.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, ToSocketAddrs, lookup_host};
use tokio::sync::{Notify, oneshot};
use tokio::task::{JoinHandle, JoinSet};

use super::protocol::{
    CHECK_NOT_READY, CHECK_READY, Command, Frame, MAX_PAYLOAD_LEN, ParseError, QueryType,
    STOP_WAITING, VALIDATION_MAGIC, WAIT_CANCELED, parse_command,
};
use crate::store::{Error, Result, compare_set_outcome, parse_counter};

/// The most bytes one request may span before the connection is closed:
/// large enough for a `MULTI_SET` of many full-size values.
const MAX_REQUEST_LEN: usize = 32 * MAX_PAYLOAD_LEN as usize;

/// A running store server. Dropping it shuts it down (SRV-3).
///
/// Must be created inside a tokio runtime; its tasks run on that runtime.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (use port 0 for any free port) and starts serving.
    ///
    /// Like PyTorch's server it sets `SO_REUSEADDR` and asks for the longest
    /// accept backlog the system allows, so thousands of workers can connect
    /// at once.
    ///
    /// # Errors
    /// [`Error::Io`] if the address cannot be resolved or bound.
    pub async fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        let shown = format!("{addr:?}");
        let context = || format!("bind store server on {shown}");
        let mut last = None;
        for addr in lookup_host(addr)
            .await
            .map_err(|e| Error::io(context(), e))?
        {
            match listen(addr) {
                Ok(listener) => return Self::from_listener(listener),
                Err(e) => last = Some(e),
            }
        }
        Err(Error::io(
            context(),
            last.unwrap_or_else(|| std::io::Error::other("the address resolved to nothing")),
        ))
    }

    /// Serves on an already bound listener (PyTorch's `master_listen_fd`).
    ///
    /// # Errors
    /// [`Error::Io`] if the listener's address cannot be read.
    pub fn from_listener(listener: TcpListener) -> Result<Self> {
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("read store server address", e))?;
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(accept_loop(listener, Arc::new(State::default()), stopped));
        tracing::debug!(%local_addr, "store server listening");
        Ok(Self {
            local_addr,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// Stops accepting, closes every connection and waits until the server's
    /// tasks are gone (SRV-3).
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The accept backlog asked for; Linux caps it at `net.core.somaxconn`.
const BACKLOG: u32 = 65_535;

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

async fn accept_loop(listener: TcpListener, state: Arc<State>, mut stopped: oneshot::Receiver<()>) {
    // Dropping the set at the end aborts every connection task (SRV-3).
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
                    }
                    connections.spawn(serve_connection(stream, peer, Arc::clone(&state)));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly
                    // instead of spinning.
                    tracing::warn!(error = %e, "store server accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = done
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "store connection task panicked");
                }
            }
        }
    }
    tracing::debug!("store server stopped");
}

/// A client's pending `WAIT` (SRV-1).
#[derive(Debug)]
struct Waiter {
    keys: Vec<Vec<u8>>,
    /// Awaited keys not yet set; the waiter fires when it reaches zero.
    remaining: AtomicUsize,
    fired: Notify,
}

impl Waiter {
    fn decrement(&self) -> bool {
        let fired = self.remaining.fetch_sub(1, Ordering::AcqRel) == 1;
        if fired {
            self.fired.notify_one();
        }
        fired
    }

    fn has_fired(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }
}

#[derive(Debug, Default)]
struct State {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    data: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiting: HashMap<Vec<u8>, Vec<Arc<Waiter>>>,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every critical section below leaves the maps consistent, so a
        // poisoned lock (impossible without a panic) is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    fn wake_all(&mut self, key: &[u8]) {
        if let Some(waiters) = self.waiting.remove(key) {
            for waiter in waiters {
                waiter.decrement();
            }
        }
    }

    fn wake_one(&mut self, key: &[u8]) {
        if let Some(waiters) = self.waiting.get_mut(key) {
            while !waiters.is_empty() {
                if waiters.remove(0).decrement() {
                    break;
                }
            }
            if waiters.is_empty() {
                self.waiting.remove(key);
            }
        }
    }

    fn set(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.wake_all(&key);
        self.data.insert(key, value);
    }

    fn exists(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Registers `keys` for a wait; `None` if they are all there already.
    fn wait(&mut self, keys: Vec<Vec<u8>>) -> Option<Arc<Waiter>> {
        if keys.iter().all(|k| self.exists(k)) {
            return None;
        }
        let missing: Vec<Vec<u8>> = keys
            .into_iter()
            .filter(|k| !self.data.contains_key(k))
            .collect();
        let waiter = Arc::new(Waiter {
            remaining: AtomicUsize::new(missing.len()),
            keys: missing,
            fired: Notify::new(),
        });
        for key in &waiter.keys {
            self.waiting
                .entry(key.clone())
                .or_default()
                .push(Arc::clone(&waiter));
        }
        Some(waiter)
    }

    fn cancel(&mut self, waiter: &Arc<Waiter>) {
        for key in &waiter.keys {
            if let Some(list) = self.waiting.get_mut(key) {
                list.retain(|w| !Arc::ptr_eq(w, waiter));
                if list.is_empty() {
                    self.waiting.remove(key);
                }
            }
        }
    }
}

async fn serve_connection(stream: TcpStream, peer: SocketAddr, state: Arc<State>) {
    let mut conn = Connection {
        state,
        validated: false,
        pending: None,
        out: Vec::new(),
    };
    match conn.run(stream).await {
        Ok(()) => tracing::trace!(%peer, "store client disconnected"),
        Err(reason) => tracing::warn!(%peer, %reason, "closing store connection"),
    }
    if let Some(waiter) = conn.pending.take() {
        conn.state.lock().cancel(&waiter);
    }
}

struct Connection {
    state: Arc<State>,
    validated: bool,
    pending: Option<Arc<Waiter>>,
    out: Vec<u8>,
}

async fn fired(waiter: Option<Arc<Waiter>>) {
    match waiter {
        Some(waiter) => waiter.fired.notified().await,
        None => std::future::pending().await,
    }
}

impl Connection {
    async fn run(&mut self, stream: TcpStream) -> Result<(), String> {
        let (mut reader, mut writer) = stream.into_split();
        let mut buf: Vec<u8> = Vec::with_capacity(4096);
        loop {
            let mut used = 0;
            loop {
                // TCP-1: refuse a stranger at its first byte, without waiting
                // for the rest of whatever it is sending.
                if !self.validated && buf.first().is_some_and(|&b| b != QueryType::Validate as u8) {
                    return Err(format!("first request is not VALIDATE (code {})", buf[0]));
                }
                match parse_command(&buf[used..]) {
                    Ok((command, n)) => {
                        used += n;
                        self.handle(command)?;
                    }
                    Err(ParseError::Incomplete) => break,
                    Err(ParseError::Invalid(why)) => return Err(why),
                }
            }
            buf.drain(..used);
            if buf.len() > MAX_REQUEST_LEN {
                return Err(format!("request larger than {MAX_REQUEST_LEN} bytes"));
            }
            if !self.out.is_empty() {
                writer
                    .write_all(&self.out)
                    .await
                    .map_err(|e| format!("write failed: {e}"))?;
                self.out.clear();
            }
            let waiter = self.pending.clone();
            let has_waiter = waiter.is_some();
            tokio::select! {
                read = reader.read_buf(&mut buf) => match read {
                    Ok(0) if buf.is_empty() => return Ok(()),
                    Ok(0) => return Err(format!("connection closed inside a request ({} bytes pending)", buf.len())),
                    Ok(_) => {}
                    Err(e) => return Err(format!("read failed: {e}")),
                },
                () = fired(waiter), if has_waiter => {
                    self.pending = None;
                    self.out.push(STOP_WAITING);
                }
            }
        }
    }

    fn handle(&mut self, command: Command) -> Result<(), String> {
        if !self.validated {
            return match command {
                Command::Validate(VALIDATION_MAGIC) => {
                    self.validated = true;
                    Ok(())
                }
                Command::Validate(magic) => Err(format!("bad validation number {magic:#x}")),
                other => Err(format!("first request is not VALIDATE: {}", name(&other))),
            };
        }
        let mut inner = self.state.lock();
        let mut reply = Frame::default();
        match command {
            Command::Validate(_) => return Err("VALIDATE sent twice".into()),
            Command::Ping(nonce) => {
                reply.u32(nonce);
            }
            Command::Set(key, value) => inner.set(key, value),
            Command::CompareSet {
                key,
                expected,
                desired,
            } => {
                let (store, ret) = compare_set_outcome(
                    inner.data.get(&key).map(Vec::as_slice),
                    &expected,
                    &desired,
                );
                if let Some(value) = store {
                    inner.data.insert(key.clone(), value);
                }
                if inner.data.contains_key(&key) {
                    inner.wake_all(&key);
                }
                reply.bytes(&ret);
            }
            Command::Get(key) => {
                reply.bytes(inner.data.get(&key).map_or(&[][..], Vec::as_slice));
            }
            Command::Add(key, delta) => {
                let base = match inner.data.get(&key) {
                    None => 0,
                    Some(v) => parse_counter(v).ok_or_else(|| {
                        format!(
                            "ADD to non-integer value of key {:?}",
                            String::from_utf8_lossy(&key)
                        )
                    })?,
                };
                let new = base.checked_add(delta).ok_or_else(|| {
                    format!("ADD overflows for key {:?}", String::from_utf8_lossy(&key))
                })?;
                inner.set(key, new.to_string().into_bytes());
                reply.i64(new);
            }
            Command::Check(keys) => {
                let ready = keys.iter().all(|k| inner.exists(k));
                reply.u8(if ready { CHECK_READY } else { CHECK_NOT_READY });
            }
            Command::Wait(keys) => {
                if let Some(old) = self.pending.take() {
                    inner.cancel(&old);
                }
                match inner.wait(keys) {
                    None => {
                        reply.u8(STOP_WAITING);
                    }
                    Some(waiter) => self.pending = Some(waiter),
                }
            }
            Command::GetNumKeys => {
                reply.i64(i64::try_from(inner.data.len()).unwrap_or(i64::MAX));
            }
            Command::DeleteKey(key) => {
                reply.i64(i64::from(inner.data.remove(&key).is_some()));
            }
            Command::Append(key, value) => {
                inner.wake_all(&key);
                inner.data.entry(key).or_default().extend_from_slice(&value);
            }
            Command::MultiGet(keys) => {
                for key in keys {
                    reply.bytes(inner.data.get(&key).map_or(&[][..], Vec::as_slice));
                }
            }
            Command::MultiSet(pairs) => {
                for (key, value) in pairs {
                    inner.set(key, value);
                }
            }
            Command::CancelWait => {
                if let Some(waiter) = self.pending.take() {
                    inner.cancel(&waiter);
                    if waiter.has_fired() {
                        // The keys arrived before the cancel: answer the wait
                        // first, as PyTorch's client expects.
                        reply.u8(STOP_WAITING);
                    }
                }
                reply.u8(WAIT_CANCELED);
            }
            Command::QueuePush(key, value) => {
                inner
                    .queues
                    .entry(key.clone())
                    .or_default()
                    .push_back(value);
                inner.wake_one(&key);
            }
            Command::QueuePop(key) => {
                let queue = inner.queues.entry(key).or_default();
                reply.i64(i64::try_from(queue.len()).unwrap_or(i64::MAX));
                if let Some(value) = queue.pop_front() {
                    reply.bytes(&value);
                }
            }
            Command::QueueLen(key) => {
                let len = inner.queues.get(&key).map_or(0, VecDeque::len);
                reply.i64(i64::try_from(len).unwrap_or(i64::MAX));
            }
        }
        drop(inner);
        self.out.extend_from_slice(&reply.0);
        Ok(())
    }
}

fn name(command: &Command) -> &'static str {
    match command {
        Command::Validate(_) => "VALIDATE",
        Command::Set(..) => "SET",
        Command::CompareSet { .. } => "COMPARE_SET",
        Command::Get(_) => "GET",
        Command::Add(..) => "ADD",
        Command::Check(_) => "CHECK",
        Command::Wait(_) => "WAIT",
        Command::GetNumKeys => "GETNUMKEYS",
        Command::DeleteKey(_) => "DELETE_KEY",
        Command::Append(..) => "APPEND",
        Command::MultiGet(_) => "MULTI_GET",
        Command::MultiSet(_) => "MULTI_SET",
        Command::CancelWait => "CANCEL_WAIT",
        Command::Ping(_) => "PING",
        Command::QueuePush(..) => "QUEUE_PUSH",
        Command::QueuePop(_) => "QUEUE_POP",
        Command::QueueLen(_) => "QUEUE_LEN",
    }
}

#[cfg(test)]
mod tests;
