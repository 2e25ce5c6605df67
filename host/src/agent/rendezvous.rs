//! Rendezvous through the store: static groups (every rank of a world size)
//! and dynamic groups (join and leave at any time).
//!
//! Store keys (the store is the group's own, or a prefix of one):
//! - `rpc/mode`: "static" or "dynamic", set by the first worker (compare-set),
//!   so the two kinds never meet (JOIN-1);
//! - static: `rpc/claim/{rank}` (a counter: a second claim is a re-init) and
//!   `rpc/worker/{rank}` (name and address), read by everyone in one
//!   `multi_get`: five round trips per worker, whatever the world size
//!   (JOIN-2);
//! - dynamic: `rpc/token` (mutual exclusion of joins and leaves, as PyTorch's
//!   `RpcGroupManagementToken`), `rpc/nmembers` and `rpc/member/{i}` (every
//!   worker that ever joined, marked when it leaves). A joiner tells every
//!   member about itself over RPC before releasing the token.
//!
//! JOIN-3: nothing secret is ever written to the store, nor read from it.
//! The store speaks PyTorch's unauthenticated TCPStore protocol, so anyone
//! who reaches it reads every key; credentials (the cluster secret, TLS
//! keys) come from the operator only ([`RpcBackendOptions::cluster_secret`],
//! `WASMRPC_CLUSTER_SECRET`, the `wasmrpc worker` flags). The records above
//! hold names, ranks, addresses and device counts only.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::{
    AgentHandler, AgentInner, CallKind, CallOptions, Dest, Extensions, Member, RUNNING, RpcAgent,
    RpcBackendOptions, all_gather, store_err,
};
use crate::abi::{Value, WorkerInfo};
use crate::error::{
    Error, MIXED_MEMBERSHIP, RANK_ENV_MISSING, Result, already_initialized_message,
    name_not_unique_message, rank_parameter_missing_message,
};
use crate::store::Store;
use crate::transport::{Handler, Transport, TransportConfig};
use crate::value::Payload;
use crate::{agent::registry::FunctionRegistry, args};

pub(crate) const UPDATE_MEMBERSHIP: &str = "wasmrpc::_update_group_membership";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    name: String,
    rank: u32,
    addr: String,
    left: bool,
    /// The worker's device count, `devices` and device maps, all-gathered
    /// for `device::validate_device_maps`.
    devices: crate::device::DeviceInfo,
}

impl Record {
    fn member(&self) -> Result<Member> {
        let addr: SocketAddr = self.addr.parse().map_err(|e| {
            Error::runtime(format!(
                "worker {} published a bad address {}: {e}",
                self.name, self.addr
            ))
        })?;
        Ok(Member {
            info: WorkerInfo {
                id: self.rank,
                name: self.name.clone(),
            },
            addr,
        })
    }
}

fn decode_record(bytes: &[u8]) -> Result<Record> {
    crate::abi::decode(bytes)
        .map_err(|e| Error::runtime(format!("malformed worker record in the store: {e}")))
}

fn encode_record(r: &Record) -> Result<Vec<u8>> {
    crate::abi::encode(r).map_err(|e| Error::runtime(format!("cannot encode worker record: {e}")))
}

fn resolve_rank(rank: Option<u32>, init_method: &str) -> Result<u32> {
    if let Some(r) = rank {
        return Ok(r);
    }
    if init_method.starts_with("env://") {
        let v = std::env::var("RANK").map_err(|_| Error::value(RANK_ENV_MISSING))?;
        return v
            .trim()
            .parse()
            .map_err(|_| Error::value(format!("environment variable RANK is not a rank: {v}")));
    }
    Err(Error::value(rank_parameter_missing_message(init_method)))
}

/// The credentials this worker authenticates its connections with
/// ([`RpcBackendOptions::check_credentials`]): a secret, TLS, or both; an
/// empty secret and no TLS when it runs unauthenticated, which it says in
/// one WARN line.
fn credentials(name: &str, options: &RpcBackendOptions) -> Result<Credentials> {
    let (secret, tls) = options.resolve_credentials(name)?;
    if secret.is_some() || tls.is_some() {
        tracing::info!(
            worker = %name,
            "connections: {}",
            match (&tls, &secret) {
                (Some(_), Some(_)) => "TLS 1.3 with mutual authentication, and the cluster secret",
                (Some(_), None) => "TLS 1.3 with mutual authentication",
                _ => "authenticated with the cluster secret (not encrypted)",
            }
        );
        let tls = tls.map(|t| t.endpoints()).transpose()?;
        return Ok((secret.unwrap_or_default(), tls));
    }
    let listen = options.listen_addr;
    if listen.ip().is_loopback() {
        tracing::warn!(
            worker = %name,
            "no cluster credentials: connections to {listen} are not authenticated \
             (loopback only: every local user can connect); set {} or TLS credentials for an authenticated cluster",
            super::CLUSTER_SECRET_ENV
        );
    } else {
        tracing::warn!(
            worker = %name,
            "no cluster credentials and --insecure: connections to {listen} are NOT \
             authenticated; anyone who can reach it can call this worker's functions"
        );
    }
    Ok((Vec::new(), None))
}

