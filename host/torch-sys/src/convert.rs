//! Conversions between [`wasmrpc_abi::Value`] (what crosses the wire and the
//! guest boundary) and [`OpValue`], for the two callers of builtin ops: the
//! agent's builtin RPCs and the guests' tensor-op host import.
//!
//! Tensors are out of line in a `Value` (an index into a side table), so
//! both directions take a closure over the caller's table. This module owns
//! only the mapping of value kinds; tables, handles and their lifetimes stay
//! with the caller.

use crate::error::OpError;
use crate::op::{AdmitAll, OpGate, call_method_gated, call_op};
use crate::value::{OpValue, kind_code};
use tch::{Device, Tensor};
use wasmrpc_abi::protocol::CallArgs;
use wasmrpc_abi::{ErrorKind, RemoteError, Value};

/// The callee side of a builtin call in one step: converts `call`'s
/// arguments ([`op_value_from_abi`]), runs `name` ([`call_op`]) and returns
/// the value Python would see ([`OpValue::from_outputs`]: `None`, the one
/// output, or a tuple), its tensors stored through `store`.
///
/// # Errors
///
/// As for [`op_value_from_abi`] and [`call_op`]; `RemoteError::from` turns
/// any of them into what crosses the wire.
pub fn call_op_abi(
    name: &str,
    call: &CallArgs,
    tensor: &mut impl FnMut(u32) -> Option<Tensor>,
    store: &mut impl FnMut(Tensor) -> u32,
) -> Result<Value, OpError> {
    call_op_values(name, &call.args, &call.kwargs, tensor, store)
}

/// [`call_op_abi`] over separate positional and keyword values (the
/// agent's `Args` shape).
///
/// # Errors
///
/// As for [`call_op_abi`].
pub fn call_op_values(
    name: &str,
    args: &[Value],
    kwargs: &[(String, Value)],
    tensor: &mut impl FnMut(u32) -> Option<Tensor>,
    store: &mut impl FnMut(Tensor) -> u32,
) -> Result<Value, OpError> {
    let (args, kwargs) = convert_args(args, kwargs, tensor)?;
    let outputs = call_op(name, &args, &kwargs)?;
    Ok(op_value_into_abi(OpValue::from_outputs(outputs), store))
}

/// [`call_op_values`] for a tensor method on `args[0]` (an RRef proxy's
/// `rref.rpc_sync().view(1, 4)`): see [`call_method`](crate::call_method), including its
/// `AttributeError` for unknown methods.
///
/// # Errors
///
/// As for [`call_op_abi`] and [`call_method`](crate::call_method).
pub fn call_method_values(
    name: &str,
    args: &[Value],
    kwargs: &[(String, Value)],
    tensor: &mut impl FnMut(u32) -> Option<Tensor>,
    store: &mut impl FnMut(Tensor) -> u32,
) -> Result<Value, OpError> {
    call_method_values_gated(name, args, kwargs, tensor, store, &AdmitAll)
}

/// [`call_method_values`], with `gate` deciding whether each op it would
/// run may run ([`call_method_gated`]).
///
/// # Errors
///
/// As for [`call_method_values`], and the gate's refusal.
pub fn call_method_values_gated(
    name: &str,
    args: &[Value],
    kwargs: &[(String, Value)],
    tensor: &mut impl FnMut(u32) -> Option<Tensor>,
    store: &mut impl FnMut(Tensor) -> u32,
    gate: &dyn OpGate,
) -> Result<Value, OpError> {
    let (args, kwargs) = convert_args(args, kwargs, tensor)?;
    let outputs = call_method_gated(name, &args, &kwargs, gate)?;
    Ok(op_value_into_abi(OpValue::from_outputs(outputs), store))
}

type Converted = (Vec<OpValue>, Vec<(String, OpValue)>);

fn convert_args(
    args: &[Value],
    kwargs: &[(String, Value)],
    tensor: &mut impl FnMut(u32) -> Option<Tensor>,
) -> Result<Converted, OpError> {
    let args = args
        .iter()
        .map(|v| op_value_from_abi(v, tensor))
        .collect::<Result<Vec<_>, _>>()?;
    let kwargs = kwargs
        .iter()
        .map(|(k, v)| Ok((k.clone(), op_value_from_abi(v, tensor)?)))
        .collect::<Result<Vec<_>, OpError>>()?;
    Ok((args, kwargs))
}

