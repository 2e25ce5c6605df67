//! The [`Store`] trait (PyTorch's c10d `Store` interface) and the crate's
//! [`Error`] type.
//!
//! This module owns the contract every store implements and the error kinds
//! they report; the implementations live in their own modules.

use std::sync::Mutex;
use std::time::Duration;

/// The timeout a store uses when none is given: PyTorch's
/// `Store::kDefaultTimeout`, 300 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Why a store operation (or a rendezvous step built on stores) failed.
///
/// [`Error::python_kind`] names the Python exception PyTorch raises in the
/// same situation, so callers that forward errors across the wire can keep
/// the kind.
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
    /// A system call or socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, and on which address or file.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The peer closed the connection while a reply was expected.
    #[error("store connection to {addr} closed by the peer")]
    ConnectionClosed {
        /// The address of the store server.
        addr: String,
    },
    /// The peer broke the protocol (or a file store holds a corrupt record).
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The caller passed something the store cannot accept (PyTorch's
    /// `ValueError`).
    #[error("{0}")]
    InvalidArgument(String),
    /// A PyTorch `RuntimeError` with its upstream text (for example a missing
    /// `LOCAL_RANK`, or an unknown rendezvous scheme).
    #[error("{0}")]
    Runtime(String),
    /// A PyTorch `AssertionError` with its upstream text.
    #[error("{0}")]
    Assertion(String),
    /// A PyTorch `DistStoreError` with its upstream text (for example the
    /// store-based barrier timing out, or workers not joining a TCP store).
    #[error("{0}")]
    DistStore(String),
}

impl Error {
    /// Builds an [`Error::Io`] with context.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The Python exception class PyTorch raises for this failure:
    /// `"DistStoreError"`, `"DistNetworkError"`, `"ValueError"`,
    /// `"RuntimeError"` or `"AssertionError"`.
    pub fn python_kind(&self) -> &'static str {
        match self {
            Error::Timeout { .. } | Error::Protocol(_) | Error::DistStore(_) => "DistStoreError",
            Error::Io { .. } | Error::ConnectionClosed { .. } => "DistNetworkError",
            Error::InvalidArgument(_) => "ValueError",
            Error::Runtime(_) => "RuntimeError",
            Error::Assertion(_) => "AssertionError",
        }
    }
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
/// - a timeout of zero means "no timeout" (PyTorch's `kNoTimeout`).
///
/// Every method is usable from any tokio runtime; implementations are cheap to
/// share behind an `Arc<dyn Store>`.
///
/// # Errors
/// `get`, `multi_get` and `wait` fail with [`Error::Timeout`] when keys do
/// not appear in time; network stores fail with [`Error::Io`] or
/// [`Error::ConnectionClosed`] when the server is unreachable or goes away,
/// and [`Error::Protocol`] when it answers nonsense; `add` fails with
/// [`Error::InvalidArgument`] on a value that is not a decimal integer (a TCP
/// server closes the connection instead, as PyTorch's does);
/// `multi_set` fails with [`Error::InvalidArgument`] when the slices differ
/// in length.
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

/// A store's default timeout, read and changed through `&self`.
#[derive(Debug)]
pub(crate) struct TimeoutCell(Mutex<Duration>);

impl TimeoutCell {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self(Mutex::new(timeout))
    }

    pub(crate) fn get(&self) -> Duration {
        // A Duration cannot be left half-written: a poisoned lock is fine.
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set(&self, timeout: Duration) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
    }
}

/// The instant `timeout` from now, or `None` for a zero ("no") timeout.
pub(crate) fn deadline_after(timeout: Duration) -> Option<tokio::time::Instant> {
    (!timeout.is_zero()).then(|| tokio::time::Instant::now() + timeout)
}

/// `multi_get` as one `get` per key, for stores without a batched form.
pub(crate) async fn get_each(store: &(impl Store + ?Sized), keys: &[&str]) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        out.push(store.get(key).await?);
    }
    Ok(out)
}

