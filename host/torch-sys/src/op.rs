//! [`Operator`]: a builtin op name resolved once through libtorch's JIT
//! operator registry, and the calls that match arguments against its
//! overloads and run it.
//!
//! This module owns name resolution (`aten::add`, `torch.ops.aten.add`, a
//! bare tensor method name such as `view`), the process-wide cache of
//! resolved names, and the safe wrappers over the shim's entry points.
//! Schema matching and the call itself happen in the C++ shim; Python's
//! builtins (`builtins.min`, ...) live in [`crate::builtin`].

use crate::builtin;
use crate::error::OpError;
use crate::ffi::{self, RawOp, RawOut, RawStr, RawValue};
use crate::value::{self, OpValue};
use std::borrow::Cow;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use wasmrpc_abi::ErrorKind;

mod gate;

pub use gate::{Admission, AdmitAll, OpGate, Target};

/// The prefix PyTorch RPC puts on builtin op names on the wire
/// (`torch.ops.aten.add` for `aten::add`).
pub const WIRE_PREFIX: &str = "torch.ops.aten.";

/// A builtin op resolved by name: all its overloads, in the order PyTorch RPC
/// tries them (dispatcher ops first, then TorchScript-only ones).
///
/// Cheap to clone (an `Arc`), `Send` and `Sync`: resolve once, call from any
/// thread. [`Operator::resolve`] caches by name for the life of the process.
#[derive(Clone)]
pub struct Operator {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    raw: NonNull<RawOp>,
    schemas: Vec<String>,
}

// SAFETY: the shim's `wrs_op` is immutable after resolution; calls only read
// its overload list and invoke the operations, which libtorch allows from
// any thread at once (the dispatcher and JIT operations are thread-safe).
unsafe impl Send for Inner {}
// SAFETY: as for `Send`: shared access only reads.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `wrs_op_resolve`, is freed only here, and
        // no call can be running since this is the last reference.
        unsafe { ffi::wrs_op_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Operator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operator")
            .field("name", &self.inner.name)
            .field("overloads", &self.inner.schemas.len())
            .finish()
    }
}

/// Longest name [`Operator::resolve`] looks up.
const MAX_NAME_LEN: usize = 256;

/// Whether `name` can be a registered operator name at all. Checked before
/// the registry lookup, which interns every name it is given: a peer
/// sending arbitrary strings should not grow that table with garbage.
fn plausible_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':' || b == b'.')
}

/// Name → resolved operator, filled on first use of each name.
fn cache() -> &'static RwLock<HashMap<String, Operator>> {
    static CACHE: OnceLock<RwLock<HashMap<String, Operator>>> = OnceLock::new();
    CACHE.get_or_init(|| RwLock::new(HashMap::new()))
}

/// The registry's qualified name for a name as callers spell it:
/// `aten::add` stays, `torch.ops.aten.add` (PyTorch RPC's wire form) and a
/// bare `add` (a tensor method) become `aten::add`.
pub fn qualified_name(name: &str) -> Cow<'_, str> {
    if name.contains("::") {
        Cow::Borrowed(name)
    } else if let Some(rest) = name.strip_prefix(WIRE_PREFIX) {
        Cow::Owned(format!("aten::{rest}"))
    } else {
        Cow::Owned(format!("aten::{name}"))
    }
}

/// Reads an error out of the shim's thread-local storage.
///
/// # Safety
///
/// `out` must have just been filled by a shim call on this thread.
unsafe fn error_text(out: &RawOut) -> String {
    if out.err.is_null() {
        return String::new();
    }
    // SAFETY: the shim set `err`/`err_len` to its thread-local message, valid
    // until the next shim call on this thread.
    let bytes = unsafe { std::slice::from_raw_parts(out.err, out.err_len) };
    String::from_utf8_lossy(bytes).into_owned()
}

fn error_kind(class: i32) -> ErrorKind {
    match class {
        ffi::CLASS_INDEX => ErrorKind::IndexError,
        ffi::CLASS_VALUE => ErrorKind::ValueError,
        ffi::CLASS_TYPE => ErrorKind::TypeError,
        ffi::CLASS_NOT_IMPLEMENTED => ErrorKind::NotImplementedError,
        _ => ErrorKind::RuntimeError,
    }
}

impl Operator {
    /// The operator registered under `name` (see [`qualified_name`]),
    /// resolved on first use and then served from a process-wide cache.
    ///
    /// # Errors
    ///
    /// [`OpError::UnknownOp`] if libtorch registers no operator under the
    /// name.
    pub fn resolve(name: &str) -> Result<Operator, OpError> {
        if let Some(op) = cache()
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
        {
            return Ok(op.clone());
        }
        let qualified = qualified_name(name);
        if !plausible_name(&qualified) {
            return Err(OpError::UnknownOp {
                name: qualified.into_owned(),
            });
        }
        let op = Operator::resolve_uncached(&qualified)?;
        let mut map = cache().write().unwrap_or_else(PoisonError::into_inner);
        Ok(map.entry(name.to_owned()).or_insert(op).clone())
    }

