//! The values the op fuzzer passes: tensors described by [`TensorSpec`],
//! arguments as [`FuzzValue`]s, and for each schema type the plausible
//! value and the boundary values a parameter of that type is given.

use std::fmt;

use tch::{Device, Kind, Tensor};

use crate::abi::Value;

/// A tensor argument, described rather than built, so that cases print
/// and replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TensorSpec {
    /// `arange(6).reshape(2, 3)` as `kind`.
    Matrix(Kind),
    /// A 0-dim tensor holding 1.
    Scalar,
    /// Shape `[0]`.
    Empty,
    /// Shape `[3, 0, 2]`.
    EmptyMiddle,
    /// A `[2, 3]` matrix transposed: not contiguous.
    Transposed,
    /// `[1, 3]` expanded to `[4, 3]`: stride 0.
    Expanded,
    /// Every other column of a `[2, 6]` matrix: a storage offset and
    /// strides.
    Strided,
    /// `[0, 1, 2, 3]` as int64: indices that fit.
    Indices,
    /// int64 indices far out of any range: `[-5, 7, i64::MAX]`.
    BadIndices,
    /// int64 `[i64::MIN, -1, 2^40]`.
    ExtremeInts,
    /// float64 `[NaN, inf, -inf, -0.0, 1e308, 5e-324]`.
    NonFinite,
    /// A `[2, 3, 4, 5]` float tensor (an NCHW batch).
    Batch,
    /// Six dims of size 1.
    ManyDims,
    /// A sparse COO `[3, 3]` tensor with two values.
    Sparse,
}

/// Every tensor the fuzzer passes.
pub const TENSORS: &[TensorSpec] = &[
    TensorSpec::ExtremeInts,
    TensorSpec::Empty,
    TensorSpec::BadIndices,
    TensorSpec::Sparse,
    TensorSpec::Expanded,
    TensorSpec::Scalar,
    TensorSpec::NonFinite,
    TensorSpec::Transposed,
    TensorSpec::Matrix(Kind::Float),
    TensorSpec::Matrix(Kind::Double),
    TensorSpec::Matrix(Kind::Half),
    TensorSpec::Matrix(Kind::BFloat16),
    TensorSpec::Matrix(Kind::Int64),
    TensorSpec::Matrix(Kind::Int),
    TensorSpec::Matrix(Kind::Int8),
    TensorSpec::Matrix(Kind::Uint8),
    TensorSpec::Matrix(Kind::Bool),
    TensorSpec::Matrix(Kind::ComplexFloat),
    TensorSpec::EmptyMiddle,
    TensorSpec::Strided,
    TensorSpec::Indices,
    TensorSpec::Batch,
    TensorSpec::ManyDims,
];

impl TensorSpec {
    /// The tensor itself.
    pub fn build(self) -> Tensor {
        let cpu = (Kind::Float, Device::Cpu);
        match self {
            TensorSpec::Matrix(kind) => Tensor::arange(6, cpu).reshape([2, 3]).to_kind(kind),
            TensorSpec::Scalar => Tensor::scalar_tensor(1.0, cpu),
            TensorSpec::Empty => Tensor::zeros([0], cpu),
            TensorSpec::EmptyMiddle => Tensor::zeros([3, 0, 2], cpu),
            TensorSpec::Transposed => Tensor::arange(6, cpu).reshape([2, 3]).tr(),
            TensorSpec::Expanded => Tensor::arange(3, cpu).reshape([1, 3]).expand([4, 3], false),
            TensorSpec::Strided => Tensor::arange(12, cpu).reshape([2, 6]).slice(1, 1, 6, 2),
            TensorSpec::Indices => Tensor::from_slice(&[0_i64, 1, 2, 3]),
            TensorSpec::BadIndices => Tensor::from_slice(&[-5_i64, 7, i64::MAX]),
            TensorSpec::ExtremeInts => Tensor::from_slice(&[i64::MIN, -1, 1 << 40]),
            TensorSpec::NonFinite => Tensor::from_slice(&[
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                -0.0,
                1e308,
                5e-324,
            ]),
            TensorSpec::Batch => Tensor::arange(120, cpu).reshape([2, 3, 4, 5]),
            TensorSpec::ManyDims => Tensor::ones([1, 1, 1, 1, 1, 1], cpu),
            TensorSpec::Sparse => {
                let dense = Tensor::zeros([3, 3], cpu);
                let _ = dense.get(0).get(1).fill_(2.0);
                let _ = dense.get(2).get(0).fill_(-1.0);
                dense.to_sparse(None, None::<&[i64]>, None)
            }
        }
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorSpec::Matrix(kind) => write!(f, "tensor([2, 3], {kind:?})"),
            other => write!(f, "tensor:{other:?}"),
        }
    }
}

