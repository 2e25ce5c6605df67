//! The wasmrpc wasm runtime: loads plugins and runs their functions and
//! objects on pooled wasmtime instances. The runtime itself lands in the
//! next commit; this crate exists now because the workspace lists it.