/// Converts an argument from the wire or a guest into an [`OpValue`];
/// `tensor(i)` yields the tensor at index `i` of the caller's table (a
/// shallow clone: calls borrow their arguments).
///
/// A `torch.dtype` travels as its `ScalarType` code (an `Int`), a
/// `torch.device` as its string (`"cpu"`, `"cuda:0"`): ops accept both.
///
/// # Errors
///
/// A `TypeError` ([`OpError::Rejected`]) for values no op takes (bytes,
/// dicts, records, worker infos, RRefs) and a `RuntimeError` for a tensor
/// index the table lacks.
pub fn op_value_from_abi(
    value: &Value,
    tensor: &mut impl FnMut(u32) -> Option<Tensor>,
) -> Result<OpValue, OpError> {
    Ok(match value {
        Value::None => OpValue::None,
        Value::Bool(b) => OpValue::Bool(*b),
        Value::Int(i) => OpValue::Int(*i),
        Value::Float(f) => OpValue::Float(*f),
        Value::Str(s) => OpValue::Str(s.clone()),
        Value::List(items) => OpValue::List(
            items
                .iter()
                .map(|v| op_value_from_abi(v, tensor))
                .collect::<Result<_, _>>()?,
        ),
        Value::Tuple(items) => OpValue::Tuple(
            items
                .iter()
                .map(|v| op_value_from_abi(v, tensor))
                .collect::<Result<_, _>>()?,
        ),
        Value::Tensor(index) => {
            OpValue::Tensor(tensor(*index).ok_or_else(|| OpError::Internal {
                op: String::new(),
                message: format!("no tensor at index {index} of the call's tensor table"),
            })?)
        }
        other => {
            return Err(OpError::Rejected {
                kind: ErrorKind::TypeError,
                message: format!("builtin ops take no value of type '{}'", other.type_name()),
            });
        }
    })
}

/// Converts an op's result back into a [`Value`]; `store(t)` puts a tensor
/// in the caller's table and returns its index. Dtypes become their
/// `ScalarType` code and devices their string, as in
/// [`op_value_from_abi`].
pub fn op_value_into_abi(value: OpValue, store: &mut impl FnMut(Tensor) -> u32) -> Value {
    match value {
        OpValue::None => Value::None,
        OpValue::Bool(b) => Value::Bool(b),
        OpValue::Int(i) => Value::Int(i),
        OpValue::Float(f) => Value::Float(f),
        OpValue::Str(s) => Value::Str(s),
        OpValue::Tensor(t) => Value::Tensor(store(t)),
        OpValue::List(items) => Value::List(
            items
                .into_iter()
                .map(|v| op_value_into_abi(v, store))
                .collect(),
        ),
        OpValue::Tuple(items) => Value::Tuple(
            items
                .into_iter()
                .map(|v| op_value_into_abi(v, store))
                .collect(),
        ),
        OpValue::Dtype(kind) => Value::Int(kind_code(kind)),
        OpValue::Device(device) => Value::Str(device_string(device)),
    }
}

/// PyTorch's string for a device (`"cpu"`, `"cuda:1"`), which ops accept
/// wherever a `Device` is expected.
pub fn device_string(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_owned(),
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Mps => "mps".to_owned(),
        Device::Vulkan => "vulkan".to_owned(),
    }
}

