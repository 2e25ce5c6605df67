//! [`HashStore`]: an in-process store, PyTorch's `HashStore`.
//!
//! It owns a map behind a mutex and a [`Notify`] that every mutation fires,
//! so `get` and `wait` sleep until something changes instead of polling.
//! It is for workers that share one process (threads, tests).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::store::{
    DEFAULT_TIMEOUT, Error, Result, Store, TimeoutCell, add_to_counter, check_multi_set,
    compare_set_outcome, deadline_after, get_each,
};

/// An in-memory c10d store shared by the tasks and threads of one process.
///
/// Cheap to share behind an `Arc`; waits are event-driven.
#[derive(Debug)]
pub struct HashStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Notify,
    timeout: TimeoutCell,
}

impl Default for HashStore {
    fn default() -> Self {
        Self::new()
    }
}

impl HashStore {
    /// An empty store with the default timeout (300 s).
    pub fn new() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            timeout: TimeoutCell::new(DEFAULT_TIMEOUT),
        }
    }

    /// Every key and its value, sorted by key: what anyone who reaches the
    /// store can read (tests check that no secret is among them).
    pub fn entries(&self) -> Vec<(String, Vec<u8>)> {
        let mut all: Vec<_> = self
            .map()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.sort();
        all
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A poisoned lock only means another thread panicked while holding
        // it; every update below is a single map operation, so the map is
        // still consistent.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies `f` to the map and wakes every waiter.
    fn mutate<T>(&self, f: impl FnOnce(&mut HashMap<String, Vec<u8>>) -> T) -> T {
        let out = f(&mut self.map());
        self.changed.notify_waiters();
        out
    }

    async fn wait_for(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = deadline_after(timeout);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Register before checking, so a change between the check and the
            // await is not missed.
            notified.as_mut().enable();
            let missing: Vec<String> = {
                let map = self.map();
                keys.iter()
                    .filter(|k| !map.contains_key(**k))
                    .map(|k| (*k).to_owned())
                    .collect()
            };
            if missing.is_empty() {
                return Ok(());
            }
            match deadline {
                None => notified.await,
                Some(deadline) => {
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return Err(Error::Timeout {
                            keys: missing,
                            timeout,
                        });
                    }
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl Store for HashStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.mutate(|m| m.insert(key.to_owned(), value.to_vec()));
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.wait_for(&[key], self.timeout()).await?;
        self.map()
            .get(key)
            .cloned()
            // Deleted between the wait and the read: report it as missing.
            .ok_or_else(|| Error::Timeout {
                keys: vec![key.to_owned()],
                timeout: self.timeout(),
            })
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.mutate(|m| {
            let new = add_to_counter(key, m.get(key).map(Vec::as_slice), delta)?;
            m.insert(key.to_owned(), new.to_string().into_bytes());
            Ok(new)
        })
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        Ok(self.mutate(|m| {
            let (store, ret) =
                compare_set_outcome(m.get(key).map(Vec::as_slice), expected, desired);
            if let Some(value) = store {
                m.insert(key.to_owned(), value);
            }
            ret
        }))
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_for(keys, timeout).await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let map = self.map();
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        Ok(self.mutate(|m| m.remove(key).is_some()))
    }

    async fn num_keys(&self) -> Result<i64> {
        Ok(i64::try_from(self.map().len()).unwrap_or(i64::MAX))
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.mutate(|m| {
            m.entry(key.to_owned())
                .or_default()
                .extend_from_slice(value)
        });
        Ok(())
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        get_each(self, keys).await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        check_multi_set(keys, values)?;
        self.mutate(|m| {
            for (k, v) in keys.iter().zip(values) {
                m.insert((*k).to_owned(), v.to_vec());
            }
        });
        Ok(())
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout);
    }
}
