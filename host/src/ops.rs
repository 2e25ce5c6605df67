//! Builtin ops as RPC targets: `rpc_sync("worker1", "aten::add", args![a, b])`
//! runs libtorch's `aten::add` on worker1, matched against its overloads as
//! PyTorch RPC matches them, if worker1's [`OpPolicy`] serves it.
//!
//! What this module owns: [`BuiltinOps`], which names are builtin ops (the
//! agent's function registry resolves them through it, `agent::registry`,
//! and calls [`run_builtin`]); the conversion of a call's
//! [`Args`] into op arguments and of the op's outputs back into a
//! [`Payload`]; running ops off the agent's network and callee threads
//! ([`run_blocking`]); and the op policy ([`policy`], with its
//! [`family`] lists and [`schema`] hazards): which ops a worker runs for
//! peers and plugins at all; and how many threads one op may use
//! (`threads`, libtorch's intra-op pool, process-wide). Resolving names, matching schemas and running
//! the op are `wasmrpc-torch-sys`'s; errors keep its texts (libtorch's own
//! messages, PyTorch's "... failed to match any schema ...").
//!
//! Names it resolves: any `namespace::name` libtorch's operator registry
//! knows (`aten::add`, `aten::linalg_multi_dot`, `prim::min`, ...),
//! PyTorch RPC's wire form `torch.ops.aten.add`, and the Python builtins
//! the seeds call (`builtins.min`, `builtins.max`). Functions registered
//! explicitly under the same names win over these. Which of them a worker
//! runs is its policy's call: by default the tensor-computing families of
//! [`family`], and a refusal is a `RuntimeError` naming the op, the worker
//! and how to allow it (POL-1).
//!
//! Invariants:
//! - OPS-1: an op that may be slow never runs on a tokio worker thread: it
//!   runs on the blocking pool, so it delays neither the connections'
//!   readers nor other calls. Only an op whose work is bounded by its
//!   tensor arguments (elementwise, reductions, products: [`BOUNDED_OPS`])
//!   and, by their shapes, stays under about half a millisecond
//!   ([`placement`]) runs in place, since the hop to the pool and back
//!   costs more than that in a VM's slow phases.
//! - OPS-2: arguments are borrowed: the caller's tensors are passed by
//!   reference to the same storage (in-place ops such as `aten::add_` change
//!   them, as in PyTorch), and every output is a new entry of the result's
//!   tensor table.
//! - OPS-3: a builtin op a peer names runs only after the worker's op
//!   policy admits it (POL-1), on whichever thread it runs.

pub(crate) mod family;
pub(crate) mod placement;
pub mod policy;
mod recording;
pub(crate) mod schema;
mod threads;

use std::sync::Arc;

use tch::Tensor;
use wasmrpc_torch_sys::{BUILTINS, OpError, OpValue, Operator, WIRE_PREFIX, call_op_gated};

use crate::abi::RemoteError;
use crate::error::{Error, Result};
use crate::tensor::budget::CallBudget;
use crate::value::{Args, Payload};
pub use policy::OpPolicy;
pub(crate) use policy::PolicyGate;
pub(crate) use recording::{OpListener, listen_for_ops, profiled};
pub use threads::{
    adopt_intra_op_threads, cores_per_local_worker, cores_per_worker, intra_op_threads,
    set_intra_op_threads,
};

/// The resolver of builtin op names (see the module docs for the names it
/// serves). Stateless: resolved operators are cached process-wide by
/// `wasmrpc-torch-sys`.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinOps;

impl BuiltinOps {
    /// Whether `name` is a builtin op this host can run.
    pub fn knows(name: &str) -> bool {
        if BUILTINS.contains(&name) {
            return true;
        }
        (name.contains("::") || name.starts_with(WIRE_PREFIX)) && Operator::resolve(name).is_ok()
    }
}

/// Runs the builtin op `name` on `args` for a caller of worker `worker`,
/// if `policy` admits it (OPS-3), on the blocking pool (OPS-1), and returns
/// its result as Python would see it: `None`, the one output, or a tuple of
/// several.
///
/// # Errors
/// `RuntimeError` "WORKER does not run OP: ..." if the policy refuses the
/// op; otherwise the op's errors with PyTorch's kind and text:
/// `RuntimeError` "Overloaded torch operator invoked from Python failed to
/// match any schema ..." when no overload accepts the arguments, libtorch's
/// own message when the op raises, `RuntimeError` "Unknown builtin op: ..."
/// for an unknown name, `TypeError` for arguments no op takes (dicts,
/// RRefs, worker infos).
pub async fn call_builtin(
    policy: &Arc<OpPolicy>,
    worker: &str,
    name: &str,
    args: Args,
) -> Result<Payload> {
    run_builtin(policy, worker, name, args, None).await
}

