//! Tests of `policy`.

//! POLICY_TEST_NAMES_DENIED_OPS: op names in this file are inputs the
//! policy must refuse, not ops the seeds call (see
//! `every_op_the_seeds_call_is_allowed_by_default`).

use super::*;
use crate::ops::schema::{HazardKind, schema_hazard};
use std::collections::{BTreeMap, BTreeSet};
use wasmrpc_torch_sys::{OpValue, call_op, registered_ops};

fn schemas(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

const ADD: &[&str] = &[
    "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
    "aten::add.t(t[] a, t[] b) -> t[]",
];
const FROM_FILE: &[&str] =
    &["aten::from_file(str filename, bool? shared=None, int? size=0) -> Tensor"];

fn denial(v: &Verdict) -> &Denial {
    match v {
        Verdict::Denied(d) => d,
        Verdict::Allowed { by, .. } => panic!("allowed by {by}"),
    }
}

#[test]
fn rules_decide_in_order_deny_then_exact_allow_then_globs_and_families() {
    let default = OpPolicy::default();
    match default.decide("aten", "add", &schemas(ADD)) {
        Verdict::Allowed {
            by: Grant::Family(f),
            withheld,
        } => {
            assert_eq!(f.name, "arithmetic");
            assert_eq!(withheld.len(), 1);
            assert_eq!(withheld[0].schema(), ADD[1]);
            assert_eq!(withheld[0].hazard.kind, HazardKind::Opaque);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        denial(&default.decide("aten", "from_file", &schemas(FROM_FILE))),
        Denial::UnsafeSchema(h) if h.kind == HazardKind::FileName
    ));
    assert!(matches!(
        denial(&default.decide("prim", "dtype", &schemas(&["prim::dtype(Tensor a) -> int"]))),
        Denial::OtherNamespace(ns) if ns == "prim"
    ));
    assert!(matches!(
        denial(&default.decide(
            "aten",
            "_foo",
            &schemas(&["aten::_foo(Tensor a) -> Tensor"])
        )),
        Denial::Private
    ));
    assert!(matches!(
        denial(&default.decide(
            "aten",
            "empty",
            &schemas(&["aten::empty(int[] size) -> Tensor"])
        )),
        Denial::NotInFamily
    ));

    // An exact allow grants every overload, hazards included; deny wins.
    let p = OpPolicy::default()
        .allow("aten::from_file")
        .unwrap()
        .allow("aten::add")
        .unwrap();
    assert!(
        p.decide("aten", "from_file", &schemas(FROM_FILE))
            .is_allowed()
    );
    match p.decide("aten", "add", &schemas(ADD)) {
        Verdict::Allowed {
            by: Grant::Rule(r),
            withheld,
        } => {
            assert_eq!(r.to_string(), "allow aten::add");
            assert!(withheld.is_empty());
        }
        other => panic!("{other:?}"),
    }
    let p = p.deny("aten::from_file").unwrap();
    assert!(matches!(
        denial(&p.decide("aten", "from_file", &schemas(FROM_FILE))),
        Denial::Rule(r) if r.to_string() == "deny aten::from_file"
    ));

    // Globs and families grant safe overloads only.
    let p = OpPolicy::empty().allow("aten::*").unwrap();
    assert!(matches!(
        denial(&p.decide("aten", "from_file", &schemas(FROM_FILE))),
        Denial::UnsafeSchema(_)
    ));
    assert!(matches!(
        p.decide("aten", "add", &schemas(ADD)),
        Verdict::Allowed { withheld, .. } if withheld.len() == 1
    ));
    assert!(
        p.decide(
            "aten",
            "empty",
            &schemas(&["aten::empty(int[] size) -> Tensor"])
        )
        .is_allowed()
    );

    // Families can be denied as a whole; an empty policy serves nothing.
    let p = OpPolicy::default().deny("@arithmetic").unwrap();
    assert!(matches!(
        denial(&p.decide("aten", "add_", &schemas(ADD))),
        Denial::Rule(_)
    ));
    assert!(p.decide("aten", "matmul", &[]).is_allowed());
    assert!(matches!(
        denial(&OpPolicy::empty().decide("aten", "add", &schemas(ADD))),
        Denial::NotInFamily
    ));
    let p = OpPolicy::empty().allow("@arithmetic").unwrap();
    assert!(p.decide("aten", "add", &schemas(ADD)).is_allowed());
    assert!(!p.decide("aten", "matmul", &[]).is_allowed());
}

#[test]
fn allow_globs_skip_private_names_and_deny_globs_do_not() {
    let p = OpPolicy::empty().allow("*").unwrap();
    assert!(p.decide("aten", "add", &[]).is_allowed());
    assert!(p.decide("prim", "dtype", &[]).is_allowed());
    assert!(!p.decide("aten", "_foo", &[]).is_allowed());
    assert!(!p.decide("_caffe2", "x", &[]).is_allowed());
    let p = OpPolicy::empty().allow("aten::_*").unwrap();
    assert!(p.decide("aten", "_foo", &[]).is_allowed());
    let p = OpPolicy::default()
        .allow("*")
        .unwrap()
        .deny("aten::*")
        .unwrap();
    assert!(!p.decide("aten", "_foo", &[]).is_allowed());
    assert!(!p.decide("aten", "add", &[]).is_allowed());
    assert!(p.decide("prim", "dtype", &[]).is_allowed());
}

#[test]
fn patterns_take_every_spelling_and_refuse_overloads_and_unknown_families() {
    let exact = |ns: &str, base: &str| Pattern::Exact {
        namespace: ns.into(),
        base: base.into(),
    };
    assert_eq!(
        Pattern::parse("aten::from_file").unwrap(),
        exact("aten", "from_file")
    );
    assert_eq!(
        Pattern::parse("torch.ops.aten.from_file").unwrap(),
        exact("aten", "from_file")
    );
    assert_eq!(
        Pattern::parse(" from_file ").unwrap(),
        exact("aten", "from_file")
    );
    assert_eq!(
        Pattern::parse("builtins.min").unwrap(),
        exact("builtins", "min")
    );
    assert!(matches!(
        Pattern::parse("prim::*").unwrap(),
        Pattern::Glob { .. }
    ));
    assert!(matches!(Pattern::parse("*").unwrap(), Pattern::Glob { .. }));
    assert_eq!(Pattern::parse("@random").unwrap().to_string(), "@random");
    let e = Pattern::parse("aten::add.Tensor").unwrap_err();
    assert!(
        e.message().contains("names overload `Tensor` of aten::add"),
        "{e}"
    );
    let e = Pattern::parse("@nope").unwrap_err();
    assert!(e.message().contains("unknown op family @nope"), "{e}");
    assert!(e.message().contains("@arithmetic"), "{e}");
    for bad in ["", "aten::", "a b", "aten::x;y", "::x"] {
        assert!(Pattern::parse(bad).is_err(), "{bad:?} parsed");
    }
    assert!(glob_match("linalg_*", "linalg_inv"));
    assert!(glob_match("*_backward", "mse_loss_backward"));
    assert!(glob_match("a*b*c", "aXXbYYc"));
    assert!(!glob_match("a*b*c", "aXXbYY"));
    assert!(!glob_match("linalg_*", "matmul"));
    assert!(glob_match("*", ""));
}

#[test]
fn policy_files_take_comments_and_name_the_line_of_a_bad_rule() {
    let text = "# trusted plugins read their data\nallow aten::from_file  # the loader\n\n  deny @random\n";
    let p = OpPolicy::default()
        .rules_from_text(text, "ops.policy")
        .unwrap();
    let rules: Vec<String> = p.rules().iter().map(ToString::to_string).collect();
    assert_eq!(
        rules,
        [
            "allow aten::from_file (ops.policy:2)",
            "deny @random (ops.policy:4)"
        ]
    );
    let e = OpPolicy::default()
        .rules_from_text("allow aten::add\npermit aten::mul\n", "p.txt")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ValueError);
    assert!(
        e.message()
            .starts_with("p.txt:2: expected `allow PATTERN` or `deny PATTERN`"),
        "{e}"
    );
    let e = OpPolicy::default()
        .rules_from_text("deny @nope", "p.txt")
        .unwrap_err();
    assert!(
        e.message().starts_with("p.txt:1: unknown op family @nope"),
        "{e}"
    );
    let e = OpPolicy::default()
        .rules_from_text("allow a b", "p.txt")
        .unwrap_err();
    assert!(
        e.message().starts_with("p.txt:1: expected one pattern"),
        "{e}"
    );
    let e = OpPolicy::default()
        .rules_from_file("/nonexistent/ops.policy")
        .unwrap_err();
    assert!(
        e.message()
            .contains("cannot read op policy file /nonexistent/ops.policy"),
        "{e}"
    );
}