/// Checks that `multi_set` got as many values as keys.
pub(crate) fn check_multi_set(keys: &[&str], values: &[&[u8]]) -> Result<()> {
    if keys.len() == values.len() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "multiSet keys and values vectors must be of same size (got {} keys and {} values)",
            keys.len(),
            values.len()
        )))
    }
}

/// Parses a counter value the way PyTorch's stores do (`std::stoll`): optional
/// leading whitespace, an optional sign, then decimal digits; anything after
/// the digits is ignored.
pub(crate) fn parse_counter(bytes: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(bytes).ok()?;
    let text = text.trim_start();
    let digits_start = usize::from(text.starts_with(['+', '-']));
    let digits_len = text[digits_start..]
        .bytes()
        .take_while(u8::is_ascii_digit)
        .count();
    if digits_len == 0 {
        return None;
    }
    text[..digits_start + digits_len].parse().ok()
}

/// The new counter value after adding `delta` to `current` (absent = 0).
pub(crate) fn add_to_counter(key: &str, current: Option<&[u8]>, delta: i64) -> Result<i64> {
    let base = match current {
        None => 0,
        Some(bytes) => parse_counter(bytes).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "value of key {key:?} is not an integer counter: {:?}",
                String::from_utf8_lossy(bytes)
            ))
        })?,
    };
    base.checked_add(delta).ok_or_else(|| {
        Error::InvalidArgument(format!("add of {delta} to key {key:?} overflows i64"))
    })
}

/// The outcome of compare-and-set on a value that is `current`:
/// `(value to store, if any; value to return)`.
pub(crate) fn compare_set_outcome(
    current: Option<&[u8]>,
    expected: &[u8],
    desired: &[u8],
) -> (Option<Vec<u8>>, Vec<u8>) {
    match current {
        None if expected.is_empty() => (Some(desired.to_vec()), desired.to_vec()),
        None => (None, expected.to_vec()),
        Some(value) if value == expected => (Some(desired.to_vec()), desired.to_vec()),
        Some(value) => (None, value.to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse_like_stoll() {
        assert_eq!(parse_counter(b"42"), Some(42));
        assert_eq!(parse_counter(b"  -7"), Some(-7));
        assert_eq!(parse_counter(b"+3"), Some(3));
        assert_eq!(parse_counter(b"12abc"), Some(12));
        assert_eq!(parse_counter(b"abc"), None);
        assert_eq!(parse_counter(b""), None);
        assert_eq!(parse_counter(b"-"), None);
        assert_eq!(parse_counter(b"99999999999999999999"), None);
    }

    #[test]
    fn add_starts_at_zero_and_rejects_garbage() {
        assert_eq!(add_to_counter("k", None, 5).unwrap(), 5);
        assert_eq!(add_to_counter("k", Some(b"5"), -2).unwrap(), 3);
        assert!(add_to_counter("k", Some(b"x"), 1).is_err());
        assert!(add_to_counter("k", Some(b"9223372036854775807"), 1).is_err());
    }

    #[test]
    fn compare_set_follows_pytorch() {
        assert_eq!(
            compare_set_outcome(None, b"", b"d"),
            (Some(b"d".to_vec()), b"d".to_vec())
        );
        assert_eq!(compare_set_outcome(None, b"e", b"d"), (None, b"e".to_vec()));
        assert_eq!(
            compare_set_outcome(Some(b"e"), b"e", b"d"),
            (Some(b"d".to_vec()), b"d".to_vec())
        );
        assert_eq!(
            compare_set_outcome(Some(b"x"), b"e", b"d"),
            (None, b"x".to_vec())
        );
    }

    #[test]
    fn kinds_name_python_exceptions() {
        let timeout = Error::Timeout {
            keys: vec!["k".into()],
            timeout: Duration::from_secs(1),
        };
        assert!(timeout.to_string().contains("Timeout"));
        assert_eq!(timeout.python_kind(), "DistStoreError");
        assert_eq!(Error::Runtime("x".into()).python_kind(), "RuntimeError");
        assert_eq!(
            Error::InvalidArgument("x".into()).python_kind(),
            "ValueError"
        );
    }
}
