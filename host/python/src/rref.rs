//! `RRef` for a Python program: a reference to a value some worker owns,
//! with `to_here`, `local_value`, its owner, and the calls behind its
//! `rpc_sync()` / `rpc_async()` / `remote()` proxies.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use wasmrpc::{RRef, RRefProxyMode};

use crate::rpc;
use crate::values::{self, Tables};
use crate::worker::{self, PyWorkerInfo, to_py_err};

/// A reference to a value owned by a worker of the group
/// (`torch.distributed.rpc.RRef`).
#[pyclass(name = "RRef", module = "wasmrpc.rpc", frozen, subclass)]
pub(crate) struct PyRRef {
    pub(crate) rref: RRef,
}

impl PyRRef {
    pub(crate) fn new(rref: RRef) -> Self {
        PyRRef { rref }
    }

    fn proxy(&self, mode: RRefProxyMode, timeout: Option<f64>) -> PyResult<PyRRefProxy> {
        Ok(PyRRefProxy {
            rref: self.rref.clone(),
            mode,
            timeout: rpc::timeout(timeout)?,
        })
    }
}

/// `rref.rpc_sync()`, `rref.rpc_async()` or `rref.remote()`: any attribute
/// is a method of the value, called on its owner.
#[pyclass(name = "RRefProxy", module = "wasmrpc.rpc", frozen)]
pub(crate) struct PyRRefProxy {
    rref: RRef,
    mode: RRefProxyMode,
    timeout: Option<std::time::Duration>,
}

#[pymethods]
impl PyRRefProxy {
    fn __getattr__(&self, method: String) -> PyRRefMethod {
        PyRRefMethod {
            rref: self.rref.clone(),
            mode: self.mode,
            timeout: self.timeout,
            method,
        }
    }
}

/// One method of an RRef's value, through a proxy; calling it calls the
/// method on the owner.
#[pyclass(name = "RRefMethod", module = "wasmrpc.rpc", frozen)]
pub(crate) struct PyRRefMethod {
    rref: RRef,
    mode: RRefProxyMode,
    timeout: Option<std::time::Duration>,
    method: String,
}

#[pymethods]
impl PyRRefMethod {
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let agent = worker::agent()?;
        let call_args = Tables::default().args(Some(args.as_any()), kwargs.map(|k| k.as_any()))?;
        let method = self.method.clone();
        let timeout = self.timeout;
        let context = rpc::current_context(py)?;
        match self.mode {
            RRefProxyMode::Sync => {
                let proxy = self.rref.rpc_sync(&agent, timeout);
                let out = rpc::block_in_context(py, context, async move {
                    proxy.call(&method, call_args).await
                })?;
                values::to_python(py, &out.map_err(to_py_err)?)
            }
            RRefProxyMode::Async => {
                let proxy = self.rref.rpc_async(&agent, timeout);
                let fut = rpc::block_in_context(py, context, async move {
                    proxy.call_async(&method, call_args)
                })?;
                rpc::torch_future(py, fut)
            }
            RRefProxyMode::Remote => {
                let proxy = self.rref.remote(&agent, timeout);
                let made = rpc::block_in_context(py, context, async move {
                    proxy.call_remote(&method, call_args).await
                })?;
                Ok(Bound::new(py, PyRRef::new(made.map_err(to_py_err)?))?.into_any())
            }
        }
    }
}

#[pymethods]
impl PyRRef {
    /// `RRef(value)`: an RRef this worker owns, holding `value`.
    #[new]
    fn create(value: &Bound<'_, PyAny>) -> PyResult<Self> {
        let agent = worker::agent()?;
        let payload = Tables::payload(value)?;
        Ok(PyRRef::new(RRef::new(&agent, payload)))
    }

    /// The owner's `WorkerInfo`.
    fn owner(&self) -> PyWorkerInfo {
        PyWorkerInfo {
            info: self.rref.owner(),
        }
    }

    /// The owner's name.
    fn owner_name(&self) -> String {
        self.rref.owner_name().to_string()
    }

    /// Whether this worker owns the value.
    fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    /// Whether the owner knows of this reference.
    fn confirmed_by_owner(&self) -> bool {
        self.rref.confirmed_by_owner()
    }

    /// The value, fetched from its owner (a copy; on the owner, the value).
    #[pyo3(signature = (timeout = None))]
    fn to_here<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyAny>> {
        let agent = worker::agent()?;
        let timeout = rpc::timeout(timeout)?;
        let rref = self.rref.clone();
        // In a distributed autograd context, the value joins its graph.
        let context = rpc::current_context(py)?;
        let value =
            rpc::block_in_context(
                py,
                context,
                async move { rref.to_here(&agent, timeout).await },
            )?;
        values::to_python(py, &value.map_err(to_py_err)?)
    }

    /// The value itself, on its owner; PyTorch's `RuntimeError` elsewhere.
    fn local_value<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let agent = worker::agent()?;
        let rref = self.rref.clone();
        let value = worker::block_on(py, async move { rref.local_value(&agent).await })?;
        values::to_python(py, &value.map_err(to_py_err)?)
    }

    /// A future that completes once the owner has created the value (or
    /// failed to): `RRef._get_future()`.
    fn _get_future<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        rpc::torch_future(py, self.rref.get_future())
    }

    /// A proxy whose method calls run on the owner and return their result
    /// (`rref.rpc_sync().method(...)`).
    #[pyo3(signature = (timeout = None))]
    fn rpc_sync(&self, timeout: Option<f64>) -> PyResult<PyRRefProxy> {
        self.proxy(RRefProxyMode::Sync, timeout)
    }

    /// A proxy whose method calls return futures of their results.
    #[pyo3(signature = (timeout = None))]
    fn rpc_async(&self, timeout: Option<f64>) -> PyResult<PyRRefProxy> {
        self.proxy(RRefProxyMode::Async, timeout)
    }

    /// A proxy whose method calls keep their results on the owner and
    /// return RRefs to them.
    #[pyo3(signature = (timeout = None))]
    fn remote(&self, timeout: Option<f64>) -> PyResult<PyRRefProxy> {
        self.proxy(RRefProxyMode::Remote, timeout)
    }

    /// Backward from the scalar tensor the RRef holds, on its owner: local
    /// autograd (filling `.grad`) without a context, else a distributed
    /// pass in context `dist_autograd_ctx_id`.
    #[pyo3(signature = (dist_autograd_ctx_id = -1, retain_graph = false))]
    fn backward(
        &self,
        py: Python<'_>,
        dist_autograd_ctx_id: i64,
        retain_graph: bool,
    ) -> PyResult<()> {
        let agent = worker::agent()?;
        let rref = self.rref.clone();
        let context = (dist_autograd_ctx_id != -1).then_some(dist_autograd_ctx_id);
        let done = worker::block_on(py, async move {
            rref.backward(&agent, context, retain_graph).await
        })?;
        done.map_err(to_py_err)
    }

    /// Refused, as PyTorch refuses it: an RRef travels only as an RPC
    /// argument, never through Python's pickle.
    fn __reduce__(&self) -> PyResult<()> {
        Err(pyo3::exceptions::PyRuntimeError::new_err(
            "Can not pickle rref in python pickler, rref can only be pickled when using RPC",
        ))
    }

    fn __repr__(&self) -> String {
        self.rref.to_string()
    }
}
