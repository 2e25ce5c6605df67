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
use crate::rref::RRef;
use crate::value::Handle;
use crate::value::{Args, Payload};

fn no_handle(what: &str, handle: u32) -> RemoteError {
    RemoteError::new(
        ErrorKind::RuntimeError,
        format!("no {what} with handle {handle} in this call"),
    )
}

/// Which table a value's reference points into.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Ref {
    Tensor,
    RRef,
}

/// Rebuilds `value` with every tensor and RRef reference `i` replaced by
/// `f(kind, i)`.
fn map_refs(value: Value, f: &mut impl FnMut(Ref, u32) -> HostResult<u32>) -> HostResult<Value> {
    crate::value::map_values(value, &mut |v| {
        Ok(match v {
            Value::Tensor(i) => Value::Tensor(f(Ref::Tensor, i)?),
            Value::RRef(i) => Value::RRef(f(Ref::RRef, i)?),
            other => other,
        })
    })
}

/// The tables a guest value's handles resolve into; one handle named twice
/// is one entry.
#[derive(Default)]
struct Tables {
    tensors: Vec<Tensor>,
    rrefs: Vec<Handle>,
    seen: HashMap<(Ref, u32), u32>,
}

/// The handle tables of one plugin call (tensors, the agent's futures and
/// RRefs).
/// Handles are never reused within a call; everything left is released
/// when the call's host is dropped.
#[derive(Default)]
pub(crate) struct Handles {
    next: u32,
    tensors: HashMap<u32, Tensor>,
    futures: HashMap<u32, Future>,
    rrefs: HashMap<u32, RRef>,
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

    /// Moves every tensor behind a handle to `device` in place
    /// (`set_data`): the handles, and every other reference to the same
    /// tensors, see them on `device`.
    pub(crate) fn move_tensors(&mut self, device: tch::Device) -> Result<(), tch::TchError> {
        for t in self.tensors.values_mut() {
            if t.device() != device {
                let moved = tch::no_grad(|| t.f_to_device(device))?;
                t.f_set_data(&moved)?;
            }
        }
        Ok(())
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

    /// A new handle to `r` (the same RRef object).
    pub(crate) fn insert_rref(&mut self, r: RRef) -> u32 {
        let h = self.fresh();
        self.rrefs.insert(h, r);
        h
    }

    /// The RRef behind `h`.
    pub(crate) fn rref(&self, h: u32) -> HostResult<RRef> {
        self.rrefs
            .get(&h)
            .cloned()
            .ok_or_else(|| no_handle("RRef", h))
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
            HandleKind::RRef => {
                let r = self.rref(h)?;
                Ok(self.insert_rref(r))
            }
        }
    }

    /// Releases `h`.
    pub(crate) fn release(&mut self, kind: HandleKind, h: u32) -> HostResult<()> {
        let found = match kind {
            HandleKind::Tensor => self.tensors.remove(&h).is_some(),
            HandleKind::Future => self.futures.remove(&h).is_some(),
            HandleKind::RRef => self.rrefs.remove(&h).is_some(),
        };
        if found {
            Ok(())
        } else {
            let what = match kind {
                HandleKind::Tensor => "tensor",
                HandleKind::Future => "future",
                HandleKind::RRef => "RRef",
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
        let Payload {
            value,
            tensors,
            rrefs,
        } = payload;
        map_refs(value, &mut |kind, i| match kind {
            Ref::Tensor => {
                let t = tensors.get(i as usize).ok_or_else(|| {
                    RemoteError::new(
                        ErrorKind::RuntimeError,
                        format!("tensor index {i} outside a table of {}", tensors.len()),
                    )
                })?;
                Ok(self.insert_tensor(t.shallow_clone()))
            }
            Ref::RRef => {
                let r = rrefs
                    .get(i as usize)
                    .and_then(|h| h.downcast_ref::<RRef>())
                    .ok_or_else(|| {
                        RemoteError::new(
                            ErrorKind::RuntimeError,
                            format!("RRef index {i} outside a table of {}", rrefs.len()),
                        )
                    })?;
                Ok(self.insert_rref(r.clone()))
            }
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
            rrefs,
        } = args;
        let table = |v: Value| Payload {
            value: v,
            tensors: tensors.iter().map(Tensor::shallow_clone).collect(),
            rrefs: rrefs.clone(),
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
        tables: &mut Tables,
    ) -> HostResult<Value> {
        map_refs(value, &mut |kind, h| {
            if let Some(i) = tables.seen.get(&(kind, h)) {
                return Ok(*i);
            }
            let len = match kind {
                Ref::Tensor => {
                    let t = if take {
                        self.tensors
                            .remove(&h)
                            .ok_or_else(|| no_handle("tensor", h))?
                    } else {
                        self.tensor(h)?
                    };
                    tables.tensors.push(t);
                    tables.tensors.len()
                }
                Ref::RRef => {
                    let r = if take {
                        self.rrefs.remove(&h).ok_or_else(|| no_handle("RRef", h))?
                    } else {
                        self.rref(h)?
                    };
                    tables.rrefs.push(Handle::new(r));
                    tables.rrefs.len()
                }
            };
            let i = u32::try_from(len - 1).map_err(|_| {
                RemoteError::new(
                    ErrorKind::RuntimeError,
                    "more than 2^32 tensors or RRefs in one value",
                )
            })?;
            tables.seen.insert((kind, h), i);
            Ok(i)
        })
    }

    /// The payload a guest value stands for; the guest keeps its handles.
    ///
    /// # Errors
    /// `RuntimeError` for an unknown handle, `NotImplementedError` for RRefs.
    pub(crate) fn borrow_payload(&mut self, value: Value) -> HostResult<Payload> {
        let mut t = Tables::default();
        let value = self.resolve_handles(value, false, &mut t)?;
        Ok(Payload {
            value,
            tensors: t.tensors,
            rrefs: t.rrefs,
        })
    }

    /// The payload a guest value stands for, moving its handles out.
    ///
    /// # Errors
    /// As [`Self::borrow_payload`].
    pub(crate) fn take_payload(&mut self, value: Value) -> HostResult<Payload> {
        let mut t = Tables::default();
        let value = self.resolve_handles(value, true, &mut t)?;
        Ok(Payload {
            value,
            tensors: t.tensors,
            rrefs: t.rrefs,
        })
    }

    /// Guest call arguments as [`Args`] over one tensor table; the guest
    /// keeps its handles.
    ///
    /// # Errors
    /// As [`Self::borrow_payload`].
    pub(crate) fn borrow_args(&mut self, call: CallArgs) -> HostResult<Args> {
        let mut t = Tables::default();
        let mut positional = Vec::with_capacity(call.args.len());
        for v in call.args {
            positional.push(self.resolve_handles(v, false, &mut t)?);
        }
        let mut kwargs = Vec::with_capacity(call.kwargs.len());
        for (k, v) in call.kwargs {
            kwargs.push((k, self.resolve_handles(v, false, &mut t)?));
        }
        Ok(Args {
            positional,
            kwargs,
            tensors: t.tensors,
            rrefs: t.rrefs,
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
    fn unknown_handles_are_errors() {
        let mut h = Handles::default();
        let e = h.borrow_payload(Value::RRef(1)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::RuntimeError);
        assert!(e.message.contains("no RRef with handle 1"), "{e:?}");
        let e = h.release(HandleKind::Tensor, 9).unwrap_err();
        assert!(e.message.contains("no tensor with handle 9"), "{e:?}");
        assert!(h.dup(HandleKind::RRef, 1).is_err());
    }
}
