//! wasmrpc: PyTorch's distributed RPC, rebuilt in Rust, running user
//! functions as registered WebAssembly plugins.
//!
//! A host (this crate, and its `wasmrpc` binary) runs on every worker. It owns
//! the network, the tensors (libtorch through `tch`), the RRefs and the
//! distributed autograd graph; plugins compute by asking the host to run
//! tensor ops.
//!
//! The modules are added issue by issue; the README lists what works today.

pub use wasmrpc_abi as abi;
pub use wasmrpc_store as store;