/// One argument of a generated call.
#[derive(Debug, Clone, PartialEq)]
pub enum FuzzValue {
    /// `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An int (dtypes, layouts and memory formats are ints on the wire).
    Int(i64),
    /// A float.
    Float(f64),
    /// A string (devices are strings on the wire).
    Str(String),
    /// A tensor.
    Tensor(TensorSpec),
    /// A list.
    List(Vec<FuzzValue>),
    /// A tuple.
    Tuple(Vec<FuzzValue>),
    /// A dict: a type no op takes.
    Dict(Vec<(FuzzValue, FuzzValue)>),
}

impl FuzzValue {
    pub(super) fn to_value(&self, tensors: &mut Vec<Tensor>) -> Value {
        match self {
            FuzzValue::None => Value::None,
            FuzzValue::Bool(b) => Value::Bool(*b),
            FuzzValue::Int(i) => Value::Int(*i),
            FuzzValue::Float(x) => Value::Float(*x),
            FuzzValue::Str(s) => Value::Str(s.clone()),
            FuzzValue::Tensor(spec) => {
                tensors.push(spec.build());
                // Tables of a fuzz case hold a few tensors.
                Value::Tensor(u32::try_from(tensors.len() - 1).unwrap_or(u32::MAX))
            }
            FuzzValue::List(items) => {
                Value::List(items.iter().map(|v| v.to_value(tensors)).collect())
            }
            FuzzValue::Tuple(items) => {
                Value::Tuple(items.iter().map(|v| v.to_value(tensors)).collect())
            }
            FuzzValue::Dict(items) => Value::Dict(
                items
                    .iter()
                    .map(|(k, v)| (k.to_value(tensors), v.to_value(tensors)))
                    .collect(),
            ),
        }
    }
}

impl fmt::Display for FuzzValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn seq(f: &mut fmt::Formatter<'_>, items: &[FuzzValue]) -> fmt::Result {
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{v}")?;
            }
            Ok(())
        }
        match self {
            FuzzValue::None => f.write_str("None"),
            FuzzValue::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            FuzzValue::Int(i) => write!(f, "{i}"),
            FuzzValue::Float(x) => write!(f, "{x:?}"),
            FuzzValue::Str(s) if s.len() > 40 => write!(f, "'{}...' ({} bytes)", &s[..8], s.len()),
            FuzzValue::Str(s) => write!(f, "{s:?}"),
            FuzzValue::Tensor(spec) => write!(f, "{spec}"),
            FuzzValue::List(items) => {
                f.write_str("[")?;
                seq(f, items)?;
                f.write_str("]")
            }
            FuzzValue::Tuple(items) => {
                f.write_str("(")?;
                seq(f, items)?;
                f.write_str(",)")
            }
            FuzzValue::Dict(items) => write!(f, "{{dict of {}}}", items.len()),
        }
    }
}

/// A parameter type, as far as the fuzzer tells them apart.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Ty {
    Tensor,
    Int,
    Float,
    Complex,
    Scalar,
    Bool,
    Str,
    ScalarType,
    Layout,
    MemoryFormat,
    Device,
    Dimname,
    /// Anything else: the wrong-type values only.
    Other,
    Optional(Box<Ty>),
    /// A list, with its fixed size (`int[2]`) if any.
    List(Box<Ty>, Option<usize>),
}

/// Reads a schema type (`Tensor(a!)[]?`, `int[2]`, `SymInt[]?`).
pub(super) fn parse_ty(text: &str) -> Ty {
    let text = text.trim();
    if let Some(inner) = text.strip_suffix('?') {
        return Ty::Optional(Box::new(parse_ty(inner)));
    }
    if let Some(open) = text.rfind('[')
        && text.ends_with(']')
    {
        let size = text[open + 1..text.len() - 1].trim().parse().ok();
        return Ty::List(Box::new(parse_ty(&text[..open])), size);
    }
    // Alias annotations: `Tensor(a!)`.
    let base = text.split('(').next().unwrap_or(text).trim();
    match base {
        "Tensor" => Ty::Tensor,
        "int" | "SymInt" | "int64_t" => Ty::Int,
        "float" | "SymFloat" => Ty::Float,
        "complex" => Ty::Complex,
        "Scalar" => Ty::Scalar,
        "bool" | "SymBool" => Ty::Bool,
        "str" => Ty::Str,
        "ScalarType" => Ty::ScalarType,
        "Layout" => Ty::Layout,
        "MemoryFormat" => Ty::MemoryFormat,
        "Device" => Ty::Device,
        "Dimname" => Ty::Dimname,
        _ => Ty::Other,
    }
}

/// Ints, the likeliest to break a kernel first (a bounded run takes the
/// first few of each list).
const INTS: &[i64] = &[
    -1,
    0,
    i64::MAX,
    i64::MIN,
    1 << 40,
    2,
    1,
    3,
    -2,
    64,
    1 << 31,
    -(1 << 31) - 1,
    i64::MAX - 1,
];

