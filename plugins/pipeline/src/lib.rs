//! Pipeline parallelism (PyTorch's "Distributed Pipeline Parallelism Using
//! RPC"): an MLP split into two stages, stage 1 on worker1 and stage 2 on
//! worker2, driven from worker0, which splits each batch into
//! micro-batches.
//!
//! - **Sequential** (`pipelined = false`): each micro-batch goes through
//!   stage 1, then stage 2, before the next one starts; one worker is idle
//!   at any time.
//! - **Pipelined** (`pipelined = true`): the driver sends every micro-batch
//!   to stage 1 with `rpc_async` at once, and hands each result on to stage
//!   2 as soon as its future completes, so stage 1 works on micro-batch
//!   `i + 1` while stage 2 works on `i`. The backward pass runs the same way
//!   in reverse. Each stage takes one micro-batch at a time (a per-worker
//!   lock), as a stage object in PyTorch's tutorial does.
//!
//! Each step, the driver sums the micro-batches' gradients (GPipe-style) and
//! has both stages take one SGD step. Stage 1 is `relu(x @ W + b)`, stage 2
//! `x @ W + b`; a stage's parameters, accumulated gradients and the
//! activations it stashes for the backward pass are globals of its worker. The backward passes are written out with tensor ops, because
//! guests have no distributed autograd yet (PyTorch's tutorial uses
//! `dist_autograd.backward` and a `DistributedOptimizer`).
//!
//! **Data**: a synthetic 10-class problem: inputs uniform in [-1, 1]^64,
//! labelled by the largest output of a fixed random linear "teacher" (seed
//! 7), fresh samples every step.

use wasmrpc_guest::{
    Error, Future, Result, Tensor, clear_global, global, lock, progress, remote, rpc_async,
    set_global,
};

/// Inputs and classes of the synthetic problem.
const INPUTS: usize = 64;
const CLASSES: usize = 10;

/// xorshift64: reproducible uniform numbers in [0, 1).
struct Rng(u64);

