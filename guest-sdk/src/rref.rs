//! [`RRef`]: a handle to a remote reference held by the host: fetch the
//! value, ask about its owner, make a local one, and call methods of the
//! value on its owner through proxies ([`RRef::rpc_sync`],
//! [`RRef::rpc_async`], [`RRef::remote`]).
//!
//! Objects of plugin classes live in RRefs: [`crate::remote`] with a class
//! name constructs one on the destination, and the proxies call its
//! methods there:
//!
//! ```ignore
//! let counter = remote("worker1", "MyClass", (7,))?;
//! counter.rpc_sync().call::<()>("increment_value", (1,))?;
//! let fut = counter.rpc_async().call("get_value", ())?;
//! let value: i64 = fut.wait()?;
//! let result: RRef = counter.remote().timeout(5.0).call("get_value", ())?;
//! ```

use crate::convert::{FromValue, ToArgs, ToValue};
use crate::host;
use crate::{Future, Result};
use wasmrpc_abi::protocol::{CallArgs, HandleKind, HostCall, RpcMode};
use wasmrpc_abi::{Value, WorkerInfo};

/// A remote reference (`torch.distributed.rpc.RRef`).
#[derive(Debug)]
pub struct RRef {
    handle: u32,
}

impl RRef {
    /// A local RRef owned by this worker, holding `value` (`RRef(value)`).
    ///
    /// # Errors
    /// A `RuntimeError` from the host.
    pub fn new(value: impl ToValue) -> Result<RRef> {
        host::handle(&HostCall::RRefNew(value.to_value())).map(RRef::from_raw)
    }

    /// Wraps a raw handle the guest owns.
    pub fn from_raw(handle: u32) -> RRef {
        RRef { handle }
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

    /// Fetches the value from the owner (`rref.to_here()`).
    ///
    /// # Errors
    /// The error that creating the value raised, a `TypeError` if it is
    /// not a `T`, or a `TypeError` for an object of a plugin class (objects
    /// stay on their owner: call their methods through the proxies).
    pub fn to_here<T: FromValue>(&self) -> Result<T> {
        T::from_value(host::value(&HostCall::RRefToHere(self.handle))?)
    }

    /// The worker that owns the value (`rref.owner()`).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn owner(&self) -> Result<WorkerInfo> {
        host::worker(&HostCall::RRefOwner(self.handle))
    }

    /// The name of the worker that owns the value (`rref.owner_name()`).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn owner_name(&self) -> Result<String> {
        self.owner().map(|w| w.name)
    }

    /// Whether this worker owns the value (`rref.is_owner()`).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn is_owner(&self) -> Result<bool> {
        host::flag(&HostCall::RRefIsOwner(self.handle))
    }

    /// Whether the owner knows this user RRef (`rref.confirmed_by_owner()`);
    /// always true on the owner.
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn confirmed_by_owner(&self) -> Result<bool> {
        host::flag(&HostCall::RRefConfirmed(self.handle))
    }

    /// A proxy that runs methods of the value on its owner and waits for
    /// their results (`rref.rpc_sync()`):
    /// `rref.rpc_sync().call::<i64>("get_value", ())`.
    pub fn rpc_sync(&self) -> SyncProxy<'_> {
        SyncProxy(Proxy::new(self))
    }

    /// A proxy that runs methods of the value on its owner and returns
    /// futures of their results (`rref.rpc_async()`).
    pub fn rpc_async(&self) -> AsyncProxy<'_> {
        AsyncProxy(Proxy::new(self))
    }

    /// A proxy that runs methods of the value on its owner and keeps their
    /// results there, returning RRefs (`rref.remote()`).
    pub fn remote(&self) -> RemoteProxy<'_> {
        RemoteProxy(Proxy::new(self))
    }
}

impl Drop for RRef {
    fn drop(&mut self) {
        // A failure means the host already forgot the handle.
        let _ = host::unit(&HostCall::Drop(HandleKind::RRef, self.handle));
    }
}

/// What the three proxies share: the RRef and the timeout.
#[derive(Debug, Clone, Copy)]
struct Proxy<'a> {
    rref: &'a RRef,
    timeout: Option<f64>,
}

impl<'a> Proxy<'a> {
    fn new(rref: &'a RRef) -> Self {
        Proxy {
            rref,
            timeout: None,
        }
    }

