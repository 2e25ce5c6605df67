//! [`Handles`]: the `u32` handles one plugin call's guest holds, and the
//! conversions between guest values (handles) and [`Payload`]s (tensor
//! tables).
//!
//! The rules are the runtime's ([`wasmrpc_wasm::GuestHost`]): *requests
//! borrow, outcomes move*. [`Handles::borrow_payload`] resolves handles
//! without releasing them (a request's arguments);
//! [`Handles::take_payload`] moves them out (a call's result);
//! [`Handles::import`] gives the guest a new handle for every tensor a value
//! refers to (replies and call arguments).

use std::collections::HashMap;

use tch::Tensor;
use wasmrpc_wasm::{CallArgs, ErrorKind, HandleKind, HostResult, RemoteError, Value};

use crate::agent::Future;
use crate::value::{Args, Payload};

/// The text of every RRef request from a plugin until RRefs reach plugins.
pub(crate) const RREFS_UNAVAILABLE: &str = "RRefs are not available to plugins yet";

/// The `NotImplementedError` for RRefs in plugins.
pub(crate) fn rrefs_unavailable() -> RemoteError {
    RemoteError::new(ErrorKind::NotImplementedError, RREFS_UNAVAILABLE)
}

fn no_handle(what: &str, handle: u32) -> RemoteError {
    RemoteError::new(
        ErrorKind::RuntimeError,
        format!("no {what} with handle {handle} in this call"),
    )
}

/// Rebuilds `value` with every tensor reference replaced by `tensor(i)`;
/// RRef references are refused.
fn map_tensors(value: Value, tensor: &mut impl FnMut(u32) -> HostResult<u32>) -> HostResult<Value> {
    Ok(match value {
        Value::Tensor(i) => Value::Tensor(tensor(i)?),
        Value::RRef(_) => return Err(rrefs_unavailable()),
        Value::List(xs) => Value::List(
            xs.into_iter()
                .map(|x| map_tensors(x, tensor))
                .collect::<HostResult<_>>()?,
        ),
        Value::Tuple(xs) => Value::Tuple(
            xs.into_iter()
                .map(|x| map_tensors(x, tensor))
                .collect::<HostResult<_>>()?,
        ),
        Value::Dict(kv) => Value::Dict(
            kv.into_iter()
                .map(|(k, v)| Ok((map_tensors(k, tensor)?, map_tensors(v, tensor)?)))
                .collect::<HostResult<_>>()?,
        ),
        Value::Record { name, fields } => Value::Record {
            name,
            fields: fields
                .into_iter()
                .map(|(k, v)| Ok((k, map_tensors(v, tensor)?)))
                .collect::<HostResult<_>>()?,
        },
        other => other,
    })
}

/// The handle tables of one plugin call (tensors and the agent's futures).
/// Handles are never reused within a call; everything left is released
/// when the call's host is dropped.
#[derive(Default)]
pub(crate) struct Handles {
    next: u32,
    tensors: HashMap<u32, Tensor>,
    futures: HashMap<u32, Future>,
}

impl Handles {
    fn fresh(&mut self) -> u32 {
        self.next = self.next.wrapping_add(1).max(1);
        self.next
    }

    /// A new handle to `t`.
    pub(crate) fn insert_tensor(&mut self, t: Tensor) -> u32 {
        let h = self.fresh();
        self.tensors.insert(h, t);
        h
    }

    /// The tensor behind `h` (a reference to the same tensor).
    pub(crate) fn tensor(&self, h: u32) -> HostResult<Tensor> {
        self.tensors
            .get(&h)
            .map(Tensor::shallow_clone)
            .ok_or_else(|| no_handle("tensor", h))
    }

    /// A new handle to `f`.
    pub(crate) fn insert_future(&mut self, f: Future) -> u32 {
        let h = self.fresh();
        self.futures.insert(h, f);
        h
    }

