//! Calls from a plugin to other workers (or its own): [`rpc_sync`],
//! [`rpc_async`], [`remote`], and [`Call`] for keyword arguments and
//! timeouts.
//!
//! A function is named as the agent registers it: an aten op
//! (`"aten::add"`) or a plugin function. The host awaits the network while
//! the guest is suspended, so a call back into the same worker cannot
//! deadlock on a pooled instance.

use crate::convert::{FromValue, ToArgs, ToValue};
use crate::host;
use crate::{Future, RRef, Result};
use wasmrpc_abi::protocol::{CallArgs, HostCall, RpcMode};
use wasmrpc_abi::{Value, WorkerInfo};

/// A call being built: destination, function, arguments, timeout.
///
/// The call keeps its arguments (tensors passed by value included) until it
/// is sent, and releases them after: requests only borrow handles.
pub struct Call<'a> {
    to: String,
    function: String,
    args: Box<dyn ToArgs + 'a>,
    kwargs: Vec<(String, Box<dyn ToValue + 'a>)>,
    timeout: Option<f64>,
}

impl core::fmt::Debug for Call<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Call")
            .field("to", &self.to)
            .field("function", &self.function)
            .field("args", &self.args.to_args())
            .finish_non_exhaustive()
    }
}

impl<'a> Call<'a> {
    /// A call of `function` on worker `to` with positional `args`.
    pub fn new(to: &str, function: &str, args: impl ToArgs + 'a) -> Call<'a> {
        Call {
            to: to.to_owned(),
            function: function.to_owned(),
            args: Box::new(args),
            kwargs: Vec::new(),
            timeout: None,
        }
    }

    /// Adds a keyword argument.
    pub fn kwarg(mut self, name: &str, value: impl ToValue + 'a) -> Call<'a> {
        self.kwargs.push((name.to_owned(), Box::new(value)));
        self
    }

    /// Sets a timeout in seconds (`0` for none, as in PyTorch).
    pub fn timeout(mut self, seconds: f64) -> Call<'a> {
        self.timeout = Some(seconds);
        self
    }

    /// The request; `self` must stay alive until it is answered.
    fn request(&self, mode: RpcMode) -> HostCall {
        let args = CallArgs {
            args: self.args.to_args(),
            kwargs: self
                .kwargs
                .iter()
                .map(|(k, v)| (k.clone(), v.to_value()))
                .collect(),
        };
        HostCall::Rpc {
            mode,
            to: self.to.clone(),
            function: self.function.clone(),
            args,
            timeout: self.timeout,
        }
    }

    /// Makes the call and waits for its result.
    ///
    /// # Errors
    /// The remote error, kind and message unchanged, or a `TypeError` if the
    /// result is not a `T`.
    pub fn sync<T: FromValue>(self) -> Result<T> {
        T::from_value(host::value(&self.request(RpcMode::Sync))?)
    }

    /// Makes the call and returns a future of its result.
    ///
    /// # Errors
    /// A `RuntimeError` if the call cannot be sent (e.g. an unknown worker).
    pub fn start(self) -> Result<Future> {
        host::handle(&self.request(RpcMode::Async)).map(Future::from_raw)
    }

    /// Makes the call, keeping the result on `to`, and returns an RRef to it.
    ///
    /// # Errors
    /// A `RuntimeError` if the call cannot be sent.
    pub fn remote(self) -> Result<RRef> {
        host::handle(&self.request(RpcMode::Remote)).map(RRef::from_raw)
    }
}

/// `rpc.rpc_sync(to, function, args)`.
///
/// # Errors
/// The remote error, or a `TypeError` if the result is not a `T`.
pub fn rpc_sync<T: FromValue>(to: &str, function: &str, args: impl ToArgs) -> Result<T> {
    Call::new(to, function, args).sync()
}

/// `rpc.rpc_async(to, function, args)`.
///
/// # Errors
/// A `RuntimeError` if the call cannot be sent.
pub fn rpc_async(to: &str, function: &str, args: impl ToArgs) -> Result<Future> {
    Call::new(to, function, args).start()
}

/// `rpc.remote(to, function, args)`.
///
/// # Errors
/// A `RuntimeError` if the call cannot be sent.
pub fn remote(to: &str, function: &str, args: impl ToArgs) -> Result<RRef> {
    Call::new(to, function, args).remote()
}

/// `rpc.get_worker_info()`: this worker's identity.
///
/// # Errors
/// A `RuntimeError` from the host.
pub fn get_worker_info() -> Result<WorkerInfo> {
    host::worker(&HostCall::WorkerInfo(None))
}

/// `rpc.get_worker_info(name)`: another worker's identity.
///
/// # Errors
/// A `RuntimeError` if no worker has that name.
pub fn worker_info(name: &str) -> Result<WorkerInfo> {
    host::worker(&HostCall::WorkerInfo(Some(name.to_owned())))
}

/// A value with no handles, for building argument lists by hand.
pub fn value(v: impl ToValue) -> Value {
    v.to_value()
}