#[test]
fn every_spelling_of_a_name_gets_the_op_verdict() {
    let p = OpPolicy::default();
    for name in [
        "aten::add",
        "torch.ops.aten.add",
        "add",
        "aten::add.Tensor",
        "torch.ops.aten.add.Scalar",
    ] {
        let (op, v) = p.verdict_of(name).unwrap();
        assert_eq!(op, "aten::add", "{name}");
        assert!(v.is_allowed(), "{name}");
    }
    for name in [
        "aten::from_file",
        "torch.ops.aten.from_file",
        "from_file",
        "aten::from_file.out",
    ] {
        let (op, v) = p.verdict_of(name).unwrap();
        assert_eq!(op, "aten::from_file", "{name}");
        assert!(!v.is_allowed(), "{name}");
    }
    assert!(p.verdict("builtins.min").unwrap().is_allowed());
    assert!(matches!(
        p.verdict("aten::no_such_op"),
        Err(OpError::UnknownOp { .. })
    ));
    assert!(matches!(
        p.verdict("builtins.eval"),
        Err(OpError::UnknownOp { .. })
    ));
}

#[test]
fn refusals_name_the_worker_the_op_and_how_to_allow_it() {
    let p = OpPolicy::default();
    let op = Operator::resolve("aten::from_file").unwrap();
    let args = [OpValue::Str("/etc/hostname".into())];
    let admission = Admission {
        target: Target::Op(&op),
        args: &args,
        kwargs: &[],
        method: false,
    };
    let e = p.admit(&admission, "worker1").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RuntimeError);
    let text = e.to_string();
    assert!(
        text.starts_with("worker1 does not run aten::from_file: the op takes a file name"),
        "{text}"
    );
    assert!(
        text.ends_with("(allow it with --allow-op aten::from_file, or OpPolicy::allow in RpcBackendOptions::op_policy)"),
        "{text}"
    );
    let e = p.clone().deny("aten::add").unwrap();
    let add = Operator::resolve("aten::add").unwrap();
    let refused = e
        .admit(
            &Admission {
                target: Target::Op(&add),
                args: &[],
                kwargs: &[],
                method: false,
            },
            "w",
        )
        .unwrap_err()
        .to_string();
    assert_eq!(
        refused,
        "w does not run aten::add: denied by rule `deny aten::add` (remove that rule to serve it)"
    );
}

