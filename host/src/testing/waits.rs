//! Waiting in tests: store barriers, and polls of a worker's debug info or
//! RRef counters until a condition holds, failing with the seeds' texts.

use std::time::Duration;

use crate::store::Store;
use crate::{Error, NOOP, Remote, Result, RpcAgent, args};

/// A barrier of `n` participants through `store` under `key`.
///
/// # Errors
/// Store errors (e.g. a timeout).
pub async fn store_barrier(store: &dyn Store, key: &str, n: u32) -> Result<()> {
    let store_err = |e: crate::store::Error| Error::runtime(e.to_string());
    let arrived = store
        .add(&format!("{key}/arrived"), 1)
        .await
        .map_err(store_err)?;
    let done = format!("{key}/done");
    if arrived >= i64::from(n) {
        store.set(&done, b"1").await.map_err(store_err)?;
    }
    store
        .wait(&[done.as_str()], store.timeout())
        .await
        .map_err(store_err)
}

/// Polls `agent`'s debug info every 10 ms until `done` holds, or fails with
/// `what` and the last debug info after `timeout`.
///
/// # Errors
/// A `ValueError` naming `what` on timeout.
pub async fn wait_until_debug_info(
    agent: &RpcAgent,
    what: &str,
    timeout: Duration,
    done: impl Fn(&std::collections::BTreeMap<String, String>) -> bool,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let info = agent.get_debug_info();
        if done(&info) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::value(format!(
                "Timed out waiting for {what}: {info:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Calls the no-op function on `rank` every 100 ms until a call fails with
/// an error containing `needle` (the seeds' `wait_until_node_failure`).
///
/// # Errors
/// The error that matched.
pub async fn wait_until_node_failure(agent: &RpcAgent, rank: u32, needle: &str) -> Error {
    loop {
        match agent
            .rpc_sync_with_timeout(rank, NOOP, args![], Duration::from_secs(5))
            .await
        {
            Err(e) if e.message().contains(needle) || e.to_string().contains(needle) => return e,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The seeds' text when pending RRef futures and users do not flush.
pub fn pending_not_flushed_message(futures: &str, users: &str) -> String {
    format!(
        "Timed out waiting to flush pending futures and users, had {futures} pending futures and {users} pending users"
    )
}

/// Polls this worker's RRef debug info until `num_pending_futures` and
/// `num_pending_users` are both zero (the seeds'
/// `wait_until_pending_futures_and_users_flushed`, default timeout 20 s).
///
/// # Errors
/// `ValueError` "Timed out waiting to flush pending futures and users, had
/// {f} pending futures and {u} pending users".
pub async fn wait_until_pending_futures_and_users_flushed(
    agent: &RpcAgent,
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let info = agent.rref_context_debug_info();
        let get = |k: &str| info.get(k).cloned().unwrap_or_else(|| "?".into());
        let (f, u) = (get("num_pending_futures"), get("num_pending_users"));
        if f == "0" && u == "0" {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::value(pending_not_flushed_message(&f, &u)));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls worker `rank`'s RRef debug info once a second (through an RPC with
/// a 5 s timeout) until it has `num_owners` owner RRefs and `num_forks`
/// forks (the seeds' `wait_until_owners_and_forks_on_rank`, default
/// timeout 20 s).
///
/// # Errors
/// `ValueError` "Timed out waiting {timeout} sec for {owners} owners and
/// {forks} forks on rank, had {o} owners and {f} forks".
pub async fn wait_until_owners_and_forks_on_rank(
    agent: &RpcAgent,
    num_owners: usize,
    num_forks: usize,
    rank: u32,
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let (mut owners, mut forks) = (String::from("?"), String::from("?"));
    loop {
        let r = agent
            .rpc_sync_with_timeout(
                rank,
                crate::rref_debug_info_function(),
                args![],
                Duration::from_secs(5),
            )
            .await?;
        for (k, v) in r.entries()? {
            match k.as_str()? {
                "num_owner_rrefs" => owners = v.as_str()?.to_string(),
                "num_forks" => forks = v.as_str()?.to_string(),
                _ => {}
            }
        }
        if owners == num_owners.to_string() && forks == num_forks.to_string() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::value(format!(
                "Timed out waiting {} sec for {num_owners} owners and {num_forks} forks on rank, had {owners} owners and {forks} forks",
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
