//! The raw imports from the host's `wasmrpc` import module, and nothing else.
//!
//! Everything here is `unsafe` glue; [`crate::host`] wraps it into one safe
//! request/reply function. Off wasm32 (unit tests, `trybuild` snapshots on
//! the build machine) there is no host: every request fails with a
//! `RuntimeError`.

#[cfg(target_arch = "wasm32")]
mod imports {
    #[link(wasm_import_module = "wasmrpc")]
    unsafe extern "C" {
        /// `wasmrpc_abi::protocol::IMPORT_CALL`.
        #[link_name = "call"]
        pub(super) fn call(ptr: u32, len: u32) -> u32;
        /// `wasmrpc_abi::protocol::IMPORT_TAKE_REPLY`.
        #[link_name = "take_reply"]
        pub(super) fn take_reply(ptr: u32);
    }
}

/// Sends an encoded request to the host and returns the encoded reply.
#[cfg(target_arch = "wasm32")]
pub(crate) fn call(request: &[u8]) -> Vec<u8> {
    // Addresses and lengths are 32-bit on wasm32: these casts are lossless.
    let (ptr, len) = (request.as_ptr() as usize as u32, request.len() as u32);
    // SAFETY: `ptr..ptr+len` is `request`, a live borrowed slice the host only
    // reads during the call.
    let reply_len = unsafe { imports::call(ptr, len) } as usize;
    let mut reply = vec![0u8; reply_len];
    // SAFETY: `reply` is a live, writable buffer of exactly `reply_len` bytes,
    // the length the host said its pending reply has; the host writes no more.
    unsafe { imports::take_reply(reply.as_mut_ptr() as usize as u32) };
    reply
}

/// Off wasm32 there is no host: every request fails.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn call(_request: &[u8]) -> Vec<u8> {
    let err: Result<wasmrpc_abi::protocol::HostReply, wasmrpc_abi::RemoteError> =
        Err(wasmrpc_abi::RemoteError::new(
            wasmrpc_abi::ErrorKind::RuntimeError,
            "not running inside a wasmrpc host",
        ));
    wasmrpc_abi::encode(&err).unwrap_or_default()
}
