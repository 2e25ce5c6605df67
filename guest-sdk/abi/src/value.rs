//! [`Value`], the dynamically typed value of every call's arguments and result.

use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// A worker's identity: its rank (`id`) and its unique name.
///
/// Ordered and hashed by `(id, name)`, as PyTorch's `WorkerInfo` compares.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's rank in the group.
    pub id: u32,
    /// The worker's name, unique in the group.
    pub name: String,
}

/// Everything a call can take or return.
///
/// Mirrors the Python values the seed tests pass: `None`, scalars, strings,
/// bytes, containers, named records, worker infos, tensors and RRefs.
/// Tensors and RRefs are out of line: the variants hold an index into a table
/// that travels beside the value (see the crate docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value {
    /// Python's `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// A 64-bit signed integer.
    Int(i64),
    /// A 64-bit float.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes.
    Bytes(#[serde(with = "crate::raw_bytes")] Vec<u8>),
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A dict, in insertion order; keys may be any value.
    Dict(Vec<(Value, Value)>),
    /// A named record (a Python dataclass or named tuple): its type name and
    /// its fields in order.
    Record {
        /// The record's type name.
        name: String,
        /// Field names and values, in declaration order.
        fields: Vec<(String, Value)>,
    },
    /// A worker's identity.
    WorkerInfo(WorkerInfo),
    /// A tensor: an index into the side table of tensors.
    Tensor(u32),
    /// An RRef: an index into the side table of RRefs.
    RRef(u32),
}

impl Value {
    /// The Python type name of this value, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "NoneType",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Record { .. } => "record",
            Value::WorkerInfo(_) => "WorkerInfo",
            Value::Tensor(_) => "Tensor",
            Value::RRef(_) => "RRef",
        }
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.into())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Str(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn round_trips_nested_values() {
        let v = Value::Dict(vec![(
            Value::Str("k".into()),
            Value::List(vec![
                Value::Int(-3),
                Value::Float(1.5),
                Value::Tensor(2),
                Value::None,
            ]),
        )]);
        let bytes = crate::encode(&v).unwrap();
        assert_eq!(crate::decode::<Value>(&bytes).unwrap(), v);
    }

    #[test]
    fn truncated_bytes_are_an_error_not_a_panic() {
        let bytes = crate::encode(&Value::Str("hello".into())).unwrap();
        for cut in 0..bytes.len() {
            assert!(crate::decode::<Value>(&bytes[..cut]).is_err());
        }
    }
}
