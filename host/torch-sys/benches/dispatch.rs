//! Dispatch overhead: `aten::add` on two 4-element tensors through the shim
//! (name resolved and cached; arguments matched against the overloads)
//! vs the same call through tch directly, in one run.
//!
//! Prints ns per call for each and the overhead, then runs the same cases
//! under criterion.

use criterion::{Criterion, black_box};
use std::time::Instant;
use tch::{Device, Kind, Tensor};
use wasmrpc_torch_sys::{OpValue, Operator, call_op};

fn ns_per_call(iters: u32, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters / 10 {
        f();
    }
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_nanos() as f64 / f64::from(iters)
}

fn main() {
    let opts = (Kind::Float, Device::Cpu);
    let a = Tensor::ones([4], opts);
    let b = Tensor::ones([4], opts);
    let args = [
        OpValue::Tensor(a.shallow_clone()),
        OpValue::Tensor(b.shallow_clone()),
    ];
    let scalar_args = [OpValue::Tensor(a.shallow_clone()), OpValue::Int(1)];
    let op = Operator::resolve("aten::add").expect("aten::add is registered");

    let direct = || {
        let _sum = black_box(a.f_add(&b).expect("add"));
    };
    let by_handle = || {
        black_box(op.call(&args, &[]).expect("add"));
    };
    let by_name = || {
        black_box(call_op("aten::add", &args, &[]).expect("add"));
    };
    let scalar_direct = || {
        let _sum = black_box(a.f_add_scalar(1).expect("add"));
    };
    let scalar_by_name = || {
        black_box(call_op("aten::add", &scalar_args, &[]).expect("add"));
    };

    let iters = 200_000;
    // Interleave and take the best of a few rounds, so that the machine's
    // other load touches both sides alike.
    let mut best = [f64::MAX; 5];
    for _ in 0..3 {
        best[0] = best[0].min(ns_per_call(iters, direct));
        best[1] = best[1].min(ns_per_call(iters, by_handle));
        best[2] = best[2].min(ns_per_call(iters, by_name));
        best[3] = best[3].min(ns_per_call(iters, scalar_direct));
        best[4] = best[4].min(ns_per_call(iters, scalar_by_name));
    }
    let [d, h, n, sd, sn] = best;
    println!("aten::add, two 4-element f32 tensors (best of 3 x {iters} calls):");
    println!("  tch direct (at::add)            {d:8.0} ns/call");
    println!(
        "  Operator::call (add.Tensor)     {h:8.0} ns/call  overhead {:6.0} ns  ratio {:.2}",
        h - d,
        h / d
    );
    println!(
        "  call_op by name (add.Tensor)    {n:8.0} ns/call  overhead {:6.0} ns  ratio {:.2}",
        n - d,
        n / d
    );
    println!("  tch direct add_scalar           {sd:8.0} ns/call");
    println!(
        "  call_op by name (add.Scalar)    {sn:8.0} ns/call  overhead {:6.0} ns  ratio {:.2}",
        sn - sd,
        sn / sd
    );

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("aten_add_4");
    group.bench_function("tch_direct", |bench| bench.iter(direct));
    group.bench_function("operator_call", |bench| bench.iter(by_handle));
    group.bench_function("call_op_by_name", |bench| bench.iter(by_name));
    group.finish();
    c.final_summary();
}
