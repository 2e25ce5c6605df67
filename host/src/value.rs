//! [`Payload`] and [`Args`]: host-side values with their tensors.
//!
//! A [`Value`](crate::abi::Value) tree refers to tensors by index; a
//! [`Payload`] is such a tree together with the table of `tch` tensors it
//! refers to. [`Args`] is a call's positional and keyword arguments over one
//! shared tensor table. Both are cheap to clone: cloning a tensor clones a
//! reference to its storage (`shallow_clone`), never the data.
//!
//! The conversions (`Payload::from(tensor)`, `Payload::from(3)`,
//! [`args!`](crate::args)) and accessors (`as_int`, `as_tensor`, `items`)
//! are what native functions and tests use. RRef entries of a value
//! (`Value::RRef(i)`) index a second side table, [`Payload::rrefs`] /
//! [`Args::rrefs`], of live [`Handle`]s: RRefs, which this module carries
//! without knowing what they are. `crate::rref` puts them in and takes them
//! out (`Payload::from(rref)`, `Payload::as_rref`) and turns them into fork
//! records when a payload is sent and back into handles on arrival (the
//! agent's [`HandleCodec`](crate::agent::HandleCodec)).
//!
//! [`map_values`] is the one walk over a value tree that every rewrite of
//! its tensor or RRef entries uses.

use std::fmt;

use tch::Tensor;

use crate::abi::{Value, WorkerInfo};
use crate::error::{Error, Result};

mod args;

pub use args::Args;

/// A live object a value refers to by `Value::RRef(i)`: an RRef. The value
/// layer carries it and clones it (cheaply: a reference); the feature that
/// made it takes it back out by its type ([`Handle::downcast_ref`]).
#[derive(Clone)]
pub struct Handle(std::sync::Arc<dyn HandleObject>);

/// What a [`Handle`] may hold.
pub trait HandleObject: std::any::Any + Send + Sync + fmt::Display {}

impl Handle {
    /// A handle holding `object`.
    pub fn new(object: impl HandleObject) -> Self {
        Handle(std::sync::Arc::new(object))
    }

