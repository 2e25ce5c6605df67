//! Rendezvous: how workers find their store, rank and world size from an
//! init method URL (`env://`, `tcp://host:port`, `file:///path`), and the
//! store-based barrier, as in `torch.distributed.rendezvous` and
//! `distributed_c10d._store_based_barrier`.
//!
//! This module owns the URL rules and PyTorch's error texts for them; the
//! stores it returns come from `tcp` and `file`. Invariants:
//! - RDV-1: for `tcp://` and `env://`, rank 0 hosts the TCP store server
//!   (sharing one already running in this process on that port) unless
//!   `TORCHELASTIC_USE_AGENT_STORE=True`, in which case every rank, rank 0
//!   included, is a client of the store `torchrun`'s agent hosts.
//! - RDV-2: the returned store's timeout is the rendezvous timeout (PyTorch's
//!   `init_process_group` sets it on the store it got).
//! - RDV-4: under torchrun's agent store, a group restarted after a
//!   failure (`TORCHELASTIC_RESTART_COUNT` above 0) keys everything under
//!   `/worker/attempt_{N}` (as PyTorch's `_create_c10d_store` did before
//!   torchrun made a new store per attempt, which its `--standalone` agent
//!   does not): the keys of a failed round, left in the agent's store,
//!   never meet the next round's.
//! - RDV-3: the barrier's key is `store_based_barrier_key:{group_name}`; the
//!   worker that completes the count sets `{key}:last_worker` and everyone
//!   waits for that key.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::env::{EnvLookup, parse_int, process_env};
use crate::file::FileStore;
use crate::prefix::PrefixStore;
use crate::store::{Error, Result, Store};
use crate::tcp::{TcpStore, TcpStoreOptions};

/// PyTorch's `default_pg_timeout`: 30 minutes.
pub const DEFAULT_PG_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The prefix of the barrier's key (PyTorch's `STORE_BASED_BARRIER_PREFIX`).
pub const STORE_BASED_BARRIER_PREFIX: &str = "store_based_barrier_key";

/// What [`rendezvous`] returns: the shared store, this worker's rank and the
/// world size (-1 when the world size is dynamic).
pub type RendezvousResult = (Arc<dyn Store>, i64, i64);

/// Resolves an init method URL into a store, a rank and a world size
/// (PyTorch's `rendezvous(url, rank, world_size)` followed by
/// `store.set_timeout(timeout)`). Pass -1 for a rank or world size the URL or
/// environment provides.
///
/// - `env://`: `RANK`, `WORLD_SIZE` (unless given), `MASTER_ADDR`,
///   `MASTER_PORT`;
/// - `tcp://host:port?rank=r&world_size=n` (rank and world size may be given
///   as arguments instead);
/// - `file:///path?rank=r&world_size=n`, likewise.
///
/// The `use_libuv` query parameter is accepted and ignored (there is one
/// server implementation). As in PyTorch, rank 0's store owns the server it
/// started: keep it until every rank is done with the store. With a world
/// size, rank 0 returns only once every rank has connected (PyTorch's
/// `wait_for_workers`), so start all ranks concurrently.
///
/// # Errors
/// PyTorch's texts: [`Error::InvalidArgument`] (`ValueError`) such as
/// "Error initializing torch.distributed using env:// rendezvous: environment
/// variable RANK expected, but not set"; [`Error::Runtime`] "No rendezvous
/// handler for {scheme}://"; [`Error::Assertion`] when the URL and the
/// arguments both give a rank or world size; store errors from connecting.
pub async fn rendezvous(
    url: &str,
    rank: i64,
    world_size: i64,
    timeout: Duration,
) -> Result<RendezvousResult> {
    rendezvous_with(url, rank, world_size, timeout, &process_env).await
}

