//! wasmrpc: PyTorch's distributed RPC, rebuilt in Rust, running user
//! functions as registered WebAssembly plugins.
//!
//! A host (this crate, and its `wasmrpc` binary) runs on every worker. It owns
//! the network, the tensors (libtorch through `tch`), the RRefs and the
//! distributed autograd graph; plugins compute by asking the host to run
//! tensor ops.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use wasmrpc::{Payload, RpcBackendOptions, args, init_rpc};
//!
//! # async fn run(store: Arc<dyn wasmrpc::store::Store>) -> wasmrpc::Result<()> {
//! let options = RpcBackendOptions::default();
//! options.registry.register_native("demo::add", |_ctx, args| async move {
//!     Ok(Payload::from(args.get(0)?.as_int()? + args.get(1)?.as_int()?))
//! });
//! let agent = init_rpc("worker0", Some(0), Some(1), store, options).await?;
//! let three = agent.rpc_sync("worker0", "demo::add", args![1, 2]).await?;
//! assert_eq!(three.as_int()?, 3);
//! agent.shutdown(true, std::time::Duration::ZERO).await?;
//! # Ok(()) }
//! ```
//!
//! # Core concepts
//!
//! - **Worker**: one member of an RPC group, named (`worker0`) and ranked.
//!   [`WorkerInfo`] is its identity; names follow PyTorch's rules.
//! - **Agent** ([`RpcAgent`]): a worker's runtime: its listener and
//!   connections, the calls it has pending, the functions it is running, its
//!   membership. An agent is an object; a process may run several (the test
//!   harness runs whole groups in one process). Clones are cheap and refer to
//!   the same agent. [`init_rpc`] starts one; [`RpcAgent::shutdown`] stops it.
//!   A process-wide [`current_agent`] is optional.
//! - **Store** ([`store::Store`]): the c10d key-value store workers meet
//!   through. Rendezvous costs each worker a constant number of store round
//!   trips; after it, workers talk directly over TCP. The store is
//!   unauthenticated (PyTorch's protocol) and holds nothing secret.
//! - **Credentials** ([`TlsCredentials`], [`CertificateAuthority`],
//!   [`RpcBackendOptions::cluster_secret`]): every connection between agents
//!   is TLS 1.3 with mutual authentication and certificates that name their
//!   worker, or authenticated with a cluster secret; both come from the
//!   operator only (options, environment, `wasmrpc worker` flags). Without
//!   any, a worker runs unauthenticated only on a loopback address or with
//!   [`RpcBackendOptions::insecure`].
//! - **Function registry** ([`FunctionRegistry`]): qualified name →
//!   [`RpcFunction`]. Builtin ops (`aten::add`), wasm exports and native Rust
//!   functions are all called through it. Each call runs as its own tokio
//!   task on the callee and gets a [`CallContext`] (its agent, for nested
//!   calls, and the caller).
//! - **Value / payload** ([`Payload`], [`Args`]): a [`abi::Value`] tree plus
//!   the `tch` tensors it refers to. Tensors travel as raw storage bytes
//!   beside the value, keeping strides, offsets, sparsity, `requires_grad`
//!   and storage sharing.
//! - **Builtin ops** ([`BuiltinOps`]): every op libtorch's operator registry
//!   knows, by schema name (`aten::add`), resolved by every registry unless
//!   a function of the same name is registered; they run off the async
//!   threads, with PyTorch's schema matching and error texts.
//! - **Op policy** ([`OpPolicy`], in
//!   [`RpcBackendOptions::op_policy`]; the rest of its API in
//!   [`op_policy`]): which of those ops a worker runs for peers and
//!   plugins. Deny by default: the tensor-computing families of
//!   [`op_policy::FAMILIES`] and nothing else; every other op is refused
//!   before it runs, whatever the spelling of its name.
//! - **Plugins** ([`PluginHost`]): wasm modules built with the guest SDK,
//!   loaded once per process and registered in a worker's registry as
//!   `namespace::function` (`seed_fns::my_function`). Each call gets its
//!   own handles; tensor ops, nested RPCs, globals and locks go through the
//!   worker's agent. [`wasm`] is the runtime underneath.
//! - **Distributed autograd context** ([`dist_autograd::DistAutogradContext`]):
//!   opened with [`dist_autograd::context`], current for its task and for the
//!   functions peers run for calls made in it; RPCs record send/recv
//!   functions in it, [`dist_autograd::backward`] runs backward across workers
//!   and gradients accumulate in it ([`dist_autograd::get_gradients`]). Each
//!   worker holds its own copy under the same id.
//! - **Distributed optimizer** ([`optim::DistributedOptimizer`]): one
//!   optimizer (SGD, Adam) over parameter RRefs owned by many workers; each
//!   owner keeps a local optimizer and `step(context_id)` updates every
//!   owner's parameters in place with that context's gradients.
//! - **Future** ([`Future`]): the result of [`RpcAgent::rpc_async`]; await it
//!   or block on it, chain callbacks with `then`, combine with [`wait_all`].
//!   Errors keep their Python kind and message across the wire ([`Error`]).
//!
//! # Threads and runtimes
//!
//! An agent runs on the tokio runtime it was started on. Its methods are
//! `async`; [`Future::wait_blocking`] serves blocking code. Callee functions
//! never run on a connection's reader, so calls to self and nested calls back
//! to the caller do not deadlock.

