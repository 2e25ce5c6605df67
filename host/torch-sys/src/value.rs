//! [`OpValue`]: the arguments and results of builtin ops, and their encoding
//! as the shim's pre-order node arrays.
//!
//! This module owns the conversion between Rust values and the C ABI's
//! `wrs_value` trees, including the transfer of tensor ownership out of the
//! shim. Matching values against schemas is the shim's job.

use crate::error::OpError;
use crate::ffi::{self, RawValue};
use std::ffi::c_void;
use tch::{Device, Kind, Tensor};

/// A value an op takes or returns: what TorchScript's `IValue` holds, limited
/// to the kinds that cross RPC and the guest boundary.
///
/// Arguments convert to a schema's types the way PyTorch RPC converts Python
/// values: an `Int` is accepted where a `float` or a `Scalar` is expected, a
/// `List` of ints where an `int[]` is, a single `Int` where an `int[N]` is
/// (broadcast), a `Str` where a `Device` is (`"cpu"`, `"cuda:0"`), and an
/// `Int` or a [`OpValue::Dtype`] where a `ScalarType` is.
///
/// Results keep TorchScript's types: a `ScalarType` result is an `Int`, an
/// undefined tensor is `None`.
#[derive(Debug)]
pub enum OpValue {
    /// Python's `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int` (also `SymInt`, and the codes of `ScalarType`, `Layout` and
    /// `MemoryFormat` arguments).
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A tensor, dense or sparse.
    Tensor(Tensor),
    /// A Python list.
    List(Vec<OpValue>),
    /// A Python tuple.
    Tuple(Vec<OpValue>),
    /// A `torch.dtype`, for `ScalarType` arguments such as `dtype=`.
    Dtype(Kind),
    /// A `torch.device`.
    Device(Device),
}

