//! In-process multi-worker harness (feature `testing`): the seeds'
//! `dist_init` without processes.
//!
//! A [`Cluster`] is N agents named `worker0..` on one tokio runtime, each on
//! its own loopback port (port 0, so no fixed ports) and all meeting through
//! a fresh in-memory store, so clusters of concurrent tests never see each
//! other. [`dist_init`] runs one test body on every rank concurrently, then
//! shuts every agent down gracefully and checks nothing leaked; any rank's
//! failure fails the test. [`run`] puts a whole test under a timeout so a
//! hang is a failure.
//!
//! Agents of a cluster check RRef leaks at shutdown (the seeds' harness sets
//! `_ignore_rref_leak = False`). [`wait_until_pending_futures_and_users_flushed`]
//! polls the RRef context's counters (which `get_debug_info` includes, so
//! [`wait_until_debug_info`] serves other waits on them) and fails with the
//! seeds' text; [`wait_until_owners_and_forks_on_rank`] polls a rank's
//! counters through an RPC, as [`wait_until_node_failure`] polls a worker.

use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::store::{HashStore, Store};
use crate::{
    Error, FaultInjection, FunctionRegistry, Remote, Result, RpcAgent, RpcBackendOptions, init_rpc,
};

pub mod op_fuzz;
mod waits;

pub use waits::{
    pending_not_flushed_message, store_barrier, wait_until_debug_info, wait_until_node_failure,
    wait_until_owners_and_forks_on_rank, wait_until_pending_futures_and_users_flushed,
};

/// The default limit for one test.
pub const DEFAULT_TEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The seeds' `worker_name(rank)`.
pub fn worker_name(rank: u32) -> String {
    format!("worker{rank}")
}

/// A fresh in-memory store.
pub fn fresh_store() -> Arc<dyn Store> {
    Arc::new(HashStore::new())
}

/// Runs `fut` on a new multi-threaded runtime, failing (panicking) if it
/// takes longer than `timeout`.
///
/// # Panics
/// When the timeout passes, or the runtime cannot be built.
pub fn run<T, F>(timeout: Duration, fut: F) -> T
where
    F: std::future::Future<Output = T>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot build a tokio runtime: {e}"));
    let out = rt.block_on(async { tokio::time::timeout(timeout, fut).await });
    rt.shutdown_timeout(Duration::from_secs(1));
    match out {
        Ok(v) => v,
        Err(_) => panic!("test timed out after {timeout:?}"),
    }
}

/// Log lines captured by [`global_logs`].
#[derive(Clone, Default)]
pub struct CapturedLogs(Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedLogs {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs (once per process) a global `tracing` subscriber writing every
/// event to one [`CapturedLogs`], and returns it: the workers' logs, which
/// the seeds check on stderr. Thread-scoped subscribers are not used, because
/// callsite interest is cached process-wide and tests run in parallel.
pub fn global_logs() -> &'static CapturedLogs {
    static LOGS: std::sync::OnceLock<CapturedLogs> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = CapturedLogs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        if tracing::subscriber::set_global_default(subscriber).is_err() {
            tracing::warn!("a global tracing subscriber was already set; logs are not captured");
        }
        logs
    })
}

/// One rank's failure in a multi-rank test.
#[derive(Debug)]
pub struct TestFailure(pub String);

impl Display for TestFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TestFailure {}

impl From<Error> for TestFailure {
    fn from(e: Error) -> Self {
        TestFailure(e.to_string())
    }
}

type Setup = Arc<dyn Fn(&FunctionRegistry) + Send + Sync>;
type Configure = Arc<dyn Fn(u32, &mut RpcBackendOptions) + Send + Sync>;

/// Set to `1` to run every [`Cluster`] over TLS (an ephemeral CA per
/// cluster), as if each builder called [`ClusterBuilder::tls`]:
/// `cargo xtask test` runs the transport's fault and garbage tests again
/// this way.
pub const TEST_TLS_ENV: &str = "WASMRPC_TEST_TLS";

