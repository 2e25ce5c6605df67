//! The contract shared by the wasmrpc host and the plugins it runs.
//!
//! Everything that two parties must encode the same way lives here, compiled
//! both for the host and for `wasm32-unknown-unknown`:
//!
//! - [`Value`]: every value that crosses the wire between workers or the
//!   boundary between the host and a guest. Tensors never travel inside a
//!   `Value`: a [`Value::Tensor`] holds an index into a side table (the
//!   tensors of a wire message, or the host's handle table for a guest), so
//!   tensor bytes can be moved without passing through the value encoding.
//! - [`ErrorKind`] and [`RemoteError`]: the Python exception classes that
//!   errors keep across the wire, and the error itself.
//! - [`encode`] / [`decode`]: the one encoding (postcard) used for both.
//! - [`protocol`]: the calling convention between the host's wasm runtime
//!   and a guest: import and export names, [`protocol::HostCall`] (what a
//!   guest may ask of the host) and [`protocol::Outcome`] (what a call
//!   returns).
//! - [`manifest`]: the plugin manifest the guest macros write into a custom
//!   section, and its parser.
//!
//! This crate owns no behaviour: no I/O, no tensors, no wasm runtime.

#![no_std]
extern crate alloc;

mod error;
pub mod manifest;
pub mod protocol;
pub mod raw_bytes;
mod value;

pub use error::{ErrorKind, RemoteError};
pub use value::{MAX_VALUE_DEPTH, Value, WorkerInfo};

use alloc::vec::Vec;
use serde::{Serialize, de::DeserializeOwned};

/// Encodes `value` with the encoding shared by host, wire and guests.
///
/// # Errors
/// Fails only if `value`'s `Serialize` implementation fails.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_allocvec(value)
}

/// Appends the encoding of `value` (the bytes [`encode`] returns) to
/// `out`, and returns it. A caller that knows about how long the encoding
/// will be sizes `out` once, instead of the buffer growing from empty by
/// doubling (a reallocation and a copy at 8, 16, 32, ... bytes), and can
/// put a prefix before it.
///
/// # Errors
/// Fails only if `value`'s `Serialize` implementation fails.
pub fn encode_append<T: Serialize + ?Sized>(
    value: &T,
    out: Vec<u8>,
) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_extend(value, out)
}

/// Decodes a value written by [`encode`].
///
/// # Errors
/// Fails on truncated or malformed bytes; never panics on any input.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}
