//! `grad` without libtorch's engine for a graph of one node: the same
//! gradients and the same errors as the engine's, and the engine whenever
//! the graph or its options ask for more than one node's call. Each case
//! computes its reference through the engine (`create_graph`, which the
//! bypass refuses, with the graph kept) and checks whether the bypass ran
//! by `engine_bypasses`, which counts per thread.

use tch::{Kind, Tensor};
use wasmrpc_torch_sys::{GradOptions, engine_bypasses, grad, register_hook};

const F32: (Kind, tch::Device) = (Kind::Float, tch::Device::Cpu);

/// What the distributed backward passes: the graph kept, unused inputs allowed.
const KEEP: GradOptions = GradOptions {
    retain_graph: Some(true),
    create_graph: false,
    allow_unused: true,
};

/// Through the engine, the graph kept: the bypass refuses `create_graph`.
const ENGINE: GradOptions = GradOptions {
    retain_graph: Some(true),
    create_graph: true,
    allow_unused: true,
};

fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_slice(values).set_requires_grad(true)
}

fn values(t: &Option<Tensor>) -> Vec<f32> {
    let t = t.as_ref().expect("a gradient");
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

/// Runs `grad` with `options` and says whether it skipped the engine.
fn run(
    outputs: &[&Tensor],
    seeds: &[&Tensor],
    inputs: &[&Tensor],
    options: GradOptions,
) -> (Result<Vec<Option<Tensor>>, String>, bool) {
    let before = engine_bypasses();
    let outs: Vec<Tensor> = outputs.iter().map(|t| t.shallow_clone()).collect();
    let seeds: Vec<Tensor> = seeds.iter().map(|t| t.shallow_clone()).collect();
    let ins: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
    let r = grad(&outs, &seeds, &ins, options).map_err(|e| e.to_string());
    (r, engine_bypasses() > before)
}

/// The gradients with the bypass, checked against the engine's.
fn bypassed_and_equal(outputs: &[&Tensor], seeds: &[&Tensor], inputs: &[&Tensor]) {
    let (fast, bypassed) = run(outputs, seeds, inputs, KEEP);
    assert!(bypassed, "the one-node graph went through the engine");
    let (engine, through_engine) = run(outputs, seeds, inputs, ENGINE);
    assert!(!through_engine);
    let (fast, engine) = (fast.unwrap(), engine.unwrap());
    assert_eq!(fast.len(), engine.len());
    for (f, e) in fast.iter().zip(&engine) {
        match (f, e) {
            (None, None) => {}
            (Some(f), Some(e)) => {
                assert_eq!(f.size(), e.size());
                assert!(f.allclose(e, 1e-6, 1e-6, false), "{f} != {e}");
            }
            _ => panic!("one path gave a gradient the other did not: {fast:?} {engine:?}"),
        }
    }
}

#[test]
fn a_matmuls_backward_skips_the_engine_with_the_engines_gradients() {
    let a = Tensor::rand([16, 16], F32).set_requires_grad(true);
    let b = Tensor::rand([16, 16], F32).set_requires_grad(true);
    let p = a.matmul(&b);
    let seed = Tensor::rand([16, 16], F32);
    bypassed_and_equal(&[&p], &[&seed], &[&a, &b]);
    // One of the two inputs, and an unused one beside them.
    let unused = leaf(&[1.0]);
    bypassed_and_equal(&[&p], &[&seed], &[&b, &unused]);
}

#[test]
fn a_broadcast_gradient_is_reduced_to_its_inputs_shape() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    let y = leaf(&[10.0]);
    let z = &x + &y;
    let seed = Tensor::from_slice(&[1.0_f32, 10.0, 100.0]);
    let (g, bypassed) = run(&[&z], &[&seed], &[&x, &y], KEEP);
    assert!(bypassed);
    let g = g.unwrap();
    assert_eq!(values(&g[0]), [1.0, 10.0, 100.0]);
    assert_eq!(values(&g[1]), [111.0]);
    bypassed_and_equal(&[&z], &[&seed], &[&x, &y]);
}

#[test]
fn a_gradient_is_taken_at_a_non_leaf_input() {
    let a = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let p = a.matmul(&a.tr());
    let s = p.sum(None);
    let one = s.ones_like();
    bypassed_and_equal(&[&s], &[&one], &[&p]);
    let (g, _) = run(&[&s], &[&one], &[&p], KEEP);
    assert_eq!(values(&g.unwrap()[0]), vec![1.0; 16]);
}