/// [`call_builtin`], with the op's tensor memory charged to `budget` when
/// there is one (a peer's call: BUDGET-1 in `crate::tensor::budget`).
pub(crate) async fn run_builtin(
    policy: &Arc<OpPolicy>,
    worker: &str,
    name: &str,
    args: Args,
    budget: Option<CallBudget>,
) -> Result<Payload> {
    let (positional, kwargs) = op_args(args).map_err(op_error)?;
    // In a profiling scope (a profiled call's callee, or a local call in a
    // scope), the op is listed as the aten ops libtorch runs for it, as
    // PyTorch's profiler lists them.
    let listener = recording::op_listener();
    let options = listener.as_ref().map(|l| l.record_options());
    let (outputs, ops) = if is_cheap(name, &positional, &kwargs) {
        // A 256x256 matmul splits over every core on a thread that has not
        // adopted the op thread count, and leaves helpers spinning.
        adopt_intra_op_threads();
        let gate = PolicyGate { policy, worker };
        profiled(options, || {
            in_budget(budget.as_ref(), name, || {
                call_op_gated(name, &positional, &kwargs, &gate)
            })
        })
    } else {
        let (policy, worker, name) = (policy.clone(), worker.to_owned(), name.to_owned());
        run_blocking(move || {
            let gate = PolicyGate {
                policy: &policy,
                worker: &worker,
            };
            // Recorded on the thread the op runs on.
            profiled(options, || {
                in_budget(budget.as_ref(), &name, || {
                    call_op_gated(&name, &positional, &kwargs, &gate)
                })
            })
        })
        .await?
    };
    if let (Some(l), Some((start, ops))) = (listener, ops) {
        l.ops_ran(start, ops);
    }
    Ok(payload_from_op_value(OpValue::from_outputs(outputs?)))
}

/// Runs the op work `f` for `what` in `budget` (if any); a refused
/// allocation is reported as the budget's error, not as the op's own.
pub(crate) fn in_budget<T>(
    budget: Option<&CallBudget>,
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, OpError>,
) -> Result<T> {
    let Some(budget) = budget else {
        return f().map_err(op_error);
    };
    match budget.run(what, f) {
        (_, Some(refused)) => Err(refused),
        (out, None) => out.map_err(op_error),
    }
}

/// Ops (names without the `aten::` namespace) whose work and output are
/// bounded by the size of their tensor arguments, unlike e.g. `ones` or
/// `repeat`, whose sizes come from integer arguments.
const BOUNDED_OPS: &[&str] = &[
    "abs", "add", "add_", "addmm", "bmm", "clone", "cos", "div", "div_", "dot", "eq", "exp", "ge",
    "gt", "le", "log", "lt", "matmul", "max", "mean", "min", "mm", "mul", "mul_", "mv", "ne",
    "neg", "pow", "relu", "sigmoid", "sin", "sqrt", "sub", "sub_", "sum", "t", "tanh",
];

/// Whether the op `name` on these arguments runs in place (OPS-1): a
/// bounded op whose tensors' shapes keep its work within [`placement`]'s
/// bounds, and otherwise scalars (or short lists of them, such as
/// reduction dims).
pub(crate) fn is_cheap(name: &str, positional: &[OpValue], kwargs: &[(String, OpValue)]) -> bool {
    let base = name
        .strip_prefix("aten::")
        .or_else(|| name.strip_prefix(WIRE_PREFIX));
    let Some(base) = base.map(|b| b.split('.').next().unwrap_or(b)) else {
        return false;
    };
    if !BOUNDED_OPS.contains(&base) {
        return false;
    }
    fn scalars(v: &OpValue) -> bool {
        match v {
            OpValue::Tensor(_) => false,
            OpValue::List(vs) | OpValue::Tuple(vs) => vs.len() <= 8 && vs.iter().all(scalars),
            _ => true,
        }
    }
    let mut shapes = Vec::new();
    for v in positional.iter().chain(kwargs.iter().map(|(_, v)| v)) {
        match v {
            OpValue::Tensor(t) => shapes.push(t.size()),
            other if scalars(other) => {}
            _ => return false,
        }
    }
    let shapes: Vec<&[i64]> = shapes.iter().map(Vec::as_slice).collect();
    placement::Work::of_op(base, &shapes).is_some_and(placement::Work::runs_in_place)
}

