//! [`PrefixStore`]: a namespace inside another store, PyTorch's `PrefixStore`.
//!
//! It owns nothing but the prefix: every key `k` becomes `prefix/k` in the
//! wrapped store, which does all the work (and owns the timeout).

use std::sync::Arc;
use std::time::Duration;

use crate::store::{Result, Store};

/// Wraps an `Arc<dyn Store>` and puts every key under `prefix/`.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Keys `k` become `{prefix}/{k}` in `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        Self {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The wrapped store.
    pub fn underlying_store(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    fn keys(&self, keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| self.key(k)).collect()
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

#[async_trait::async_trait]
impl Store for PrefixStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value).await
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key)).await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta).await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner
            .compare_set(&self.key(key), expected, desired)
            .await
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let keys = self.keys(keys);
        self.inner.wait(&refs(&keys), timeout).await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys = self.keys(keys);
        self.inner.check(&refs(&keys)).await
    }

    async fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.key(key)).await
    }

    async fn num_keys(&self) -> Result<i64> {
        self.inner.num_keys().await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.append(&self.key(key), value).await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        let keys = self.keys(keys);
        self.inner.multi_get(&refs(&keys)).await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        let keys = self.keys(keys);
        self.inner.multi_set(&refs(&keys), values).await
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout);
    }
}
