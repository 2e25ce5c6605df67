//! Python values ⇄ the host's values ([`Value`] trees with their tensor and
//! RRef tables): what a call's arguments become on the wire and what its
//! result becomes in Python.
//!
//! Only data crosses: `None`, `bool`, `int`, `float`, `str`, `bytes`,
//! lists, tuples, dicts, named tuples, tensors, `WorkerInfo`s, RRefs, and
//! torch's `dtype`/`device` objects (as the integer and the string the
//! host's ops take). Anything else (a function, an arbitrary object) is
//! refused with a `TypeError` naming its type: nothing is pickled.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tch::Tensor;
use wasmrpc::{Args, Handle, Payload, RRef, Value};

use crate::rref::PyRRef;
use crate::tensor;
use crate::worker::PyWorkerInfo;

/// How deeply containers may nest in a value, either way: a list that
/// contains itself must fail as an error, not overflow the stack.
pub(crate) const MAX_DEPTH: usize = 100;

fn too_deep() -> PyErr {
    PyValueError::new_err(format!(
        "cannot send a value nested more than {MAX_DEPTH} containers deep over RPC (does a \
         list or dict contain itself?)"
    ))
}

/// The tensors and RRefs the values being converted refer to.
#[derive(Default)]
pub(crate) struct Tables {
    pub(crate) tensors: Vec<Tensor>,
    pub(crate) rrefs: Vec<Handle>,
    depth: usize,
}

impl Tables {
    /// `obj` as a value, its tensors and RRefs appended to the tables.
    pub(crate) fn value(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
        if self.depth >= MAX_DEPTH {
            return Err(too_deep());
        }
        self.depth += 1;
        let v = self.leaf_or_container(obj);
        self.depth -= 1;
        v
    }

