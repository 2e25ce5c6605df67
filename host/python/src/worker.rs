//! The process's worker: the tokio runtime the agent runs on, the agent
//! itself (PyTorch's module-level "current agent"), its start and its
//! stop, `WorkerInfo`, and how host errors become Python exceptions.
//!
//! Every blocking wait here lets go of the GIL first, so Python threads
//! (and the callbacks that complete `rpc_async` futures) keep running.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{
    PyAssertionError, PyAttributeError, PyConnectionError, PyIndexError, PyKeyError,
    PyNotImplementedError, PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use wasmrpc::{ErrorKind, FunctionRegistry, PluginHost, RpcAgent, RpcBackendOptions, WorkerInfo};

/// The runtime every agent of this process runs on, made by the first
/// `init_rpc` with its `num_worker_threads`, at most this process's share
/// of the host's cores.
static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// The agent `init_rpc` started, until `shutdown`.
static AGENT: Mutex<Option<RpcAgent>> = Mutex::new(None);

pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    RUNTIME
        .get()
        .ok_or_else(|| PyRuntimeError::new_err(NOT_INITIALIZED))
}

/// PyTorch's text for a call before `init_rpc` or after `shutdown`.
const NOT_INITIALIZED: &str =
    "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.";

/// The current agent.
///
/// # Errors
/// PyTorch's `RuntimeError` "RPC has not been initialized ..." when there
/// is none.
pub(crate) fn agent() -> PyResult<RpcAgent> {
    AGENT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or_else(|| PyRuntimeError::new_err(NOT_INITIALIZED))
}

/// Runs `fut` to completion on the runtime with the GIL released.
pub(crate) fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    Ok(py.detach(|| rt.block_on(fut)))
}

/// A host error as the Python exception PyTorch raises for it: the class
/// of its kind, its message and then where it happened.
pub(crate) fn to_py_err(e: wasmrpc::Error) -> PyErr {
    let mut text = e.message().to_string();
    for line in e.context() {
        text.push_str("\n  while ");
        text.push_str(line);
    }
    match e.kind() {
        ErrorKind::RuntimeError => PyRuntimeError::new_err(text),
        ErrorKind::ValueError => PyValueError::new_err(text),
        ErrorKind::TypeError => PyTypeError::new_err(text),
        ErrorKind::TimeoutError => PyTimeoutError::new_err(text),
        ErrorKind::KeyError => PyKeyError::new_err(text),
        ErrorKind::IndexError => PyIndexError::new_err(text),
        ErrorKind::AttributeError => PyAttributeError::new_err(text),
        ErrorKind::NotImplementedError => PyNotImplementedError::new_err(text),
        ErrorKind::AssertionError => PyAssertionError::new_err(text),
        ErrorKind::ConnectionError => PyConnectionError::new_err(text),
    }
}

/// A rendezvous failure as the exception PyTorch raises for it: its
/// `ValueError`s (a missing rank or world size) stay `ValueError`s.
fn store_err(init_method: &str, e: wasmrpc::store::Error) -> PyErr {
    let text = format!("rendezvous through {init_method} failed: {e}");
    match e.python_kind() {
        "ValueError" => PyValueError::new_err(text),
        "AssertionError" => PyAssertionError::new_err(text),
        _ => PyRuntimeError::new_err(text),
    }
}

/// A worker's identity (`torch.distributed.rpc.WorkerInfo`): its `name`
/// and its rank, `id`.
#[pyclass(name = "WorkerInfo", module = "wasmrpc.rpc", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash, Clone)]
pub(crate) struct PyWorkerInfo {
    pub(crate) info: WorkerInfo,
}

#[pymethods]
impl PyWorkerInfo {
    /// `WorkerInfo(name, id)`; the name must follow PyTorch's rules.
    #[new]
    fn new(name: String, id: u32) -> PyResult<Self> {
        wasmrpc::validate_worker_name(&name).map_err(to_py_err)?;
        Ok(PyWorkerInfo {
            info: WorkerInfo { id, name },
        })
    }

    /// The worker's name.
    #[getter]
    fn name(&self) -> &str {
        &self.info.name
    }

    /// The worker's rank.
    #[getter]
    fn id(&self) -> u32 {
        self.info.id
    }

    fn __repr__(&self) -> String {
        format!("WorkerInfo(id={}, name={})", self.info.id, self.info.name)
    }
}

/// What `init_rpc` takes besides the name, rank and world size (the
/// Python layer fills it from `RpcBackendOptions`).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct InitOptions {
    init_method: String,
    rpc_timeout: f64,
    num_worker_threads: usize,
    init_timeout: f64,
    plugins: Vec<PathBuf>,
    cluster_secret: Option<Vec<u8>>,
    listen: String,
}

