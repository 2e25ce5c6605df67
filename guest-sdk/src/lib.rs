//! The guest SDK: what a plugin author imports to write functions that
//! wasmrpc workers call by name.

pub use wasmrpc_abi::{ErrorKind, RemoteError, Value, WorkerInfo};