    fn resolve_uncached(qualified: &str) -> Result<Operator, OpError> {
        let mut raw: *mut RawOp = std::ptr::null_mut();
        let mut out = RawOut::empty();
        // SAFETY: the name is a valid byte range; `raw` and `out` are valid
        // places for the shim to write; the shim catches every exception.
        let status =
            unsafe { ffi::wrs_op_resolve(qualified.as_ptr(), qualified.len(), &mut raw, &mut out) };
        if status == ffi::STATUS_UNKNOWN_OP {
            return Err(OpError::UnknownOp {
                name: qualified.to_owned(),
            });
        }
        let raw = match NonNull::new(raw) {
            Some(raw) if status == ffi::STATUS_OK => raw,
            _ => {
                return Err(OpError::Internal {
                    op: qualified.to_owned(),
                    // SAFETY: `out` was just filled by the shim on this thread.
                    message: unsafe { error_text(&out) },
                });
            }
        };
        // SAFETY: `raw` is a live handle from `wrs_op_resolve`.
        let count = unsafe { ffi::wrs_op_num_overloads(raw.as_ptr()) };
        let mut schemas = Vec::with_capacity(count);
        for index in 0..count {
            let mut text = RawStr {
                ptr: std::ptr::null(),
                len: 0,
            };
            // SAFETY: `raw` is live, `index` is in range, `text` is writable.
            let status = unsafe { ffi::wrs_op_schema(raw.as_ptr(), index, &mut text) };
            if status == ffi::STATUS_OK && !text.ptr.is_null() {
                // SAFETY: the shim points `text` at its thread-local string,
                // valid until the next shim call on this thread.
                let bytes = unsafe { std::slice::from_raw_parts(text.ptr, text.len) };
                schemas.push(String::from_utf8_lossy(bytes).into_owned());
            }
        }
        Ok(Operator {
            inner: Arc::new(Inner {
                name: qualified.to_owned(),
                raw,
                schemas,
            }),
        })
    }

    /// The qualified name, e.g. `aten::add`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The schema of every overload, in matching order, e.g.
    /// `aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor`.
    pub fn schemas(&self) -> &[String] {
        &self.inner.schemas
    }

    /// Runs the first overload whose schema accepts `args` and `kwargs`
    /// (defaults filled in) and returns its outputs, one per schema return:
    /// `aten::max.dim` gives `[values, indices]`. Autograd records the call
    /// if an input requires grad; grad mode is this thread's.
    ///
    /// # Errors
    ///
    /// [`OpError::NoMatchingSchema`] if no overload accepts the arguments;
    /// [`OpError::Raised`] with libtorch's message if the op raises;
    /// [`OpError::Internal`] if an output has a type [`OpValue`] lacks.
    pub fn call(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
    ) -> Result<Vec<OpValue>, OpError> {
        self.call_inner(args, kwargs, false)
    }

    /// Like [`Operator::call`] for a tensor method, `args[0]` being `self`:
    /// as in Python, a method whose one parameter is an `int[]` also takes
    /// it as trailing ints (`t.view(2, 3)`).
    ///
    /// # Errors
    ///
    /// As for [`Operator::call`].
    pub fn call_method(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
    ) -> Result<Vec<OpValue>, OpError> {
        self.call_inner(args, kwargs, true)
    }

    /// The schema of the overload a call with these arguments would run,
    /// without running it (`aten::add.Scalar(...)` for a tensor and an int).
    ///
    /// # Errors
    ///
    /// [`OpError::NoMatchingSchema`] if no overload accepts the arguments.
    pub fn matching_schema(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
    ) -> Result<&str, OpError> {
        self.matching_schema_inner(args, kwargs, false)
    }

    /// [`Operator::matching_schema`] for a tensor method call
    /// ([`Operator::call_method`]: trailing ints may fill an `int[]`).
    ///
    /// # Errors
    ///
    /// [`OpError::NoMatchingSchema`] if no overload accepts the arguments.
    pub fn matching_method_schema(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
    ) -> Result<&str, OpError> {
        self.matching_schema_inner(args, kwargs, true)
    }