/// Configures a [`Cluster`].
#[derive(Clone)]
pub struct ClusterBuilder {
    world_size: u32,
    setup: Option<Setup>,
    options: RpcBackendOptions,
    configure: Option<Configure>,
    faults: Vec<(u32, FaultInjection)>,
    store: Option<Arc<dyn Store>>,
    /// The cluster's own random secret, given to every rank whose options
    /// name no credentials: test clusters are authenticated, and two
    /// clusters never accept each other's workers.
    secret: Vec<u8>,
    /// The cluster's CA and each rank's credentials, after
    /// [`tls`](Self::tls).
    tls: Option<(Arc<crate::CertificateAuthority>, Vec<crate::TlsCredentials>)>,
}

impl ClusterBuilder {
    /// Runs every connection of the cluster over TLS: a fresh CA, and a
    /// certificate naming each rank's worker (given to ranks whose options
    /// name no TLS credentials). The cluster secret stays on too.
    ///
    /// # Errors
    /// Key generation or signing failed.
    pub fn tls(mut self) -> Result<Self> {
        let ca = crate::CertificateAuthority::generate()?;
        let creds = (0..self.world_size)
            .map(|rank| ca.credentials_for(&worker_name(rank)))
            .collect::<std::result::Result<_, _>>()?;
        self.tls = Some((Arc::new(ca), creds));
        Ok(self)
    }

    /// The cluster's CA after [`tls`](Self::tls): tests issue certificates
    /// from it (e.g. to a peer that claims another worker's name).
    pub fn authority(&self) -> Option<&Arc<crate::CertificateAuthority>> {
        self.tls.as_ref().map(|(ca, _)| ca)
    }

    /// The secret ranks get when their options give none (see
    /// [`options_for`](Self::options_for)).
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// Registers functions on every worker's (own) registry.
    #[must_use]
    pub fn functions(mut self, setup: impl Fn(&FunctionRegistry) + Send + Sync + 'static) -> Self {
        self.setup = Some(Arc::new(setup));
        self
    }

    /// Options for every worker (each still gets its own registry).
    #[must_use]
    pub fn options(mut self, options: RpcBackendOptions) -> Self {
        self.options = options;
        self
    }

    /// Adjusts each rank's options before it starts, e.g. the device maps
    /// the seeds set per rank (`options.set_device_map(dst, {rank: ...})`).
    #[must_use]
    pub fn configure(
        mut self,
        configure: impl Fn(u32, &mut RpcBackendOptions) + Send + Sync + 'static,
    ) -> Self {
        self.configure = Some(Arc::new(configure));
        self
    }

    /// Faults for rank `rank`'s sends.
    #[must_use]
    pub fn faults(mut self, rank: u32, faults: FaultInjection) -> Self {
        self.faults.push((rank, faults));
        self
    }

    /// Uses `store` instead of a fresh one.
    #[must_use]
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// The options rank `rank` starts with: the template (with the
    /// cluster's random [`secret`](Self::secret) if it gives no secret), a
    /// registry of its own with the setup's functions, its faults, then
    /// [`configure`](Self::configure)'s changes.
    pub fn options_for(&self, rank: u32) -> RpcBackendOptions {
        let mut o = self.options.clone();
        if o.cluster_secret.is_none() {
            o.cluster_secret = Some(self.secret.clone());
        }
        if o.tls.is_none()
            && let Some((_, creds)) = &self.tls
            && let Some(c) = creds.get(rank as usize)
        {
            o.tls = Some(c.clone());
        }
        let registry = FunctionRegistry::new();
        if let Some(s) = &self.setup {
            s(&registry);
        }
        o.registry = Arc::new(registry);
        if let Some((_, f)) = self.faults.iter().find(|(r, _)| *r == rank) {
            o.faults = f.clone();
        }
        if let Some(c) = &self.configure {
            c(rank, &mut o);
        }
        o
    }