#[test]
fn withheld_overloads_are_refused_and_the_rest_of_the_op_runs() {
    let policy = OpPolicy::default();
    let gate = PolicyGate {
        policy: &policy,
        worker: "worker1",
    };
    let t = || OpValue::Tensor(tch::Tensor::ones([2], (tch::Kind::Float, tch::Device::Cpu)));
    // Tensors: `add.Tensor`, no matching needed.
    let out = wasmrpc_torch_sys::call_op_gated("aten::add", &[t(), t()], &[], &gate).unwrap();
    assert_eq!(out.len(), 1);
    // Ints: `add.int`, after asking libtorch (a list overload could fit).
    let out = wasmrpc_torch_sys::call_op_gated(
        "aten::add",
        &[OpValue::Int(2), OpValue::Int(3)],
        &[],
        &gate,
    )
    .unwrap();
    assert!(matches!(out[..], [OpValue::Int(5)]));
    // Lists bind `add.t(t[] a, t[] b)`: withheld.
    let lists = [OpValue::List(vec![]), OpValue::List(vec![])];
    let e = wasmrpc_torch_sys::call_op_gated("aten::add", &lists, &[], &gate).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("worker1 does not run aten::add.t(t[] a, t[] b) -> t[]"),
        "{e}"
    );
    // `mul.left_t(t[] l, int n)` would build a list of n items.
    let e = wasmrpc_torch_sys::call_op_gated(
        "aten::mul",
        &[OpValue::List(vec![]), OpValue::Int(1 << 40)],
        &[],
        &gate,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("does not run aten::mul.left_t"),
        "{e}"
    );
    // A generator the caller passes, even None, is the withheld
    // `rand.generator`; without one, the worker's own generator runs.
    let size = || OpValue::List(vec![OpValue::Int(2)]);
    let e = wasmrpc_torch_sys::call_op_gated(
        "aten::rand",
        &[size()],
        &[("generator".into(), OpValue::None)],
        &gate,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("does not run aten::rand.generator"),
        "{e}"
    );
    assert!(wasmrpc_torch_sys::call_op_gated("aten::rand", &[size()], &[], &gate).is_ok());
}