const FLOATS: &[f64] = &[
    f64::NAN,
    f64::INFINITY,
    -1.0,
    0.0,
    f64::NEG_INFINITY,
    1e308,
    0.5,
    -0.0,
    5e-324,
    1e10,
];

const STRS: &[&str] = &[
    "", "none", "sum", "mean", "floor", "trunc", "tanh", "reflect", "L", "fro", "nuc", "\u{0}", "é",
];

const DEVICES: &[&str] = &[
    "meta",
    "cuda:127",
    "cpu:-1",
    "nonsense",
    "cpu",
    "cpu:0",
    "cpu:1",
    "cuda",
    "cuda:0",
    "mps",
    "xla",
    "vulkan",
    "cuda:-2",
    "cpu:99999999999",
    "",
];

/// Codes around and past each enum's defined range, and every code in it.
fn enum_codes(defined: i64) -> Vec<i64> {
    let mut codes = vec![-1, defined + 1, i64::MAX, i64::MIN, 128, 255];
    codes.extend(0..=defined);
    codes.extend([defined + 2, 127, 256]);
    codes
}

/// A value a kernel would accept for `ty`: what the other parameters of a
/// case hold while one is varied.
pub(super) fn plausible(ty: &Ty, name: &str) -> FuzzValue {
    match ty {
        Ty::Tensor => FuzzValue::Tensor(TensorSpec::Matrix(Kind::Float)),
        Ty::Int => FuzzValue::Int(if name.contains("dim") { 0 } else { 1 }),
        Ty::Float | Ty::Complex => FuzzValue::Float(0.5),
        Ty::Scalar => FuzzValue::Int(2),
        Ty::Bool => FuzzValue::Bool(false),
        Ty::Str => FuzzValue::Str(
            match name {
                "reduce" | "reduction" => "sum",
                "rounding_mode" => "floor",
                "approximate" => "none",
                "ord" => "fro",
                _ => "none",
            }
            .into(),
        ),
        // torch.float32, torch.strided, torch.contiguous_format.
        Ty::ScalarType => FuzzValue::Int(6),
        Ty::Layout | Ty::MemoryFormat => FuzzValue::Int(0),
        Ty::Device => FuzzValue::Str("cpu".into()),
        Ty::Dimname => FuzzValue::Str("N".into()),
        Ty::Other => FuzzValue::None,
        Ty::Optional(inner) => plausible(inner, name),
        Ty::List(elem, size) => match **elem {
            Ty::Tensor => FuzzValue::List(vec![
                FuzzValue::Tensor(TensorSpec::Matrix(Kind::Float)),
                FuzzValue::Tensor(TensorSpec::Matrix(Kind::Float)),
            ]),
            Ty::Optional(_) => FuzzValue::List(vec![FuzzValue::Tensor(TensorSpec::Indices)]),
            Ty::Int => FuzzValue::List(match size {
                Some(n) => vec![FuzzValue::Int(1); *n],
                None => vec![FuzzValue::Int(2), FuzzValue::Int(3)],
            }),
            ref other => FuzzValue::List(vec![plausible(other, name); size.unwrap_or(1)]),
        },
    }
}

/// The other baseline: values at the edge of what kernels take (int64
/// extremes, -1), so that a boundary value of one parameter meets them in
/// another (the smallest int64 divided by -1).
pub(super) fn extreme(ty: &Ty, name: &str) -> FuzzValue {
    match ty {
        Ty::Tensor => FuzzValue::Tensor(TensorSpec::ExtremeInts),
        Ty::Int | Ty::Scalar => FuzzValue::Int(-1),
        Ty::Float | Ty::Complex => FuzzValue::Float(-1.0),
        Ty::Optional(inner) => extreme(inner, name),
        other => plausible(other, name),
    }
}

