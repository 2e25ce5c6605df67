//! The gradients of the two graphs of a 16x16 distributed autograd step
//! (`wasmrpc-bench --only dist_autograd_16`) through libtorch's autograd
//! engine and through [`grad`]'s run of a one-node graph without it, each
//! warm (call after call) and cold (after a sweep through a buffer larger
//! than a core's L2 cache, as a worker's other work between two steps
//! leaves it). Measures, judges nothing.
//!
//! - the callee's graph: the gradients of `a @ b` with respect to `a` and
//!   `b` (`MmBackward0`, two 16x16 matmuls);
//! - the caller's graph: the gradient of `(a @ b).sum()` with respect to
//!   the product (`SumBackward0`).
//!
//! `cargo bench -p wasmrpc-torch-sys --bench engine [-- SWEEP_MIB]`
//! (default 4 MiB) prints the median of each, and the callee's two matmuls
//! alone, for comparison.

use std::hint::black_box;
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use wasmrpc_torch_sys::{GradOptions, grad, set_engine_bypass};

/// Median of `samples` calls of `f`, in µs, each after `before` ran.
fn median_us(samples: usize, mut before: impl FnMut(), mut f: impl FnMut()) -> f64 {
    for _ in 0..samples / 10 {
        before();
        f();
    }
    let mut times: Vec<f64> = (0..samples)
        .map(|_| {
            before();
            let started = Instant::now();
            f();
            started.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; a number among the arguments is the
    // sweep's size in MiB.
    let sweep_mib: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(4);
    // The workers' setting (one op thread each).
    tch::set_num_threads(1);
    let leaf = || Tensor::rand([16, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let (a, b) = (leaf(), leaf());
    let product = a.matmul(&b);
    let seed = product.ones_like();
    let loss = product.sum(None);
    let loss_seed = loss.ones_like();
    let options = || GradOptions {
        retain_graph: Some(true),
        create_graph: false,
        allow_unused: true,
    };
    let callee = || {
        black_box(
            grad(
                &[product.shallow_clone()],
                &[seed.shallow_clone()],
                &[a.shallow_clone(), b.shallow_clone()],
                options(),
            )
            .expect("the gradients of a @ b"),
        );
    };
    let caller = || {
        black_box(
            grad(
                &[loss.shallow_clone()],
                &[loss_seed.shallow_clone()],
                &[product.shallow_clone()],
                options(),
            )
            .expect("the gradient of (a @ b).sum()"),
        );
    };
    let ops_alone = || {
        let _no_grad = tch::no_grad_guard();
        let _gradients = black_box((seed.mm(&b.tr()), a.tr().mm(&seed)));
    };
    let mut buffer = vec![0u8; sweep_mib << 20];
    let mut pass = 0u8;
    let mut sweep = || {
        pass = pass.wrapping_add(1);
        // One write per cache line.
        for i in (0..buffer.len()).step_by(64) {
            buffer[i] = buffer[i].wrapping_add(pass);
        }
        black_box(&buffer);
    };
    const SAMPLES: usize = 20_000;
    println!("gradients of the 16x16 step's graphs, median of {SAMPLES} calls (µs):");
    println!("{:<44} {:>8} {:>8}", "", "warm", "cold");
    let cases: [(&str, &dyn Fn(), bool); 5] = [
        ("callee: d(a @ b)/da, d(a @ b)/db, engine", &callee, false),
        ("callee: the same, without the engine", &callee, true),
        ("callee: its two matmuls alone", &ops_alone, true),
        ("caller: d(sum(p))/dp, engine", &caller, false),
        ("caller: the same, without the engine", &caller, true),
    ];
    for (name, f, bypass) in cases {
        set_engine_bypass(bypass);
        let warm = median_us(SAMPLES, || {}, f);
        let cold = median_us(SAMPLES, &mut sweep, f);
        println!("{name:<44} {warm:>8.2} {cold:>8.2}");
    }
    set_engine_bypass(true);
    println!("cold: after a sweep of {sweep_mib} MiB (one write per 64-byte line)");
}