type OpArgs = (Vec<OpValue>, Vec<(String, OpValue)>);

/// A call's arguments as op arguments, sharing the tensors (OPS-2).
fn op_args(args: Args) -> std::result::Result<OpArgs, OpError> {
    // RRefs are not op arguments: `op_value_from_abi` rejects `Value::RRef`.
    let Args {
        positional,
        kwargs,
        tensors,
        ..
    } = args;
    let mut lookup = |i: u32| tensors.get(i as usize).map(Tensor::shallow_clone);
    let positional = positional
        .iter()
        .map(|v| wasmrpc_torch_sys::op_value_from_abi(v, &mut lookup))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let kwargs = kwargs
        .iter()
        .map(|(k, v)| {
            Ok((
                k.clone(),
                wasmrpc_torch_sys::op_value_from_abi(v, &mut lookup)?,
            ))
        })
        .collect::<std::result::Result<Vec<_>, OpError>>()?;
    Ok((positional, kwargs))
}

/// An op's output as a payload: tensors go to the payload's table.
pub(crate) fn payload_from_op_value(value: OpValue) -> Payload {
    let mut tensors = Vec::new();
    let value = wasmrpc_torch_sys::op_value_into_abi(value, &mut |t| {
        tensors.push(t);
        // A table longer than u32::MAX entries cannot be built from one
        // op's outputs.
        u32::try_from(tensors.len() - 1).unwrap_or(u32::MAX)
    });
    Payload {
        value,
        tensors,
        rrefs: Vec::new(),
    }
}

/// A torch-sys error as a host error: the same kind and text.
pub(crate) fn op_error(e: OpError) -> Error {
    Error::from(RemoteError::from(e))
}