    /// Starts every worker concurrently (a static group).
    ///
    /// # Errors
    /// The first rank's `init_rpc` error.
    pub async fn start(self) -> Result<Cluster> {
        let store = self.store.clone().unwrap_or_else(fresh_store);
        let mut tasks = Vec::new();
        for rank in 0..self.world_size {
            let (store, options, ws) = (store.clone(), self.options_for(rank), self.world_size);
            tasks.push(tokio::spawn(async move {
                init_rpc(&worker_name(rank), Some(rank), Some(ws), store, options).await
            }));
        }
        let mut agents = Vec::new();
        let mut first_err = None;
        for t in tasks {
            match t.await {
                Ok(Ok(a)) => {
                    a.set_ignore_rref_leak(false);
                    agents.push(a)
                }
                Ok(Err(e)) => first_err = first_err.or(Some(e)),
                Err(e) => {
                    first_err = first_err.or(Some(Error::runtime(format!("init task failed: {e}"))))
                }
            }
        }
        if let Some(e) = first_err {
            agents.iter().for_each(RpcAgent::abort);
            return Err(e);
        }
        Ok(Cluster {
            agents,
            store,
            world_size: self.world_size,
        })
    }
}

/// N workers of one static group in this process.
pub struct Cluster {
    agents: Vec<RpcAgent>,
    store: Arc<dyn Store>,
    world_size: u32,
}

impl Cluster {
    /// A builder for a group of `world_size` workers: authenticated with a
    /// fresh cluster secret, and over TLS too when [`TEST_TLS_ENV`] is `1`
    /// (how the suites run again with TLS on).
    ///
    /// # Panics
    /// If [`TEST_TLS_ENV`] asks for TLS and no key can be generated.
    pub fn builder(world_size: u32) -> ClusterBuilder {
        let builder = ClusterBuilder {
            world_size,
            setup: None,
            options: RpcBackendOptions::default(),
            configure: None,
            faults: Vec::new(),
            store: None,
            secret: crate::transport::generate_secret().into_bytes(),
            tls: None,
        };
        if std::env::var(TEST_TLS_ENV).is_ok_and(|v| v == "1") {
            builder
                .tls()
                .unwrap_or_else(|e| panic!("{TEST_TLS_ENV}=1: cannot make the cluster's CA: {e}"))
        } else {
            builder
        }
    }

    /// Starts `world_size` workers with no functions of their own.
    ///
    /// # Errors
    /// As [`ClusterBuilder::start`].
    pub async fn start(world_size: u32) -> Result<Cluster> {
        Self::builder(world_size).start().await
    }

    /// Rank `rank`'s agent.
    ///
    /// # Panics
    /// If there is no such rank.
    pub fn agent(&self, rank: u32) -> &RpcAgent {
        &self.agents[rank as usize]
    }

    /// Every agent, by rank.
    pub fn agents(&self) -> &[RpcAgent] {
        &self.agents
    }

