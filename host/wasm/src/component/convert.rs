//! Conversions between the plugin world's types (`guest-sdk/wit`) and
//! `wasmrpc_abi`'s: values as trees of nodes, call arguments, errors,
//! dtypes, handle kinds, outcomes and manifests.

use super::bindings::exports::wasmrpc::plugin::guest;
use super::bindings::wasmrpc::plugin::types;
use wasmrpc_abi::protocol::{self as abi, CallArgs, Outcome};
use wasmrpc_abi::{ErrorKind, RemoteError, Value, WorkerInfo};
/// Flattens `value` into nodes, root first.
pub(super) fn value_to_wit(value: &Value) -> types::Value {
    let mut nodes = Vec::new();
    push_node(value, &mut nodes);
    nodes
}

/// Appends `value`'s node (and, after it, its children's) and returns its
/// index.
fn push_node(value: &Value, nodes: &mut Vec<types::Node>) -> u32 {
    use types::Node as N;
    let at = nodes.len();
    nodes.push(N::None);
    let node = match value {
        Value::None => N::None,
        Value::Bool(b) => N::Boolean(*b),
        Value::Int(i) => N::Int(*i),
        Value::Float(f) => N::Float(*f),
        Value::Str(s) => N::Str(s.clone()),
        Value::Bytes(b) => N::Bytes(b.clone()),
        Value::List(items) => N::List(items.iter().map(|v| push_node(v, nodes)).collect()),
        Value::Tuple(items) => N::Tuple(items.iter().map(|v| push_node(v, nodes)).collect()),
        Value::Dict(items) => N::Dict(
            items
                .iter()
                .map(|(k, v)| (push_node(k, nodes), push_node(v, nodes)))
                .collect(),
        ),
        Value::Record { name, fields } => N::Record(types::RecordNode {
            name: name.clone(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.clone(), push_node(v, nodes)))
                .collect(),
        }),
        Value::WorkerInfo(w) => N::Worker(types::WorkerInfo {
            id: w.id,
            name: w.name.clone(),
        }),
        Value::Tensor(h) => N::Tensor(*h),
        Value::RRef(h) => N::Rref(*h),
    };
    nodes[at] = node;
    // A value has far fewer than 4G nodes: its encoding would not fit.
    u32::try_from(at).unwrap_or(u32::MAX)
}

/// Rebuilds a value from its nodes. Children must come after their parent
/// (so the nodes form a tree, never a cycle) and nesting is limited as
/// decoding limits it.
pub(super) fn value_from_wit(nodes: &types::Value) -> Result<Value, String> {
    if nodes.is_empty() {
        return Err("a value with no nodes".to_owned());
    }
    node(nodes, 0, 0)
}

fn node(nodes: &[types::Node], at: usize, depth: usize) -> Result<Value, String> {
    use types::Node as N;
    if depth > wasmrpc_abi::MAX_VALUE_DEPTH {
        return Err(format!(
            "a value nested deeper than {} levels",
            wasmrpc_abi::MAX_VALUE_DEPTH
        ));
    }
    let child = |i: u32| -> Result<Value, String> {
        let i = i as usize;
        if i <= at || i >= nodes.len() {
            return Err(format!("node {at} names node {i}, not a later node"));
        }
        node(nodes, i, depth + 1)
    };
    Ok(match &nodes[at] {
        N::None => Value::None,
        N::Boolean(b) => Value::Bool(*b),
        N::Int(i) => Value::Int(*i),
        N::Float(f) => Value::Float(*f),
        N::Str(s) => Value::Str(s.clone()),
        N::Bytes(b) => Value::Bytes(b.clone()),
        N::List(items) => Value::List(items.iter().map(|&i| child(i)).collect::<Result<_, _>>()?),
        N::Tuple(items) => Value::Tuple(items.iter().map(|&i| child(i)).collect::<Result<_, _>>()?),
        N::Dict(items) => Value::Dict(
            items
                .iter()
                .map(|&(k, v)| Ok((child(k)?, child(v)?)))
                .collect::<Result<_, String>>()?,
        ),
        N::Record(r) => Value::Record {
            name: r.name.clone(),
            fields: r
                .fields
                .iter()
                .map(|(k, v)| Ok((k.clone(), child(*v)?)))
                .collect::<Result<_, String>>()?,
        },
        N::Worker(w) => Value::WorkerInfo(WorkerInfo {
            id: w.id,
            name: w.name.clone(),
        }),
        N::Tensor(h) => Value::Tensor(*h),
        N::Rref(h) => Value::RRef(*h),
    })
}

