//! Local autograd on [`Tensor`]s (`requires_grad_`, `backward`, `grad`,
//! `detach`, in-place updates) and [`no_grad`] scopes. Everything runs in
//! the host, which records the graph; this module only sends the requests.

use crate::host;
use crate::tensor::Operand;
use crate::{Result, Tensor};
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{AutogradCall, HostCall};

/// Sends one autograd request; its reply is a value.
pub(crate) fn request(call: AutogradCall) -> Result<Value> {
    host::value(&HostCall::Autograd(call))
}

impl Tensor {
    /// Turns gradient recording for this (leaf) tensor on or off, in place
    /// (`tensor.requires_grad_(flag)`); returns the tensor for chaining.
    ///
    /// # Errors
    /// A `RuntimeError` for a non-leaf tensor ("you can only change
    /// requires_grad flags of leaf variables").
    pub fn requires_grad_(self, flag: bool) -> Result<Tensor> {
        request(AutogradCall::SetRequiresGrad(self.handle(), flag))?;
        Ok(self)
    }

    /// Whether autograd records operations on this tensor.
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn requires_grad(&self) -> Result<bool> {
        Ok(self.meta()?.requires_grad)
    }

    /// Local backward from this scalar (`tensor.backward()`): fills the
    /// `.grad` of the leaves it reaches.
    ///
    /// # Errors
    /// libtorch's, e.g. "element 0 of tensors does not require grad and
    /// does not have a grad_fn".
    pub fn backward(&self) -> Result<()> {
        request(AutogradCall::Backward(self.handle())).map(|_| ())
    }

    /// Sets (`Some`) or clears (`None`) the gradient (`tensor.grad = g`),
    /// as an optimizer's `zero_grad(set_to_none=True)` does.
    ///
    /// # Errors
    /// A `RuntimeError` "assigned grad has data of a different size" (or
    /// type, or device), as PyTorch raises.
    pub fn set_grad(&self, grad: Option<&Tensor>) -> Result<()> {
        request(AutogradCall::SetGrad(
            self.handle(),
            grad.map(Tensor::handle),
        ))
        .map(|_| ())
    }

    /// The gradient local autograd accumulated (`tensor.grad`), if any.
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn grad(&self) -> Result<Option<Tensor>> {
        match request(AutogradCall::Grad(self.handle()))? {
            Value::Tensor(h) => Ok(Some(Tensor::from_raw(h))),
            Value::None => Ok(None),
            other => Err(crate::convert::mismatch("Tensor or None", &other)),
        }
    }

    /// The same data without a graph (`tensor.detach()`).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn detach(&self) -> Result<Tensor> {
        Tensor::call("aten::detach", vec![Value::Tensor(self.handle())])
    }

    /// `self -= other`, in place (`tensor.sub_(other)`); on a leaf that
    /// requires grad, only inside [`no_grad`].
    ///
    /// # Errors
    /// libtorch's, e.g. "a leaf Variable that requires grad is being used
    /// in an in-place operation."
    pub fn sub_(&self, other: impl Operand) -> Result<()> {
        Tensor::op(
            "aten::sub_",
            vec![Value::Tensor(self.handle()), other.operand()],
            &[],
        )
        .map(drop_value)
    }

    /// `self += other`, in place (`tensor.add_(other)`).
    ///
    /// # Errors
    /// As [`sub_`](Self::sub_).
    pub fn add_(&self, other: impl Operand) -> Result<()> {
        Tensor::op(
            "aten::add_",
            vec![Value::Tensor(self.handle()), other.operand()],
            &[],
        )
        .map(drop_value)
    }

    /// An opaque identity of the tensor object behind this handle: equal
    /// for two handles to the same tensor (how [`Gradients`](crate::dist_autograd::Gradients)
    /// finds a tensor's gradient).
    ///
    /// # Errors
    /// A `RuntimeError` if the handle is no longer valid.
    pub fn identity(&self) -> Result<i64> {
        match request(AutogradCall::Identity(self.handle()))? {
            Value::Int(i) => Ok(i),
            other => Err(crate::convert::mismatch("int", &other)),
        }
    }
}

/// Releases the handles of an op's result the caller does not need.
fn drop_value(v: Value) {
    drop(<crate::AnyValue as crate::FromValue>::from_value(v));
}

/// Runs `f` with gradient recording off for this call's ops
/// (`with torch.no_grad():`), restoring the previous setting after.
///
/// # Errors
/// `f`'s error, or the host's.
pub fn no_grad<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let previous = match request(AutogradCall::SetGradEnabled(false))? {
        Value::Bool(b) => b,
        other => return Err(crate::convert::mismatch("bool", &other)),
    };
    let out = f();
    let restored = request(AutogradCall::SetGradEnabled(previous));
    match (out, restored) {
        (Ok(v), Ok(_)) => Ok(v),
        (Err(e), _) | (Ok(_), Err(e)) => Err(e),
    }
}
