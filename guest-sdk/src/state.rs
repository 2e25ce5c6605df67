//! Per-worker state that outlives a call: globals (the seeds' module-level
//! variables), named locks, sleeping and logging.
//!
//! Globals live in the host, not in the guest's memory, because stateless
//! functions run on whichever pooled instance is free.

use crate::Result;
use crate::convert::{FromValue, ToValue};
use crate::host;
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{HostCall, LogLevel};

/// Reads the worker-global `key`; `None` when unset.
///
/// # Errors
/// A `TypeError` if the global is not a `T`.
pub fn global<T: FromValue>(key: &str) -> Result<Option<T>> {
    match host::value(&HostCall::GlobalGet(key.to_owned()))? {
        Value::None => Ok(None),
        v => T::from_value(v).map(Some),
    }
}

/// Sets the worker-global `key`; the host keeps the tensors it names.
///
/// # Errors
/// A `RuntimeError` from the host.
pub fn set_global(key: &str, value: impl ToValue) -> Result<()> {
    host::unit(&HostCall::GlobalSet(key.to_owned(), value.to_value()))
}

/// Clears the worker-global `key`.
///
/// # Errors
/// A `RuntimeError` from the host.
pub fn clear_global(key: &str) -> Result<()> {
    host::unit(&HostCall::GlobalSet(key.to_owned(), Value::None))
}

/// A held per-worker named lock; released on drop.
#[derive(Debug)]
#[must_use = "the lock is released when the guard is dropped"]
pub struct LockGuard {
    key: String,
}

/// Takes the per-worker lock `key`, waiting (without holding a host thread)
/// until it is free. Locks a call still holds when it ends are released by
/// the runtime.
///
/// # Errors
/// A `RuntimeError` from the host.
pub fn lock(key: &str) -> Result<LockGuard> {
    host::unit(&HostCall::Lock(key.to_owned()))?;
    Ok(LockGuard {
        key: key.to_owned(),
    })
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // Unlocking a lock this call holds cannot fail.
        let _ = host::unit(&HostCall::Unlock(core::mem::take(&mut self.key)));
    }
}

/// Sleeps for `seconds` (`time.sleep`), holding no host thread.
///
/// # Errors
/// A `RuntimeError` from the host.
pub fn sleep(seconds: f64) -> Result<()> {
    host::unit(&HostCall::Sleep(seconds))
}

/// Logs a line at info level (the seeds' `print`).
pub fn log(message: &str) {
    // Logging is best-effort.
    let _ = host::unit(&HostCall::Log(LogLevel::Info, message.to_owned()));
}

/// Logs a line at `level`.
pub fn log_at(level: LogLevel, message: &str) {
    // Logging is best-effort.
    let _ = host::unit(&HostCall::Log(level, message.to_owned()));
}