/// Our values cannot be generators: no `OpValue` variant is one (this
/// match has no wildcard, so adding a variant fails to compile here
/// until it is reviewed), and no value of any variant converts to a
/// `Generator` parameter.
#[test]
fn callers_cannot_pass_a_generator() {
    let t = tch::Tensor::ones([1], (tch::Kind::Float, tch::Device::Cpu));
    let every_kind = [
        OpValue::None,
        OpValue::Bool(true),
        OpValue::Int(7),
        OpValue::Float(0.5),
        OpValue::Str("cpu".into()),
        OpValue::Tensor(t),
        OpValue::List(vec![OpValue::Int(7)]),
        OpValue::Tuple(vec![OpValue::Int(7)]),
        OpValue::Dtype(tch::Kind::Float),
        OpValue::Device(tch::Device::Cpu),
    ];
    for value in every_kind {
        let could_be_a_generator = match &value {
            OpValue::None => true,
            OpValue::Bool(_)
            | OpValue::Int(_)
            | OpValue::Float(_)
            | OpValue::Str(_)
            | OpValue::Tensor(_)
            | OpValue::List(_)
            | OpValue::Tuple(_)
            | OpValue::Dtype(_)
            | OpValue::Device(_) => false,
        };
        // `aten::initial_seed(Generator self)`: only a real generator fits.
        let r = call_op("aten::initial_seed", &[value.shallow_clone()], &[]);
        assert!(
            matches!(r, Err(OpError::NoMatchingSchema { .. })),
            "{value:?}: {r:?}"
        );
        // `rand.generator(..., Generator? generator)`: None, the default one.
        let rand = Operator::resolve("aten::rand").unwrap();
        let r = rand.matching_schema(
            &[OpValue::List(vec![OpValue::Int(2)])],
            &[("generator".into(), value.shallow_clone())],
        );
        assert_eq!(r.is_ok(), could_be_a_generator, "{value:?}: {r:?}");
    }
}

/// Counts this thread's heap allocations, for POL-5.
struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: every call forwards to the system allocator unchanged; the
// counter is a const-initialized thread-local without a destructor, so
// touching it allocates nothing.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { std::alloc::System.realloc(ptr, layout, size) }
    }
}

#[global_allocator]
static COUNTING: CountingAllocator = CountingAllocator;

/// POL-5: once an op's verdict is cached, admitting a call to it
/// allocates nothing (the hot path: `aten::add` of two tensors from a
/// peer, a withheld overload in the op screened out by argument kinds).
#[test]
fn a_cached_verdict_admits_without_allocating() {
    let policy = OpPolicy::default();
    let add = Operator::resolve("aten::add").unwrap();
    let t = || {
        OpValue::Tensor(tch::Tensor::ones(
            [2, 2],
            (tch::Kind::Float, tch::Device::Cpu),
        ))
    };
    let args = [t(), t()];
    let admission = Admission {
        target: Target::Op(&add),
        args: &args,
        kwargs: &[],
        method: false,
    };
    policy.admit(&admission, "worker1").unwrap();
    let before = ALLOCATIONS.with(std::cell::Cell::get);
    let started = std::time::Instant::now();
    for _ in 0..10_000 {
        policy.admit(&admission, "worker1").unwrap();
    }
    let per_call = started.elapsed() / 10_000;
    let allocated = ALLOCATIONS.with(std::cell::Cell::get) - before;
    println!("admitting aten::add from the cache: {per_call:?} a call, {allocated} allocations");
    assert_eq!(allocated, 0);
}

mod registry;
