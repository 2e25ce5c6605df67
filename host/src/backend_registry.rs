//! RPC backends by name (`torch.distributed.rpc.backend_registry`): each
//! backend is a handler that builds its options and one that starts its
//! agent, and [`init_rpc_backend`] starts a worker on a backend chosen by
//! name or inferred from the type of its options.
//!
//! One backend is built in: [`TENSORPIPE`], this crate's agent (TCP or TLS
//! connections, see `transport`), whose options are [`RpcBackendOptions`].
//! PyTorch's name is kept so code written against it reads the same.
//! Other backends (a test double, an agent with other extensions) are
//! registered at run time; names are unique for the life of the process.
//!
//! This module only dispatches: what a backend does is its handlers'.

use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex, OnceLock};

use futures::future::BoxFuture;
use wasmrpc_store::Store;

use crate::error::{Error, Result};
use crate::{RpcAgent, RpcBackendOptions};

/// The name of the built-in backend: this crate's agent.
pub const TENSORPIPE: &str = "TENSORPIPE";

/// The options of some backend. [`init_rpc_backend`] infers the backend
/// from their type when it is not named.
pub trait BackendOptions: Any + Debug + Send + Sync {
    /// The options as `Any`, for the backend's handler to downcast.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl BackendOptions for RpcBackendOptions {
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// What a backend's init handler is given
/// (`init_backend_handler(store, name, rank, world_size, options)`).
pub struct InitArgs {
    /// The group's store.
    pub store: Arc<dyn Store>,
    /// This worker's name.
    pub name: String,
    /// This worker's rank, if known.
    pub rank: Option<u32>,
    /// The group's size; `None` for a dynamic group.
    pub world_size: Option<u32>,
    /// The options, of the backend's own type.
    pub options: Box<dyn BackendOptions>,
}

/// Starts a backend's agent.
pub type InitBackendHandler =
    Arc<dyn Fn(InitArgs) -> BoxFuture<'static, Result<RpcAgent>> + Send + Sync>;

/// Builds a backend's options from the common settings (the RPC timeout
/// and the init method), as `construct_rpc_backend_options` does.
pub type ConstructOptionsHandler =
    Arc<dyn Fn(std::time::Duration, &str) -> Result<Box<dyn BackendOptions>> + Send + Sync>;

struct Entry {
    options_type: TypeId,
    construct: ConstructOptionsHandler,
    init: InitBackendHandler,
}

/// A registered backend, by name (`BackendType.<NAME>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendType {
    name: String,
}

impl BackendType {
    /// The name it was registered under.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Display for BackendType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BackendType.{}", self.name)
    }
}

fn registry() -> &'static Mutex<BTreeMap<String, Entry>> {
    static REGISTRY: OnceLock<Mutex<BTreeMap<String, Entry>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let construct: ConstructOptionsHandler = Arc::new(|rpc_timeout, init_method| {
            Ok(Box::new(RpcBackendOptions {
                rpc_timeout,
                init_method: init_method.to_string(),
                ..RpcBackendOptions::default()
            }))
        });
        let init: InitBackendHandler = Arc::new(|args: InitArgs| {
            Box::pin(async move {
                let shown = format!("{:?}", args.options);
                let options = args
                    .options
                    .into_any()
                    .downcast::<RpcBackendOptions>()
                    .map_err(|_| {
                        Error::type_error(format!(
                            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. {shown}"
                        ))
                    })?;
                crate::init_rpc(&args.name, args.rank, args.world_size, args.store, *options).await
            })
        });
        let entry = Entry {
            options_type: TypeId::of::<RpcBackendOptions>(),
            construct,
            init,
        };
        Mutex::new(BTreeMap::from([(TENSORPIPE.to_string(), entry)]))
    })
}

fn lock() -> std::sync::MutexGuard<'static, BTreeMap<String, Entry>> {
    registry().lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers backend `name`, whose options are of type `O`.
///
/// # Errors
/// `RuntimeError` "RPC backend {name}: already registered" for a name taken
/// (the built-in [`TENSORPIPE`] included).
pub fn register_backend<O: BackendOptions>(
    name: &str,
    construct_options: ConstructOptionsHandler,
    init_backend: InitBackendHandler,
) -> Result<BackendType> {
    let mut backends = lock();
    if backends.contains_key(name) {
        return Err(Error::runtime(format!(
            "RPC backend {name}: already registered"
        )));
    }
    backends.insert(
        name.to_string(),
        Entry {
            options_type: TypeId::of::<O>(),
            construct: construct_options,
            init: init_backend,
        },
    );
    Ok(BackendType {
        name: name.to_string(),
    })
}

/// Whether a backend of that name is registered.
pub fn backend_registered(name: &str) -> bool {
    lock().contains_key(name)
}

/// The backend registered as `name`.
pub fn backend(name: &str) -> Option<BackendType> {
    backend_registered(name).then(|| BackendType {
        name: name.to_string(),
    })
}

/// `backend`'s options built from the common settings.
///
/// # Errors
/// `RuntimeError` for a backend no longer registered, or the handler's.
pub fn construct_rpc_backend_options(
    backend: &BackendType,
    rpc_timeout: std::time::Duration,
    init_method: &str,
) -> Result<Box<dyn BackendOptions>> {
    let construct = lock()
        .get(backend.name())
        .map(|e| e.construct.clone())
        .ok_or_else(|| not_registered(backend))?;
    construct(rpc_timeout, init_method)
}

fn not_registered(backend: &BackendType) -> Error {
    Error::runtime(format!("RPC backend {}: not registered", backend.name()))
}

/// `init_rpc(name, backend=, rank=, world_size=, rpc_backend_options=)`:
/// starts this worker on `backend`, or, when none is named, on the backend
/// whose options type `options` are ([`TENSORPIPE`] when there are no
/// options either, with its defaults).
///
/// # Errors
/// `TypeError` "Could not infer backend for options {options:?}" when no
/// backend is named and no registered backend takes options of that type;
/// `RuntimeError` for a backend not registered; otherwise the backend's
/// init handler's errors.
pub async fn init_rpc_backend(
    name: &str,
    backend: Option<&BackendType>,
    rank: Option<u32>,
    world_size: Option<u32>,
    store: Arc<dyn Store>,
    options: Option<Box<dyn BackendOptions>>,
) -> Result<RpcAgent> {
    let (init, options) = {
        let backends = lock();
        let chosen = match (backend, &options) {
            (Some(backend), _) => backends
                .get(backend.name())
                .ok_or_else(|| not_registered(backend))?,
            (None, None) => &backends[TENSORPIPE],
            (None, Some(options)) => {
                let wanted = (**options).type_id();
                backends
                    .values()
                    .find(|e| e.options_type == wanted)
                    .ok_or_else(|| {
                        Error::type_error(format!(
                            "Could not infer backend for options {options:?}"
                        ))
                    })?
            }
        };
        let options = match options {
            Some(options) => options,
            None => (chosen.construct)(crate::DEFAULT_RPC_TIMEOUT, crate::DEFAULT_INIT_METHOD)?,
        };
        (chosen.init.clone(), options)
    };
    init(InitArgs {
        store,
        name: name.to_string(),
        rank,
        world_size,
        options,
    })
    .await
}