mod agent;
pub mod backend_registry;
pub mod device;
pub mod dist_autograd;
mod error;
pub mod metrics;
mod ops;
pub mod optim;
mod plugin;
pub mod profiler;
pub mod progress;
pub mod remote_module;
mod rref;
mod tensor;
pub mod trace;
pub mod transport;
mod value;
mod worker;

#[cfg(feature = "testing")]
pub mod testing;

pub use wasmrpc_abi as abi;
pub use wasmrpc_store as store;
pub use wasmrpc_wasm as wasm;
/// How the runtime hands freed heap memory back to the system: set by an
/// executable whose allocator is not glibc's (`wasmrpc_alloc`).
pub use wasmrpc_wasm::set_memory_release;

pub use abi::{ErrorKind, RemoteError, Value, WorkerInfo};
pub use agent::{
    Builtins, CLUSTER_SECRET_ENV, CallContext, CallKind, CallOptions, CallScope, DEBUG_INFO,
    DEFAULT_BUSY_POLL, DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT, Dest,
    Extension, Extensions, FAILED_WORKERS, FUTURE_PICKLE, Field, Fields, FunctionRegistry,
    FunctionResolver, Future, HandleCodec, INTERNAL_PREFIX, IncomingCall, IncomingReply, Inherit,
    Message, NEXT_FAILURE, NOOP, OutgoingCall, RESTART_COUNT, Request, RpcAgent, RpcBackendOptions,
    RpcFunction, Run, ServeScope, ShutdownHook, WorkerFailure, collect_all, collected_futures,
    current_agent, init_rpc_with, reset_current_agent, set_current_agent, validate_worker_name,
    wait_all, wait_all_blocking, wait_all_scope, worker_info,
};
pub use error::*;
pub use ops::policy as op_policy;
pub use ops::{
    BuiltinOps, OpPolicy, adopt_intra_op_threads, call_builtin, cores_per_local_worker,
    cores_per_worker, intra_op_threads, set_intra_op_threads,
};
pub use plugin::{
    CACHE_DIR_ENV, CACHE_MAX_ENV, COMPILE_HELPER_SUBCOMMAND, DEPLOY_PLUGIN, Deploy, DeployPlugin,
    DeployReport, MIN_PREFIX, PACKAGE_PREFIX, PLUGIN_SWITCH, PluginHost, PluginSwitch, PluginTrust,
    PluginVersion, WorkerDeployment, plugin_global, plugin_namespace, serve_as_compile_helper,
};
pub use remote_module::RemoteModule;
pub use rref::{
    GloballyUniqueId, OBJECT_STATE_METHOD, RREF_PICKLE_OUTSIDE_RPC, RRef, RRefId, RRefMessage,
    RRefProxy, RRefProxyMode, Remote, rref_debug_info_function,
};
pub use tensor::budget::{TensorMemoryBudget, machine_memory, parse_bytes};
pub use transport::{
    CertificateAuthority, DEFAULT_FAILURE_TIMEOUT, FaultInjection, MessageKind, TlsCredentials,
};
pub use value::{Args, Handle, HandleObject, Payload, map_values};