    fn matching_schema_inner(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
        method_varargs: bool,
    ) -> Result<&str, OpError> {
        let call = Encoded::new(args, kwargs).map_err(|e| e.with_op(self.name()))?;
        let mut index = usize::MAX;
        let mut out = RawOut::empty();
        // SAFETY: as in `call_inner`; `index` is writable.
        let status = unsafe {
            ffi::wrs_op_match(
                self.inner.raw.as_ptr(),
                call.nodes.as_ptr(),
                call.nodes.len(),
                args.len(),
                call.names.as_ptr(),
                call.names.len(),
                i32::from(method_varargs),
                &mut index,
                &mut out,
            )
        };
        if status != ffi::STATUS_OK {
            // SAFETY: `out` was just filled by the shim on this thread.
            return Err(unsafe { self.error(status, &out) });
        }
        self.inner
            .schemas
            .get(index)
            .map(String::as_str)
            .ok_or_else(|| OpError::Internal {
                op: self.name().to_owned(),
                message: format!("overload index {index} out of range"),
            })
    }

    /// The error for a failed shim call.
    ///
    /// # Safety
    ///
    /// `out` must have just been filled by a shim call on this thread.
    unsafe fn error(&self, status: i32, out: &RawOut) -> OpError {
        // SAFETY: forwarded contract.
        let message = unsafe { error_text(out) };
        let op = self.name().to_owned();
        match status {
            ffi::STATUS_SCHEMA => OpError::NoMatchingSchema { op, message },
            ffi::STATUS_OP => OpError::Raised {
                op,
                kind: error_kind(out.err_class),
                message,
            },
            _ => OpError::Internal { op, message },
        }
    }

    fn call_inner(
        &self,
        args: &[OpValue],
        kwargs: &[(String, OpValue)],
        method_varargs: bool,
    ) -> Result<Vec<OpValue>, OpError> {
        let call = Encoded::new(args, kwargs).map_err(|e| e.with_op(self.name()))?;
        let mut out = RawOut::empty();
        // SAFETY: `call.nodes` is a well-formed pre-order encoding of `args`
        // then `kwargs`, whose tensor pointers and string bytes borrow from
        // them and so outlive the call; `call.names` borrows from `kwargs`;
        // the op handle is live; `out` is writable; the shim catches every
        // exception.
        let status = unsafe {
            ffi::wrs_op_call(
                self.inner.raw.as_ptr(),
                call.nodes.as_ptr(),
                call.nodes.len(),
                args.len(),
                call.names.as_ptr(),
                call.names.len(),
                i32::from(method_varargs),
                &mut out,
            )
        };
        match status {
            ffi::STATUS_OK => {
                let raw_nodes = if out.n_nodes == 0 {
                    &[][..]
                } else {
                    // SAFETY: on success the shim points `nodes` at
                    // `n_nodes` entries of its thread-local buffer, valid
                    // until the next shim call on this thread.
                    unsafe { std::slice::from_raw_parts(out.nodes, out.n_nodes) }
                };
                // SAFETY: the shim's outputs own fresh `new at::Tensor`
                // pointers and point strings at its thread-local arena.
                unsafe { value::decode(raw_nodes, out.n_outputs) }
                    .map_err(|e| e.with_op(self.name()))
            }
            // SAFETY: `out` was just filled by the shim on this thread.
            status => Err(unsafe { self.error(status, &out) }),
        }
    }
}

/// A call's arguments encoded for the shim. Its tensor and string pointers
/// borrow from the arguments, which the lifetime keeps alive.
struct Encoded<'a> {
    nodes: Vec<RawValue>,
    names: Vec<RawStr>,
    _borrows: std::marker::PhantomData<&'a [OpValue]>,
}

impl<'a> Encoded<'a> {
    fn new(args: &'a [OpValue], kwargs: &'a [(String, OpValue)]) -> Result<Encoded<'a>, OpError> {
        let mut nodes = Vec::with_capacity(args.len() + kwargs.len() + 2);
        for arg in args {
            value::encode(arg, &mut nodes)?;
        }
        let mut names = Vec::with_capacity(kwargs.len());
        for (name, arg) in kwargs {
            value::encode(arg, &mut nodes)?;
            names.push(RawStr {
                ptr: name.as_ptr(),
                len: name.len(),
            });
        }
        Ok(Encoded {
            nodes,
            names,
            _borrows: std::marker::PhantomData,
        })
    }
}

/// Calls the builtin named `name` (`aten::add`, `torch.ops.aten.add`, a bare
/// tensor-op name, or a Python builtin such as `builtins.min`), resolving
/// the name through the cache. See [`Operator::call`]. Runs whatever the name
/// resolves to: [`call_op_gated`] is the form for names callers choose.
///
/// # Errors
///
/// [`OpError::UnknownOp`] for an unknown name, otherwise as for
/// [`Operator::call`] (or the Python builtin's own errors).
pub fn call_op(
    name: &str,
    args: &[OpValue],
    kwargs: &[(String, OpValue)],
) -> Result<Vec<OpValue>, OpError> {
    call_op_gated(name, args, kwargs, &AdmitAll)
}

