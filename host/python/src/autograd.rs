//! Distributed autograd and the distributed optimizer for a Python
//! program: contexts, `backward`, `get_gradients`, and
//! `DistributedOptimizer` over parameter RRefs.
//!
//! Which context is current is the Python layer's to track (per thread, as
//! PyTorch does); every call made in one passes its id down
//! (`rpc::in_context`).

use std::sync::Mutex;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tch::Tensor;
use wasmrpc::dist_autograd;
use wasmrpc::optim::{Adam, DistributedOptimizer, OptimizerConfig, Sgd};

use crate::rref::PyRRef;
use crate::tensor;
use crate::worker::{self, to_py_err};

/// A new context on this worker; returns its id.
#[pyfunction]
pub(crate) fn new_context() -> PyResult<i64> {
    let agent = worker::agent()?;
    Ok(dist_autograd::new_context(&agent)
        .map_err(to_py_err)?
        .context_id())
}

/// Releases context `id` here and on every worker it reached.
#[pyfunction]
pub(crate) fn release_context(id: i64) -> PyResult<()> {
    let agent = worker::agent()?;
    dist_autograd::release_context(&agent, id).map_err(to_py_err)
}

fn tensors(list: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Tensor>> {
    list.try_iter()?
        .map(|t| {
            let t = t?;
            tensor::from_python(&t).ok_or_else(|| {
                PyTypeError::new_err(format!(
                    "{what} must be tensors, not {}",
                    t.get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })
        })
        .collect()
}

/// Runs backward from `roots` in context `context_id`, across every
/// worker the context reached.
#[pyfunction]
#[pyo3(signature = (context_id, roots, retain_graph = false))]
pub(crate) fn backward(
    py: Python<'_>,
    context_id: i64,
    roots: &Bound<'_, PyAny>,
    retain_graph: bool,
) -> PyResult<()> {
    let agent = worker::agent()?;
    let roots = tensors(roots, "roots")?;
    let pass = dist_autograd::backward(&agent, context_id, &roots, retain_graph);
    drop(roots);
    worker::block_on(py, pass)?.map_err(to_py_err)
}

/// The gradients context `context_id` accumulated on this worker, as a
/// dict from tensor to gradient.
#[pyfunction]
pub(crate) fn get_gradients<'py>(py: Python<'py>, context_id: i64) -> PyResult<Bound<'py, PyDict>> {
    let agent = worker::agent()?;
    let grads = dist_autograd::get_gradients(&agent, context_id).map_err(to_py_err)?;
    let out = PyDict::new(py);
    for (t, g) in grads.iter() {
        out.set_item(tensor::to_python(py, t)?, tensor::to_python(py, g)?)?;
    }
    Ok(out)
}

/// An optimizer over parameters owned by several workers
/// (`torch.distributed.optim.DistributedOptimizer`): the Python layer
/// names the kind (`"SGD"`, `"Adam"`) and passes its hyper-parameters.
#[pyclass(name = "DistributedOptimizer", module = "wasmrpc._native")]
pub(crate) struct PyDistributedOptimizer {
    inner: Mutex<Option<DistributedOptimizer>>,
}

fn config(kind: &str, hyper: &Bound<'_, PyDict>) -> PyResult<OptimizerConfig> {
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> { hyper.get_item(k) };
    let lr: f64 = match get("lr")? {
        Some(v) => v.extract()?,
        None if kind == "Adam" => 1e-3,
        None => {
            return Err(PyTypeError::new_err(
                "SGD needs a learning rate: DistributedOptimizer(optim.SGD, params, lr=...)",
            ));
        }
    };
    let known: &[&str] = match kind {
        "SGD" => &["lr", "momentum", "dampening", "weight_decay", "nesterov"],
        "Adam" => &["lr", "betas", "eps", "weight_decay"],
        other => {
            return Err(PyValueError::new_err(format!(
                "DistributedOptimizer supports optim.SGD and optim.Adam, not {other}"
            )));
        }
    };
    for key in hyper.keys() {
        let key: String = key.extract()?;
        if !known.contains(&key.as_str()) {
            return Err(PyTypeError::new_err(format!(
                "{kind}.__init__() got an unexpected keyword argument '{key}'"
            )));
        }
    }
    Ok(match kind {
        "SGD" => {
            let mut s = Sgd::new(lr);
            if let Some(v) = get("momentum")? {
                s = s.momentum(v.extract()?);
            }
            if let Some(v) = get("dampening")? {
                s = s.dampening(v.extract()?);
            }
            if let Some(v) = get("weight_decay")? {
                s = s.weight_decay(v.extract()?);
            }
            if let Some(v) = get("nesterov")? {
                s = s.nesterov(v.extract()?);
            }
            s.into()
        }
        _ => {
            let mut a = Adam::new(lr);
            if let Some(v) = get("betas")? {
                let (b1, b2): (f64, f64) = v.extract()?;
                a = a.betas(b1, b2);
            }
            if let Some(v) = get("eps")? {
                a = a.eps(v.extract()?);
            }
            if let Some(v) = get("weight_decay")? {
                a = a.weight_decay(v.extract()?);
            }
            a.into()
        }
    })
}

#[pymethods]
impl PyDistributedOptimizer {
    /// Creates a local optimizer of `kind` on every owner of `params`.
    #[new]
    fn new(
        py: Python<'_>,
        kind: &str,
        params: &Bound<'_, PyList>,
        hyper: &Bound<'_, PyDict>,
    ) -> PyResult<Self> {
        let agent = worker::agent()?;
        let config = config(kind, hyper)?;
        let rrefs = params
            .iter()
            .map(|p| {
                p.cast::<PyRRef>()
                    .map(|r| r.get().rref.clone())
                    .map_err(|_| PyTypeError::new_err("DistributedOptimizer takes a list of RRefs"))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let made = worker::block_on(py, async move {
            DistributedOptimizer::new(&agent, config, &rrefs).await
        })?;
        Ok(PyDistributedOptimizer {
            inner: Mutex::new(Some(made.map_err(to_py_err)?)),
        })
    }

    /// Steps every owner's parameters with context `context_id`'s
    /// gradients.
    fn step(&self, py: Python<'_>, context_id: i64) -> PyResult<()> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let opt = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("this DistributedOptimizer was closed"))?;
        worker::block_on(py, opt.step(context_id))?.map_err(to_py_err)
    }
}
