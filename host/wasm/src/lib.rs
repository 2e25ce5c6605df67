//! The wasmrpc wasm runtime: loads plugins (wasm modules built with the
//! guest SDK) and runs their functions and objects on wasmtime.
//!
//! It knows nothing of tensors or the network: everything a guest asks of
//! its worker goes through the [`GuestHost`] trait, which the `wasmrpc` host
//! crate implements with the agent and libtorch.
//!
//! # A tour
//!
//! ```no_run
//! use std::sync::Arc;
//! use wasmrpc_wasm::{CallArgs, Config, GuestHost, Runtime, Value};
//!
//! # async fn example(host: Arc<dyn GuestHost>) -> Result<(), wasmrpc_wasm::Error> {
//! let runtime = Runtime::new(Config {
//!     cache_dir: Some("/tmp/wasmrpc-cache".into()),
//!     ..Config::default()
//! })?;
//! let plugin = runtime.load(&std::fs::read("seed_fns.wasm").unwrap())?;
//! for export in &plugin.manifest().exports {
//!     println!("{:?} {} {:?}", export.kind, export.name, export.params);
//! }
//!
//! // A function, with keyword arguments.
//! let args = CallArgs {
//!     args: vec![],
//!     kwargs: vec![("a".into(), Value::Int(1)), ("b".into(), Value::Int(2)), ("c".into(), Value::Int(3))],
//! };
//! let six = runtime.call(&plugin, "my_function", args, host.clone()).await?;
//! assert_eq!(six, Value::Int(6));
//!
//! // An object: its own instance, one method call at a time.
//! let object = runtime.construct(&plugin, "MyClass", CallArgs { args: vec![Value::Int(2)], kwargs: vec![] }, host.clone()).await?;
//! let three = object.call_method("my_instance_method", CallArgs { args: vec![Value::Int(1)], kwargs: vec![] }, host.clone()).await?;
//! assert_eq!(three, Value::Int(3));
//! object.dispose(host).await?;
//! # Ok(()) }
//! ```
//!
//! # Core concepts
//!
//! - **[`Runtime`]** owns the wasmtime engine (async host imports, epoch
//!   interruption, the pooling allocator), the host imports, the on-disk
//!   cache of compiled modules (keyed by the sha256 of the bytes) and the
//!   loaded plugins by name. One per worker; cheap to clone and `Send +
//!   Sync`.
//! - **[`Plugin`]** is a loaded module: its [`Manifest`] (what the guest
//!   macros wrote into a custom section: functions, classes, methods,
//!   parameter names) and a pool of warm instances. A call holds an instance
//!   only while guest code runs; when all are busy it makes another, so any
//!   number of calls run at once, and a guest that calls back into its own
//!   worker never waits for itself. Host imports are async: a guest waiting
//!   on the network holds no thread.
//! - **[`Object`]** is an object of a plugin class, on an instance of its
//!   own; its methods run one at a time (actor semantics). A
//!   single-instance plugin's objects and functions share one instance
//!   ([`Object::module`]); a call of it that waits on a future runs the
//!   calls waiting for the instance meanwhile (visits, `visit.rs`).
//! - **`async_execution`** functions and methods return a future handle;
//!   [`Runtime::call`] gives the instance back, then awaits the future
//!   through [`GuestHost::future_wait`].
//! - **[`GuestHost`]** is the worker's side of every request: tensor ops by
//!   aten name on `u32` handles, nested RPCs, RRefs, futures, globals and
//!   locks, sleep, log. Its docs state who owns a handle when.
//! - **[`Error`]** keeps a guest's own error kind and message
//!   ([`Error::Raised`]); traps (with the panic message), time limits (guest
//!   time only, waiting on the host does not count) and memory limits are
//!   errors naming the plugin and the function. Nothing a guest does panics
//!   the host; an instance that trapped is discarded.
//! - **Component plugins** (Python plugins built with componentize-py
//!   against the WIT world `guest-sdk/wit/plugin.wit`) are one more kind of
//!   code in a [`Plugin`]: [`Runtime::load`] tells them by their header,
//!   caches them compiled like modules, checks their manifest section
//!   against their own `describe` export, and runs them on the same pool,
//!   limits and host requests ([`GuestHost`]); WASI is linked over a
//!   context that grants nothing. [`Plugin::is_component`] tells them
//!   apart. A Python instance takes 13 to 16 of the pool's slots: a call that
//!   finds the pool full drops the idle instances of every plugin, then
//!   waits for a busy one to come back, fails when none came back for
//!   [`POOL_WAIT`], and fails at once when no instance is live (a pool too
//!   small for one).
//! - **[`manifest::read`]** reads a module's (or a component's) manifest
//!   without compiling it.

mod component;
mod error;
pub mod folders;
mod host;
mod imports;
mod instance;
pub mod manifest;
mod object;
mod plugin;
mod runtime;
mod visit;

pub use error::{ASYNC_WRONG_TYPE, Error, Result};
pub use folders::{FolderGrant, FolderGrants, Folders};
pub use host::{GuestHost, HostResult, runtime_error};
pub use manifest::Manifest;
pub use object::{Called, Object};
pub use plugin::{LoadSource, POOL_WAIT, Plugin};
pub use runtime::{
    CodeKind, CompileHelper, Config, DEFAULT_CACHE_MAX_BYTES, DEFAULT_HELPER_TIMEOUT,
    INVALID_WASM_EXIT, PERF_MAP_VAR, Runtime, compile_entry, helper_main, set_memory_release,
};
pub use wasmrpc_abi::protocol::{
    AutogradCall, CallArgs, DType, FileCall, HandleKind, LogLevel, Progress, TensorMeta,
};
pub use wasmrpc_abi::{ErrorKind, RemoteError, Value, WorkerInfo};
