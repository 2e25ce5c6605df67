//! The calls a Python program makes: `rpc_sync`, `rpc_async` and `remote`
//! of a function named by its registered name, in the caller's
//! distributed autograd context when it has one.
//!
//! The Python layer (`wasmrpc/rpc/__init__.py`) turns what a user passes
//! as the function (a name, a decorated plugin function, a torch builtin)
//! into its name, and wraps `rpc_async`'s completion in a
//! `torch.futures.Future`.

use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
use wasmrpc::{Args, CallKind, CallOptions, Dest, Payload, Remote, RpcAgent};

use crate::rref::PyRRef;
use crate::values::{self, Tables};
use crate::worker::{self, PyWorkerInfo, to_py_err};

/// Where a call goes: a worker's name, its rank or its `WorkerInfo`. A
/// float names no worker (the host's `ValueError`), a rank outside the
/// group none either (its `RuntimeError`), as in PyTorch.
pub(crate) fn dest(to: &Bound<'_, PyAny>) -> PyResult<Dest> {
    if let Ok(w) = to.cast::<PyWorkerInfo>() {
        return Ok(Dest::Info(w.borrow().info.clone()));
    }
    if let Ok(name) = to.cast::<PyString>() {
        return Ok(Dest::Name(name.to_str()?.to_owned()));
    }
    if to.is_instance_of::<PyInt>() && !to.is_instance_of::<PyBool>() {
        return Ok(match to.extract::<i64>() {
            Ok(rank) => Dest::Rank(rank),
            Err(_) => Dest::Invalid(to.repr()?.to_string()),
        });
    }
    if to.is_instance_of::<PyFloat>() {
        return Ok(Dest::Invalid(to.repr()?.to_string()));
    }
    Err(PyTypeError::new_err(format!(
        "a call's destination is a worker's name, rank or WorkerInfo, not {}",
        to.get_type().name()?
    )))
}

/// PyTorch's timeout argument: a negative value (its `UNSET_RPC_TIMEOUT`)
/// or none means the agent's default, zero means none.
pub(crate) fn timeout(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s < 0.0 => Ok(None),
        Some(s) => Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|e| PyValueError::new_err(format!("timeout {s}: {e}"))),
    }
}

/// The calling thread's distributed autograd context, which the Python
/// layer tracks per thread (`with dist_autograd.context()`), as PyTorch
/// does.
pub(crate) fn current_context(py: Python<'_>) -> PyResult<Option<i64>> {
    py.import("wasmrpc.distributed.autograd")?
        .getattr("_current_context_id")?
        .call0()?
        .extract()
}

/// Runs `f` in distributed autograd context `context` (when given), so
/// that a call it makes records its send and receive functions there.
pub(crate) async fn in_context<Fut: std::future::Future>(
    context: Option<i64>,
    fut: Fut,
) -> wasmrpc::Result<Fut::Output> {
    match context {
        Some(id) => wasmrpc::dist_autograd::with_context(id, fut).await,
        None => Ok(fut.await),
    }
}

/// Runs `fut` to completion with the GIL released, inside the calling
/// thread's distributed autograd context `context`.
pub(crate) fn block_in_context<F>(
    py: Python<'_>,
    context: Option<i64>,
    fut: F,
) -> PyResult<F::Output>
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    worker::block_on(py, in_context(context, fut))?.map_err(to_py_err)
}

/// A call as Python gave it, converted: where it goes, what it runs, its
/// arguments, its timeout, and the calling thread's autograd context.
struct Call {
    agent: RpcAgent,
    to: Dest,
    function: String,
    args: Args,
    timeout: Option<Duration>,
    context: Option<i64>,
}

