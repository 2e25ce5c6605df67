//! The c10d TCP store: [`TcpStoreServer`] and its client [`TcpStore`], both
//! wire-compatible with PyTorch 2.13's `TCPStore`.
//!
//! `protocol` owns the bytes, `server` the serving side, `client` the
//! connecting side. Either side works with PyTorch's other side: a
//! `torch.distributed.TCPStore(..., is_master=False)` can use our server, and
//! our client can use a store PyTorch (or `torchrun`'s agent) hosts.

mod client;
mod protocol;
mod server;

pub use client::{TcpStore, TcpStoreOptions};
pub use server::TcpStoreServer;
