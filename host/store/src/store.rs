//! The [`Store`] trait: PyTorch's c10d `Store` interface.

use std::time::Duration;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `get` or `wait` outlived its timeout. The text contains "Timeout",
    /// as PyTorch's does.
    #[error("Timeout waiting for key(s) {keys:?} after {timeout:?}")]
    Timeout {
        /// The keys that were still missing.
        keys: Vec<String>,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The connection to the store failed or was closed.
    #[error("store connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The caller passed something the store cannot accept.
    #[error("{0}")]
    InvalidArgument(String),
}

/// The result of a store operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A c10d key-value store.
///
/// Semantics follow PyTorch's `torch.distributed.Store`:
/// - `get` waits until the key exists or the store's timeout passes;
/// - `add` is an atomic counter (a missing key starts at 0, so `add(k, 0)`
///   is an atomic read) stored as the decimal text of the number;
/// - `compare_set(k, expected, desired)` sets `desired` when the current
///   value equals `expected`, or when the key is absent and `expected` is
///   empty, and returns the value the key then holds (or `expected` if the
///   key is absent and nothing was set).
///
/// Every method is usable from any tokio runtime; implementations are cheap to
/// share behind an `Arc`.
#[async_trait::async_trait]
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Sets `key` to `value`, waking everyone waiting for it.
    async fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Returns the value of `key`, waiting up to the store's timeout for it.
    async fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Adds `delta` to the counter at `key` and returns the new value.
    async fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Atomic compare-and-set; see the trait docs for the absent-key rules.
    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Waits until every key exists, or fails with [`Error::Timeout`].
    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Tells whether every key exists, without waiting.
    async fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Deletes `key`; tells whether it existed.
    async fn delete_key(&self, key: &str) -> Result<bool>;
    /// The number of keys in the store.
    async fn num_keys(&self) -> Result<i64>;
    /// Appends `value` to the bytes at `key` (creating it if absent).
    async fn append(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Gets every key, waiting for each as `get` does.
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>>;
    /// Sets every key to its value.
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()>;
    /// The timeout `get` and `wait` use when none is given.
    fn timeout(&self) -> Duration;
    /// Changes the timeout `get` and `wait` use when none is given.
    fn set_timeout(&self, timeout: Duration);
}
