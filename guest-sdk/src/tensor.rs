//! [`Tensor`]: a handle to a tensor that lives in the host, and the ops that
//! run on it there (by aten schema name, so autograd records them).

use crate::convert::ToArgs;
use crate::host;
use crate::{Error, Result};
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{CallArgs, DType, HandleKind, HostCall, HostReply, TensorMeta};

/// A tensor held by the host, named by a handle.
///
/// Dropping a `Tensor` releases its handle. Ops never copy data into the
/// guest: `a.add(&b)` asks the host to run `aten::add` and returns a handle to
/// the result. Only [`Tensor::to_vec`] and friends read the elements.
#[derive(Debug)]
pub struct Tensor {
    handle: u32,
}

/// An operand of a binary op: a tensor or a Python scalar.
pub trait Operand {
    /// The operand as a value, borrowing a tensor's handle.
    fn operand(&self) -> Value;
}
impl Operand for Tensor {
    fn operand(&self) -> Value {
        Value::Tensor(self.handle)
    }
}
impl Operand for i64 {
    fn operand(&self) -> Value {
        Value::Int(*self)
    }
}
impl Operand for i32 {
    fn operand(&self) -> Value {
        Value::Int(i64::from(*self))
    }
}
impl Operand for f64 {
    fn operand(&self) -> Value {
        Value::Float(*self)
    }
}
impl<T: Operand + ?Sized> Operand for &T {
    fn operand(&self) -> Value {
        (**self).operand()
    }
}

/// Plain element types that tensors can be made of and read into.
pub trait Element: Copy {
    /// The matching dtype.
    const DTYPE: DType;
    /// Appends the little-endian bytes of `self`.
    fn put(self, out: &mut Vec<u8>);
    /// Reads one element from the first `DTYPE.size()` bytes (zero if there
    /// are fewer).
    fn get(bytes: &[u8]) -> Self;
}
macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(bytes: &[u8]) -> Self {
                let mut a = [0u8; core::mem::size_of::<$t>()];
                let n = a.len();
                if let Some(src) = bytes.get(..n) {
                    a.copy_from_slice(src);
                }
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}
element!(f32 => Float32, f64 => Float64, i64 => Int64, i32 => Int32, u8 => UInt8);

impl Tensor {
    /// Wraps a raw handle the guest owns (e.g. from a [`Value::Tensor`]).
    pub fn from_raw(handle: u32) -> Tensor {
        Tensor { handle }
    }

    /// Gives up the handle without releasing it.
    pub fn into_raw(self) -> u32 {
        let h = self.handle;
        core::mem::forget(self);
        h
    }

    /// The raw handle, still owned by `self`.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// A tensor of `dtype` and `shape` from contiguous little-endian bytes.
    ///
    /// # Errors
    /// A `ValueError` from the host if `data` does not match the shape.
    pub fn from_bytes(dtype: DType, shape: &[i64], data: Vec<u8>) -> Result<Tensor> {
        let call = HostCall::TensorNew {
            dtype,
            shape: shape.to_vec(),
            data,
        };
        host::handle(&call).map(Tensor::from_raw)
    }

    /// A tensor of `shape` holding `data` in row-major order.
    ///
    /// # Errors
    /// A `ValueError` if `data.len()` is not the product of `shape`.
    pub fn from_slice<T: Element>(shape: &[i64], data: &[T]) -> Result<Tensor> {
        let mut bytes = Vec::with_capacity(data.len() * T::DTYPE.size());
        for x in data {
            x.put(&mut bytes);
        }
        Tensor::from_bytes(T::DTYPE, shape, bytes)
    }

    /// `torch.ones(shape)` (float32).
    ///
    /// # Errors
    /// Whatever the host's `aten::ones` raises.
    pub fn ones(shape: &[i64]) -> Result<Tensor> {
        Tensor::call("aten::ones", (shape.to_vec(),))
    }

    /// `torch.zeros(shape)` (float32).
    ///
    /// # Errors
    /// Whatever the host's `aten::zeros` raises.
    pub fn zeros(shape: &[i64]) -> Result<Tensor> {
        Tensor::call("aten::zeros", (shape.to_vec(),))
    }

    /// Runs any aten op by schema name with positional and keyword
    /// arguments, returning whatever it returns.
    ///
    /// # Errors
    /// The op's own error, e.g. a `RuntimeError` for mismatched shapes.
    pub fn op(name: &str, args: impl ToArgs, kwargs: &[(&str, Value)]) -> Result<Value> {
        let args = CallArgs {
            args: args.to_args(),
            kwargs: kwargs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
        };
        host::value(&HostCall::Op {
            name: name.to_owned(),
            args,
        })
    }

    /// Runs an aten op that returns one tensor.
    ///
    /// # Errors
    /// The op's error, or a `TypeError` if it returned something else.
    pub fn call(name: &str, args: impl ToArgs) -> Result<Tensor> {
        match Tensor::op(name, args, &[])? {
            Value::Tensor(h) => Ok(Tensor::from_raw(h)),
            other => Err(crate::convert::mismatch("Tensor", &other)),
        }
    }