impl Rng {
    fn seeded(seed: i64) -> Rng {
        Rng((seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        ((x >> 40) as f32) / (1u64 << 24) as f32
    }

    fn symmetric(&mut self, bound: f32) -> f32 {
        (self.next() * 2.0 - 1.0) * bound
    }
}

fn stored(name: &str) -> Result<Tensor> {
    global::<Tensor>(name)?.ok_or_else(|| {
        Error::runtime_error(format!(
            "this stage has no `{name}`: call pipeline::init_stage first"
        ))
    })
}

/// On a stage's worker: fresh parameters `W` (`inputs x outputs`) and `b`,
/// as `torch.nn.Linear` initialises them, and zero gradients.
#[remote]
fn init_stage(inputs: i64, outputs: i64, seed: i64) -> Result<()> {
    if inputs < 1 || outputs < 1 {
        return Err(Error::value_error(format!(
            "init_stage needs inputs and outputs >= 1, got {inputs} and {outputs}"
        )));
    }
    let mut rng = Rng::seeded(seed);
    let bound = 1.0 / (inputs as f32).sqrt();
    let w: Vec<f32> = (0..inputs * outputs)
        .map(|_| rng.symmetric(bound))
        .collect();
    let b: Vec<f32> = (0..outputs).map(|_| rng.symmetric(bound)).collect();
    set_global("W", Tensor::from_slice(&[inputs, outputs], &w)?)?;
    set_global("b", Tensor::from_slice(&[outputs], &b)?)?;
    set_global("gW", Tensor::zeros(&[inputs, outputs])?)?;
    set_global("gb", Tensor::zeros(&[outputs])?)
}

/// On a stage's worker: the stage's output for micro-batch `mb`, stashing
/// what the backward pass needs.
#[remote]
fn forward(mb: i64, x: Tensor, relu: bool) -> Result<Tensor> {
    let _stage = lock("stage")?;
    let pre = x.matmul(&stored("W")?)?.add(&stored("b")?)?;
    let out = if relu { pre.relu()? } else { pre.try_clone()? };
    set_global(&format!("in{mb}"), x)?;
    set_global(&format!("pre{mb}"), pre)?;
    Ok(out)
}

/// On a stage's worker: given the gradient of the loss with respect to
/// micro-batch `mb`'s output, accumulates the parameters' gradients and
/// returns the gradient with respect to its input.
#[remote]
fn backward(mb: i64, grad: Tensor, relu: bool) -> Result<Tensor> {
    let _stage = lock("stage")?;
    let (x, pre) = (stored(&format!("in{mb}"))?, stored(&format!("pre{mb}"))?);
    clear_global(&format!("in{mb}"))?;
    clear_global(&format!("pre{mb}"))?;
    let grad = if relu {
        grad.mul(&Tensor::call("aten::gt", (&pre, 0i64))?)?
    } else {
        grad
    };
    let t = |m: &Tensor| Tensor::call("aten::t", (m,));
    let gw = stored("gW")?.add(&t(&x)?.matmul(&grad)?)?;
    let gb = stored("gb")?.add(&Tensor::call("aten::sum", (&grad, vec![0i64]))?)?;
    set_global("gW", gw)?;
    set_global("gb", gb)?;
    grad.matmul(&t(&stored("W")?)?)
}

/// On a stage's worker: one SGD step with the accumulated gradients, which
/// are then zeroed.
#[remote]
fn step(lr: f64) -> Result<()> {
    let _stage = lock("stage")?;
    for (p, g) in [("W", "gW"), ("b", "gb")] {
        let grad = stored(g)?;
        set_global(p, stored(p)?.sub(&grad.mul(lr)?)?)?;
        set_global(g, grad.mul(0i64)?)?;
    }
    Ok(())
}

/// A fresh batch of `n` samples of the synthetic problem: inputs (`n x
/// 64`, row-major) and labels.
fn batch(rng: &mut Rng, teacher: &[f32], n: usize) -> (Vec<f32>, Vec<i64>) {
    let x: Vec<f32> = (0..n * INPUTS).map(|_| rng.symmetric(1.0)).collect();
    let labels = x
        .chunks_exact(INPUTS)
        .map(|row| {
            let score = |c: usize| -> f32 {
                row.iter()
                    .enumerate()
                    .map(|(i, v)| v * teacher[i * CLASSES + c])
                    .sum()
            };
            (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .unwrap_or(0) as i64
        })
        .collect();
    (x, labels)
}

/// The driver, on worker0: `steps` SGD steps of an MLP 64-`hidden`-10
/// split over worker1 (stage 1) and worker2 (stage 2), each step on
/// `micro_batches` micro-batches of `micro_batch_size` samples, pipelined
/// or not. Returns the loss of each step (the mean cross-entropy over its
/// micro-batches, before the update).
#[remote]
fn run(
    micro_batches: i64,
    micro_batch_size: i64,
    steps: i64,
    lr: f64,
    hidden: i64,
    pipelined: bool,
) -> Result<Vec<f64>> {
    if micro_batches < 1 || micro_batch_size < 1 || steps < 1 {
        return Err(Error::value_error(format!(
            "run needs micro_batches, micro_batch_size and steps >= 1, got {micro_batches}, \
             {micro_batch_size}, {steps}"
        )));
    }
    let (s1, s2) = ("worker1", "worker2");
    let mut inits = vec![
        rpc_async(s1, "pipeline::init_stage", (INPUTS as i64, hidden, 1i64))?,
        rpc_async(s2, "pipeline::init_stage", (hidden, CLASSES as i64, 2i64))?,
    ];
    for f in inits.drain(..) {
        f.wait::<()>()?;
    }
    let mut rng = Rng::seeded(7);
    let teacher: Vec<f32> = (0..INPUTS * CLASSES).map(|_| rng.symmetric(1.0)).collect();
    let n = micro_batch_size as usize;
    let mut losses = Vec::new();
    for step_no in 0..steps {
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        for _ in 0..micro_batches {
            let (x, y) = batch(&mut rng, &teacher, n);
            inputs.push(Tensor::from_slice(&[n as i64, INPUTS as i64], &x)?);
            targets.push(y);
        }
        // Forward through both stages.
        let logits: Vec<Tensor> = if pipelined {
            let first: Vec<Future> = inputs
                .iter()
                .enumerate()
                .map(|(i, x)| rpc_async(s1, "pipeline::forward", (i as i64, x, true)))
                .collect::<Result<_>>()?;
            let mut second = Vec::new();
            for (i, f) in first.iter().enumerate() {
                let h: Tensor = f.wait()?;
                second.push(rpc_async(s2, "pipeline::forward", (i as i64, h, false))?);
            }
            second.iter().map(|f| f.wait()).collect::<Result<_>>()?
        } else {
            let mut out = Vec::new();
            for (i, x) in inputs.iter().enumerate() {
                let h: Tensor = rpc_async(s1, "pipeline::forward", (i as i64, x, true))?.wait()?;
                out.push(rpc_async(s2, "pipeline::forward", (i as i64, h, false))?.wait()?);
            }
            out
        };
        // The loss and its gradient with respect to each micro-batch's
        // logits (the mean over the whole batch).
        let total = (micro_batches as usize * n) as f64;
        let mut loss = 0.0;
        let mut grads = Vec::new();
        for (out, y) in logits.iter().zip(&targets) {
            let labels = Tensor::from_slice(&[n as i64], y)?;
            let l = Tensor::call("aten::cross_entropy_loss", (out, &labels))?;
            loss += f64::from(l.to_vec::<f32>()?.first().copied().unwrap_or(f32::NAN));
            let mut onehot = vec![0f32; n * CLASSES];
            for (row, &c) in y.iter().enumerate() {
                onehot[row * CLASSES + c as usize] = 1.0;
            }
            let onehot = Tensor::from_slice(&[n as i64, CLASSES as i64], &onehot)?;
            let p = Tensor::call("aten::softmax", (out, 1i64))?;
            grads.push(p.sub(&onehot)?.div(total)?);
        }
        loss /= micro_batches as f64;
        // Backward through both stages, in reverse.
        if pipelined {
            let second: Vec<Future> = grads
                .iter()
                .enumerate()
                .map(|(i, g)| rpc_async(s2, "pipeline::backward", (i as i64, g, false)))
                .collect::<Result<_>>()?;
            let mut first = Vec::new();
            for (i, f) in second.iter().enumerate() {
                let g: Tensor = f.wait()?;
                first.push(rpc_async(s1, "pipeline::backward", (i as i64, g, true))?);
            }
            for f in first {
                f.wait::<Tensor>()?;
            }
        } else {
            for (i, g) in grads.iter().enumerate() {
                let g: Tensor =
                    rpc_async(s2, "pipeline::backward", (i as i64, g, false))?.wait()?;
                rpc_async(s1, "pipeline::backward", (i as i64, g, true))?.wait::<Tensor>()?;
            }
        }
        let updates = [
            rpc_async(s1, "pipeline::step", (lr,))?,
            rpc_async(s2, "pipeline::step", (lr,))?,
        ];
        for f in updates {
            f.wait::<()>()?;
        }
        progress::report(
            "step",
            step_no as u64 + 1,
            steps as u64,
            &format!("loss {loss:.3}"),
        );
        losses.push(loss);
    }
    Ok(losses)
}
