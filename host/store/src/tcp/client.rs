//! [`TcpStore`]: the client side of PyTorch's `TCPStore`, usable against our
//! [`TcpStoreServer`] or PyTorch's own server.
//!
//! It owns a small pool of connections: each operation takes an idle one (or
//! opens another), so one task waiting for a key does not hold up another
//! task setting it, as it would with PyTorch's single locked connection.
//! Invariants:
//! - CLI-1: the connection opens with `VALIDATE` and a `PING` whose nonce must
//!   come back, exactly as PyTorch's client does; connecting retries with
//!   backoff until the store's timeout.
//! - CLI-2: every user key travels as `/key` (PyTorch's client key prefix), so
//!   our clients and PyTorch's see the same keys. The worker counter `init/`
//!   has no prefix, as in PyTorch.
//! - CLI-3: an operation that fails on the socket, or whose future is dropped
//!   half-way, discards its connection; new connections after the first are
//!   opened once, without retrying, so a dead server fails callers promptly.
//! - CLI-4: at most [`MAX_IDLE`] idle connections are kept.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::protocol::{
    CHECK_NOT_READY, CHECK_READY, Frame, MAX_KEY_LEN, MAX_PAYLOAD_LEN, QueryType,
};
use super::server::TcpStoreServer;
use crate::store::{
    DEFAULT_TIMEOUT, Error, Result, Store, TimeoutCell, check_multi_set, deadline_after,
    parse_counter,
};

/// The prefix PyTorch's client puts before every user key (CLI-2).
mod connection;

use connection::Connection;

const KEY_PREFIX: &str = "/";
/// The key workers count themselves on when `wait_for_workers` is set.
const INIT_KEY: &str = "init/";
/// Idle connections kept for reuse (CLI-4).
const MAX_IDLE: usize = 4;

/// How a [`TcpStore`] connects, and what it waits for.
#[derive(Debug, Clone)]
pub struct TcpStoreOptions {
    /// The store's default timeout for `get`, `wait`, connecting and waiting
    /// for workers (PyTorch's default: 300 s). Zero means no timeout.
    pub timeout: Duration,
    /// The number of workers that use the store, if known.
    pub world_size: Option<usize>,
    /// Count this client on the `init/` key when it connects and, on the
    /// master, wait until `world_size` clients have (PyTorch's default: true).
    pub wait_for_workers: bool,
}

impl Default for TcpStoreOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            world_size: None,
            wait_for_workers: true,
        }
    }
}

/// A client of a c10d TCP store.
///
/// Keys longer than 8 KiB (with the `/` prefix) and values longer than
/// 8 MiB are refused with [`Error::InvalidArgument`] before anything is sent:
/// PyTorch's server, and ours, would close the connection over them.
#[derive(Debug)]
pub struct TcpStore {
    host: String,
    port: u16,
    timeout: TimeoutCell,
    idle: Mutex<Vec<Connection>>,
    server: Option<Arc<TcpStoreServer>>,
}

/// Servers started by [`TcpStore::start_master`] in this process, by port, so
/// that a second master on the same port shares the first (PyTorch's
/// `multi_tenant`). The lock is held across the bind, so two masters racing
/// for one port share a server.
static SERVERS: LazyLock<tokio::sync::Mutex<HashMap<u16, Weak<TcpStoreServer>>>> =
    LazyLock::new(|| tokio::sync::Mutex::new(HashMap::new()));

impl TcpStore {
    /// Connects to the store at `host:port` as a client
    /// (PyTorch's `TCPStore(host, port, world_size, is_master=False)`).
    ///
    /// # Errors
    /// [`Error::Io`] if no connection succeeds within `options.timeout`, or
    /// an error from counting this worker.
    pub async fn connect(host: &str, port: u16, options: TcpStoreOptions) -> Result<Self> {
        let store = Self::open(host, port, options.timeout, None).await?;
        store.join(&options, false).await?;
        Ok(store)
    }

    /// Starts a server on every interface at `port` (or reuses the one this
    /// process already runs there), then connects to it through `host`
    /// (PyTorch's `TCPStore(host, port, world_size, is_master=True,
    /// multi_tenant=True)`). The store keeps the server alive.
    ///
    /// With `wait_for_workers` and a `world_size`, returns only once that
    /// many clients have connected.
    ///
    /// # Errors
    /// [`Error::Io`] if the port cannot be bound or connected to;
    /// [`Error::DistStore`] ("Timed out after {s} seconds waiting for
    /// clients. {n}/{world_size} clients joined.") if the workers do not come.
    pub async fn start_master(host: &str, port: u16, options: TcpStoreOptions) -> Result<Self> {
        let server = shared_server(port).await?;
        let store = Self::open(host, server.port(), options.timeout, Some(server)).await?;
        store.join(&options, true).await?;
        Ok(store)
    }

