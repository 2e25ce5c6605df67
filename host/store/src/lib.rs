//! Key-value stores with the semantics of PyTorch's c10d stores, and the
//! rendezvous built on them.
//!
//! Workers find each other through a store, as in PyTorch: rank 0 (or a
//! launcher such as `torchrun`) hosts it, and every worker publishes its
//! address and reads everyone else's.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use wasmrpc_store::{Store, TcpStore, TcpStoreOptions, TcpStoreServer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> wasmrpc_store::Result<()> {
//! let server = Arc::new(TcpStoreServer::bind("127.0.0.1:0").await?);
//! let options = TcpStoreOptions { timeout: Duration::from_secs(5), ..Default::default() };
//! let store: Arc<dyn Store> =
//!     Arc::new(TcpStore::with_server(Arc::clone(&server), "127.0.0.1", options).await?);
//! store.set("worker0", b"10.0.0.1:4000").await?;
//! assert_eq!(store.get("worker0").await?, b"10.0.0.1:4000");
//! assert_eq!(store.add("joined", 1).await?, 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Core concepts
//!
//! - [`Store`]: the interface (`set`, `get`, `add`, `compare_set`, `wait`,
//!   ...), object-safe and used as `Arc<dyn Store>`. `get` and `wait` wait
//!   for keys up to a timeout and fail with [`Error::Timeout`].
//! - [`HashStore`]: in one process; waits are event-driven.
//! - [`FileStore`]: processes on one machine sharing a file, in PyTorch's
//!   file format, under `flock`.
//! - [`TcpStoreServer`] and [`TcpStore`]: a server and a client that speak
//!   PyTorch 2.13's `TCPStore` protocol, so either side interoperates with
//!   PyTorch's. The server owns the data; clients are cheap, one connection
//!   each, and a [`TcpStore`] may own the server it started.
//! - [`PrefixStore`]: a namespace (`prefix/key`) inside another store.
//! - [`rendezvous()`]: turns `env://`, `tcp://` or `file://` into
//!   `(store, rank, world_size)`; [`store_based_barrier`] synchronises workers
//!   on a store. [`get_node_local_rank`] and [`DebugLevel`] read the other
//!   variables `torch.distributed` reads.
//!
//! Errors keep PyTorch's texts where PyTorch's tests assert them;
//! [`Error::python_kind`] names the Python exception.
//!
//! This crate owns the store protocol and nothing above it: it knows nothing
//! of RPC, tensors or wasm, and does not link libtorch.

mod env;
mod file;
mod hash;
mod prefix;
mod rendezvous;
mod store;
mod tcp;

pub use env::{
    DEBUG_LEVEL_INVALID, DebugLevel, EnvLookup, LOCAL_RANK_MISSING, get_debug_level,
    get_node_local_rank, get_node_local_rank_with, process_env, set_debug_level,
    set_debug_level_from_env, set_debug_level_from_env_with,
};
pub use file::FileStore;
pub use hash::HashStore;
pub use prefix::PrefixStore;
pub use rendezvous::{
    DEFAULT_PG_TIMEOUT, RendezvousResult, STORE_BASED_BARRIER_PREFIX, dynamic_store, rendezvous,
    rendezvous_with, store_based_barrier,
};
pub use store::{DEFAULT_TIMEOUT, Error, Result, Store};
pub use tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
