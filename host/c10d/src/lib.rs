//! c10d process groups for wasmrpc: `torch.distributed`'s process-group API
//! on `tch` tensors.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tch::Tensor;
//! use wasmrpc_c10d::{InitOptions, ReduceOp, World};
//! use wasmrpc_store::FileStore;
//!
//! # #[tokio::main]
//! # async fn main() -> wasmrpc_c10d::Result<()> {
//! # let (rank, world_size) = (0, 2);
//! let world = World::new();
//! world
//!     .init_process_group(InitOptions {
//!         backend: Some("gloo".into()),
//!         store: Some(Arc::new(FileStore::new("/tmp/pg", Some(world_size)))),
//!         rank: Some(rank as i64),
//!         world_size: Some(world_size as i64),
//!         ..Default::default()
//!     })
//!     .await?;
//! let t = Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu));
//! world.all_reduce(&t, ReduceOp::SUM, None)?.wait().await?;
//! world.destroy_process_group(None)?;
//! # Ok(())
//! # }
//! ```
//!
//! # Core concepts
//!
//! - [`World`]: one worker's `torch.distributed` module state (default
//!   group, groups, warnings) and the `dist.*` functions as methods:
//!   `init_process_group`, `destroy_process_group`, `new_group`,
//!   `get_rank`, rank mapping, and the collectives (`all_reduce`,
//!   `broadcast`, `all_gather`, `reduce_scatter`, `all_to_all_single`,
//!   `barrier`, `send`/`recv`, ...). Several ranks may live in one process,
//!   each with its own `World`.
//! - [`ProcessGroup`]: a group's members, this worker's rank in it, its
//!   backends and its sequence number.
//! - [`Work`]: an issued collective; `wait()` joins it.
//! - [`Backend`], [`BackendConfig`], [`CollectiveBackend`]: backend names,
//!   the plugin registry (`register_backend`), `"cpu:gloo,cuda:nccl"`
//!   strings, and the trait a backend implements.
//! - [`engine`]: `gloo` and `nccl`, libtorch's own `ProcessGroupGloo` and
//!   `ProcessGroupNCCL` reached through a C++ shim, their rendezvous served
//!   by the group's Rust store.
//! - [`tcp`]: this crate's own CPU backend (`tcp`), over TCP connections
//!   between the members whose addresses are exchanged through the store.
//! - [`ReduceOp`]: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR and
//!   PREMUL_SUM.
//! - [`compute_bucket_assignment_by_size`]: DDP's gradient bucketing;
//!   [`ddp::Reducer`] synchronises gradients bucket by bucket through a
//!   communication hook (by default an averaging allreduce).
//!
//! # Where this crate sits
//!
//! It is its own crate, above `wasmrpc-store` (which stays free of libtorch)
//! and beside the RPC host: the RPC agent does not need process groups, and
//! process groups do not need wasm. It owns the process-group layer and
//! nothing below it (stores, rendezvous) or above it (DDP itself).
//!
//! Not done: UCC and MPI (known names, never available); NCCL where the
//! libtorch is CPU-only or CUDA's compiler headers are missing (see the
//! build script); DDP's module wrapper (forward hooks, overlap with
//! backward, unused parameters).

mod backend;
mod bucketing;
pub mod ddp;
pub mod engine;
mod error;
mod group;
mod handshake;
mod mesh;
mod reduce_op;
pub mod tcp;
mod work;
mod world;

pub use backend::{
    Backend, BackendArgs, BackendConfig, BackendCreator, BackendFuture, BackendPlugin,
    CollectiveBackend, OpContext, is_backend_available, is_gloo_available, is_mpi_available,
    is_nccl_available, is_ucc_available,
};
pub use bucketing::compute_bucket_assignment_by_size;
pub use error::{Error, Result};
pub use group::ProcessGroup;
pub use reduce_op::{PremulScale, RedOpType, ReduceOp, make_nccl_premul_sum};
pub use work::Work;
pub use world::{Env, InitOptions, NewGroupOptions, World, dtype_name};