/// Runs `f` on tokio's blocking pool (OPS-1), with the process's op thread
/// count ([`adopt_intra_op_threads`]).
///
/// # Errors
/// `RuntimeError` if `f` panicked or the runtime is shutting down.
pub(crate) async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(move || {
        adopt_intra_op_threads();
        f()
    })
    .await
    .map_err(|e| Error::runtime(format!("a builtin op did not complete: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::ErrorKind;
    use tch::{Device, Kind};

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(f)
    }

    /// `name` on `args` as worker0 under the default policy runs it for a peer.
    fn builtin(name: &str, args: Args) -> Result<Payload> {
        run(call_builtin(
            &OpPolicy::shared_default(),
            "worker0",
            name,
            args,
        ))
    }

    #[test]
    fn only_bounded_ops_on_small_tensors_run_in_place() {
        let small = || OpValue::Tensor(Tensor::ones([256, 256], (Kind::Float, Device::Cpu)));
        let big = || OpValue::Tensor(Tensor::ones([1024, 1024], (Kind::Float, Device::Cpu)));
        assert!(is_cheap("aten::matmul", &[small(), small()], &[]));
        assert!(is_cheap(
            "torch.ops.aten.add",
            &[small(), OpValue::Int(1)],
            &[]
        ));
        assert!(is_cheap(
            "aten::sum.dim_IntList",
            &[small(), OpValue::List(vec![OpValue::Int(0)])],
            &[]
        ));
        assert!(!is_cheap("aten::matmul", &[small(), big()], &[]));
        assert!(!is_cheap(
            "aten::add",
            &[small()],
            &[("other".into(), big())]
        ));
        // Sizes from integers: the work is not bounded by the tensors.
        assert!(!is_cheap(
            "aten::ones",
            &[OpValue::List(vec![OpValue::Int(1 << 20)])],
            &[]
        ));
        assert!(!is_cheap(
            "aten::repeat",
            &[small(), OpValue::List(vec![OpValue::Int(1000)])],
            &[]
        ));
        assert!(!is_cheap(
            "builtins.min",
            &[OpValue::Int(1), OpValue::Int(2)],
            &[]
        ));
        // A list of tensors is never cheap (its length is unbounded).
        assert!(!is_cheap(
            "aten::add",
            &[OpValue::List(vec![small()]), small()],
            &[]
        ));
    }

    #[test]
    fn names_the_registry_resolves() {
        assert!(BuiltinOps::knows("aten::add"));
        assert!(BuiltinOps::knows("torch.ops.aten.add"));
        assert!(BuiltinOps::knows("builtins.min"));
        assert!(!BuiltinOps::knows("aten::no_such_op"));
        assert!(!BuiltinOps::knows("seed_fns::my_function"));
        assert!(!BuiltinOps::knows("add"));
        assert!(!BuiltinOps::knows(crate::NOOP));
    }

    #[test]
    fn tensor_and_scalar_overloads() {
        let t = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        let out = builtin("aten::add", crate::args![&t, &t]).unwrap();
        assert!(out.as_tensor().unwrap().equal(&(&t * 2)));
        let out = builtin("aten::add", crate::args![&t, 3].kwarg("alpha", 2)).unwrap();
        assert!(out.as_tensor().unwrap().equal(&(&t * 7)));
    }

    #[test]
    fn several_outputs_are_a_tuple_and_errors_keep_their_text() {
        let t = Tensor::from_slice(&[1.0f32, 5.0, 2.0]);
        let out = builtin("aten::max", crate::args![&t, 0]).unwrap();
        let items = out.items().unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(items[1].as_tensor().unwrap().int64_value(&[]), 1);

        let e = builtin("aten::add", crate::args!["x"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RuntimeError);
        assert!(e.message().contains("failed to match any schema"), "{e}");
        let e = builtin(
            "aten::add",
            crate::args![
                Tensor::ones([2], (Kind::Float, Device::Cpu)),
                Tensor::ones([3], (Kind::Float, Device::Cpu))
            ],
        )
        .unwrap_err();
        assert!(
            e.message()
                .contains("The size of tensor a (2) must match the size of tensor b (3)"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod properties {
    //! Random op names and arguments against the op path: whatever a peer
    //! sends, the worker answers `Ok` or an error, never panics or aborts,
    //! and never runs an op its policy refuses.
    //!
    //! POLICY_TEST_NAMES_DENIED_OPS: names here are random or refused on
    //! purpose, not ops the seeds call.

    use std::sync::OnceLock;

    use proptest::prelude::*;
    use proptest::sample::select;
    use tch::{Device, Kind, Tensor};
    use wasmrpc_torch_sys::{BUILTINS, Operator, registered_ops};

    use super::policy::{OpPolicy, Verdict};
    use super::*;
    use crate::abi::ErrorKind;

    /// Every operator libtorch registers (looked up once).
    fn registry() -> &'static [String] {
        static NAMES: OnceLock<Vec<String>> = OnceLock::new();
        NAMES.get_or_init(registered_ops)
    }

    /// The registry's ops the default policy serves that work in place
    /// (their side effect shows whether they ran).
    fn in_place_allowed() -> &'static [String] {
        static NAMES: OnceLock<Vec<String>> = OnceLock::new();
        NAMES.get_or_init(|| {
            let policy = OpPolicy::default();
            registry()
                .iter()
                .filter(|n| n.starts_with("aten::") && n.ends_with('_') && !n.ends_with("__"))
                .filter(|n| policy.verdict(n).is_ok_and(|v| v.is_allowed()))
                .cloned()
                .collect()
        })
    }

    /// An op name as a peer might send it: random text, or a real op in any
    /// spelling with or without an overload suffix.
    fn op_name() -> impl Strategy<Value = String> {
        let real = (
            select(registry()),
            0..3u8,
            prop_oneof![
                6 => Just(String::new()),
                1 => Just(".Tensor".to_owned()),
                1 => Just(".out".to_owned()),
                1 => Just(".t".to_owned()),
                1 => "\\.[A-Za-z_]{1,8}",
            ],
        )
            .prop_map(|(name, spelling, suffix)| {
                let base = name.split_once("::").map_or(name.as_str(), |(_, b)| b);
                match (spelling, name.starts_with("aten::")) {
                    (1, true) => format!("torch.ops.aten.{base}{suffix}"),
                    (2, _) => format!("{base}{suffix}"),
                    _ => format!("{name}{suffix}"),
                }
            });
        prop_oneof![
            4 => real,
            1 => ".{0,40}",
            1 => "[a-z_:.]{1,30}",
            1 => select(BUILTINS).prop_map(str::to_owned),
        ]
    }

    /// A small tensor: up to 2 dimensions of up to 4, float or int.
    fn small_tensor() -> impl Strategy<Value = Tensor> {
        (
            prop::collection::vec(0..4i64, 0..3),
            any::<bool>(),
            -4.0..4.0f64,
        )
            .prop_map(|(shape, float, fill)| {
                let kind = if float { Kind::Float } else { Kind::Int64 };
                Tensor::full(shape.as_slice(), fill, (kind, Device::Cpu))
            })
    }

    /// A random argument: scalars, strings, small tensors, lists and tuples
    /// of them.
    fn value() -> impl Strategy<Value = Payload> {
        let leaf = prop_oneof![
            Just(Payload::from(())),
            any::<bool>().prop_map(Payload::from),
            (-4..16i64).prop_map(Payload::from),
            (-4.0..4.0f64).prop_map(Payload::from),
            "[a-z/._]{0,8}".prop_map(Payload::from),
            small_tensor().prop_map(Payload::from),
        ];
        leaf.prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Payload::list),
                prop::collection::vec(inner, 0..4).prop_map(Payload::tuple),
            ]
        })
    }

    fn call_args() -> impl Strategy<Value = Args> {
        let kwarg = (
            select(
                &[
                    "dim",
                    "alpha",
                    "dtype",
                    "generator",
                    "out",
                    "self",
                    "keepdim",
                ][..],
            ),
            value(),
        );
        (
            prop::collection::vec(value(), 0..4),
            prop::collection::vec(kwarg, 0..2),
        )
            .prop_map(|(positional, kwargs)| {
                let mut args = positional.into_iter().fold(Args::new(), |a, v| a.arg(v));
                for (k, v) in kwargs {
                    args = args.kwarg(k, v);
                }
                args
            })
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    }

    fn is_refusal(e: &Error, worker: &str) -> bool {
        e.kind() == ErrorKind::RuntimeError
            && e.message().starts_with(&format!("{worker} does not run "))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Any name, any arguments: an answer, never a panic; an op the
        /// policy refuses answers with the refusal.
        #[test]
        fn any_call_answers_and_refused_ops_never_run(name in op_name(), args in call_args()) {
            let policy = OpPolicy::shared_default();
            let result = runtime().block_on(call_builtin(&policy, "worker9", &name, args));
            let resolves = BUILTINS.contains(&name.as_str()) || Operator::resolve(&name).is_ok();
            match policy.verdict(&name) {
                Ok(v) if resolves && !v.is_allowed() => {
                    let e = result.expect_err("a refused op ran");
                    prop_assert!(is_refusal(&e, "worker9"), "{name}: {e}");
                }
                Ok(_) if resolves => {
                    // Served (or a withheld overload refused): any answer.
                }
                _ => {
                    // Not an op as spelled: nothing could run, and the gate
                    // never saw it.
                    let e = result.expect_err("an unknown name ran");
                    prop_assert!(e.message().starts_with("Unknown builtin op"), "{name}: {e}");
                }
            }
        }

        /// An in-place op the operator denies leaves its tensors untouched:
        /// refused, not run, whichever spelling and arguments.
        #[test]
        fn a_denied_in_place_op_changes_nothing(
            index in any::<prop::sample::Index>(),
            spelling in 0..3u8,
            fill in -4.0..4.0f64,
            extra in prop::collection::vec(value(), 0..3),
        ) {
            let ops = in_place_allowed();
            prop_assume!(!ops.is_empty());
            let name = index.get(ops);
            let base = &name["aten::".len()..];
            let policy = Arc::new(OpPolicy::default().deny(name).expect("a valid pattern"));
            let target = Tensor::full([3], fill, (Kind::Float, Device::Cpu));
            let before = target.copy();
            let args = extra.into_iter().fold(Args::new().arg(&target), |a, v| a.arg(v));
            let spelled = match spelling {
                0 => name.clone(),
                1 => format!("torch.ops.aten.{base}"),
                _ => base.to_owned(),
            };
            let e = runtime()
                .block_on(call_builtin(&policy, "worker9", &spelled, args))
                .expect_err("a denied op ran");
            prop_assert!(is_refusal(&e, "worker9"), "{spelled}: {e}");
            prop_assert!(target.equal(&before), "{spelled} changed its argument");
        }

        /// The policy's own parsing and checks answer for any input.
        #[test]
        fn policy_inputs_never_panic(text in ".{0,60}", name in op_name()) {
            let _ = policy::Pattern::parse(&text);
            let _ = OpPolicy::default().rules_from_text(&text, "fuzz");
            // The default policy serves aten and Python's builtins only.
            if let Ok((op, v)) = OpPolicy::shared_default().verdict_of(&name)
                && let Verdict::Allowed { .. } = *v
            {
                prop_assert!(op.starts_with("aten::") || op.starts_with("builtins."), "{op}");
                prop_assert!(!op.starts_with("aten::_"), "{op}");
            }
        }
    }
}