    fn leaf_or_container(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
        // `bool` before `int`: in Python a bool is an int.
        if obj.is_none() {
            return Ok(Value::None);
        }
        if let Ok(b) = obj.cast::<PyBool>() {
            return Ok(Value::Bool(b.is_true()));
        }
        if obj.is_instance_of::<PyInt>() {
            return match obj.extract::<i64>() {
                Ok(i) => Ok(Value::Int(i)),
                Err(_) => Err(PyOverflowError::new_err(format!(
                    "cannot send the integer {obj} over RPC: it does not fit in 64 bits"
                ))),
            };
        }
        if obj.is_instance_of::<PyFloat>() {
            return Ok(Value::Float(obj.extract::<f64>()?));
        }
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(Value::Str(s.to_str()?.to_owned()));
        }
        if let Ok(b) = obj.cast::<PyBytes>() {
            return Ok(Value::Bytes(b.as_bytes().to_vec()));
        }
        if let Some(t) = tensor::from_python(obj) {
            self.tensors.push(t);
            return Ok(Value::Tensor(self.tensors.len() as u32 - 1));
        }
        if let Ok(w) = obj.cast::<PyWorkerInfo>() {
            return Ok(Value::WorkerInfo(w.borrow().info.clone()));
        }
        if let Ok(r) = obj.cast::<PyRRef>() {
            self.rrefs.push(Handle::new(r.borrow().rref.clone()));
            return Ok(Value::RRef(self.rrefs.len() as u32 - 1));
        }
        if let Ok(l) = obj.cast::<PyList>() {
            return Ok(Value::List(
                l.iter().map(|v| self.value(&v)).collect::<PyResult<_>>()?,
            ));
        }
        if let Ok(d) = obj.cast::<PyDict>() {
            let mut entries = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                entries.push((self.value(&k)?, self.value(&v)?));
            }
            return Ok(Value::Dict(entries));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            // A named tuple keeps its type name and field names.
            if let Ok(fields) = obj.getattr("_fields") {
                let names: Vec<String> = fields.extract()?;
                let name = obj.get_type().name()?.to_string();
                let values = t.iter().map(|v| self.value(&v));
                return Ok(Value::Record {
                    name,
                    fields: names
                        .into_iter()
                        .zip(values)
                        .map(|(n, v)| Ok((n, v?)))
                        .collect::<PyResult<_>>()?,
                });
            }
            return Ok(Value::Tuple(
                t.iter().map(|v| self.value(&v)).collect::<PyResult<_>>()?,
            ));
        }
        if let Some(name) = function_ref_name(obj)? {
            return Ok(function_ref(name));
        }
        let type_name = obj.get_type().name()?.to_string();
        let module = obj.get_type().module()?.to_string();
        if module == "torch" && type_name == "dtype" {
            return Ok(Value::Int(dtype_code(obj)?));
        }
        if module == "torch" && type_name == "device" {
            return Ok(Value::Str(obj.str()?.to_string()));
        }
        Err(PyTypeError::new_err(format!(
            "cannot send a value of type {module}.{type_name} over RPC: wasmrpc sends data \
             (None, bool, int, float, str, bytes, lists, tuples, dicts, tensors, WorkerInfo, \
             RRef), never pickled objects; call a registered function by its name instead"
        )))
    }

    /// The arguments of a call: `args` (a tuple or list, or `None`) and
    /// `kwargs` (a dict with string keys, or `None`).
    pub(crate) fn args(
        mut self,
        args: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Args> {
        let mut positional = Vec::new();
        if let Some(args) = args.filter(|a| !a.is_none()) {
            for a in args.try_iter().map_err(|_| {
                PyTypeError::new_err(format!(
                    "args must be a tuple or a list, not {}",
                    args.get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })? {
                positional.push(self.value(&a?)?);
            }
        }
        let mut named = Vec::new();
        if let Some(kwargs) = kwargs.filter(|k| !k.is_none()) {
            let dict = kwargs
                .cast::<PyDict>()
                .map_err(|_| PyTypeError::new_err("kwargs must be a dict"))?;
            for (k, v) in dict.iter() {
                let key: String = k
                    .extract()
                    .map_err(|_| PyTypeError::new_err("kwargs keys must be strings"))?;
                named.push((key, self.value(&v)?));
            }
        }
        Ok(Args {
            positional,
            kwargs: named,
            tensors: self.tensors,
            rrefs: self.rrefs,
        })
    }

    /// `obj` as a payload of its own.
    pub(crate) fn payload(obj: &Bound<'_, PyAny>) -> PyResult<Payload> {
        let mut tables = Tables::default();
        let value = tables.value(obj)?;
        Ok(Payload {
            value,
            tensors: tables.tensors,
            rrefs: tables.rrefs,
        })
    }
}

/// The record a function reference travels as: the guest kit's
/// `wasmrpc.FunctionRef { name }`, which the receiver resolves among the
/// functions it serves. A function itself never crosses.
const FUNCTION_REF: &str = "wasmrpc.FunctionRef";
/// The guest kit's records of a module sent by value, and of a module
/// class (`guest-sdk/python/wasmrpc/nn/_transfer.py`): a Python program
/// refuses them with a `TypeError` that says what to send instead.
const MODULE: &str = "wasmrpc.Module";
const MODULE_CLASS: &str = "wasmrpc.ModuleClass";

fn function_ref(name: String) -> Value {
    Value::Record {
        name: FUNCTION_REF.to_string(),
        fields: vec![("name".to_string(), Value::Str(name))],
    }
}

/// The registered name `obj` stands for, if it is a function that has one:
/// a `wasmrpc.FunctionRef` (what `wasmrpc.plugin(...)` hands out) or a
/// torch builtin (`torch.add` is `aten::add`, PyTorch's own mapping). Any
/// other callable is refused: it could only travel pickled.
fn function_ref_name(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let py = obj.py();
    let refs = py.import("wasmrpc.plugins")?.getattr("FunctionRef")?;
    if obj.is_instance(&refs)? {
        return Ok(Some(obj.getattr("__wasmrpc_name__")?.extract()?));
    }
    if !obj.is_callable() || obj.is_instance_of::<pyo3::types::PyType>() {
        return Ok(None);
    }
    let builtin = py
        .import("torch.jit._builtins")?
        .getattr("_find_builtin")?
        .call1((obj,))?;
    if !builtin.is_none() {
        return Ok(Some(builtin.extract()?));
    }
    let what = obj.getattr("__qualname__").map_or_else(
        |_| obj.get_type().name().map(|n| n.to_string()),
        |q| q.extract(),
    )?;
    Err(PyTypeError::new_err(format!(
        "cannot send the function {what} over RPC: only registered functions travel, as \
         references to their names (a torch builtin, or a function of wasmrpc.plugin(path)); \
         code is never pickled"
    )))
}

/// libtorch's `ScalarType` code of a `torch.dtype`, which is what the
/// host's ops take for a dtype argument.
fn dtype_code(dtype: &Bound<'_, PyAny>) -> PyResult<i64> {
    let name = dtype.str()?.to_string();
    let code = match name.trim_start_matches("torch.") {
        "uint8" => 0,
        "int8" => 1,
        "int16" => 2,
        "int32" => 3,
        "int64" => 4,
        "float16" => 5,
        "float32" => 6,
        "float64" => 7,
        "complex32" => 8,
        "complex64" => 9,
        "complex128" => 10,
        "bool" => 11,
        "bfloat16" => 15,
        other => {
            return Err(PyTypeError::new_err(format!(
                "cannot send dtype torch.{other} over RPC"
            )));
        }
    };
    Ok(code)
}

/// A call's result in Python: `value` with its tables.
pub(crate) fn to_python<'py>(py: Python<'py>, payload: &Payload) -> PyResult<Bound<'py, PyAny>> {
    convert(py, &payload.value, payload, 0)
}