    fn request(
        &self,
        mode: RpcMode,
        method: &str,
        args: &dyn ToArgs,
        kwargs: &[(&str, Value)],
    ) -> HostCall {
        HostCall::RRefProxyCall {
            rref: self.rref.handle,
            mode,
            method: method.to_owned(),
            args: CallArgs {
                args: args.to_args(),
                kwargs: kwargs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.clone()))
                    .collect(),
            },
            timeout: self.timeout,
        }
    }
}

/// `rref.rpc_sync(timeout)`: calls methods and waits. Reusable.
///
/// Like every proxy, it first learns the value's type from the owner (with
/// the proxy's timeout), then calls the method there; a method of an object
/// runs once the object's earlier calls are done. A method that calls back
/// into its own object through a proxy waits for itself: use functions for
/// re-entrant work.
#[derive(Debug, Clone, Copy)]
pub struct SyncProxy<'a>(Proxy<'a>);

impl SyncProxy<'_> {
    /// Sets the timeout of every call, in seconds (`0` for none).
    #[must_use]
    pub fn timeout(mut self, seconds: f64) -> Self {
        self.0.timeout = Some(seconds);
        self
    }

    /// Calls `method(*args)` on the owner and waits for its result.
    ///
    /// # Errors
    /// `AttributeError` "'Class' object has no attribute 'method'", the
    /// method's error, a timeout ("RPC ran for more than"), or a
    /// `TypeError` if the result is not a `T`.
    pub fn call<T: FromValue>(&self, method: &str, args: impl ToArgs) -> Result<T> {
        self.call_kw(method, args, &[])
    }

    /// [`call`](Self::call) with keyword arguments.
    ///
    /// # Errors
    /// As [`call`](Self::call).
    pub fn call_kw<T: FromValue>(
        &self,
        method: &str,
        args: impl ToArgs,
        kwargs: &[(&str, Value)],
    ) -> Result<T> {
        let request = self.0.request(RpcMode::Sync, method, &args, kwargs);
        T::from_value(host::value(&request)?)
    }
}

/// `rref.rpc_async(timeout)`: calls methods and returns futures. Reusable.
#[derive(Debug, Clone, Copy)]
pub struct AsyncProxy<'a>(Proxy<'a>);

impl AsyncProxy<'_> {
    /// Sets the timeout of every call, in seconds (`0` for none).
    #[must_use]
    pub fn timeout(mut self, seconds: f64) -> Self {
        self.0.timeout = Some(seconds);
        self
    }

    /// Calls `method(*args)` on the owner; the future completes with its
    /// result or error.
    ///
    /// # Errors
    /// A `RuntimeError` if the host cannot start the call (e.g. the handle
    /// is no longer valid).
    pub fn call(&self, method: &str, args: impl ToArgs) -> Result<Future> {
        self.call_kw(method, args, &[])
    }

    /// [`call`](Self::call) with keyword arguments.
    ///
    /// # Errors
    /// As [`call`](Self::call).
    pub fn call_kw(
        &self,
        method: &str,
        args: impl ToArgs,
        kwargs: &[(&str, Value)],
    ) -> Result<Future> {
        let request = self.0.request(RpcMode::Async, method, &args, kwargs);
        host::handle(&request).map(Future::from_raw)
    }
}

/// `rref.remote(timeout)`: calls methods and keeps their results on the
/// owner. Reusable.
#[derive(Debug, Clone, Copy)]
pub struct RemoteProxy<'a>(Proxy<'a>);

impl RemoteProxy<'_> {
    /// Sets the timeout of every call, in seconds (`0` for none).
    #[must_use]
    pub fn timeout(mut self, seconds: f64) -> Self {
        self.0.timeout = Some(seconds);
        self
    }

    /// Calls `method(*args)` on the owner and returns an RRef to its result
    /// (its errors surface on [`RRef::to_here`]).
    ///
    /// # Errors
    /// A timeout or error while the proxy learns the value's type.
    pub fn call(&self, method: &str, args: impl ToArgs) -> Result<RRef> {
        self.call_kw(method, args, &[])
    }

    /// [`call`](Self::call) with keyword arguments.
    ///
    /// # Errors
    /// As [`call`](Self::call).
    pub fn call_kw(
        &self,
        method: &str,
        args: impl ToArgs,
        kwargs: &[(&str, Value)],
    ) -> Result<RRef> {
        let request = self.0.request(RpcMode::Remote, method, &args, kwargs);
        host::handle(&request).map(RRef::from_raw)
    }
}