pub(super) fn call_args_to_wit(args: &CallArgs) -> types::CallArgs {
    types::CallArgs {
        args: args.args.iter().map(value_to_wit).collect(),
        kwargs: args
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), value_to_wit(v)))
            .collect(),
    }
}

pub(super) fn call_args_from_wit(args: types::CallArgs) -> Result<CallArgs, String> {
    Ok(CallArgs {
        args: args
            .args
            .iter()
            .map(value_from_wit)
            .collect::<Result<_, _>>()?,
        kwargs: args
            .kwargs
            .iter()
            .map(|(k, v)| Ok((k.clone(), value_from_wit(v)?)))
            .collect::<Result<_, String>>()?,
    })
}

const KINDS: [(types::ErrorKind, ErrorKind); 10] = [
    (types::ErrorKind::RuntimeError, ErrorKind::RuntimeError),
    (types::ErrorKind::ValueError, ErrorKind::ValueError),
    (types::ErrorKind::TypeError, ErrorKind::TypeError),
    (types::ErrorKind::TimeoutError, ErrorKind::TimeoutError),
    (types::ErrorKind::KeyError, ErrorKind::KeyError),
    (types::ErrorKind::IndexError, ErrorKind::IndexError),
    (types::ErrorKind::AttributeError, ErrorKind::AttributeError),
    (
        types::ErrorKind::NotImplementedError,
        ErrorKind::NotImplementedError,
    ),
    (types::ErrorKind::AssertionError, ErrorKind::AssertionError),
    (
        types::ErrorKind::ConnectionError,
        ErrorKind::ConnectionError,
    ),
];

pub(super) fn error_to_wit(e: RemoteError) -> types::RemoteError {
    let kind = KINDS
        .iter()
        .find(|(_, k)| *k == e.kind)
        .map_or(types::ErrorKind::RuntimeError, |(w, _)| *w);
    types::RemoteError {
        kind,
        message: e.message,
    }
}

pub(super) fn error_from_wit(e: types::RemoteError) -> RemoteError {
    let kind = KINDS
        .iter()
        .find(|(w, _)| *w == e.kind)
        .map_or(ErrorKind::RuntimeError, |(_, k)| *k);
    RemoteError::new(kind, e.message)
}

const DTYPES: [(types::Dtype, abi::DType); 10] = [
    (types::Dtype::Float32, abi::DType::Float32),
    (types::Dtype::Float64, abi::DType::Float64),
    (types::Dtype::Float16, abi::DType::Float16),
    (types::Dtype::Bfloat16, abi::DType::BFloat16),
    (types::Dtype::Int64, abi::DType::Int64),
    (types::Dtype::Int32, abi::DType::Int32),
    (types::Dtype::Int16, abi::DType::Int16),
    (types::Dtype::Int8, abi::DType::Int8),
    (types::Dtype::Uint8, abi::DType::UInt8),
    (types::Dtype::Boolean, abi::DType::Bool),
];

pub(super) fn dtype_from_wit(d: types::Dtype) -> abi::DType {
    DTYPES
        .iter()
        .find(|(w, _)| *w == d)
        .map_or(abi::DType::Float32, |(_, a)| *a)
}