fn convert<'py>(
    py: Python<'py>,
    v: &Value,
    p: &Payload,
    depth: usize,
) -> PyResult<Bound<'py, PyAny>> {
    if depth >= MAX_DEPTH {
        return Err(too_deep());
    }
    let convert = |py: Python<'py>, v: &Value, p: &Payload| convert(py, v, p, depth + 1);
    Ok(match v {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => f.into_pyobject(py)?.into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::List(items) => PyList::new(
            py,
            items
                .iter()
                .map(|i| convert(py, i, p))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
        Value::Tuple(items) => PyTuple::new(
            py,
            items
                .iter()
                .map(|i| convert(py, i, p))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
        Value::Dict(entries) => {
            let d = PyDict::new(py);
            for (k, v) in entries {
                d.set_item(convert(py, k, p)?, convert(py, v, p)?)?;
            }
            d.into_any()
        }
        Value::Record { name, fields } if name == FUNCTION_REF => {
            let Some((_, Value::Str(function))) = fields.iter().find(|(n, _)| n == "name") else {
                return Err(PyTypeError::new_err("a function reference without a name"));
            };
            py.import("wasmrpc.plugins")?
                .getattr("FunctionRef")?
                .call1((function.as_str(),))?
        }
        Value::Record { name, fields } if name == MODULE || name == MODULE_CLASS => {
            let class = fields.iter().find_map(|(n, v)| match v {
                Value::Str(class) if n == "class" => Some(class.as_str()),
                _ => None,
            });
            return Err(PyTypeError::new_err(format!(
                "a plugin's nn.Module (class {}) arrived by value: a Python program cannot \
                 rebuild a plugin's module classes; have the plugin return model.state_dict() (a \
                 dict of tensors) and load it into a torch model",
                class.unwrap_or("unnamed")
            )));
        }
        Value::Record { name, fields } => {
            let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
            let class = py
                .import("collections")?
                .getattr("namedtuple")?
                .call1((name.as_str(), names))?;
            let values = fields
                .iter()
                .map(|(_, v)| convert(py, v, p))
                .collect::<PyResult<Vec<_>>>()?;
            class.call1(PyTuple::new(py, values)?)?
        }
        Value::WorkerInfo(w) => Bound::new(py, PyWorkerInfo { info: w.clone() })?.into_any(),
        Value::Tensor(i) => {
            let t = p.tensors.get(*i as usize).ok_or_else(|| {
                PyTypeError::new_err(format!("tensor index {i} outside the result's table"))
            })?;
            tensor::to_python(py, t)?
        }
        Value::RRef(i) => {
            let handle = p.rrefs.get(*i as usize).ok_or_else(|| {
                PyTypeError::new_err(format!("RRef index {i} outside the result's table"))
            })?;
            let rref = handle.downcast_ref::<RRef>().ok_or_else(|| {
                PyTypeError::new_err("a handle in the result is not an RRef".to_string())
            })?;
            Bound::new(py, PyRRef::new(rref.clone()))?.into_any()
        }
    })
}
