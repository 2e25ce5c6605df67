//! What the op policy costs on the hot path (POL-5): `aten::add` of two
//! 2x2 tensors called by name, ungated and through the default policy's
//! gate, in the same run, and the gate's check alone. Prints the overhead.

use std::time::Instant;

use criterion::Criterion;
use tch::{Device, Kind, Tensor};
use wasmrpc::OpPolicy;
use wasmrpc_torch_sys::{
    Admission, OpError, OpGate, OpValue, Operator, Target, call_op, call_op_gated,
};

/// The default policy as a worker's callers meet it.
struct Gate<'a>(&'a OpPolicy);

impl OpGate for Gate<'_> {
    fn admit(&self, admission: &Admission<'_>) -> Result<(), OpError> {
        self.0.admit(admission, "worker1")
    }
}

fn args() -> [OpValue; 2] {
    let t = || OpValue::Tensor(Tensor::ones([2, 2], (Kind::Float, Device::Cpu)));
    [t(), t()]
}

/// Mean time of `f` over `n` runs, in nanoseconds.
fn mean_ns(n: u32, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_nanos() as f64 / f64::from(n)
}

fn main() {
    let policy = OpPolicy::default();
    let gate = Gate(&policy);
    let args = args();
    let add = Operator::resolve("aten::add").expect("aten::add resolves");
    let admission = Admission {
        target: Target::Op(&add),
        args: &args,
        kwargs: &[],
        method: false,
    };
    let mut c = Criterion::default().configure_from_args();
    c.bench_function("aten::add ungated", |b| {
        b.iter(|| call_op("aten::add", &args, &[]).expect("add runs"))
    });
    c.bench_function("aten::add through the default policy", |b| {
        b.iter(|| call_op_gated("aten::add", &args, &[], &gate).expect("add runs"))
    });
    c.bench_function("policy check alone (cached verdict)", |b| {
        b.iter(|| policy.admit(&admission, "worker1").expect("admitted"))
    });
    c.final_summary();

    // One comparison in the same run, as the other benches report ratios.
    let n = 200_000;
    let _ = mean_ns(n / 10, || {
        drop(call_op_gated("aten::add", &args, &[], &gate))
    });
    let ungated = mean_ns(n, || drop(call_op("aten::add", &args, &[])));
    let gated = mean_ns(n, || drop(call_op_gated("aten::add", &args, &[], &gate)));
    let check = mean_ns(n, || drop(policy.admit(&admission, "worker1")));
    println!(
        "aten::add 2x2: {ungated:.0} ns ungated, {gated:.0} ns gated ({:+.1}%); the check alone \
         {check:.0} ns",
        (gated / ungated - 1.0) * 100.0
    );
}