    /// The future behind `h`.
    pub(crate) fn future(&self, h: u32) -> HostResult<Future> {
        self.futures
            .get(&h)
            .cloned()
            .ok_or_else(|| no_handle("future", h))
    }

    /// A second handle to the object behind `h`.
    pub(crate) fn dup(&mut self, kind: HandleKind, h: u32) -> HostResult<u32> {
        match kind {
            HandleKind::Tensor => {
                let t = self.tensor(h)?;
                Ok(self.insert_tensor(t))
            }
            HandleKind::Future => {
                let f = self.future(h)?;
                Ok(self.insert_future(f))
            }
            HandleKind::RRef => Err(rrefs_unavailable()),
        }
    }

    /// Releases `h`.
    pub(crate) fn release(&mut self, kind: HandleKind, h: u32) -> HostResult<()> {
        let found = match kind {
            HandleKind::Tensor => self.tensors.remove(&h).is_some(),
            HandleKind::Future => self.futures.remove(&h).is_some(),
            HandleKind::RRef => return Err(rrefs_unavailable()),
        };
        if found {
            Ok(())
        } else {
            let what = if kind == HandleKind::Tensor {
                "tensor"
            } else {
                "future"
            };
            Err(no_handle(what, h))
        }
    }

    /// Live handles: `(tensors, futures)`.
    #[cfg(test)]
    pub(crate) fn live(&self) -> (usize, usize) {
        (self.tensors.len(), self.futures.len())
    }

    /// `payload` as a guest value: a new handle for every tensor reference
    /// (two references to one entry get two handles, so the guest may drop
    /// each).
    ///
    /// # Errors
    /// `NotImplementedError` for RRefs; `RuntimeError` for an index outside
    /// the payload's table.
    pub(crate) fn import(&mut self, payload: Payload) -> HostResult<Value> {
        let Payload { value, tensors, .. } = payload;
        map_tensors(value, &mut |i| {
            let t = tensors.get(i as usize).ok_or_else(|| {
                RemoteError::new(
                    ErrorKind::RuntimeError,
                    format!("tensor index {i} outside a table of {}", tensors.len()),
                )
            })?;
            Ok(self.insert_tensor(t.shallow_clone()))
        })
    }

    /// A call's arguments as guest call arguments (see [`Self::import`]).
    ///
    /// # Errors
    /// As [`Self::import`].
    pub(crate) fn import_args(&mut self, args: Args) -> HostResult<CallArgs> {
        let Args {
            positional,
            kwargs,
            tensors,
            ..
        } = args;
        let table = |v: Value| Payload {
            value: v,
            tensors: tensors.iter().map(Tensor::shallow_clone).collect(),
            rrefs: Vec::new(),
        };
        let args = positional
            .into_iter()
            .map(|v| self.import(table(v)))
            .collect::<HostResult<_>>()?;
        let kwargs = kwargs
            .into_iter()
            .map(|(k, v)| Ok((k, self.import(table(v))?)))
            .collect::<HostResult<_>>()?;
        Ok(CallArgs { args, kwargs })
    }

    /// Resolves the handles of `value` into a payload, either keeping them
    /// (`take` false: a request borrows) or releasing them (`take` true: an
    /// outcome moves). One handle named twice is one table entry.
    fn resolve_handles(
        &mut self,
        value: Value,
        take: bool,
        tensors: &mut Vec<Tensor>,
        seen: &mut HashMap<u32, u32>,
    ) -> HostResult<Value> {
        map_tensors(value, &mut |h| {
            if let Some(i) = seen.get(&h) {
                return Ok(*i);
            }
            let t = if take {
                self.tensors
                    .remove(&h)
                    .ok_or_else(|| no_handle("tensor", h))?
            } else {
                self.tensor(h)?
            };
            tensors.push(t);
            let i = u32::try_from(tensors.len() - 1).map_err(|_| {
                RemoteError::new(
                    ErrorKind::RuntimeError,
                    "more than 2^32 tensors in one value",
                )
            })?;
            seen.insert(h, i);
            Ok(i)
        })
    }

