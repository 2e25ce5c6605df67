//! The guest SDK: write the functions and classes that wasmrpc workers call
//! on each other, in Rust, and build them to `wasm32-unknown-unknown`.
//!
//! # An author's tour
//!
//! A plugin is a `cdylib` crate that depends on `wasmrpc-guest`. Mark free
//! functions with [`remote`](macro@remote) and class `impl` blocks with [`remote_class`];
//! the macros export them under their names, convert arguments from
//! [`Value`]s (positional or keyword, by parameter name), and write a
//! manifest into the module that the host reads when it loads the plugin.
//!
//! ```
//! use wasmrpc_guest::{Error, Future, Result, Tensor, remote, remote_class, rpc_async};
//!
//! /// `my_function(a, b, c)`: `a + b + c`, callable as
//! /// `rpc_sync(dst, "my_function", kwargs={"a": ..., "b": ..., "c": ...})`.
//! #[remote]
//! fn my_function(a: Tensor, b: i64, c: i64) -> Result<Tensor> {
//!     a.add(b)?.add(c)
//! }
//!
//! /// Errors keep their Python class and message across the wire.
//! #[remote]
//! fn raise_func() -> Result<()> {
//!     Err(Error::value_error("Expected error"))
//! }
//!
//! /// `@rpc.functions.async_execution`: return a future, and the call
//! /// completes when it does. Waiting holds no instance and no thread.
//! #[remote(async_execution)]
//! fn async_add(to: String, x: Tensor, y: Tensor) -> Result<Future> {
//!     rpc_async(&to, "aten::add", (x, y))
//! }
//!
//! /// A class: each object gets its own instance; its method calls run one
//! /// at a time.
//! pub struct Counter {
//!     value: i64,
//! }
//!
//! #[remote_class]
//! impl Counter {
//!     #[constructor]
//!     fn new(start: i64) -> Counter {
//!         Counter { value: start }
//!     }
//!     fn increment(&mut self, by: i64) {
//!         self.value += by;
//!     }
//!     fn get(&self) -> i64 {
//!         self.value
//!     }
//!     /// A method without `self` is exported as the function
//!     /// `Counter.is_big`.
//!     fn is_big(x: i64) -> bool {
//!         x > 10
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! # Core concepts
//!
//! - **Values.** Arguments and results are [`Value`]s. Parameter types
//!   implement [`FromValue`], results [`IntoValue`]: integers, floats,
//!   `bool`, `String`, `Vec<T>`, `Option<T>` (an optional parameter), tuples,
//!   [`WorkerInfo`], [`Tensor`], [`RRef`], [`AnyValue`] (any value; releases
//!   the handles in it when dropped) and the raw [`Value`] (whose handles
//!   the function must release or return).
//! - **Tensors live in the host.** A [`Tensor`] is a handle; its ops
//!   (`add`, `matmul`, [`Tensor::op`] for any aten op by schema name) run in
//!   the host, where autograd records them. Reading the elements
//!   ([`Tensor::to_vec`]) is the only copy into the guest. Dropping a handle
//!   releases it.
//! - **Handles: requests borrow, results move.** Passing a tensor to an op
//!   or an RPC lends it for the call; returning it hands it to the caller.
//! - **Calls to workers.** [`rpc_sync`], [`rpc_async`] (a [`Future`]) and
//!   [`remote`](fn@remote) (an [`RRef`]) call an aten op or a plugin
//!   function on any worker, this one included. The guest is suspended
//!   while the host waits; a call back into this worker runs on another
//!   instance, so it cannot deadlock.
//! - **State.** Stateless functions run on whichever pooled instance is
//!   free, so anything that must outlive a call lives in the host:
//!   [`global`]/[`set_global`], named [`lock`]s, and objects of
//!   [`remote_class`]es (each on an instance of its own).
//! - **Objects.** [`remote`](fn@remote) of a class name (`"MyClass"` for
//!   this plugin's, `"ns::Class"` for another's) constructs an object on
//!   the destination and returns an [`RRef`] to it; the object stays there,
//!   and its methods run through the RRef's proxies:
//!   `rref.rpc_sync().call::<i64>("get_value", ())`, [`RRef::rpc_async`]
//!   (a [`Future`]), [`RRef::remote`] (an [`RRef`] to the result). Static
//!   and class methods are functions named `Class.method`.
//! - **Autograd.** Ops record gradients in the host: [`Tensor::requires_grad_`],
//!   [`Tensor::backward`], [`Tensor::grad`], [`no_grad`]. Distributed
//!   autograd ([`dist_autograd::context`], [`dist_autograd::backward`],
//!   [`dist_autograd::get_gradients`]) and the distributed optimizer
//!   ([`optim::DistributedOptimizer`]) work as on the host, so a trainer can
//!   be a plugin; RPCs inside a context carry it.
//! - **Errors.** Return [`Error`] (or use [`raise!`]) with an
//!   [`ErrorKind`]; the caller sees that kind and message unchanged. A
//!   panic traps the instance: the caller gets a `RuntimeError` naming the
//!   plugin and function, with the panic message.
//! - **Permissions.** A worker runs a plugin's ops through its op policy.
//!   A plugin its operator loads (`--plugins`) may run whatever that
//!   policy serves and call any function; a plugin deployed at run time
//!   runs the policy's op families and calls its own functions and
//!   builtin ops only, unless it declares more with [`permissions!`]
//!   (`permissions!(ops = ["aten::from_file"], calls = ["hello::*"])`),
//!   which the worker grants as far as its operator's policy allows.
//! - **Files.** A plugin reaches only the folders its worker's operator
//!   grants it (`--grant-dir`): [`fs::read`], [`fs::write`] (atomic),
//!   [`fs::list`], and tensors in safetensors, `.npy` and `.npz` files
//!   ([`fs::save_tensors`], [`fs::load_tensors`]; never a pickle).
//! - **Progress.** [`progress::report`] reports how far a long task is;
//!   `wasmrpc launch` draws a bar per worker and task.
//! - **Profiling.** [`profiler::record_function`] opens a named range that
//!   a profiling caller gets back with the ops and RPCs the function ran.
//!
//! # Building
//!
//! `plugins/artifacts` builds every crate under `plugins/` with
//! `cargo build --release --target wasm32-unknown-unknown`; off wasm32 the
//! SDK compiles, but every host request fails with a `RuntimeError`.

mod abi;
mod autograd;
pub mod checkpoint;
mod convert;
pub mod dist_autograd;
mod error;
pub mod fs;
mod future;
mod host;
mod memory;
pub mod optim;
pub mod profiler;
pub mod progress;
mod rpc;
mod rref;
mod state;
pub mod supervision;
mod tensor;

#[doc(hidden)]
pub mod __private;

pub use autograd::no_grad;
pub use convert::{AnyValue, FromValue, IntoValue, ToArgs, ToValue};
pub use error::{Error, Result};
pub use future::{Future, MaybeFuture};
pub use memory::wasmrpc_input_buffer;
pub use rpc::{Call, get_worker_info, remote, rpc_async, rpc_sync, value, worker_info};
pub use rref::{AsyncProxy, RRef, RemoteProxy, SyncProxy};
pub use state::{LockGuard, clear_global, global, lock, log, log_at, set_global, sleep};
pub use tensor::{Element, Operand, Tensor};
pub use wasmrpc_abi::protocol::{DType, LogLevel, TensorMeta};
pub use wasmrpc_abi::{ErrorKind, Value, WorkerInfo};
pub use wasmrpc_guest_macros::{permissions, remote, remote_class};