/// [`call_op`], with `gate` deciding whether the resolved op may run.
///
/// # Errors
///
/// As for [`call_op`], and the gate's refusal.
pub fn call_op_gated(
    name: &str,
    args: &[OpValue],
    kwargs: &[(String, OpValue)],
    gate: &dyn OpGate,
) -> Result<Vec<OpValue>, OpError> {
    if crate::builtin::BUILTINS.contains(&name) {
        gate.admit(&Admission {
            target: Target::Builtin(name),
            args,
            kwargs,
            method: false,
        })?;
        if let Some(result) = builtin::call(name, args, kwargs) {
            return result.map(|v| vec![v]);
        }
    }
    let op = Operator::resolve(name)?;
    gate.admit(&Admission {
        target: Target::Op(&op),
        args,
        kwargs,
        method: false,
    })?;
    op.call(args, kwargs)
}

/// Calls the tensor method `name` (`view`, `size`, `sum`, `to`, ...) on
/// `args[0]`, resolved as `aten::<name>`; see [`Operator::call_method`].
///
/// Tensor properties are TorchScript `prim::` ops (`dtype`, `device`,
/// `is_sparse`, `requires_grad`, `is_cuda`): when no `aten::<name>` overload
/// exists or accepts the arguments, a bare name falls back to
/// `prim::<name>`. Python-only methods with no operator (`float()`,
/// `long()`, `tolist()`, `type()`) do not resolve: call `to` with a dtype.
/// Runs whatever the name resolves to: [`call_method_gated`] is the form
/// for names callers choose.
///
/// # Errors
///
/// [`OpError::UnknownMethod`] (`AttributeError`) if neither op exists;
/// otherwise as for [`call_op`], with the `aten::` error if both fail,
/// unless only the `prim::` op exists.
pub fn call_method(
    name: &str,
    args: &[OpValue],
    kwargs: &[(String, OpValue)],
) -> Result<Vec<OpValue>, OpError> {
    call_method_gated(name, args, kwargs, &AdmitAll)
}

/// [`call_method`], with `gate` deciding whether each op it would run
/// (`aten::<name>`, then the `prim::<name>` fallback) may run.
///
/// # Errors
///
/// As for [`call_method`], and the gate's refusal: a refused `aten::` op
/// fails the call at once (no fallback); a refused fallback is reported
/// as the `aten::` error would be, or as the refusal when no `aten::` op
/// exists.
pub fn call_method_gated(
    name: &str,
    args: &[OpValue],
    kwargs: &[(String, OpValue)],
    gate: &dyn OpGate,
) -> Result<Vec<OpValue>, OpError> {
    let admit = |op: &Operator| {
        gate.admit(&Admission {
            target: Target::Op(op),
            args,
            kwargs,
            method: true,
        })
    };
    let first = match Operator::resolve(name) {
        Ok(op) => {
            // A refusal is the answer: falling back to another op after it
            // would make refusing one op a way to reach another.
            admit(&op)?;
            op.call_method(args, kwargs)
        }
        Err(e) => Err(e),
    };
    match first {
        Err(OpError::UnknownOp { .. } | OpError::NoMatchingSchema { .. })
            if !name.contains("::") =>
        {
            let fallback = Operator::resolve(&format!("prim::{name}")).and_then(|op| {
                admit(&op)?;
                op.call_method(args, kwargs)
            });
            match (first, fallback) {
                (_, Ok(out)) => Ok(out),
                (Err(OpError::UnknownOp { .. }), Err(OpError::UnknownOp { .. })) => {
                    Err(OpError::UnknownMethod {
                        type_name: args
                            .first()
                            .map_or("NoneType", OpValue::type_name)
                            .to_owned(),
                        name: name.to_owned(),
                    })
                }
                (Err(OpError::UnknownOp { .. }), Err(e)) => Err(e),
                (first, Err(_)) => first,
            }
        }
        other => other,
    }
}

/// Every operator name libtorch registers (`aten::add`, `prim::min`, ...),
/// sorted, each once: what [`call_op`] can reach. Some need a TorchScript
/// graph node and still report `Unknown builtin op` (see the crate docs).
pub fn registered_ops() -> Vec<String> {
    let mut names = RawStr {
        ptr: std::ptr::null(),
        len: 0,
    };
    // SAFETY: `names` is writable; the shim catches every exception.
    let status = unsafe { ffi::wrs_all_op_names(&mut names) };
    if status != ffi::STATUS_OK || names.ptr.is_null() {
        return Vec::new();
    }
    // SAFETY: the shim points `names` at its thread-local string, valid until
    // the next shim call on this thread.
    let bytes = unsafe { std::slice::from_raw_parts(names.ptr, names.len) };
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The schemas of every overload registered under `name`, in matching order.
///
/// # Errors
///
/// [`OpError::UnknownOp`] for an unknown name.
pub fn schemas(name: &str) -> Result<Vec<String>, OpError> {
    Ok(Operator::resolve(name)?.schemas().to_vec())
}

#[cfg(test)]
mod tests;