pub(super) fn meta_to_wit(m: abi::TensorMeta) -> types::TensorMeta {
    let dtype = DTYPES
        .iter()
        .find(|(_, a)| *a == m.dtype)
        .map_or(types::Dtype::Float32, |(w, _)| *w);
    types::TensorMeta {
        dtype,
        shape: m.shape,
        requires_grad: m.requires_grad,
    }
}

pub(super) fn kind_from_wit(k: types::HandleKind) -> abi::HandleKind {
    match k {
        types::HandleKind::Tensor => abi::HandleKind::Tensor,
        types::HandleKind::Rref => abi::HandleKind::RRef,
        types::HandleKind::Future => abi::HandleKind::Future,
    }
}

pub(super) fn mode_from_wit(m: types::RpcMode) -> abi::RpcMode {
    match m {
        types::RpcMode::Sync => abi::RpcMode::Sync,
        types::RpcMode::Async => abi::RpcMode::Async,
        types::RpcMode::Remote => abi::RpcMode::Remote,
    }
}

pub(super) fn outcome_from_wit(o: guest::Outcome) -> Result<Outcome, String> {
    Ok(match o {
        guest::Outcome::Returned(v) => Outcome::Return(value_from_wit(&v)?),
        guest::Outcome::Raised(e) => Outcome::Raise(error_from_wit(e)),
        guest::Outcome::Future(f) => Outcome::Future(f),
        guest::Outcome::Object(id) => Outcome::Object(id),
    })
}

pub(super) fn manifest_exports(m: guest::Manifest) -> Vec<wasmrpc_abi::manifest::Export> {
    m.exports
        .into_iter()
        .map(|e| wasmrpc_abi::manifest::Export {
            name: e.name,
            kind: match e.kind {
                guest::ExportKind::Function => abi::ExportKind::Function,
                guest::ExportKind::AsyncFunction => abi::ExportKind::AsyncFunction,
                guest::ExportKind::Constructor => abi::ExportKind::Constructor,
                guest::ExportKind::Method => abi::ExportKind::Method,
                guest::ExportKind::AsyncMethod => abi::ExportKind::AsyncMethod,
            },
            class: e.class,
            params: e.params,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_nodes() {
        let v = Value::Tuple(vec![
            Value::Int(1),
            Value::List(vec![Value::Str("a".into()), Value::Tensor(3)]),
            Value::Dict(vec![(Value::Str("k".into()), Value::RRef(2))]),
            Value::Record {
                name: "P".into(),
                fields: vec![("x".into(), Value::Float(0.5))],
            },
            Value::WorkerInfo(WorkerInfo {
                id: 1,
                name: "worker1".into(),
            }),
            Value::None,
            Value::Bytes(vec![1, 2]),
            Value::Bool(true),
        ]);
        assert_eq!(value_from_wit(&value_to_wit(&v)), Ok(v));
    }

    #[test]
    fn nodes_that_are_not_a_tree_are_refused() {
        use types::Node as N;
        assert!(value_from_wit(&vec![]).is_err());
        // A list naming itself, and one naming an earlier node.
        assert!(value_from_wit(&vec![N::List(vec![0])]).is_err());
        assert!(value_from_wit(&vec![N::Int(1), N::List(vec![0])]).is_ok());
        assert!(value_from_wit(&vec![N::List(vec![1]), N::List(vec![0])]).is_err());
        // Past the end.
        assert!(value_from_wit(&vec![N::Tuple(vec![5])]).is_err());
        // Too deep.
        let deep: Vec<N> = (0..200u32)
            .map(|i| N::List(vec![i + 1]))
            .chain([N::None])
            .collect();
        assert!(value_from_wit(&deep).unwrap_err().contains("deeper"));
    }

    #[test]
    fn every_error_kind_maps_both_ways() {
        for kind in ErrorKind::ALL {
            let e = RemoteError::new(kind, "m");
            assert_eq!(error_from_wit(error_to_wit(e.clone())), e);
        }
    }
}
