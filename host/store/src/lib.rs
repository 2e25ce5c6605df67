//! Key-value stores with the semantics of PyTorch's c10d stores.
//!
//! Workers find each other through a store, as in PyTorch: rank 0 (or a
//! launcher such as `torchrun`) hosts it, and every worker publishes its
//! address and reads everyone else's. [`Store`] is the interface; its
//! implementations are added module by module.
//!
//! This crate owns the store protocol and nothing above it: it knows nothing
//! of RPC, tensors or wasm.

mod store;

pub use store::{Error, Result, Store};