/// The secret (empty: none) and the TLS ends a worker's transport uses.
type Credentials = (Vec<u8>, Option<crate::transport::TlsEndpoints>);

async fn claim_mode(store: &dyn Store, mode: &str) -> Result<()> {
    let got = store
        .compare_set("rpc/mode", b"", mode.as_bytes())
        .await
        .map_err(store_err)?;
    if got != mode.as_bytes() {
        Err(Error::runtime(MIXED_MEMBERSHIP))
    } else {
        Ok(())
    }
}

/// The agent's own functions, and those of its features.
fn internal_registry(extensions: &Extensions) -> FunctionRegistry {
    let r = FunctionRegistry::without_builtins();
    all_gather::register(&r);
    for extension in extensions.iter() {
        extension.register(&r);
    }
    super::register_agent_functions(&r);
    r.register_native(UPDATE_MEMBERSHIP, |ctx, args| async move {
        let record = args.get(0)?;
        let join = args.get(1)?.as_bool()?;
        let (name, rank, addr) = match &record.value {
            Value::Tuple(v) => match v.as_slice() {
                [Value::Str(n), Value::Int(r), Value::Str(a)] => (n.clone(), *r, a.clone()),
                _ => return Err(Error::type_error("malformed membership record")),
            },
            _ => return Err(Error::type_error("malformed membership record")),
        };
        let rank = u32::try_from(rank).map_err(|_| Error::value(format!("bad rank {rank}")))?;
        let member = Record {
            name: name.clone(),
            rank,
            addr,
            left: false,
            devices: crate::device::DeviceInfo::default(),
        }
        .member()?;
        let mut workers = ctx
            .agent()
            .inner
            .workers
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if join {
            workers.insert(name, member);
        } else {
            workers.remove(&name);
        }
        Ok(Payload::none())
    });
    r
}

async fn start(
    info: WorkerInfo,
    store: Arc<dyn Store>,
    options: RpcBackendOptions,
    (secret, tls): Credentials,
    static_group: bool,
    extensions: Extensions,
) -> Result<RpcAgent> {
    let inner = Arc::new(AgentInner {
        info: info.clone(),
        store,
        static_group,
        member_slot: AtomicU64::new(u64::MAX),
        runtime: tokio::runtime::Handle::current(),
        transport: std::sync::OnceLock::new(),
        handler: std::sync::OnceLock::new(),
        workers: RwLock::new(BTreeMap::new()),
        pending: Mutex::default(),
        deadlines: Arc::default(),
        next_id: AtomicU64::new(1),
        timeout_ms: AtomicU64::new(0),
        state: AtomicU8::new(RUNNING),
        user_sent: AtomicU64::new(0),
        user_received: AtomicU64::new(0),
        unknown_function_calls: AtomicU64::new(0),
        user_pending: AtomicUsize::new(0),
        user_active: AtomicUsize::new(0),
        active: AtomicUsize::new(0),
        quiet: Notify::new(),
        ready: std::sync::atomic::AtomicBool::new(false),
        ready_notify: Notify::new(),
        gather: all_gather::GatherStates::default(),
        internal: internal_registry(&extensions),
        extensions,
        worker_state: Mutex::default(),
        debug_sources: Mutex::default(),
        shutdown_hooks: Mutex::default(),
        tensor_budget: crate::tensor::budget::WorkerBudget::new(&info.name, options.tensor_memory),
        warn_limit: super::warn_limit::WarnLimiter::default(),
        failures: Default::default(),
        options: options.clone(),
    });
    let agent = RpcAgent::from_inner(inner.clone());
    let weak = Arc::downgrade(&inner);
    inner
        .runtime
        .spawn(inner.deadlines.clone().sweep(move |id| {
            let Some(inner) = weak.upgrade() else {
                return false;
            };
            RpcAgent::from_inner(inner).expire(id);
            true
        }));
    agent.set_rpc_timeout(options.rpc_timeout);
    let handler: Arc<dyn Handler> = Arc::new(AgentHandler {
        agent: Arc::downgrade(&inner),
    });
    // The handler lives as long as the agent, which holds it; the transport
    // only holds it weakly.
    let weak = Arc::downgrade(&handler);
    let _ = inner.handler.set(handler);
    let cfg = TransportConfig {
        name: info.name.clone(),
        rank: info.id,
        secret: Arc::new(secret),
        max_frame_size: options.max_frame_size,
        faults: options.faults.clone(),
        receive_budget: Some(inner.tensor_budget.worker().clone()),
        tls,
        shared_memory: options.shared_memory,
        busy_poll: options.busy_poll,
        failure_timeout: options.failure_timeout,
    };
    let transport = Transport::bind(cfg, options.listen_addr, weak).await?;
    let _ = inner.transport.set(transport);
    Ok(agent)
}