/// [`rendezvous`] reading environment variables through `env`.
///
/// # Errors
/// As [`rendezvous`].
pub async fn rendezvous_with(
    url: &str,
    rank: i64,
    world_size: i64,
    timeout: Duration,
    env: EnvLookup<'_>,
) -> Result<RendezvousResult> {
    let parsed = Url::parse(url);
    let mut query = parsed.query_pairs()?;
    if rank != -1 || world_size != -1 {
        if query.iter().any(|(k, _)| k == "rank" || k == "world_size") {
            return Err(Error::Assertion(format!(
                "The url: {url} has node-specific arguments(rank, world_size) already."
            )));
        }
        if rank != -1 {
            query.push(("rank".into(), rank.to_string()));
        }
        if world_size != -1 {
            query.push(("world_size".into(), world_size.to_string()));
        }
    }
    let get = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let (store, rank, world_size): RendezvousResult = match parsed.scheme.as_str() {
        "file" => {
            let error = |msg: &str| rendezvous_error("file", msg);
            if parsed.path.is_empty() {
                return Err(error("path missing"));
            }
            let (rank, world_size) = rank_and_world_size(&get, error)?;
            let store = FileStore::new(&parsed.path, usize::try_from(world_size).ok());
            (Arc::new(store), rank, world_size)
        }
        "tcp" => {
            let error = |msg: &str| rendezvous_error("tcp", msg);
            let port = parsed.port()?.ok_or_else(|| error("port number missing"))?;
            let (rank, world_size) = rank_and_world_size(&get, error)?;
            let host = parsed
                .hostname()
                .ok_or_else(|| Error::Assertion("hostname cannot be None".into()))?;
            let store = create_c10d_store(&host, port, rank, world_size, timeout, env).await?;
            (store, rank, world_size)
        }
        "env" => {
            let env_error = |var: &str| {
                rendezvous_error(
                    "env",
                    &format!("environment variable {var} expected, but not set"),
                )
            };
            // Python's `if not env_val`: empty counts as unset.
            let var = |name: &str| {
                env(name)
                    .filter(|v| !v.is_empty())
                    .ok_or_else(|| env_error(name))
            };
            let rank = match get("rank") {
                Some(rank) => parse_int(&rank)?,
                None => parse_int(&var("RANK")?)?,
            };
            let world_size = match get("world_size") {
                Some(n) => parse_int(&n)?,
                None => parse_int(&var("WORLD_SIZE")?)?,
            };
            let master_addr = var("MASTER_ADDR")?;
            let master_port = parse_int(&var("MASTER_PORT")?)?;
            let store =
                create_c10d_store(&master_addr, master_port, rank, world_size, timeout, env)
                    .await?;
            (store, rank, world_size)
        }
        other => {
            return Err(Error::Runtime(format!(
                "No rendezvous handler for {other}://"
            )));
        }
    };
    store.set_timeout(timeout);
    Ok((store, rank, world_size))
}

/// The `rank` and `world_size` query parameters `file://` and `tcp://`
/// require.
fn rank_and_world_size(
    get: &impl Fn(&str) -> Option<String>,
    error: impl Fn(&str) -> Error,
) -> Result<(i64, i64)> {
    let rank = get("rank").ok_or_else(|| error("rank parameter missing"))?;
    let world_size = get("world_size").ok_or_else(|| error("world size parameter missing"))?;
    Ok((parse_int(&rank)?, parse_int(&world_size)?))
}

fn rendezvous_error(scheme: &str, msg: &str) -> Error {
    Error::InvalidArgument(format!(
        "Error initializing torch.distributed using {scheme}:// rendezvous: {msg}"
    ))
}

/// Whether `torchrun`'s agent hosts the store (RDV-1).
fn use_agent_store(env: EnvLookup<'_>) -> bool {
    env("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True")
}

/// PyTorch's `_create_c10d_store` (RDV-1).
async fn create_c10d_store(
    host: &str,
    port: i64,
    rank: i64,
    world_size: i64,
    timeout: Duration,
    env: EnvLookup<'_>,
) -> Result<Arc<dyn Store>> {
    let port = u16::try_from(port).map_err(|_| {
        Error::InvalidArgument(format!(
            "port must have value from 0 to 65535 but was {port}."
        ))
    })?;
    let options = TcpStoreOptions {
        timeout,
        world_size: usize::try_from(world_size).ok(),
        wait_for_workers: true,
    };
    if use_agent_store(env) {
        let store: Arc<dyn Store> = Arc::new(TcpStore::connect(host, port, options).await?);
        // RDV-4.
        return Ok(
            match env("TORCHELASTIC_RESTART_COUNT").map(|n| parse_int(&n)) {
                Some(Ok(attempt)) if attempt > 0 => Arc::new(PrefixStore::new(
                    format!("/worker/attempt_{attempt}"),
                    store,
                )),
                Some(Err(e)) => return Err(e),
                _ => store,
            },
        );
    }
    let store = if rank != 0 {
        TcpStore::connect(host, port, options).await?
    } else {
        TcpStore::start_master(host, port, options).await?
    };
    Ok(Arc::new(store))
}