    /// Connects to `server` through `host` and keeps it alive as long as the
    /// returned store.
    ///
    /// # Errors
    /// As [`TcpStore::connect`].
    pub async fn with_server(
        server: Arc<TcpStoreServer>,
        host: &str,
        options: TcpStoreOptions,
    ) -> Result<Self> {
        let store = Self::open(host, server.port(), options.timeout, Some(server)).await?;
        store.join(&options, true).await?;
        Ok(store)
    }

    async fn open(
        host: &str,
        port: u16,
        timeout: Duration,
        server: Option<Arc<TcpStoreServer>>,
    ) -> Result<Self> {
        let deadline = deadline_after(timeout);
        let conn = Connection::open_with_retry(host, port, deadline).await?;
        Ok(Self {
            host: host.to_owned(),
            port,
            timeout: TimeoutCell::new(timeout),
            idle: Mutex::new(vec![conn]),
            server,
        })
    }

    /// PyTorch's `waitForWorkers`.
    async fn join(&self, options: &TcpStoreOptions, is_master: bool) -> Result<()> {
        let Some(world_size) = options.world_size.filter(|_| options.wait_for_workers) else {
            return Ok(());
        };
        self.add_raw(INIT_KEY.as_bytes(), 1).await?;
        if !is_master {
            return Ok(());
        }
        let start = Instant::now();
        loop {
            let value = self.get_raw(INIT_KEY).await?;
            let joined = parse_counter(&value).unwrap_or(0);
            if usize::try_from(joined).is_ok_and(|j| j >= world_size) {
                return Ok(());
            }
            let elapsed = start.elapsed();
            let timeout = self.timeout();
            if !timeout.is_zero() && elapsed > timeout {
                return Err(Error::DistStore(format!(
                    "Timed out after {} seconds waiting for clients. {joined}/{world_size} clients joined.",
                    elapsed.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The host this client connects to.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port this client connects to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server this store keeps alive, if it started one.
    pub fn server(&self) -> Option<&Arc<TcpStoreServer>> {
        self.server.as_ref()
    }

    /// Round-trips a `PING` to the server.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::ConnectionClosed`] or [`Error::Protocol`] if the
    /// server does not echo the nonce.
    pub async fn ping(&self) -> Result<()> {
        self.run(|c| Box::pin(c.ping())).await
    }

    /// Runs one operation on the connection (CLI-3).
    async fn run<T>(
        &self,
        op: impl for<'c> FnOnce(
            &'c mut Connection,
        )
            -> std::pin::Pin<Box<dyn Future<Output = Result<T>> + Send + 'c>>,
    ) -> Result<T> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut conn = match idle {
            Some(conn) => conn,
            None => Connection::open(&self.host, self.port).await?,
        };
        let result = op(&mut conn).await;
        if let Ok(_) | Err(Error::Timeout { .. }) = &result {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
        result
    }

    async fn add_raw(&self, key: &[u8], delta: i64) -> Result<i64> {
        let mut frame = Frame::request(QueryType::Add);
        frame.bytes(key).i64(delta);
        self.run(move |c| {
            Box::pin(async move {
                c.send(&frame).await?;
                c.read_i64().await
            })
        })
        .await
    }

    async fn get_raw(&self, wire_key: &str) -> Result<Vec<u8>> {
        let timeout = self.timeout();
        let keys = vec![wire_key.to_owned()];
        self.run(move |c| {
            Box::pin(async move {
                c.wait(&keys, timeout).await?;
                let mut frame = Frame::request(QueryType::Get);
                frame.bytes(keys[0].as_bytes());
                c.send(&frame).await?;
                c.read_bytes().await
            })
        })
        .await
    }
}

/// Returns this process's server on `port`, starting one if needed.
async fn shared_server(port: u16) -> Result<Arc<TcpStoreServer>> {
    let mut servers = SERVERS.lock().await;
    if port != 0
        && let Some(server) = servers.get(&port).and_then(Weak::upgrade)
    {
        return Ok(server);
    }
    // Like PyTorch: every interface, IPv6 (dual stack) first, then IPv4.
    let server = match TcpStoreServer::bind(("::", port)).await {
        Ok(server) => server,
        Err(v6) => {
            tracing::debug!(error = %v6, "binding the store on [::] failed, trying 0.0.0.0");
            TcpStoreServer::bind(("0.0.0.0", port)).await?
        }
    };
    let server = Arc::new(server);
    servers.retain(|_, weak| weak.strong_count() > 0);
    servers.insert(server.port(), Arc::downgrade(&server));
    Ok(server)
}

/// The key as it travels (CLI-2), refused up front if PyTorch's server (and
/// ours) would drop the connection over its length.
fn wire_key(key: &str) -> Result<String> {
    let wire = format!("{KEY_PREFIX}{key}");
    if wire.len() as u64 > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!(
            "key {:?}... of {} bytes exceeds the store's limit of {MAX_KEY_LEN} bytes",
            key.chars().take(32).collect::<String>(),
            wire.len()
        )));
    }
    Ok(wire)
}

fn wire_keys(keys: &[&str]) -> Result<Vec<String>> {
    keys.iter().map(|k| wire_key(k)).collect()
}

/// Refuses a value the store servers would drop the connection over.
fn check_value(key: &str, value: &[u8]) -> Result<()> {
    if value.len() as u64 > MAX_PAYLOAD_LEN {
        return Err(Error::InvalidArgument(format!(
            "value of {} bytes for key {key:?} exceeds the store's limit of {MAX_PAYLOAD_LEN} bytes",
            value.len()
        )));
    }
    Ok(())
}

fn user_key(wire: &str) -> String {
    wire.strip_prefix(KEY_PREFIX).unwrap_or(wire).to_owned()
}

#[async_trait::async_trait]
impl Store for TcpStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_value(key, value)?;
        let mut frame = Frame::request(QueryType::Set);
        frame.bytes(wire_key(key)?.as_bytes()).bytes(value);
        self.run(move |c| Box::pin(async move { c.send(&frame).await }))
            .await
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_raw(&wire_key(key)?).await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.add_raw(wire_key(key)?.as_bytes(), delta).await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        check_value(key, expected)?;
        check_value(key, desired)?;
        let mut frame = Frame::request(QueryType::CompareSet);
        frame
            .bytes(wire_key(key)?.as_bytes())
            .bytes(expected)
            .bytes(desired);
        self.run(move |c| {
            Box::pin(async move {
                c.send(&frame).await?;
                c.read_bytes().await
            })
        })
        .await
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let keys = wire_keys(keys)?;
        self.run(move |c| Box::pin(async move { c.wait(&keys, timeout).await }))
            .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys = wire_keys(keys)?;
        let mut frame = Frame::request(QueryType::Check);
        frame.keys(&keys);
        self.run(move |c| {
            Box::pin(async move {
                c.send(&frame).await?;
                match c.read_u8().await? {
                    CHECK_READY => Ok(true),
                    CHECK_NOT_READY => Ok(false),
                    other => Err(Error::Protocol(format!(
                        "ready or not_ready response expected, got {other} (store at {})",
                        c.addr
                    ))),
                }
            })
        })
        .await
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        let mut frame = Frame::request(QueryType::DeleteKey);
        frame.bytes(wire_key(key)?.as_bytes());
        self.run(move |c| {
            Box::pin(async move {
                c.send(&frame).await?;
                Ok(c.read_i64().await? == 1)
            })
        })
        .await
    }