pub(super) async fn init(
    name: &str,
    rank: Option<u32>,
    world_size: Option<u32>,
    store: Arc<dyn Store>,
    options: RpcBackendOptions,
    extensions: Extensions,
) -> Result<RpcAgent> {
    super::validate_worker_name(name)?;
    let rank = resolve_rank(rank, &options.init_method)?;
    match world_size {
        Some(ws) => init_static(name, rank, ws, store, options, extensions).await,
        None => init_dynamic(name, rank, store, options, extensions).await,
    }
}

async fn init_static(
    name: &str,
    rank: u32,
    world_size: u32,
    store: Arc<dyn Store>,
    options: RpcBackendOptions,
    extensions: Extensions,
) -> Result<RpcAgent> {
    if rank >= world_size {
        return Err(Error::value(format!(
            "rank {rank} is not below the world size {world_size}"
        )));
    }
    let secret = credentials(name, &options)?;
    claim_mode(&*store, "static").await?;
    let claims = store
        .add(&format!("rpc/claim/{rank}"), 1)
        .await
        .map_err(store_err)?;
    if claims > 1 {
        return Err(Error::runtime(already_initialized_message(name, rank)));
    }
    let info = WorkerInfo {
        id: rank,
        name: name.into(),
    };
    let agent = start(info, store.clone(), options, secret, true, extensions).await?;
    let result = async {
        let addr = agent.local_addr().ok_or_else(Error::not_initialized)?;
        let me = Record {
            name: name.into(),
            rank,
            addr: addr.to_string(),
            left: false,
            devices: crate::device::DeviceInfo::local(agent.options()),
        };
        store
            .set(&format!("rpc/worker/{rank}"), &encode_record(&me)?)
            .await
            .map_err(store_err)?;
        let keys: Vec<String> = (0..world_size).map(|r| format!("rpc/worker/{r}")).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let values = store.multi_get(&key_refs).await.map_err(store_err)?;
        let mut table: BTreeMap<String, Member> = BTreeMap::new();
        let mut devices = BTreeMap::new();
        for bytes in values {
            let record = decode_record(&bytes)?;
            let m = record.member()?;
            devices.insert(record.name, record.devices);
            if let Some(prev) = table.get(&m.info.name) {
                let (a, b) = (prev.info.id.min(m.info.id), prev.info.id.max(m.info.id));
                return Err(Error::runtime(name_not_unique_message(&m.info.name, a, b)));
            }
            table.insert(m.info.name.clone(), m);
        }
        crate::device::install(&agent, &devices, true)?;
        *agent
            .inner
            .workers
            .write()
            .unwrap_or_else(|p| p.into_inner()) = table;
        Ok(())
    }
    .await;
    match result {
        Ok(()) => {
            agent.set_ready();
            Ok(agent)
        }
        Err(e) => {
            agent.abort();
            Err(e)
        }
    }
}

