//! One safe request/reply to the host: encode a [`HostCall`], decode the
//! reply. Every safe wrapper of the SDK goes through [`request`].

use crate::Error;
use wasmrpc_abi::protocol::{HostCall, HostReply};
use wasmrpc_abi::{ErrorKind, RemoteError, Value, WorkerInfo};

/// Sends `call` to the host and returns its reply, or the error it raised.
pub(crate) fn request(call: &HostCall) -> Result<HostReply, Error> {
    let bytes = wasmrpc_abi::encode(call)
        .map_err(|e| Error::runtime_error(format!("cannot encode a host request: {e}")))?;
    let reply = crate::abi::call(&bytes);
    let reply: Result<HostReply, RemoteError> = wasmrpc_abi::decode(&reply)
        .map_err(|e| Error::runtime_error(format!("cannot decode the host's reply: {e}")))?;
    reply.map_err(Error::from)
}

fn unexpected(what: &str, got: &HostReply) -> Error {
    Error::new(
        ErrorKind::RuntimeError,
        format!("host replied {got:?} where {what} was expected"),
    )
}

/// A request whose reply is [`HostReply::Unit`].
pub(crate) fn unit(call: &HostCall) -> Result<(), Error> {
    match request(call)? {
        HostReply::Unit => Ok(()),
        other => Err(unexpected("nothing", &other)),
    }
}

/// A request whose reply is a [`HostReply::Value`].
pub(crate) fn value(call: &HostCall) -> Result<Value, Error> {
    match request(call)? {
        HostReply::Value(v) => Ok(v),
        other => Err(unexpected("a value", &other)),
    }
}

/// A request whose reply is a [`HostReply::Handle`].
pub(crate) fn handle(call: &HostCall) -> Result<u32, Error> {
    match request(call)? {
        HostReply::Handle(h) => Ok(h),
        other => Err(unexpected("a handle", &other)),
    }
}

/// A request whose reply is a [`HostReply::Worker`].
pub(crate) fn worker(call: &HostCall) -> Result<WorkerInfo, Error> {
    match request(call)? {
        HostReply::Worker(w) => Ok(w),
        other => Err(unexpected("a worker", &other)),
    }
}

/// A request whose reply is a [`HostReply::Bool`].
pub(crate) fn flag(call: &HostCall) -> Result<bool, Error> {
    match request(call)? {
        HostReply::Bool(b) => Ok(b),
        other => Err(unexpected("a flag", &other)),
    }
}