    fn binary(&self, name: &str, other: &dyn Operand) -> Result<Tensor> {
        Tensor::call(name, vec![Value::Tensor(self.handle), other.operand()])
    }

    fn unary(&self, name: &str) -> Result<Tensor> {
        Tensor::call(name, vec![Value::Tensor(self.handle)])
    }

    /// `self + other` (`aten::add`).
    ///
    /// # Errors
    /// The host's error for mismatched shapes or types.
    pub fn add(&self, other: impl Operand) -> Result<Tensor> {
        self.binary("aten::add", &other)
    }
    /// `self - other` (`aten::sub`).
    ///
    /// # Errors
    /// The host's error for mismatched shapes or types.
    pub fn sub(&self, other: impl Operand) -> Result<Tensor> {
        self.binary("aten::sub", &other)
    }
    /// `self * other` (`aten::mul`).
    ///
    /// # Errors
    /// The host's error for mismatched shapes or types.
    pub fn mul(&self, other: impl Operand) -> Result<Tensor> {
        self.binary("aten::mul", &other)
    }
    /// `self / other` (`aten::div`).
    ///
    /// # Errors
    /// The host's error for mismatched shapes or types.
    pub fn div(&self, other: impl Operand) -> Result<Tensor> {
        self.binary("aten::div", &other)
    }
    /// `self *= other` in place (`aten::mul_`).
    ///
    /// # Errors
    /// The host's error for mismatched shapes or types.
    pub fn mul_(&self, other: impl Operand) -> Result<()> {
        self.binary("aten::mul_", &other).map(drop)
    }
    /// `self /= other` in place (`aten::div_`).
    ///
    /// # Errors
    /// The host's error for mismatched shapes or types.
    pub fn div_(&self, other: impl Operand) -> Result<()> {
        self.binary("aten::div_", &other).map(drop)
    }
    /// `self @ other` (`aten::matmul`).
    ///
    /// # Errors
    /// The host's error for incompatible shapes.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary("aten::matmul", other)
    }
    /// The sum of all elements (`aten::sum`).
    ///
    /// # Errors
    /// The host's error.
    pub fn sum(&self) -> Result<Tensor> {
        self.unary("aten::sum")
    }
    /// `-self` (`aten::neg`).
    ///
    /// # Errors
    /// The host's error.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary("aten::neg")
    }
    /// `relu(self)` (`aten::relu`).
    ///
    /// # Errors
    /// The host's error.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary("aten::relu")
    }
    /// `sigmoid(self)` (`aten::sigmoid`).
    ///
    /// # Errors
    /// The host's error.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary("aten::sigmoid")
    }
    /// The number of elements (`aten::numel`).
    ///
    /// # Errors
    /// The host's error.
    pub fn numel(&self) -> Result<i64> {
        Ok(self.meta()?.shape.iter().product())
    }
    /// A copy with its own storage (`aten::clone`).
    ///
    /// # Errors
    /// The host's error.
    pub fn deep_clone(&self) -> Result<Tensor> {
        self.unary("aten::clone")
    }

    /// A second handle to the same tensor (no copy).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn try_clone(&self) -> Result<Tensor> {
        host::handle(&HostCall::Dup(HandleKind::Tensor, self.handle)).map(Tensor::from_raw)
    }

    /// The tensor's dtype, shape and `requires_grad`.
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn meta(&self) -> Result<TensorMeta> {
        match host::request(&HostCall::TensorMeta(self.handle))? {
            HostReply::Meta(m) => Ok(m),
            other => Err(Error::runtime_error(format!(
                "host replied {other:?} to TensorMeta"
            ))),
        }
    }

    /// The shape.
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn shape(&self) -> Result<Vec<i64>> {
        self.meta().map(|m| m.shape)
    }

    /// The dtype, shape and contiguous little-endian elements.
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn to_bytes(&self) -> Result<(TensorMeta, Vec<u8>)> {
        match host::request(&HostCall::TensorData(self.handle))? {
            HostReply::Data(m, d) => Ok((m, d)),
            other => Err(Error::runtime_error(format!(
                "host replied {other:?} to TensorData"
            ))),
        }
    }

    /// The elements in row-major order.
    ///
    /// # Errors
    /// A `TypeError` if the dtype is not `T`'s.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let (meta, data) = self.to_bytes()?;
        if meta.dtype != T::DTYPE {
            return Err(Error::type_error(format!(
                "tensor has dtype {:?}, not {:?}",
                meta.dtype,
                T::DTYPE
            )));
        }
        Ok(data.chunks_exact(T::DTYPE.size()).map(T::get).collect())
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        // A failure to release means the host already forgot the handle;
        // there is nothing left to do.
        let _ = host::unit(&HostCall::Drop(HandleKind::Tensor, self.handle));
    }
}