async fn take_token(store: &dyn Store, mine: &str, timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let got = store
            .compare_set("rpc/token", b"", mine.as_bytes())
            .await
            .map_err(store_err)?;
        if got == mine.as_bytes() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::runtime(format!(
                "timed out waiting for the group membership token held by {}",
                String::from_utf8_lossy(&got)
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn release_token(store: &dyn Store) -> Result<()> {
    store.set("rpc/token", b"").await.map_err(store_err)
}

async fn members(store: &dyn Store) -> Result<Vec<(u64, Record)>> {
    let n = store.add("rpc/nmembers", 0).await.map_err(store_err)?;
    let keys: Vec<String> = (0..n).map(|i| format!("rpc/member/{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = if refs.is_empty() {
        Vec::new()
    } else {
        store.multi_get(&refs).await.map_err(store_err)?
    };
    values
        .iter()
        .enumerate()
        .map(|(i, b)| Ok((i as u64, decode_record(b)?)))
        .collect()
}

fn record_payload(name: &str, rank: u32, addr: &str) -> Payload {
    Payload::tuple(vec![name.into(), rank.into(), addr.into()])
}

async fn init_dynamic(
    name: &str,
    rank: u32,
    store: Arc<dyn Store>,
    options: RpcBackendOptions,
    extensions: Extensions,
) -> Result<RpcAgent> {
    let secret = credentials(name, &options)?;
    claim_mode(&*store, "dynamic").await?;
    let init_timeout = options.init_timeout;
    let info = WorkerInfo {
        id: rank,
        name: name.into(),
    };
    let agent = start(
        info.clone(),
        store.clone(),
        options,
        secret,
        false,
        extensions,
    )
    .await?;
    let token = format!("Token_for_{name}_join");
    if let Err(e) = take_token(&*store, &token, init_timeout).await {
        agent.abort();
        return Err(e);
    }
    let result = async {
        let addr = agent
            .local_addr()
            .ok_or_else(Error::not_initialized)?
            .to_string();
        let live: Vec<Record> = members(&*store)
            .await?
            .into_iter()
            .map(|(_, r)| r)
            .filter(|r| !r.left)
            .collect();
        if let Some(r) = live.iter().find(|r| r.name == name) {
            return Err(Error::runtime(name_not_unique_message(
                name,
                r.rank.min(rank),
                r.rank.max(rank),
            )));
        }
        if live.iter().any(|r| r.rank == rank) {
            return Err(Error::runtime(already_initialized_message(name, rank)));
        }
        let me = Record {
            name: name.into(),
            rank,
            addr: addr.clone(),
            left: false,
            devices: crate::device::DeviceInfo::local(agent.options()),
        };
        let devices = live
            .iter()
            .chain(std::iter::once(&me))
            .map(|r| (r.name.clone(), r.devices.clone()))
            .collect();
        crate::device::install(&agent, &devices, false)?;
        let slot = store.add("rpc/nmembers", 1).await.map_err(store_err)? - 1;
        store
            .set(&format!("rpc/member/{slot}"), &encode_record(&me)?)
            .await
            .map_err(store_err)?;
        agent
            .inner
            .member_slot
            .store(slot as u64, std::sync::atomic::Ordering::Release);
        {
            let mut table = agent
                .inner
                .workers
                .write()
                .unwrap_or_else(|p| p.into_inner());
            for r in live.iter().chain(std::iter::once(&me)) {
                table.insert(r.name.clone(), r.member()?);
            }
        }
        for r in &live {
            agent
                .call(
                    Dest::Name(r.name.clone()),
                    UPDATE_MEMBERSHIP,
                    args![record_payload(name, rank, &addr), true],
                    CallOptions {
                        timeout: None,
                        ..CallOptions::new(CallKind::Internal)
                    },
                )
                .wait()
                .await?;
        }
        Ok(())
    }
    .await;
    if result.is_err() {
        // A joiner that published its record but could not tell every
        // member (e.g. refused by their handshake) marks it left, so later
        // joiners do not wait on a worker that is gone.
        let slot = agent
            .inner
            .member_slot
            .load(std::sync::atomic::Ordering::Acquire);
        if slot != u64::MAX {
            let gone = Record {
                name: name.into(),
                rank,
                addr: String::new(),
                left: true,
                devices: crate::device::DeviceInfo::default(),
            };
            if let Ok(bytes) = encode_record(&gone) {
                let _ = store.set(&format!("rpc/member/{slot}"), &bytes).await;
            }
        }
    }
    let released = release_token(&*store).await;
    match result.and(released) {
        Ok(()) => {
            agent.set_ready();
            Ok(agent)
        }
        Err(e) => {
            agent.abort();
            Err(e)
        }
    }
}

/// Leaves a dynamic group: waits for this worker's own work, tells every
/// other member, and marks its record as left.
pub(super) async fn leave(agent: &RpcAgent, timeout: Duration) -> Result<()> {
    let store = agent.store().clone();
    let token = format!("Token_for_{}_leave", agent.name());
    let wait = if timeout.is_zero() {
        Duration::from_secs(3600)
    } else {
        timeout
    };
    take_token(&*store, &token, wait).await?;
    let result = async {
        let deadline = (!timeout.is_zero()).then(|| tokio::time::Instant::now() + timeout);
        agent.wait_quiet(deadline).await?;
        let addr = agent
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        for m in agent.workers() {
            if m.info.name == agent.name() {
                continue;
            }
            let payload = record_payload(agent.name(), agent.rank(), &addr);
            agent
                .call(
                    Dest::Name(m.info.name.clone()),
                    UPDATE_MEMBERSHIP,
                    args![payload, false],
                    CallOptions {
                        timeout: None,
                        ..CallOptions::new(CallKind::Internal)
                    },
                )
                .wait()
                .await?;
        }
        let slot = agent
            .inner
            .member_slot
            .load(std::sync::atomic::Ordering::Acquire);
        if slot != u64::MAX {
            let me = Record {
                name: agent.name().into(),
                rank: agent.rank(),
                addr,
                left: true,
                devices: crate::device::DeviceInfo::default(),
            };
            store
                .set(&format!("rpc/member/{slot}"), &encode_record(&me)?)
                .await
                .map_err(store_err)?;
        }
        Ok(())
    }
    .await;
    let released = release_token(&*store).await;
    result.and(released)
}