/// The boundary values of `ty`: what each parameter is given in turn.
pub(super) fn boundary(ty: &Ty) -> Vec<FuzzValue> {
    let ints = || INTS.iter().map(|i| FuzzValue::Int(*i));
    let floats = || FLOATS.iter().map(|x| FuzzValue::Float(*x));
    let mut values: Vec<FuzzValue> = match ty {
        Ty::Tensor => TENSORS.iter().map(|t| FuzzValue::Tensor(*t)).collect(),
        Ty::Int => ints().collect(),
        Ty::Float | Ty::Complex => floats().chain(ints().take(4)).collect(),
        Ty::Scalar => ints()
            .chain(floats())
            .chain([FuzzValue::Bool(true)])
            .collect(),
        Ty::Bool => vec![FuzzValue::Bool(true), FuzzValue::Bool(false)],
        Ty::Str | Ty::Dimname => STRS
            .iter()
            .map(|s| FuzzValue::Str((*s).into()))
            .chain([FuzzValue::Str("x".repeat(4096))])
            .collect(),
        Ty::ScalarType => enum_codes(45).into_iter().map(FuzzValue::Int).collect(),
        Ty::Layout => enum_codes(7).into_iter().map(FuzzValue::Int).collect(),
        Ty::MemoryFormat => enum_codes(3).into_iter().map(FuzzValue::Int).collect(),
        Ty::Device => DEVICES
            .iter()
            .map(|s| FuzzValue::Str((*s).into()))
            .collect(),
        Ty::Other => Vec::new(),
        Ty::Optional(inner) => {
            let mut v = boundary(inner);
            v.push(FuzzValue::None);
            v
        }
        Ty::List(elem, size) => list_boundary(elem, *size),
    };
    // A value of the wrong type.
    values.push(match ty {
        Ty::Tensor | Ty::Optional(_) => FuzzValue::Str("not a tensor".into()),
        Ty::List(..) => FuzzValue::List(vec![FuzzValue::Str("x".into())]),
        _ => FuzzValue::Tensor(TensorSpec::Matrix(Kind::Float)),
    });
    values.push(FuzzValue::Dict(vec![(FuzzValue::Int(1), FuzzValue::None)]));
    values
}

fn list_boundary(elem: &Ty, size: Option<usize>) -> Vec<FuzzValue> {
    let ints = |v: &[i64]| FuzzValue::List(v.iter().map(|i| FuzzValue::Int(*i)).collect());
    let t = |s: TensorSpec| FuzzValue::Tensor(s);
    let mut values = vec![FuzzValue::List(Vec::new())];
    match elem {
        Ty::Int => {
            values.extend(
                [
                    &[i64::MAX][..],
                    &[-1],
                    &[i64::MIN],
                    &[1 << 31, 1 << 31],
                    &[1; 64],
                    &[0],
                    &[2, 3],
                    &[-1, -1],
                    &[3, -2],
                    &[0; 8],
                    &[i64::MAX, i64::MAX, i64::MAX],
                ]
                .iter()
                .map(|v| ints(v)),
            );
            if size.is_some() {
                // A single int broadcasts to a fixed-size list.
                values.extend(INTS.iter().map(|i| FuzzValue::Int(*i)));
            }
        }
        Ty::Tensor => values.extend([
            FuzzValue::List(vec![t(TensorSpec::Matrix(Kind::Float))]),
            FuzzValue::List(vec![
                t(TensorSpec::Matrix(Kind::Float)),
                t(TensorSpec::Empty),
            ]),
            FuzzValue::List(vec![
                t(TensorSpec::Matrix(Kind::Float)),
                t(TensorSpec::Matrix(Kind::Int64)),
            ]),
            FuzzValue::List(vec![t(TensorSpec::Scalar), t(TensorSpec::Batch)]),
            FuzzValue::List(vec![t(TensorSpec::Transposed), t(TensorSpec::Expanded)]),
            FuzzValue::List(vec![t(TensorSpec::Sparse), t(TensorSpec::Sparse)]),
            FuzzValue::List(vec![t(TensorSpec::Indices); 40]),
        ]),
        Ty::Optional(inner) if **inner == Ty::Tensor => values.extend([
            FuzzValue::List(vec![FuzzValue::None]),
            FuzzValue::List(vec![FuzzValue::None, t(TensorSpec::Indices)]),
            FuzzValue::List(vec![t(TensorSpec::BadIndices)]),
            FuzzValue::List(vec![t(TensorSpec::ExtremeInts)]),
            FuzzValue::List(vec![t(TensorSpec::Matrix(Kind::Bool))]),
            FuzzValue::List(vec![t(TensorSpec::Matrix(Kind::Uint8))]),
            FuzzValue::List(vec![t(TensorSpec::Matrix(Kind::Float))]),
            FuzzValue::List(vec![t(TensorSpec::Indices); 9]),
        ]),
        Ty::Float => values.extend([
            FuzzValue::List(vec![FuzzValue::Float(0.5)]),
            FuzzValue::List(vec![FuzzValue::Float(f64::NAN)]),
            FuzzValue::List(vec![
                FuzzValue::Float(-1.0),
                FuzzValue::Float(f64::INFINITY),
            ]),
        ]),
        Ty::Bool => values.extend([
            FuzzValue::List(vec![FuzzValue::Bool(true)]),
            FuzzValue::List(vec![FuzzValue::Bool(true); 3]),
            FuzzValue::List(vec![FuzzValue::Bool(false); 5]),
        ]),
        other => {
            for v in boundary(other).into_iter().take(8) {
                values.push(FuzzValue::List(vec![v]));
            }
        }
    }
    values
}