/// Starts this process's worker and joins its group (`init_rpc`).
#[pyfunction]
pub(crate) fn init_rpc(
    py: Python<'_>,
    name: String,
    rank: i64,
    world_size: i64,
    options: InitOptions,
) -> PyResult<()> {
    if AGENT.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
        return Err(PyRuntimeError::new_err(
            "RPC is already initialized (call shutdown() first)",
        ));
    }
    let threads = options.num_worker_threads.max(1);
    let rt = match RUNTIME.get() {
        Some(rt) => rt,
        None => {
            // More threads than this process's share of the cores run no
            // more calls at once: they make the runtime wake threads that
            // find nothing to do (docs: Tuning, "Runtime threads"). The
            // agent still reports `num_worker_threads`.
            let built = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads.min(wasmrpc::cores_per_local_worker()))
                .thread_name("wasmrpc")
                .enable_all()
                .build()
                .map_err(|e| PyRuntimeError::new_err(format!("cannot start tokio: {e}")))?;
            // Another thread may have won the race; either runtime is fine.
            let _ = RUNTIME.set(built);
            runtime()?
        }
    };
    let listen = options
        .listen
        .parse()
        .map_err(|e| PyValueError::new_err(format!("listen address {:?}: {e}", options.listen)))?;
    let secs = |s: f64, what: &str| {
        Duration::try_from_secs_f64(s.max(0.0))
            .map_err(|e| PyValueError::new_err(format!("{what} {s}: {e}")))
    };
    let rpc_timeout = secs(options.rpc_timeout, "rpc_timeout")?;
    let init_timeout = secs(options.init_timeout, "init_timeout")?;
    let started = py.detach(|| {
        rt.block_on(async move {
            let registry = FunctionRegistry::new();
            if !options.plugins.is_empty() {
                load_plugins(&options.plugins, &registry).await?;
            }
            let init_method = options.init_method.clone();
            let rendezvous_failed = |e: wasmrpc::store::Error| store_err(&init_method, e);
            // A dynamic group with a rank: PyTorch makes its store without
            // `rendezvous`, which requires a world size (as `wasmrpc worker`).
            let (store, rank, world) = match (u32::try_from(rank), world_size) {
                (Ok(rank), -1) if !options.init_method.starts_with("env://") => {
                    let store =
                        wasmrpc::store::dynamic_store(&options.init_method, rank, init_timeout)
                            .await
                            .map_err(rendezvous_failed)?;
                    (store, i64::from(rank), -1)
                }
                _ => {
                    wasmrpc::store::rendezvous(&options.init_method, rank, world_size, init_timeout)
                        .await
                        .map_err(rendezvous_failed)?
                }
            };
            let rank = u32::try_from(rank)
                .map_err(|_| PyValueError::new_err(format!("invalid rank {rank}")))?;
            let world = u32::try_from(world).ok();
            let backend = RpcBackendOptions {
                rpc_timeout,
                num_worker_threads: threads,
                init_method: options.init_method.clone(),
                listen_addr: listen,
                init_timeout,
                cluster_secret: options.cluster_secret,
                registry: std::sync::Arc::new(registry),
                ..RpcBackendOptions::default()
            };
            wasmrpc::init_rpc(&name, Some(rank), world, store, backend)
                .await
                .map_err(to_py_err)
        })
    });
    let agent = started?;
    *AGENT.lock().unwrap_or_else(|p| p.into_inner()) = Some(agent);
    Ok(())
}

/// Loads the plugins in `paths` (files or folders of `*.wasm`) and
/// registers their functions, as `wasmrpc worker --plugins` does.
async fn load_plugins(paths: &[PathBuf], registry: &FunctionRegistry) -> PyResult<()> {
    let host = PluginHost::shared().map_err(to_py_err)?;
    for path in paths {
        host.load_and_register(path, registry).await.map_err(|e| {
            PyRuntimeError::new_err(format!(
                "cannot load the plugins in {}: {e}",
                path.display()
            ))
        })?;
    }
    Ok(())
}

/// Stops this process's worker (`shutdown`): gracefully, it first waits
/// for every worker of the group to be done.
#[pyfunction]
#[pyo3(signature = (graceful = true, timeout = 0.0))]
pub(crate) fn shutdown(py: Python<'_>, graceful: bool, timeout: f64) -> PyResult<()> {
    let agent = agent()?;
    let timeout = Duration::try_from_secs_f64(timeout.max(0.0))
        .map_err(|e| PyValueError::new_err(format!("timeout {timeout}: {e}")))?;
    let done = block_on(py, async move { agent.shutdown(graceful, timeout).await })?;
    *AGENT.lock().unwrap_or_else(|p| p.into_inner()) = None;
    done.map_err(to_py_err)
}

/// A worker's `WorkerInfo`, by name or rank; this worker's without one.
#[pyfunction]
#[pyo3(signature = (worker_name = None))]
pub(crate) fn get_worker_info(worker_name: Option<&Bound<'_, PyAny>>) -> PyResult<PyWorkerInfo> {
    let agent = agent()?;
    let info = match worker_name {
        None => agent.info().clone(),
        Some(w) if w.is_none() => agent.info().clone(),
        Some(w) => match w.extract::<u32>() {
            Ok(rank) => agent.resolve(rank).map_err(to_py_err)?,
            Err(_) => agent
                .get_worker_info(Some(&w.extract::<String>()?))
                .map_err(to_py_err)?,
        },
    };
    Ok(PyWorkerInfo { info })
}

/// Every worker of the group.
#[pyfunction]
pub(crate) fn get_worker_infos() -> PyResult<Vec<PyWorkerInfo>> {
    Ok(agent()?
        .get_worker_infos()
        .into_iter()
        .map(|info| PyWorkerInfo { info })
        .collect())
}

/// The default timeout of calls, in seconds (`_get_current_rpc_agent
/// ().get_rpc_timeout()`).
#[pyfunction]
pub(crate) fn get_rpc_timeout() -> PyResult<f64> {
    Ok(agent()?.get_rpc_timeout().as_secs_f64())
}

/// Sets the default timeout of calls, in seconds (`_set_rpc_timeout`).
#[pyfunction]
pub(crate) fn set_rpc_timeout(seconds: f64) -> PyResult<()> {
    let timeout = Duration::try_from_secs_f64(seconds.max(0.0))
        .map_err(|e| PyValueError::new_err(format!("timeout {seconds}: {e}")))?;
    agent()?.set_rpc_timeout(timeout);
    Ok(())
}
