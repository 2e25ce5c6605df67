//! The guest side of passing bytes: the input buffer the host writes call
//! arguments into, and the output buffer an export's result is read from.
//!
//! Both are plain `Vec`s in thread-local storage (wasm32 plugins have one
//! thread), so no `unsafe` is needed: the host writes the input buffer only
//! between calls, and reads the output buffer only after an export returns.

use crate::Error;
use core::cell::RefCell;
use serde::de::DeserializeOwned;
use wasmrpc_abi::protocol::{Outcome, pack};
use wasmrpc_abi::{ErrorKind, RemoteError};

thread_local! {
    static INPUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static OUTPUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `wasmrpc_abi::protocol::EXPORT_INPUT_BUFFER`: grows the input buffer to at
/// least `len` bytes and returns its address.
#[unsafe(no_mangle)]
pub extern "C" fn wasmrpc_input_buffer(len: u32) -> u32 {
    INPUT.with_borrow_mut(|buf| {
        if buf.len() < len as usize {
            buf.resize(len as usize, 0);
        }
        // Addresses are 32-bit on wasm32, where this is called.
        buf.as_mut_ptr() as usize as u32
    })
}

/// Decodes the first `len` bytes of the input buffer.
pub(crate) fn read_input<T: DeserializeOwned>(len: u32) -> Result<T, Error> {
    INPUT.with_borrow(|buf| {
        let bytes = buf
            .get(..len as usize)
            .ok_or_else(|| Error::runtime_error("call arguments overrun the input buffer"))?;
        wasmrpc_abi::decode(bytes)
            .map_err(|e| Error::runtime_error(format!("cannot decode call arguments: {e}")))
    })
}

/// Encodes `outcome` into the output buffer and returns its packed address.
pub(crate) fn write_output(outcome: &Outcome) -> u64 {
    let bytes = wasmrpc_abi::encode(outcome).unwrap_or_else(|e| {
        let raise = Outcome::Raise(RemoteError::new(
            ErrorKind::RuntimeError,
            format!("cannot encode the result: {e}"),
        ));
        // An outcome of a kind and a short message always encodes.
        wasmrpc_abi::encode(&raise).unwrap_or_default()
    });
    OUTPUT.with_borrow_mut(|out| {
        *out = bytes;
        pack(out.as_ptr() as usize as u32, out.len() as u32)
    })
}