/// Waits until `rendezvous_count` workers have reached the barrier named
/// `group_name`, PyTorch's `_store_based_barrier` step for step (RDV-3).
///
/// Each worker adds 1 to `store_based_barrier_key:{group_name}`; the one
/// that brings it to `rendezvous_count` sets `{key}:last_worker`; everyone
/// waits for that key in slices of `logging_interval` (raised, as upstream,
/// to at least 10 s + 1 s per thousand workers), re-reading the count after
/// each slice, until `timeout` has passed.
///
/// # Errors
/// [`Error::DistStore`] with "Timed out initializing process group in store
/// based barrier on rank {rank}, for key: {key} (world_size={n},
/// num_workers_joined={k}, timeout={timeout} error={e})", the timeout shown as
/// Python prints a `timedelta`; store errors from `add` and `set`.
pub async fn store_based_barrier(
    store: &dyn Store,
    rank: i64,
    group_name: &str,
    rendezvous_count: i64,
    timeout: Duration,
    logging_interval: Duration,
) -> Result<()> {
    let store_key = format!("{STORE_BASED_BARRIER_PREFIX}:{group_name}");
    store.add(&store_key, 1).await?;
    tracing::debug!(%store_key, rank, "added key to store");

    let world_size = rendezvous_count;
    let mut worker_count = store.add(&store_key, 0).await?;
    let last_worker_key = format!("{store_key}:last_worker");
    if worker_count == world_size {
        store.set(&last_worker_key, b"1").await?;
    }

    let floor =
        Duration::from_secs(10) + Duration::from_secs_f64(world_size.max(0) as f64 / 1000.0);
    let logging_interval = logging_interval.max(floor);

    let start = Instant::now();
    loop {
        match store.wait(&[&last_worker_key], logging_interval).await {
            Ok(()) => break,
            Err(e) => {
                worker_count = store.add(&store_key, 0).await?;
                tracing::debug!(
                    elapsed = ?start.elapsed(),
                    rank,
                    %store_key,
                    world_size,
                    worker_count,
                    ?timeout,
                    error = %e,
                    "waiting in store based barrier to initialize process group"
                );
                if start.elapsed() > timeout {
                    return Err(Error::DistStore(format!(
                        "Timed out initializing process group in store based barrier on rank {rank}, for key: {store_key} (world_size={world_size}, num_workers_joined={worker_count}, timeout={} error={e})",
                        format_timedelta(timeout)
                    )));
                }
            }
        }
    }
    tracing::info!(rank, %store_key, world_size, "completed store-based barrier");
    Ok(())
}

/// Formats a duration as Python's `str(timedelta)`: `0:00:03`,
/// `0:00:01.500000`, `1 day, 2:03:04`, `2 days, 0:00:00`.
pub(crate) fn format_timedelta(d: Duration) -> String {
    let total = d.as_secs();
    let (days, rest) = (total / 86_400, total % 86_400);
    let (h, m, s) = (rest / 3600, rest % 3600 / 60, rest % 60);
    let micros = d.subsec_micros();
    let mut out = String::new();
    if days > 0 {
        out.push_str(&format!("{days} day{}, ", if days == 1 { "" } else { "s" }));
    }
    out.push_str(&format!("{h}:{m:02}:{s:02}"));
    if micros > 0 {
        out.push_str(&format!(".{micros:06}"));
    }
    out
}

/// The pieces of a URL that rendezvous needs, split as Python's `urlparse`
/// splits them.
#[derive(Debug, Default, PartialEq, Eq)]
struct Url {
    scheme: String,
    netloc: String,
    path: String,
    query: String,
}

impl Url {
    fn parse(url: &str) -> Self {
        let (scheme, rest) = match url.split_once(':') {
            Some((scheme, rest))
                if !scheme.is_empty()
                    && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                    && scheme
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
            {
                (scheme.to_ascii_lowercase(), rest)
            }
            _ => (String::new(), url),
        };
        let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (netloc, path) = match rest.strip_prefix("//") {
            Some(after) => match after.find('/') {
                Some(i) => (&after[..i], &after[i..]),
                None => (after, ""),
            },
            None => ("", rest),
        };
        Self {
            scheme,
            netloc: netloc.to_owned(),
            path: path.to_owned(),
            query: query.to_owned(),
        }
    }

