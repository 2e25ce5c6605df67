//! Attribute macros of the wasmrpc guest SDK. Use them through
//! `wasmrpc_guest`, never directly.