#[test]
fn deeper_graphs_and_other_options_go_through_the_engine() {
    let a = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let b = Tensor::rand([4, 4], F32).set_requires_grad(true);
    let s = a.matmul(&b).sum(None);
    let one = s.ones_like();
    // The sum's edge leads to the matmul, not to an input.
    let (g, bypassed) = run(&[&s], &[&one], &[&a], KEEP);
    assert!(!bypassed);
    assert_eq!(g.unwrap()[0].as_ref().unwrap().size(), [4, 4]);
    for options in [
        GradOptions {
            retain_graph: Some(false),
            ..KEEP
        },
        GradOptions {
            create_graph: true,
            ..KEEP
        },
    ] {
        // A fresh graph each time: the first frees its own.
        let p = a.matmul(&b);
        let (g, bypassed) = run(&[&p], &[&p.ones_like()], &[&a, &b], options);
        assert!(!bypassed, "{options:?}");
        assert_eq!(g.unwrap().len(), 2);
    }
    // Two edges into one input (x * x): the engine sums them.
    let x = leaf(&[1.0, 2.0, 3.0]);
    let y = &x * &x;
    let (g, bypassed) = run(&[&y], &[&y.ones_like()], &[&x], KEEP);
    assert!(!bypassed);
    assert_eq!(values(&g.unwrap()[0]), [2.0, 4.0, 6.0]);
    // Two outputs.
    let q = &x * 2.0;
    let (g, bypassed) = run(&[&y, &q], &[&y.ones_like(), &q.ones_like()], &[&x], KEEP);
    assert!(!bypassed);
    assert_eq!(values(&g.unwrap()[0]), [4.0, 6.0, 8.0]);
    // One input twice: each gets its gradient.
    let p = a.matmul(&b);
    let (g, bypassed) = run(&[&p], &[&p.ones_like()], &[&a, &a], KEEP);
    assert!(!bypassed);
    let g = g.unwrap();
    assert!(
        g[0].as_ref()
            .unwrap()
            .allclose(g[1].as_ref().unwrap(), 0.0, 0.0, false)
    );
    // The output itself as an input: its gradient is the seed.
    let (g, bypassed) = run(&[&q], &[&q.ones_like()], &[&q, &x], KEEP);
    assert!(!bypassed);
    let g = g.unwrap();
    assert_eq!(values(&g[0]), [1.0, 1.0, 1.0]);
    assert_eq!(values(&g[1]), [2.0, 2.0, 2.0]);
}

#[test]
fn a_hook_on_an_input_or_the_output_runs_through_the_engine() {
    let x = leaf(&[1.0, 2.0]);
    let y = &x * 3.0;
    let hook = register_hook(&x, |g| Ok(g * 10.0)).unwrap();
    let (g, bypassed) = run(&[&y], &[&y.ones_like()], &[&x], KEEP);
    assert!(!bypassed);
    assert_eq!(values(&g.unwrap()[0]), [30.0, 30.0]);
    hook.remove();

    let x = leaf(&[1.0, 2.0]);
    let y = &x * 3.0;
    let z = &y * 2.0;
    let _hook = register_hook(&z, |g| Ok(g * 100.0)).unwrap();
    let (g, bypassed) = run(&[&z], &[&z.ones_like()], &[&y], KEEP);
    assert!(!bypassed);
    assert_eq!(values(&g.unwrap()[0]), [200.0, 200.0]);
}

#[test]
fn refusals_keep_the_engines_words() {
    let a = Tensor::rand([3, 3], F32).set_requires_grad(true);
    let b = Tensor::rand([3, 3], F32).set_requires_grad(true);
    let p = a.matmul(&b);
    let strict = GradOptions {
        allow_unused: false,
        ..KEEP
    };
    // An unused input without allow_unused.
    let unused = leaf(&[1.0]);
    let (r, bypassed) = run(&[&p], &[&p.ones_like()], &[&a, &unused], strict);
    assert!(!bypassed);
    let e = r.unwrap_err();
    assert!(
        e.contains("appears to not have been used in the graph"),
        "{e}"
    );
    // An input that does not require grad.
    let plain = Tensor::ones([3, 3], F32);
    let (r, bypassed) = run(&[&p], &[&p.ones_like()], &[&plain], KEEP);
    assert!(!bypassed);
    let e = r.unwrap_err();
    assert!(e.contains("does not require grad"), "{e}");
    // A seed of the wrong shape: the engine's check of its root.
    let (r, bypassed) = run(&[&p], &[&Tensor::ones([2], F32)], &[&a], KEEP);
    assert!(!bypassed);
    let e = r.unwrap_err();
    assert!(
        e.contains(
            "invalid gradient at index 0 - got [2] but expected shape compatible with [3, 3]"
        ),
        "{e}"
    );
    // Saved tensors freed by an earlier pass: the node's own error, with
    // the bypass as with the engine.
    let x = Tensor::rand([3, 3], F32).set_requires_grad(true);
    let w = Tensor::rand([3, 3], F32).set_requires_grad(true);
    let y = x.matmul(&w);
    let seed = y.ones_like();
    let free = GradOptions {
        retain_graph: Some(false),
        ..KEEP
    };
    run(&[&y], &[&seed], &[&x], free).0.unwrap();
    let (r, bypassed) = run(&[&y], &[&seed], &[&x, &w], KEEP);
    let e = r.unwrap_err();
    assert!(
        e.contains("Trying to backward through the graph a second time"),
        "bypassed: {bypassed}, {e}"
    );
}