    /// The payload a guest value stands for; the guest keeps its handles.
    ///
    /// # Errors
    /// `RuntimeError` for an unknown handle, `NotImplementedError` for RRefs.
    pub(crate) fn borrow_payload(&mut self, value: Value) -> HostResult<Payload> {
        let mut tensors = Vec::new();
        let value = self.resolve_handles(value, false, &mut tensors, &mut HashMap::new())?;
        Ok(Payload {
            value,
            tensors,
            rrefs: Vec::new(),
        })
    }

    /// The payload a guest value stands for, moving its handles out.
    ///
    /// # Errors
    /// As [`Self::borrow_payload`].
    pub(crate) fn take_payload(&mut self, value: Value) -> HostResult<Payload> {
        let mut tensors = Vec::new();
        let value = self.resolve_handles(value, true, &mut tensors, &mut HashMap::new())?;
        Ok(Payload {
            value,
            tensors,
            rrefs: Vec::new(),
        })
    }

    /// Guest call arguments as [`Args`] over one tensor table; the guest
    /// keeps its handles.
    ///
    /// # Errors
    /// As [`Self::borrow_payload`].
    pub(crate) fn borrow_args(&mut self, call: CallArgs) -> HostResult<Args> {
        let mut tensors = Vec::new();
        let mut seen = HashMap::new();
        let mut positional = Vec::with_capacity(call.args.len());
        for v in call.args {
            positional.push(self.resolve_handles(v, false, &mut tensors, &mut seen)?);
        }
        let mut kwargs = Vec::with_capacity(call.kwargs.len());
        for (k, v) in call.kwargs {
            kwargs.push((k, self.resolve_handles(v, false, &mut tensors, &mut seen)?));
        }
        Ok(Args {
            positional,
            kwargs,
            tensors,
            rrefs: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imports_give_one_handle_per_reference_and_takes_move_them_out() {
        let mut h = Handles::default();
        let t = Tensor::from_slice(&[1.0f32, 2.0]);
        let p = Payload {
            value: Value::List(vec![Value::Tensor(0), Value::Int(3), Value::Tensor(0)]),
            tensors: vec![t],
            rrefs: Vec::new(),
        };
        let v = h.import(p).unwrap();
        let Value::List(items) = &v else {
            panic!("{v:?}")
        };
        assert_ne!(items[0], items[2]);
        assert_eq!(h.live(), (2, 0));

        let borrowed = h.borrow_payload(v.clone()).unwrap();
        assert_eq!(borrowed.tensors.len(), 2);
        assert_eq!(h.live(), (2, 0));

        let taken = h.take_payload(v).unwrap();
        assert_eq!(taken.tensors.len(), 2);
        assert_eq!(h.live(), (0, 0));
    }

    #[test]
    fn a_handle_named_twice_is_one_table_entry() {
        let mut h = Handles::default();
        let a = h.insert_tensor(Tensor::from_slice(&[1i64]));
        let args = h
            .borrow_args(CallArgs {
                args: vec![Value::Tensor(a), Value::Tensor(a)],
                kwargs: vec![("k".into(), Value::Tensor(a))],
            })
            .unwrap();
        assert_eq!(args.tensors.len(), 1);
        assert_eq!(args.positional, vec![Value::Tensor(0), Value::Tensor(0)]);
        assert_eq!(args.kwargs[0].1, Value::Tensor(0));
    }

    #[test]
    fn rrefs_and_unknown_handles_are_errors() {
        let mut h = Handles::default();
        let e = h.borrow_payload(Value::RRef(1)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotImplementedError);
        assert_eq!(e.message, RREFS_UNAVAILABLE);
        let e = h.release(HandleKind::Tensor, 9).unwrap_err();
        assert!(e.message.contains("no tensor with handle 9"), "{e:?}");
        assert!(h.dup(HandleKind::RRef, 1).is_err());
    }
}