impl Call {
    fn new(
        py: Python<'_>,
        to: &Bound<'_, PyAny>,
        function: String,
        args: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Call> {
        Ok(Call {
            agent: worker::agent()?,
            to: dest(to)?,
            function,
            args: Tables::default().args(args, kwargs)?,
            timeout: self::timeout(timeout)?,
            context: current_context(py)?,
        })
    }

    /// Makes the call (in its context) and returns its future.
    async fn start(self, kind: CallKind) -> wasmrpc::Future {
        let mut options = CallOptions::new(kind);
        options.timeout = self.timeout;
        self.agent.call(self.to, &self.function, self.args, options)
    }
}

/// `rpc_sync`: runs `function` on `to` and returns its result.
#[pyfunction]
#[pyo3(signature = (to, function, args = None, kwargs = None, timeout = None))]
pub(crate) fn rpc_sync<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    function: String,
    args: Option<&Bound<'py, PyAny>>,
    kwargs: Option<&Bound<'py, PyAny>>,
    timeout: Option<f64>,
) -> PyResult<Bound<'py, PyAny>> {
    let call = Call::new(py, to, function, args, kwargs, timeout)?;
    // Made and awaited in one trip into the runtime: the GIL is let go
    // once per call.
    let result = block_in_context(py, call.context, async move {
        call.start(CallKind::Sync).await.wait().await
    })?;
    values::to_python(py, &result.map_err(to_py_err)?)
}

/// `rpc_async`: starts `function` on `to` and returns a
/// `torch.futures.Future` of its result.
#[pyfunction]
#[pyo3(signature = (to, function, args = None, kwargs = None, timeout = None))]
pub(crate) fn rpc_async<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    function: String,
    args: Option<&Bound<'py, PyAny>>,
    kwargs: Option<&Bound<'py, PyAny>>,
    timeout: Option<f64>,
) -> PyResult<Bound<'py, PyAny>> {
    let call = Call::new(py, to, function, args, kwargs, timeout)?;
    let fut = block_in_context(py, call.context, call.start(CallKind::Async))?;
    torch_future(py, fut)
}

/// A `torch.futures.Future` completed with `fut`'s outcome (its value, or
/// its error raised as the matching Python exception by `wait()`).
pub(crate) fn torch_future<'py>(
    py: Python<'py>,
    fut: wasmrpc::Future,
) -> PyResult<Bound<'py, PyAny>> {
    let made = py.import("wasmrpc._futures")?.getattr("new")?.call0()?;
    let (torch_fut, done): (Bound<'py, PyAny>, Py<PyAny>) = made.extract()?;
    complete_later(fut, done)?;
    Ok(torch_fut)
}

/// Calls `done(ok, value)` once `fut` ends. The call happens on a blocking
/// thread of the runtime: taking the GIL must never stall the threads that
/// move messages.
fn complete_later(fut: wasmrpc::Future, done: Py<PyAny>) -> PyResult<()> {
    let rt = worker::runtime()?;
    let handle = rt.handle().clone();
    rt.spawn(async move {
        let result = fut.wait().await;
        let _ = handle.spawn_blocking(move || deliver(result, done)).await;
    });
    Ok(())
}

fn deliver(result: wasmrpc::Result<Payload>, done: Py<PyAny>) {
    Python::attach(|py| {
        let outcome = match result {
            Ok(p) => values::to_python(py, &p).map(|v| (true, v)),
            Err(e) => Ok((false, to_py_err(e).into_value(py).into_bound(py).into_any())),
        };
        let called = match outcome {
            Ok((ok, value)) => done.call1(py, (ok, value)),
            Err(conversion) => done.call1(py, (false, conversion.into_value(py))),
        };
        if let Err(e) = called {
            // The callback is ours (it sets a torch future); a failure here
            // is a bug worth seeing, not a reason to take the process down.
            e.print(py);
        }
    });
}

/// `remote`: runs `function` on `to`, keeps the result there, and returns
/// an RRef to it at once.
#[pyfunction]
#[pyo3(signature = (to, function, args = None, kwargs = None, timeout = None))]
pub(crate) fn remote<'py>(
    py: Python<'py>,
    to: &Bound<'py, PyAny>,
    function: String,
    args: Option<&Bound<'py, PyAny>>,
    kwargs: Option<&Bound<'py, PyAny>>,
    timeout: Option<f64>,
) -> PyResult<PyRRef> {
    let call = Call::new(py, to, function, args, kwargs, timeout)?;
    let made = block_in_context(py, call.context, async move {
        let Call {
            agent,
            to,
            function,
            args,
            timeout,
            ..
        } = call;
        match timeout {
            Some(t) => agent.remote_with_timeout(to, &function, args, t),
            None => agent.remote(to, &function, args),
        }
    })?;
    Ok(PyRRef::new(made.map_err(to_py_err)?))
}
