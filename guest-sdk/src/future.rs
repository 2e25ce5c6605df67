//! [`Future`]: a handle to a future held by the host, as returned by
//! [`rpc_async`](crate::rpc_async) or made with [`Future::new`].

use crate::convert::{AnyValue, FromValue, IntoValue, ToArgs, ToValue};
use crate::host;
use crate::{Error, Result};
use wasmrpc_abi::protocol::{HandleKind, HostCall};

/// A future held by the host (PyTorch's `torch.futures.Future`).
///
/// Waiting holds no host thread: the guest is suspended while the host
/// awaits. Return one from an `#[remote(async_execution)]` function and the
/// call completes when it does.
#[derive(Debug)]
pub struct Future {
    handle: u32,
}

impl Future {
    /// A new, unset future (`torch.futures.Future()`).
    ///
    /// # Errors
    /// A `RuntimeError` from the host.
    pub fn new() -> Result<Future> {
        host::handle(&HostCall::FutureNew).map(Future::from_raw)
    }

    // --- Worker-wide named futures (examples' batching, issue 10) ---
    /// The worker-wide future named `key` (one per plugin and worker),
    /// created unset on first use: every call that asks for `key` gets the
    /// same future until a call takes it with [`Future::take_shared`]. One
    /// call completes it and every call waiting on it (or returning a
    /// `then` of it from an `async_execution` function) resumes; this is
    /// how PyTorch's batch-RPC tutorial answers a whole batch at once.
    ///
    /// # Errors
    /// A `RuntimeError` from a host without worker-wide futures.
    pub fn shared(key: &str) -> Result<Future> {
        host::handle(&HostCall::FutureShared {
            key: key.to_owned(),
            take: false,
        })
        .map(Future::from_raw)
    }

    /// Like [`Future::shared`], and forgets the name: the next use of `key`
    /// creates a new future. The handles other calls hold stay valid.
    ///
    /// # Errors
    /// A `RuntimeError` from a host without worker-wide futures.
    pub fn take_shared(key: &str) -> Result<Future> {
        host::handle(&HostCall::FutureShared {
            key: key.to_owned(),
            take: true,
        })
        .map(Future::from_raw)
    }
    // --- end of worker-wide named futures ---

    /// Wraps a raw handle the guest owns.
    pub fn from_raw(handle: u32) -> Future {
        Future { handle }
    }

    /// Gives up the handle without releasing it.
    pub fn into_raw(self) -> u32 {
        let h = self.handle;
        core::mem::forget(self);
        h
    }

    /// The raw handle, still owned by `self`.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Waits for the result (`fut.wait()`).
    ///
    /// # Errors
    /// The error the future completed with, kind and message unchanged, or a
    /// `TypeError` if the value is not a `T`.
    pub fn wait<T: FromValue>(&self) -> Result<T> {
        T::from_value(host::value(&HostCall::FutureWait(self.handle))?)
    }

    /// Whether the future has completed (`fut.done()`).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn done(&self) -> Result<bool> {
        host::flag(&HostCall::FutureDone(self.handle))
    }

    /// Completes the future with a value (`fut.set_result(v)`).
    ///
    /// # Errors
    /// A `RuntimeError` if the future is already complete.
    pub fn set_result(&self, value: impl ToValue) -> Result<()> {
        host::unit(&HostCall::FutureSet {
            future: self.handle,
            result: Ok(value.to_value()),
        })
    }

    /// Completes the future with an error (`fut.set_exception(e)`).
    ///
    /// # Errors
    /// A `RuntimeError` if the future is already complete.
    pub fn set_error(&self, error: Error) -> Result<()> {
        host::unit(&HostCall::FutureSet {
            future: self.handle,
            result: Err(error.into()),
        })
    }

    /// Chains a callback (`fut.then(...)`): when this future completes with
    /// `v`, the host calls this plugin's `#[remote]` function
    /// `function(v, *extra)` on a pooled instance, and the returned future
    /// completes with its result. An error of this future skips the
    /// callback and passes through; an error the callback raises completes
    /// the returned future as a `RuntimeError` with its message (as a
    /// `torch.futures` callback's exception does).
    ///
    /// The callback is part of this call: it sees the same handles, so a
    /// future this call made and passes by its [`handle`](Self::handle) (as
    /// a Python closure captures it) can be completed there.
    ///
    /// # Errors
    /// A `RuntimeError` from the host.
    pub fn then(&self, function: &str, extra: impl ToArgs) -> Result<Future> {
        let call = HostCall::FutureThen {
            future: self.handle,
            function: function.to_owned(),
            extra: extra.to_args(),
        };
        host::handle(&call).map(Future::from_raw)
    }
}

impl Drop for Future {
    fn drop(&mut self) {
        // A failure means the host already forgot the handle.
        let _ = host::unit(&HostCall::Drop(HandleKind::Future, self.handle));
    }
}

/// What an `async_execution` function returns when, as in Python, its type
/// is only known at run time: a [`Future`] (the call completes with its
/// value), or any other value, which the host refuses with PyTorch's
/// "Functions decorated with @rpc.async_function must return a
/// torch.futures.Future object" `RuntimeError` (and releases).
///
/// A function whose result is always a future returns `Future` and never
/// meets that error; this type is for guests that decide at run time.
#[derive(Debug)]
pub enum MaybeFuture {
    /// A future: the call's result is its value.
    Future(Future),
    /// Not a future: the call fails.
    Value(AnyValue),
}

impl MaybeFuture {
    /// A value that is not a future; its handles move with it.
    pub fn value(value: impl IntoValue) -> MaybeFuture {
        MaybeFuture::Value(AnyValue::new(value.into_value()))
    }
}

impl From<Future> for MaybeFuture {
    fn from(future: Future) -> Self {
        MaybeFuture::Future(future)
    }
}