    /// PyTorch's `_query_to_dict`, keeping order.
    fn query_pairs(&self) -> Result<Vec<(String, String)>> {
        self.query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|pair| {
                let mut parts = pair.split('=');
                match (parts.next(), parts.next()) {
                    (Some(k), Some(v)) => Ok((k.to_owned(), v.to_owned())),
                    _ => Err(Error::InvalidArgument(format!(
                        "malformed query parameter {pair:?} in rendezvous URL"
                    ))),
                }
            })
            .collect()
    }

    /// `host[:port]` without user info.
    fn host_port(&self) -> (&str, Option<&str>) {
        let hostport = self
            .netloc
            .rsplit_once('@')
            .map_or(&*self.netloc, |(_, h)| h);
        if let Some(rest) = hostport.strip_prefix('[') {
            return match rest.split_once(']') {
                Some((host, after)) => (host, after.strip_prefix(':')),
                None => (rest, None),
            };
        }
        match hostport.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (hostport, None),
        }
    }

    /// Python's `urlparse(url).hostname` (lowercased; `None` if empty).
    fn hostname(&self) -> Option<String> {
        let (host, _) = self.host_port();
        (!host.is_empty()).then(|| host.to_ascii_lowercase())
    }

    /// Python's `urlparse(url).port`.
    fn port(&self) -> Result<Option<i64>> {
        match self.host_port().1 {
            None | Some("") => Ok(None),
            Some(port) => {
                let value = port
                    .parse::<i64>()
                    .ok()
                    .filter(|_| port.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "Port could not be cast to integer value as '{port}'"
                        ))
                    })?;
                if !(0..=65535).contains(&value) {
                    return Err(Error::InvalidArgument("Port out of range 0-65535".into()));
                }
                Ok(Some(value))
            }
        }
    }
}

/// The store of a dynamic group (no world size), as PyTorch's
/// `_create_store_from_options` makes it for `init_rpc(world_size=None)`:
/// [`rendezvous`] requires a world size, so for `tcp://HOST:PORT` rank 0
/// hosts the store and the others connect to it (every rank connects when
/// a launcher hosts it, `TORCHELASTIC_USE_AGENT_STORE=True`, as `wasmrpc
/// launch` does), and `file:///PATH` is a [`FileStore`] on that file.
/// Other init methods go through [`rendezvous`].
///
/// # Errors
/// A malformed URL (`InvalidArgument`), or the store cannot be hosted or
/// reached in `timeout`.
pub async fn dynamic_store(url: &str, rank: u32, timeout: Duration) -> Result<Arc<dyn Store>> {
    if let Some(addr) = url.strip_prefix("tcp://") {
        let Some((host, port)) = addr.rsplit_once(':') else {
            return Err(Error::InvalidArgument(format!(
                "{url}: no port (expected tcp://HOST:PORT)"
            )));
        };
        let port: u16 = port
            .parse()
            .map_err(|_| Error::InvalidArgument(format!("{url}: bad port {port:?}")))?;
        let options = TcpStoreOptions {
            timeout,
            world_size: None,
            wait_for_workers: false,
        };
        let agent_store = process_env("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True");
        let store = if rank == 0 && !agent_store {
            TcpStore::start_master(host, port, options).await?
        } else {
            TcpStore::connect(host, port, options).await?
        };
        return Ok(Arc::new(store));
    }
    if let Some(path) = url.strip_prefix("file://") {
        let store = FileStore::new(path, None);
        store.set_timeout(timeout);
        return Ok(Arc::new(store));
    }
    let (store, _, _) = rendezvous(url, i64::from(rank), -1, timeout).await?;
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_like_urlparse() {
        let u = Url::parse("tcp://127.0.0.1:29500?rank=0&world_size=2");
        assert_eq!(u.scheme, "tcp");
        assert_eq!(u.hostname().as_deref(), Some("127.0.0.1"));
        assert_eq!(u.port().unwrap(), Some(29500));
        assert_eq!(
            u.query_pairs().unwrap(),
            vec![
                ("rank".into(), "0".into()),
                ("world_size".into(), "2".into())
            ]
        );
        let f = Url::parse("file:///tmp/x y?rank=1");
        assert_eq!((f.netloc.as_str(), f.path.as_str()), ("", "/tmp/x y"));
        let v6 = Url::parse("tcp://[::1]:80");
        assert_eq!(v6.hostname().as_deref(), Some("::1"));
        assert_eq!(v6.port().unwrap(), Some(80));
        assert_eq!(Url::parse("env://").scheme, "env");
        assert_eq!(Url::parse("tcp://host").port().unwrap(), None);
        assert!(Url::parse("tcp://host:x").port().is_err());
        assert!(Url::parse("tcp://host:70000").port().is_err());
    }

    #[test]
    fn timedeltas_print_like_python() {
        assert_eq!(format_timedelta(Duration::from_secs(3)), "0:00:03");
        assert_eq!(
            format_timedelta(Duration::from_millis(1500)),
            "0:00:01.500000"
        );
        assert_eq!(format_timedelta(Duration::from_secs(1800)), "0:30:00");
        assert_eq!(
            format_timedelta(Duration::from_secs(86_400 + 3723)),
            "1 day, 1:02:03"
        );
        assert_eq!(
            format_timedelta(Duration::from_secs(2 * 86_400)),
            "2 days, 0:00:00"
        );
    }
}
