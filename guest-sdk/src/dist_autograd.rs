//! Distributed autograd from inside a plugin (`torch.distributed.autograd`):
//! open a [`context`], make RPCs in it, run [`backward`] across workers and
//! read the gradients this worker accumulated ([`get_gradients`]).
//!
//! The host keeps the context; while the guard lives, every RPC, `remote`
//! and `to_here` of this call carries it exactly as a host's would. If the
//! call itself runs inside a caller's context (an RPC made in one), that
//! context is already current and opening another one fails, as nesting
//! does in PyTorch.

use crate::autograd::request;
use crate::convert::mismatch;
use crate::{Result, Tensor};
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::AutogradCall;

/// An open distributed autograd context (`with dist_autograd.context() as
/// context_id`); dropping it leaves and releases the context on every
/// worker it reached.
#[derive(Debug)]
pub struct Context {
    id: i64,
}

impl Context {
    /// The context's id.
    pub fn id(&self) -> i64 {
        self.id
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // A failure means the context is already gone.
        let _ = request(AutogradCall::ContextRelease(self.id));
    }
}

/// Opens a context, current for this call's later RPCs until the guard is
/// dropped.
///
/// # Errors
/// `RuntimeError` "Already have an autograd context id for this thread"
/// when one is current already.
pub fn context() -> Result<Context> {
    match request(AutogradCall::ContextNew)? {
        Value::Int(id) => Ok(Context { id }),
        other => Err(mismatch("int", &other)),
    }
}

/// The id of the current context (the guest's own, or the one its caller's
/// RPC runs in), if any.
///
/// # Errors
/// The host's.
pub fn current_context_id() -> Result<Option<i64>> {
    match request(AutogradCall::CurrentContext)? {
        Value::Int(id) => Ok(Some(id)),
        Value::None => Ok(None),
        other => Err(mismatch("int or None", &other)),
    }
}

/// `dist_autograd.backward(context_id, roots, retain_graph)`: backward from
/// scalar `roots` across every worker the context reached; gradients
/// accumulate in the context, never in `.grad`.
///
/// # Errors
/// PyTorch's texts: "Could not find autograd context with id: N", a root
/// that is not a scalar or has no graph, or "Error on Node N: ..." from a
/// worker.
pub fn backward(context_id: i64, roots: &[&Tensor], retain_graph: bool) -> Result<()> {
    request(AutogradCall::DistBackward {
        context_id,
        roots: roots.iter().map(|t| t.handle()).collect(),
        retain_graph,
    })
    .map(|_| ())
}

/// The gradients a context accumulated on this worker, keyed by tensor
/// identity: [`get`](Self::get) a tensor the guest holds.
#[derive(Debug)]
pub struct Gradients {
    entries: Vec<(i64, Tensor, Tensor)>,
}

impl Gradients {
    /// The gradient of `tensor` (the same tensor object, not an equal one).
    ///
    /// # Errors
    /// The host's, if the handle is no longer valid.
    pub fn get(&self, tensor: &Tensor) -> Result<Option<&Tensor>> {
        let id = tensor.identity()?;
        Ok(self
            .entries
            .iter()
            .find(|(k, _, _)| *k == id)
            .map(|(_, _, g)| g))
    }

    /// How many tensors have a gradient.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no tensor has a gradient.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every (tensor, gradient) pair.
    pub fn iter(&self) -> impl Iterator<Item = (&Tensor, &Tensor)> {
        self.entries.iter().map(|(_, t, g)| (t, g))
    }
}

/// `dist_autograd.get_gradients(context_id)` on this worker.
///
/// # Errors
/// "Could not find autograd context with id: N".
pub fn get_gradients(context_id: i64) -> Result<Gradients> {
    let items = match request(AutogradCall::GetGradients(context_id))? {
        Value::List(items) => items,
        other => return Err(mismatch("list", &other)),
    };
    let mut entries = Vec::with_capacity(items.len());
    let mut bad = None;
    for item in items {
        match item {
            Value::Tuple(v) => match <[Value; 3]>::try_from(v) {
                Ok([Value::Int(id), Value::Tensor(t), Value::Tensor(g)]) => {
                    entries.push((id, Tensor::from_raw(t), Tensor::from_raw(g)));
                }
                Ok(other) => {
                    bad.get_or_insert(Value::Tuple(other.to_vec()));
                }
                Err(v) => {
                    bad.get_or_insert(Value::Tuple(v));
                }
            },
            other => {
                bad.get_or_insert(other);
            }
        }
    }
    match bad {
        None => Ok(Gradients { entries }),
        Some(v) => Err(mismatch("(int, Tensor, Tensor)", &v)),
    }
}