    /// The object, if it is a `T`.
    pub fn downcast_ref<T: HandleObject>(&self) -> Option<&T> {
        let object: &dyn std::any::Any = self.0.as_ref();
        object.downcast_ref::<T>()
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Rebuilds `v` with `f` applied to every node, parents before children:
/// `f` gets each node and returns what takes its place, and the walk goes
/// on into the lists, tuples, dicts and records `f` returns. The one walk
/// over value trees: tensor and RRef indexes are shifted, RRefs turned into
/// fork records and back, with it.
///
/// # Errors
/// The first error of `f`.
pub fn map_values<E>(
    v: Value,
    f: &mut impl FnMut(Value) -> std::result::Result<Value, E>,
) -> std::result::Result<Value, E> {
    Ok(match f(v)? {
        Value::List(xs) => Value::List(
            xs.into_iter()
                .map(|x| map_values(x, f))
                .collect::<std::result::Result<_, E>>()?,
        ),
        Value::Tuple(xs) => Value::Tuple(
            xs.into_iter()
                .map(|x| map_values(x, f))
                .collect::<std::result::Result<_, E>>()?,
        ),
        Value::Dict(kv) => Value::Dict(
            kv.into_iter()
                .map(|(k, v)| Ok((map_values(k, f)?, map_values(v, f)?)))
                .collect::<std::result::Result<_, E>>()?,
        ),
        Value::Record { name, fields } => Value::Record {
            name,
            fields: fields
                .into_iter()
                .map(|(k, v)| Ok((k, map_values(v, f)?)))
                .collect::<std::result::Result<_, E>>()?,
        },
        leaf => leaf,
    })
}

/// A value tree and the tensors it refers to.
pub struct Payload {
    /// The value; its `Value::Tensor(i)` entries index [`tensors`](Self::tensors).
    pub value: Value,
    /// The tensor table.
    pub tensors: Vec<Tensor>,
    /// The RRef table; `Value::RRef(i)` entries index it.
    pub rrefs: Vec<Handle>,
}

/// Shifts every tensor index of `v` by `by` and every RRef index by
/// `by_rref`.
fn shift(v: Value, by: u32, by_rref: u32) -> Value {
    if by == 0 && by_rref == 0 {
        return v;
    }
    let shifted = map_values(v, &mut |leaf| {
        Ok::<_, std::convert::Infallible>(match leaf {
            Value::Tensor(i) => Value::Tensor(i + by),
            Value::RRef(i) => Value::RRef(i + by_rref),
            other => other,
        })
    });
    match shifted {
        Ok(v) => v,
        Err(never) => match never {},
    }
}

/// Appends `p`'s tensors and RRefs to the tables and returns its value
/// re-indexed.
fn absorb(table: &mut Vec<Tensor>, rrefs: &mut Vec<Handle>, p: Payload) -> Value {
    let value = shift(p.value, table.len() as u32, rrefs.len() as u32);
    table.extend(p.tensors);
    rrefs.extend(p.rrefs);
    value
}

fn clone_tensors(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(Tensor::shallow_clone).collect()
}

impl Clone for Payload {
    fn clone(&self) -> Self {
        Payload {
            value: self.value.clone(),
            tensors: clone_tensors(&self.tensors),
            rrefs: self.rrefs.clone(),
        }
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Payload")
            .field("value", &self.value)
            .field(
                "tensors",
                &self
                    .tensors
                    .iter()
                    .map(|t| (t.kind(), t.size()))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Payload {
    /// `None`.
    pub fn none() -> Self {
        Value::None.into()
    }

    /// A value that refers to no tensors.
    pub fn from_value(value: Value) -> Self {
        Payload {
            value,
            tensors: Vec::new(),
            rrefs: Vec::new(),
        }
    }

    /// A list of payloads, merging their tensor tables.
    pub fn list(items: impl IntoIterator<Item = Payload>) -> Self {
        let (mut tensors, mut rrefs) = (Vec::new(), Vec::new());
        let values = items
            .into_iter()
            .map(|p| absorb(&mut tensors, &mut rrefs, p))
            .collect();
        Payload {
            value: Value::List(values),
            tensors,
            rrefs,
        }
    }

    /// A tuple of payloads, merging their tensor tables.
    pub fn tuple(items: impl IntoIterator<Item = Payload>) -> Self {
        let mut p = Self::list(items);
        if let Value::List(xs) = p.value {
            p.value = Value::Tuple(xs);
        }
        p
    }

    /// A dict of payload pairs, in order.
    pub fn dict(items: impl IntoIterator<Item = (Payload, Payload)>) -> Self {
        let (mut tensors, mut rrefs) = (Vec::new(), Vec::new());
        let kv = items
            .into_iter()
            .map(|(k, v)| {
                (
                    absorb(&mut tensors, &mut rrefs, k),
                    absorb(&mut tensors, &mut rrefs, v),
                )
            })
            .collect();
        Payload {
            value: Value::Dict(kv),
            tensors,
            rrefs,
        }
    }

    /// A sub-value of this payload, sharing its tensors.
    pub fn sub(&self, value: Value) -> Payload {
        Payload {
            value,
            tensors: clone_tensors(&self.tensors),
            rrefs: self.rrefs.clone(),
        }
    }

    /// Whether the value is `None`.
    pub fn is_none(&self) -> bool {
        matches!(self.value, Value::None)
    }

    pub(crate) fn mismatch(&self, want: &str) -> Error {
        Error::type_error(format!("expected {want}, got {}", self.value.type_name()))
    }

    /// The value as an int (a bool counts, as in Python).
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn as_int(&self) -> Result<i64> {
        match self.value {
            Value::Int(i) => Ok(i),
            Value::Bool(b) => Ok(i64::from(b)),
            _ => Err(self.mismatch("int")),
        }
    }

    /// The value as a float (ints convert).
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn as_float(&self) -> Result<f64> {
        match self.value {
            Value::Float(f) => Ok(f),
            Value::Int(i) => Ok(i as f64),
            _ => Err(self.mismatch("float")),
        }
    }

    /// The value as a bool.
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn as_bool(&self) -> Result<bool> {
        match self.value {
            Value::Bool(b) => Ok(b),
            _ => Err(self.mismatch("bool")),
        }
    }

    /// The value as a string.
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn as_str(&self) -> Result<&str> {
        match &self.value {
            Value::Str(s) => Ok(s),
            _ => Err(self.mismatch("str")),
        }
    }

    /// The value as a worker info.
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn as_worker_info(&self) -> Result<WorkerInfo> {
        match &self.value {
            Value::WorkerInfo(w) => Ok(w.clone()),
            _ => Err(self.mismatch("WorkerInfo")),
        }
    }

    /// The value as a tensor (a reference to the same storage).
    ///
    /// # Errors
    /// `TypeError` if the value is not a tensor; `RuntimeError` if its index
    /// is outside the table.
    pub fn as_tensor(&self) -> Result<Tensor> {
        match self.value {
            Value::Tensor(i) => self.tensor(i as usize).map(Tensor::shallow_clone),
            _ => Err(self.mismatch("Tensor")),
        }
    }

    /// Entry `i` of the tensor table.
    ///
    /// # Errors
    /// `RuntimeError` if there is no such entry.
    pub fn tensor(&self, i: usize) -> Result<&Tensor> {
        self.tensors.get(i).ok_or_else(|| {
            Error::runtime(format!(
                "tensor index {i} outside a table of {}",
                self.tensors.len()
            ))
        })
    }

    /// The items of a list or tuple, each sharing this payload's tensors.
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn items(&self) -> Result<Vec<Payload>> {
        match &self.value {
            Value::List(xs) | Value::Tuple(xs) => {
                Ok(xs.iter().map(|x| self.sub(x.clone())).collect())
            }
            _ => Err(self.mismatch("list or tuple")),
        }
    }

    /// The entries of a dict, each sharing this payload's tensors.
    ///
    /// # Errors
    /// `TypeError` for any other value.
    pub fn entries(&self) -> Result<Vec<(Payload, Payload)>> {
        match &self.value {
            Value::Dict(kv) => Ok(kv
                .iter()
                .map(|(k, v)| (self.sub(k.clone()), self.sub(v.clone())))
                .collect()),
            _ => Err(self.mismatch("dict")),
        }
    }

    /// The value of `key` in a dict with string keys, if present.
    ///
    /// # Errors
    /// `TypeError` if the value is not a dict.
    pub fn get(&self, key: &str) -> Result<Option<Payload>> {
        match &self.value {
            Value::Dict(kv) => Ok(kv
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| self.sub(v.clone()))),
            _ => Err(self.mismatch("dict")),
        }
    }

    /// Structural equality, comparing tensors by value (`Tensor::equal`, or
    /// their dense forms for sparse tensors).
    pub fn equal(&self, other: &Payload) -> bool {
        fn tensor_eq(a: &Tensor, b: &Tensor) -> bool {
            if a.size() != b.size() || a.kind() != b.kind() {
                return false;
            }
            match (a.is_sparse(), b.is_sparse()) {
                (false, false) => a.equal(b),
                _ => to_dense(a).equal(&to_dense(b)),
            }
        }
        fn to_dense(t: &Tensor) -> Tensor {
            if t.is_sparse() {
                t.to_dense(None, false)
            } else {
                t.shallow_clone()
            }
        }
        fn eq(a: &Value, ta: &[Tensor], b: &Value, tb: &[Tensor]) -> bool {
            match (a, b) {
                (Value::Tensor(i), Value::Tensor(j)) => {
                    match (ta.get(*i as usize), tb.get(*j as usize)) {
                        (Some(x), Some(y)) => tensor_eq(x, y),
                        _ => false,
                    }
                }
                (Value::List(x), Value::List(y)) | (Value::Tuple(x), Value::Tuple(y)) => {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| eq(p, ta, q, tb))
                }
                (Value::Dict(x), Value::Dict(y)) => {
                    x.len() == y.len()
                        && x.iter()
                            .zip(y)
                            .all(|((k1, v1), (k2, v2))| eq(k1, ta, k2, tb) && eq(v1, ta, v2, tb))
                }
                (
                    Value::Record {
                        name: n1,
                        fields: f1,
                    },
                    Value::Record {
                        name: n2,
                        fields: f2,
                    },
                ) => {
                    n1 == n2
                        && f1.len() == f2.len()
                        && f1
                            .iter()
                            .zip(f2)
                            .all(|((a1, v1), (a2, v2))| a1 == a2 && eq(v1, ta, v2, tb))
                }
                (x, y) => x == y,
            }
        }
        eq(&self.value, &self.tensors, &other.value, &other.tensors)
    }
}

impl From<Value> for Payload {
    fn from(value: Value) -> Self {
        Payload::from_value(value)
    }
}

impl From<Tensor> for Payload {
    fn from(t: Tensor) -> Self {
        Payload {
            value: Value::Tensor(0),
            tensors: vec![t],
            rrefs: Vec::new(),
        }
    }
}

impl From<&Tensor> for Payload {
    fn from(t: &Tensor) -> Self {
        t.shallow_clone().into()
    }
}

macro_rules! scalar_payload {
    ($($t:ty => $e:expr),* $(,)?) => {$(
        impl From<$t> for Payload {
            fn from(v: $t) -> Self {
                #[allow(clippy::redundant_closure_call, reason = "one macro arm per scalar type")]
                Payload::from_value(($e)(v))
            }
        }
    )*};
}

scalar_payload! {
    i64 => Value::Int,
    i32 => |v: i32| Value::Int(v.into()),
    u32 => |v: u32| Value::Int(v.into()),
    usize => |v: usize| Value::Int(v as i64),
    f64 => Value::Float,
    bool => Value::Bool,
    &str => |v: &str| Value::Str(v.into()),
    String => Value::Str,
    WorkerInfo => Value::WorkerInfo,
    () => |_| Value::None,
}

impl From<Vec<Payload>> for Payload {
    fn from(items: Vec<Payload>) -> Self {
        Payload::list(items)
    }
}

#[cfg(test)]
mod tests;