/// Every feature of this crate, as the agent's extensions, in the order
/// their hooks run (EXT-1): RRefs, distributed autograd, the profiler,
/// plugin deployment, the distributed optimizer, RemoteModule.
pub fn extensions() -> Extensions {
    Extensions::none()
        .with(std::sync::Arc::new(rref::RRefs))
        .with(std::sync::Arc::new(dist_autograd::DistAutograd))
        .with(std::sync::Arc::new(profiler::Profiler))
        .with(std::sync::Arc::new(plugin::deploy::Deployment))
        .with(std::sync::Arc::new(optim::Optimizers))
        .with(std::sync::Arc::new(remote_module::RemoteModules))
}

/// Starts a worker with every feature of this crate and joins its group
/// (`init_rpc`); [`init_rpc_with`] chooses the features.
///
/// With `world_size`, the group is static: every rank `0..world_size` must
/// join, and this returns once all have. Without it, the group is dynamic:
/// the worker joins whoever is there and announces itself to them. `rank`
/// may be omitted only with the `env://` init method and a `RANK` variable.
/// Rendezvous costs each worker a constant number of store round trips.
///
/// # Errors
/// - `RuntimeError` "Worker name must match ..." for an invalid name;
/// - `ValueError` "... rank parameter missing" / "... environment variable
///   RANK expected ..." without a rank;
/// - `RuntimeError` "... is not unique" if two workers share a name, "... is
///   already initialized ..." if the rank joined twice, and the mixed-group
///   text if static and dynamic workers meet;
/// - store errors (e.g. a rendezvous timeout), as `RuntimeError`.
pub async fn init_rpc(
    name: &str,
    rank: Option<u32>,
    world_size: Option<u32>,
    store: std::sync::Arc<dyn store::Store>,
    options: RpcBackendOptions,
) -> Result<RpcAgent> {
    // Traces are recorded only where the operator names a collector
    // (TRACE-2); metrics cost calls nothing unless asked for (MET-3).
    let tracing = match &options.otlp_endpoint {
        Some(endpoint) => trace::Tracing::exporting(endpoint, name, options.otlp_sample_ratio)?,
        None => trace::Tracing::propagating(),
    };
    let metrics = options.metrics_addr.map(|a| (a, options.metrics_public));
    let mut features = extensions().with(std::sync::Arc::new(tracing));
    if metrics.is_some() {
        features = features.with(std::sync::Arc::new(metrics::Metrics::default()));
    }
    let agent = init_rpc_with(name, rank, world_size, store, options, features).await?;
    if let Some((addr, public)) = metrics
        && let Err(e) = metrics::serve(&agent, addr, public).await
    {
        let _ = agent.shutdown(false, std::time::Duration::ZERO).await;
        return Err(e);
    }
    Ok(agent)
}

/// The traits that add the features' methods to an agent
/// ([`Remote`]: `remote()` and the RRef context; [`Deploy`]: plugin
/// deployment): `use wasmrpc::prelude::*;`.
pub mod prelude {
    pub use crate::{Deploy, Remote};
}

/// The kind of every message an agent of this crate sends, by owner, for
/// [`FaultInjection`] (the seeds' faulty agent fails sends by kind).
pub mod message_kinds {
    pub use crate::agent::{CALL, RESPONSE};
    pub use crate::dist_autograd::{CLEANUP_AUTOGRAD_CONTEXT, PROPAGATE_GRADIENTS};
    pub use crate::plugin::{DEPLOY_PLUGIN, PLUGIN_SWITCH};
    pub use crate::rref::{RREF_CHILD_ACCEPT, RREF_FORK, RREF_USER_DELETE};
}