impl From<OpError> for RemoteError {
    fn from(e: OpError) -> Self {
        RemoteError::new(e.kind(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn values_round_trip_through_a_tensor_table() {
        let table = [Tensor::from_slice(&[1.0_f32, 2.0])];
        let v = Value::Tuple(vec![
            Value::Tensor(0),
            Value::List(vec![Value::Int(2), Value::Float(0.5), Value::None]),
            Value::Str("cpu".into()),
            Value::Bool(true),
        ]);
        let op = op_value_from_abi(&v, &mut |i| {
            table.get(i as usize).map(Tensor::shallow_clone)
        })
        .unwrap();
        let mut stored = Vec::new();
        let back = op_value_into_abi(op, &mut |t| {
            stored.push(t);
            u32::try_from(stored.len() - 1).unwrap()
        });
        assert_eq!(back, v);
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].size(), [2]);
    }

    #[test]
    fn dtypes_and_devices_travel_as_codes_and_strings() {
        assert_eq!(
            op_value_into_abi(OpValue::Dtype(Kind::Double), &mut |_| 0),
            Value::Int(7)
        );
        assert_eq!(
            op_value_into_abi(OpValue::Device(Device::Cuda(1)), &mut |_| 0),
            Value::Str("cuda:1".into())
        );
    }

    #[test]
    fn call_op_abi_runs_a_builtin_over_tables() {
        let inputs = [Tensor::ones([2], (Kind::Float, Device::Cpu))];
        let call = CallArgs {
            args: vec![Value::Tensor(0), Value::Int(1)],
            kwargs: vec![("alpha".into(), Value::Int(2))],
        };
        let mut outputs = Vec::new();
        let result = call_op_abi(
            "aten::add",
            &call,
            &mut |i| inputs.get(i as usize).map(Tensor::shallow_clone),
            &mut |t| {
                outputs.push(t);
                u32::try_from(outputs.len() - 1).unwrap()
            },
        )
        .unwrap();
        assert_eq!(result, Value::Tensor(0));
        assert_eq!(Vec::<f32>::try_from(&outputs[0]).unwrap(), [3.0, 3.0]);

        let call = CallArgs {
            args: vec![Value::Tensor(0), Value::Int(0)],
            kwargs: vec![],
        };
        let result = call_op_abi(
            "aten::max",
            &call,
            &mut |i| inputs.get(i as usize).map(Tensor::shallow_clone),
            &mut |_| 7,
        )
        .unwrap();
        assert_eq!(
            result,
            Value::Tuple(vec![Value::Tensor(7), Value::Tensor(7)])
        );

        let call = CallArgs {
            args: vec![],
            kwargs: vec![],
        };
        let err = call_op_abi("aten::add", &call, &mut |_| None, &mut |_| 0).unwrap_err();
        assert!(err.to_string().starts_with(crate::NO_MATCHING_SCHEMA));
    }

    #[test]
    fn method_calls_over_a_tensor_table() {
        let inputs = [Tensor::ones([4], (Kind::Float, Device::Cpu))];
        let args = [Value::Tensor(0), Value::Int(1), Value::Int(4)];
        let mut outputs = Vec::new();
        let result = call_method_values(
            "view",
            &args,
            &[],
            &mut |i| inputs.get(i as usize).map(Tensor::shallow_clone),
            &mut |t| {
                outputs.push(t);
                u32::try_from(outputs.len() - 1).unwrap()
            },
        )
        .unwrap();
        assert_eq!(result, Value::Tensor(0));
        assert_eq!(outputs[0].size(), [1, 4]);
        let size = call_method_values(
            "size",
            &args[..1],
            &[],
            &mut |i| inputs.get(i as usize).map(Tensor::shallow_clone),
            &mut |_| 0,
        )
        .unwrap();
        assert_eq!(size, Value::List(vec![Value::Int(4)]));
        let err = call_method_values(
            "non_exist",
            &args[..1],
            &[],
            &mut |i| inputs.get(i as usize).map(Tensor::shallow_clone),
            &mut |_| 0,
        )
        .unwrap_err();
        assert_eq!(
            RemoteError::from(err),
            RemoteError::new(
                ErrorKind::AttributeError,
                "'Tensor' object has no attribute 'non_exist'"
            )
        );
    }

    #[test]
    fn values_no_op_takes_are_type_errors() {
        let err = op_value_from_abi(&Value::Bytes(vec![1]), &mut |_| None).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::TypeError);
        let err = op_value_from_abi(&Value::Tensor(3), &mut |_| None).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::RuntimeError);
        let remote = RemoteError::from(OpError::UnknownOp {
            name: "aten::x".into(),
        });
        assert_eq!(
            remote,
            RemoteError::new(ErrorKind::RuntimeError, "Unknown builtin op: aten::x")
        );
    }
}
