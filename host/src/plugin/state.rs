//! Per-worker plugin state: the globals and named locks of the seeds'
//! module-level variables, one set per agent and per plugin.
//!
//! Both live in the agent ([`crate::RpcAgent::state`]), so every instance
//! and every call of a plugin on that worker sees the same values, and two
//! agents of one process (the test harness) never share them. Keys are
//! scoped by plugin namespace, as Python's globals are by module, and by
//! version when a worker holds several (`versions`: a version's *scope*).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

use crate::agent::Future;
use crate::value::Payload;

type Key = (String, String);

fn key(namespace: &str, name: &str) -> Key {
    (namespace.to_owned(), name.to_owned())
}

/// A worker's plugin globals: `(plugin, key)` → value (tensors included,
/// held by reference, as a Python global holds a tensor).
#[derive(Default)]
pub(crate) struct Globals {
    values: Mutex<HashMap<Key, Payload>>,
}

impl Globals {
    /// The value of `name`, if set.
    pub(crate) fn get(&self, namespace: &str, name: &str) -> Option<Payload> {
        self.values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key(namespace, name))
            .cloned()
    }

    /// Clears every global of `namespace` (a scope: an unloaded version's).
    pub(crate) fn clear_scope(&self, namespace: &str) {
        self.values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(ns, _), _| ns != namespace);
    }

    /// Sets `name`; `None` clears it.
    pub(crate) fn set(&self, namespace: &str, name: &str, value: Option<Payload>) {
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        match value {
            Some(v) => {
                values.insert(key(namespace, name), v);
            }
            None => {
                values.remove(&key(namespace, name));
            }
        }
    }
}

/// A worker's named plugin futures: one call completes what other calls
/// wait on (the batching of PyTorch's batch-RPC tutorial keeps such a
/// future in an object attribute). Completed futures stay until a call
/// takes their name.
#[derive(Default)]
pub(crate) struct SharedFutures {
    futures: Mutex<HashMap<Key, Future>>,
}

impl SharedFutures {
    /// The future named `name`, created unset on first use; `take` forgets
    /// the name, so the next use creates a new future.
    pub(crate) fn get(&self, namespace: &str, name: &str, take: bool) -> Future {
        let mut futures = self.futures.lock().unwrap_or_else(|p| p.into_inner());
        let k = key(namespace, name);
        if take {
            futures.remove(&k).unwrap_or_default()
        } else {
            futures.entry(k).or_default().clone()
        }
    }
}

/// A worker's named plugin locks. A lock is a one-permit semaphore whose
/// permit the holder keeps until [`Locks::release`].
#[derive(Default)]
pub(crate) struct Locks {
    locks: Mutex<HashMap<Key, Arc<Semaphore>>>,
}

impl Locks {
    fn semaphore(&self, namespace: &str, name: &str) -> Arc<Semaphore> {
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key(namespace, name))
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone()
    }

    /// Takes the lock, waiting (without a thread) until it is free.
    pub(crate) async fn acquire(&self, namespace: &str, name: &str) {
        let semaphore = self.semaphore(namespace, name);
        // The semaphore is never closed, so acquiring cannot fail.
        if let Ok(permit) = semaphore.acquire().await {
            permit.forget();
        }
    }

    /// Gives the lock back. Only its holder may call this (the caller keeps
    /// track, see `GuestCall`).
    pub(crate) fn release(&self, namespace: &str, name: &str) {
        self.semaphore(namespace, name).add_permits(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lock_excludes_until_released() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        rt.block_on(async {
            let locks = Locks::default();
            locks.acquire("p", "k").await;
            let second = tokio::time::timeout(Duration::from_millis(20), locks.acquire("p", "k"));
            assert!(second.await.is_err(), "a held lock was taken twice");
            locks.acquire("other", "k").await;
            locks.release("p", "k");
            tokio::time::timeout(Duration::from_secs(5), locks.acquire("p", "k"))
                .await
                .expect("a released lock is free");
        });
    }

    #[test]
    fn a_shared_future_is_one_future_until_taken() {
        let futures = SharedFutures::default();
        let waiter = futures.get("p", "batch", false);
        let other_plugin = futures.get("q", "batch", false);
        let completer = futures.get("p", "batch", true);
        completer.set_result(7).expect("an unset future completes");
        assert_eq!(waiter.try_value().unwrap().unwrap().as_int().unwrap(), 7);
        assert!(!other_plugin.done(), "plugins share no futures");
        assert!(
            !futures.get("p", "batch", false).done(),
            "a taken name starts a new future"
        );
    }

    #[test]
    fn globals_are_scoped_by_plugin() {
        let g = Globals::default();
        g.set("a", "x", Some(Payload::from(1)));
        assert_eq!(g.get("a", "x").unwrap().as_int().unwrap(), 1);
        assert!(g.get("b", "x").is_none());
        g.set("a", "x", None);
        assert!(g.get("a", "x").is_none());
    }
}