    /// The group's store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The rank-`rank` view test bodies get.
    pub fn worker(&self, rank: u32) -> Worker {
        Worker {
            rank,
            world_size: self.world_size,
            agent: self.agents[rank as usize].clone(),
            store: self.store.clone(),
            barriers: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Runs `body` on every rank concurrently; fails if any rank fails. After
    /// a failure the other ranks get 10 s to finish before they are
    /// cancelled.
    ///
    /// # Errors
    /// Every failing rank's error, one per line.
    pub async fn run_on_all<F, Fut, E>(&self, body: F) -> std::result::Result<(), TestFailure>
    where
        F: Fn(Worker) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = std::result::Result<(), E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        run_ranks(
            (0..self.world_size).map(|r| self.worker(r)).collect(),
            body,
            false,
        )
        .await
    }

    /// Shuts every worker down gracefully and concurrently, then checks for
    /// leaks.
    ///
    /// # Errors
    /// Any shutdown error or leak.
    pub async fn shutdown(self) -> std::result::Result<(), TestFailure> {
        run_ranks(
            (0..self.world_size).map(|r| self.worker(r)).collect(),
            |_w| async { Ok::<_, Error>(()) },
            true,
        )
        .await
    }
}

async fn run_ranks<F, Fut, E>(
    workers: Vec<Worker>,
    body: F,
    shutdown: bool,
) -> std::result::Result<(), TestFailure>
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = std::result::Result<(), E>> + Send + 'static,
    E: Display + Send + 'static,
{
    let body = Arc::new(body);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut handles = Vec::new();
    for w in workers {
        let (body, tx) = (body.clone(), tx.clone());
        handles.push(tokio::spawn(async move {
            let rank = w.rank;
            let agent = w.agent.clone();
            let r = body(w).await.map_err(|e| format!("rank {rank}: {e}"));
            if r.is_err() {
                // Report at once, then leave without waiting for the others,
                // who may be waiting for this rank.
                let _ = tx.send(r);
                if shutdown {
                    let _ = agent.shutdown(false, Duration::ZERO).await;
                }
                return;
            }
            let r = if shutdown {
                agent
                    .shutdown(true, Duration::ZERO)
                    .await
                    .map_err(|e| format!("rank {rank} shutdown: {e}"))
                    .and_then(|()| leak_check(&agent).map_err(|e| format!("rank {rank}: {e}")))
            } else {
                r
            };
            let _ = tx.send(r);
        }));
    }
    drop(tx);
    let mut errors = Vec::new();
    let mut left = handles.len();
    while left > 0 {
        let next = if errors.is_empty() {
            rx.recv().await
        } else {
            tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .ok()
                .flatten()
        };
        match next {
            Some(Ok(())) => left -= 1,
            Some(Err(e)) => {
                errors.push(e);
                left -= 1;
            }
            None => break,
        }
    }
    if left > 0 {
        errors.push(format!(
            "{left} rank(s) did not finish after another rank failed"
        ));
        handles.iter().for_each(|h| h.abort());
    }
    for h in handles {
        if let Err(e) = h.await
            && e.is_panic()
        {
            errors.push(format!("a rank panicked: {e}"));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(TestFailure(errors.join("\n")))
    }
}

/// What must be true of an agent after a graceful shutdown: no pending
/// calls, no running functions, no connections.
///
/// # Errors
/// A description of what leaked.
pub fn leak_check(agent: &RpcAgent) -> std::result::Result<(), String> {
    let info = agent.get_debug_info();
    let get = |k: &str| info.get(k).map(String::as_str).unwrap_or("?").to_string();
    for key in [
        "agent.num_pending_requests",
        "agent.server_active_calls",
        "agent.num_connections",
    ] {
        if get(key) != "0" {
            return Err(format!(
                "{} leaked after shutdown: {key} = {}",
                agent.name(),
                get(key)
            ));
        }
    }
    Ok(())
}

/// Starts a cluster from `builder`, runs `body` on every rank, then shuts
/// each rank down gracefully after its body (the seeds' `@dist_init`), and
/// checks for leaks.
///
/// # Errors
/// Startup errors, or every failing rank's error.
pub async fn dist_init<F, Fut, E>(
    builder: ClusterBuilder,
    body: F,
) -> std::result::Result<(), TestFailure>
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = std::result::Result<(), E>> + Send + 'static,
    E: Display + Send + 'static,
{
    let cluster = builder.start().await?;
    let workers = (0..cluster.world_size).map(|r| cluster.worker(r)).collect();
    run_ranks(workers, body, true).await
}

/// One rank's view in a test body.
#[derive(Clone)]
pub struct Worker {
    /// This rank.
    pub rank: u32,
    /// The group's size.
    pub world_size: u32,
    /// This rank's agent.
    pub agent: RpcAgent,
    /// The group's store, for out-of-band barriers.
    pub store: Arc<dyn Store>,
    barriers: Arc<AtomicU64>,
}

impl Worker {
    /// The name of rank `(rank + k) % world_size`.
    pub fn peer(&self, k: u32) -> String {
        worker_name((self.rank + k) % self.world_size)
    }

    /// The seeds' `dst`: the next rank's name.
    pub fn dst(&self) -> String {
        self.peer(1)
    }

    /// An out-of-band barrier of every rank through the store (the seeds'
    /// process-group `dist.barrier()`). Every rank must call it the same
    /// number of times.
    ///
    /// # Errors
    /// Store errors (e.g. a timeout).
    pub async fn store_barrier(&self) -> Result<()> {
        let n = self.barriers.fetch_add(1, Ordering::AcqRel);
        store_barrier(&*self.store, &format!("test/barrier/{n}"), self.world_size).await
    }
}
