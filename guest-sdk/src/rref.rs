//! [`RRef`]: a handle to a remote reference held by the host. Minimal for
//! now: fetch the value, ask the owner, make a local one.

use crate::Result;
use crate::convert::{FromValue, ToValue};
use crate::host;
use wasmrpc_abi::WorkerInfo;
use wasmrpc_abi::protocol::{HandleKind, HostCall};

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
    /// The error that creating the value raised, or a `TypeError` if it is
    /// not a `T`.
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
}

impl Drop for RRef {
    fn drop(&mut self) {
        // A failure means the host already forgot the handle.
        let _ = host::unit(&HostCall::Drop(HandleKind::RRef, self.handle));
    }
}