    async fn num_keys(&self) -> Result<i64> {
        let frame = Frame::request(QueryType::GetNumKeys);
        self.run(move |c| {
            Box::pin(async move {
                c.send(&frame).await?;
                c.read_i64().await
            })
        })
        .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        check_value(key, value)?;
        let mut frame = Frame::request(QueryType::Append);
        frame.bytes(wire_key(key)?.as_bytes()).bytes(value);
        self.run(move |c| Box::pin(async move { c.send(&frame).await }))
            .await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        let keys = wire_keys(keys)?;
        let timeout = self.timeout();
        self.run(move |c| {
            Box::pin(async move {
                c.wait(&keys, timeout).await?;
                let mut frame = Frame::request(QueryType::MultiGet);
                frame.keys(&keys);
                c.send(&frame).await?;
                let mut out = Vec::with_capacity(keys.len());
                for _ in 0..keys.len() {
                    out.push(c.read_bytes().await?);
                }
                Ok(out)
            })
        })
        .await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        check_multi_set(keys, values)?;
        for (key, value) in keys.iter().zip(values) {
            check_value(key, value)?;
        }
        let mut frame = Frame::request(QueryType::MultiSet);
        frame.u64(keys.len() as u64);
        for (key, value) in keys.iter().zip(values) {
            frame.bytes(wire_key(key)?.as_bytes()).bytes(value);
        }
        self.run(move |c| Box::pin(async move { c.send(&frame).await }))
            .await
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout);
    }
}