impl OpValue {
    /// Python's name for the type of this value (`"int"`, `"Tensor"`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            OpValue::None => "NoneType",
            OpValue::Bool(_) => "bool",
            OpValue::Int(_) => "int",
            OpValue::Float(_) => "float",
            OpValue::Str(_) => "str",
            OpValue::Tensor(_) => "Tensor",
            OpValue::List(_) => "list",
            OpValue::Tuple(_) => "tuple",
            OpValue::Dtype(_) => "dtype",
            OpValue::Device(_) => "device",
        }
    }

    /// A copy that shares every tensor's storage and autograd identity
    /// ([`Tensor::shallow_clone`]).
    pub fn shallow_clone(&self) -> OpValue {
        match self {
            OpValue::None => OpValue::None,
            OpValue::Bool(b) => OpValue::Bool(*b),
            OpValue::Int(i) => OpValue::Int(*i),
            OpValue::Float(f) => OpValue::Float(*f),
            OpValue::Str(s) => OpValue::Str(s.clone()),
            OpValue::Tensor(t) => OpValue::Tensor(t.shallow_clone()),
            OpValue::List(v) => OpValue::List(v.iter().map(OpValue::shallow_clone).collect()),
            OpValue::Tuple(v) => OpValue::Tuple(v.iter().map(OpValue::shallow_clone).collect()),
            OpValue::Dtype(k) => OpValue::Dtype(*k),
            OpValue::Device(d) => OpValue::Device(*d),
        }
    }

    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            OpValue::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The tensor, if this is one; otherwise the value back.
    ///
    /// # Errors
    ///
    /// Returns `self` when it is not a tensor.
    pub fn into_tensor(self) -> Result<Tensor, OpValue> {
        match self {
            OpValue::Tensor(t) => Ok(t),
            other => Err(other),
        }
    }

    /// The integer, if this is an `Int`.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            OpValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The float, if this is a `Float`.
    pub fn as_float(&self) -> Option<f64> {
        match self {
            OpValue::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The boolean, if this is a `Bool`.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            OpValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The elements, if this is a `List` or a `Tuple`.
    pub fn as_slice(&self) -> Option<&[OpValue]> {
        match self {
            OpValue::List(v) | OpValue::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// The one value Python would see for an op's outputs: `None` for none,
    /// the value itself for one, a tuple for several (`createPyObjectForStack`).
    pub fn from_outputs(mut outputs: Vec<OpValue>) -> OpValue {
        match outputs.len() {
            0 => OpValue::None,
            1 => outputs.pop().unwrap_or(OpValue::None),
            _ => OpValue::Tuple(outputs),
        }
    }
}

impl From<Tensor> for OpValue {
    fn from(t: Tensor) -> Self {
        OpValue::Tensor(t)
    }
}

impl From<i64> for OpValue {
    fn from(i: i64) -> Self {
        OpValue::Int(i)
    }
}

impl From<f64> for OpValue {
    fn from(f: f64) -> Self {
        OpValue::Float(f)
    }
}

impl From<bool> for OpValue {
    fn from(b: bool) -> Self {
        OpValue::Bool(b)
    }
}

impl From<&str> for OpValue {
    fn from(s: &str) -> Self {
        OpValue::Str(s.to_owned())
    }
}

impl From<Kind> for OpValue {
    fn from(k: Kind) -> Self {
        OpValue::Dtype(k)
    }
}

impl From<Device> for OpValue {
    fn from(d: Device) -> Self {
        OpValue::Device(d)
    }
}

/// `c10::ScalarType`'s code for a tch kind: what a `ScalarType` argument
/// (`dtype=`) takes as an `Int`, and what ops returning a dtype give back
/// (`prim::dtype` gives 6 for `Kind::Float`).
pub fn kind_code(kind: Kind) -> i64 {
    match kind {
        Kind::Uint8 => 0,
        Kind::Int8 => 1,
        Kind::Int16 => 2,
        Kind::Int => 3,
        Kind::Int64 => 4,
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::Double => 7,
        Kind::ComplexHalf => 8,
        Kind::ComplexFloat => 9,
        Kind::ComplexDouble => 10,
        Kind::Bool => 11,
        Kind::QInt8 => 12,
        Kind::QUInt8 => 13,
        Kind::QInt32 => 14,
        Kind::BFloat16 => 15,
        Kind::Float8e5m2 => 23,
        Kind::Float8e4m3fn => 24,
        Kind::Float8e5m2fnuz => 25,
        Kind::Float8e4m3fnuz => 26,
    }
}

/// The tch kind of a `c10::ScalarType` code, the inverse of [`kind_code`];
/// `None` for codes tch has no kind for.
pub fn kind_of_code(code: i64) -> Option<Kind> {
    const KINDS: [Kind; 20] = [
        Kind::Uint8,
        Kind::Int8,
        Kind::Int16,
        Kind::Int,
        Kind::Int64,
        Kind::Half,
        Kind::Float,
        Kind::Double,
        Kind::ComplexHalf,
        Kind::ComplexFloat,
        Kind::ComplexDouble,
        Kind::Bool,
        Kind::QInt8,
        Kind::QUInt8,
        Kind::QInt32,
        Kind::BFloat16,
        Kind::Float8e5m2,
        Kind::Float8e4m3fn,
        Kind::Float8e5m2fnuz,
        Kind::Float8e4m3fnuz,
    ];
    KINDS.into_iter().find(|k| kind_code(*k) == code)
}

// `c10::DeviceType` codes.
const DEVICE_CPU: i64 = 0;
const DEVICE_CUDA: i64 = 1;
const DEVICE_VULKAN: i64 = 10;
const DEVICE_MPS: i64 = 13;

fn len_u32(len: usize, what: &str) -> Result<u32, OpError> {
    u32::try_from(len).map_err(|_| OpError::Internal {
        op: String::new(),
        message: format!("{what} too long to pass to an op: {len}"),
    })
}

/// How deeply lists and tuples may nest in an argument. Bounds the
/// recursion here and in the shim, whatever a peer or a guest sends.
pub const MAX_NESTING: usize = 64;

/// Appends the pre-order encoding of `value` to `out`. Tensor and string
/// nodes borrow from `value`, which must outlive every use of `out`.
pub(crate) fn encode(value: &OpValue, out: &mut Vec<RawValue>) -> Result<(), OpError> {
    encode_at(value, out, 0)
}

fn encode_at(value: &OpValue, out: &mut Vec<RawValue>, depth: usize) -> Result<(), OpError> {
    if depth > MAX_NESTING {
        return Err(OpError::Rejected {
            kind: wasmrpc_abi::ErrorKind::ValueError,
            message: format!("op arguments nest lists or tuples more than {MAX_NESTING} deep"),
        });
    }
    let mut node = RawValue::new(ffi::TAG_NONE);
    match value {
        OpValue::None => {}
        OpValue::Bool(b) => {
            node.tag = ffi::TAG_BOOL;
            node.i = i64::from(*b);
        }
        OpValue::Int(i) => {
            node.tag = ffi::TAG_INT;
            node.i = *i;
        }
        OpValue::Float(f) => {
            node.tag = ffi::TAG_FLOAT;
            node.f = *f;
        }
        OpValue::Str(s) => {
            node.tag = ffi::TAG_STR;
            node.len = len_u32(s.len(), "string")?;
            node.p = s.as_ptr().cast::<c_void>();
        }
        OpValue::Tensor(t) => {
            node.tag = ffi::TAG_TENSOR;
            // tch's `C_tensor` is an `at::Tensor*` (torch-sys allocates it
            // with `new torch::Tensor(...)`); the shim reads it as such.
            node.p = t.as_ptr().cast::<c_void>();
        }
        OpValue::List(items) | OpValue::Tuple(items) => {
            node.tag = if matches!(value, OpValue::List(_)) {
                ffi::TAG_LIST
            } else {
                ffi::TAG_TUPLE
            };
            node.len = len_u32(items.len(), "list")?;
            out.push(node);
            for item in items {
                encode_at(item, out, depth + 1)?;
            }
            return Ok(());
        }
        OpValue::Dtype(kind) => {
            node.tag = ffi::TAG_DTYPE;
            node.i = kind_code(*kind);
        }
        OpValue::Device(device) => {
            node.tag = ffi::TAG_DEVICE;
            let (ty, index) = match device {
                Device::Cpu => (DEVICE_CPU, 0),
                // `c10::DeviceIndex` is an `i8`.
                Device::Cuda(i) if *i <= 127 => (DEVICE_CUDA, len_u32(*i + 1, "device index")?),
                Device::Cuda(i) => {
                    return Err(OpError::Rejected {
                        kind: wasmrpc_abi::ErrorKind::ValueError,
                        message: format!("CUDA device index {i} is out of range"),
                    });
                }
                Device::Mps => (DEVICE_MPS, 0),
                Device::Vulkan => (DEVICE_VULKAN, 0),
            };
            node.i = ty;
            node.len = index;
        }
    }
    out.push(node);
    Ok(())
}

/// Decodes `n_outputs` top-level values from `nodes`, taking ownership of
/// every tensor in them.
///
/// # Safety
///
/// `nodes` must be a well-formed output of the shim: every tensor node holds
/// a distinct `at::Tensor*` allocated with `new` that nobody else owns, and
/// every string node points at `len` bytes that are valid for this call.
pub(crate) unsafe fn decode(nodes: &[RawValue], n_outputs: usize) -> Result<Vec<OpValue>, OpError> {
    // Take every tensor first, so that none leaks even if the tree turns out
    // malformed below.
    let mut tensors: std::collections::VecDeque<Tensor> = nodes
        .iter()
        .filter(|n| n.tag == ffi::TAG_TENSOR)
        // SAFETY: the caller guarantees each tensor node is an owned
        // `at::Tensor*`, which is what `C_tensor` wraps; `from_ptr` takes
        // that ownership exactly once.
        .map(|n| unsafe { Tensor::from_ptr(n.p.cast_mut().cast::<torch_sys::C_tensor>()) })
        .collect();
    let mut pos = 0;
    let mut out = Vec::with_capacity(n_outputs);
    for _ in 0..n_outputs {
        // SAFETY: string nodes are valid per the caller's contract.
        out.push(unsafe { decode_one(nodes, &mut pos, &mut tensors) }?);
    }
    Ok(out)
}

fn malformed() -> OpError {
    OpError::Internal {
        op: String::new(),
        message: "malformed output tree from the shim".to_owned(),
    }
}

/// # Safety
///
/// As for [`decode`].
unsafe fn decode_one(
    nodes: &[RawValue],
    pos: &mut usize,
    tensors: &mut std::collections::VecDeque<Tensor>,
) -> Result<OpValue, OpError> {
    let node = *nodes.get(*pos).ok_or_else(malformed)?;
    *pos += 1;
    Ok(match node.tag {
        ffi::TAG_NONE => OpValue::None,
        ffi::TAG_BOOL => OpValue::Bool(node.i != 0),
        ffi::TAG_INT => OpValue::Int(node.i),
        ffi::TAG_FLOAT => OpValue::Float(node.f),
        ffi::TAG_STR => {
            let bytes = if node.len == 0 {
                &[][..]
            } else {
                // SAFETY: the caller guarantees `p` points at `len` bytes
                // valid for this call.
                unsafe { std::slice::from_raw_parts(node.p.cast::<u8>(), node.len as usize) }
            };
            OpValue::Str(String::from_utf8_lossy(bytes).into_owned())
        }
        ffi::TAG_TENSOR => OpValue::Tensor(tensors.pop_front().ok_or_else(malformed)?),
        ffi::TAG_LIST | ffi::TAG_TUPLE => {
            let mut items = Vec::with_capacity(node.len as usize);
            for _ in 0..node.len {
                // SAFETY: forwarded contract.
                items.push(unsafe { decode_one(nodes, pos, tensors) }?);
            }
            if node.tag == ffi::TAG_LIST {
                OpValue::List(items)
            } else {
                OpValue::Tuple(items)
            }
        }
        ffi::TAG_DEVICE => {
            let index = (node.len as usize).checked_sub(1);
            OpValue::Device(match node.i {
                DEVICE_CPU => Device::Cpu,
                DEVICE_CUDA => Device::Cuda(index.unwrap_or(0)),
                DEVICE_MPS => Device::Mps,
                DEVICE_VULKAN => Device::Vulkan,
                other => {
                    return Err(OpError::Internal {
                        op: String::new(),
                        message: format!("unsupported output device type {other}"),
                    });
                }
            })
        }
        _ => return Err(malformed()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_is_pre_order_with_child_counts() {
        let v = OpValue::List(vec![
            OpValue::Int(1),
            OpValue::Tuple(vec![OpValue::Float(2.5), OpValue::None]),
            OpValue::Str("ab".into()),
        ]);
        let mut nodes = Vec::new();
        encode(&v, &mut nodes).unwrap();
        let tags: Vec<u32> = nodes.iter().map(|n| n.tag).collect();
        assert_eq!(
            tags,
            [
                ffi::TAG_LIST,
                ffi::TAG_INT,
                ffi::TAG_TUPLE,
                ffi::TAG_FLOAT,
                ffi::TAG_NONE,
                ffi::TAG_STR
            ]
        );
        assert_eq!(nodes[0].len, 3);
        assert_eq!(nodes[2].len, 2);
        assert_eq!(nodes[5].len, 2);
    }

    #[test]
    fn kind_codes_round_trip() {
        for code in 0..30 {
            if let Some(kind) = kind_of_code(code) {
                assert_eq!(kind_code(kind), code);
            }
        }
        assert_eq!(kind_of_code(6), Some(Kind::Float));
        assert_eq!(kind_of_code(16), None);
    }

    #[test]
    fn device_indices_fit_c10() {
        encode(&OpValue::Device(Device::Cuda(127)), &mut Vec::new()).unwrap();
        let err = encode(&OpValue::Device(Device::Cuda(128)), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    }

    #[test]
    fn nesting_is_bounded() {
        let mut v = OpValue::Int(1);
        for _ in 0..MAX_NESTING {
            v = OpValue::List(vec![v]);
        }
        encode(&v, &mut Vec::new()).unwrap();
        let v = OpValue::Tuple(vec![v]);
        let err = encode(&v, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("more than 64 deep"), "{err}");
    }

    #[test]
    fn decode_round_trips_scalars_and_nesting() {
        let v = OpValue::Tuple(vec![
            OpValue::Bool(true),
            OpValue::List(vec![OpValue::Int(-3), OpValue::Device(Device::Cuda(1))]),
            OpValue::Str("héllo".into()),
        ]);
        let mut nodes = Vec::new();
        encode(&v, &mut nodes).unwrap();
        // SAFETY: no tensor nodes; string nodes borrow from `v`, alive here.
        let out = unsafe { decode(&nodes, 1) }.unwrap();
        let items = out[0].as_slice().unwrap();
        assert_eq!(items[0].as_bool(), Some(true));
        let inner = items[1].as_slice().unwrap();
        assert_eq!(inner[0].as_int(), Some(-3));
        assert!(matches!(inner[1], OpValue::Device(Device::Cuda(1))));
        assert!(matches!(&items[2], OpValue::Str(s) if s == "héllo"));
    }

    #[test]
    fn decode_rejects_truncated_trees() {
        let mut node = RawValue::new(ffi::TAG_LIST);
        node.len = 2;
        // SAFETY: no tensor or string nodes.
        let err = unsafe { decode(&[node], 1) }.unwrap_err();
        assert!(err.to_string().contains("malformed"));
    }

    #[test]
    fn from_outputs_follows_python() {
        assert!(matches!(OpValue::from_outputs(vec![]), OpValue::None));
        assert!(matches!(
            OpValue::from_outputs(vec![OpValue::Int(1)]),
            OpValue::Int(1)
        ));
        assert!(matches!(
            OpValue::from_outputs(vec![OpValue::Int(1), OpValue::Int(2)]),
            OpValue::Tuple(v) if v.len() == 2
        ));
    }
}
