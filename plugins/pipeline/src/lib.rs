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
//!   `i + 1` while stage 2 works on `i`. Each stage is a plugin object
//!   (`Stage`) on its worker, held by the driver in an RRef and called
//!   through RRef proxies; an object runs one method at a time, so a stage
//!   takes one micro-batch at a time, as in PyTorch's tutorial.
//!
//! Each step runs in a distributed autograd context: the driver sums the
//! micro-batches' losses, `dist_autograd::backward` carries the gradients
//! back through both stages, and a `DistributedOptimizer` (SGD) over RRefs
//! to the stages' parameters takes one step (GPipe-style). Stage 1 is
//! `relu(x @ W + b)`, stage 2 `x @ W + b`; the parameters are fields of
//! the stage objects.
//!
//! **Data**: a synthetic 10-class problem: inputs uniform in [-1, 1]^64,
//! labelled by the largest output of a fixed random linear "teacher" (seed
//! 7), fresh samples every step.

use wasmrpc_guest::optim::{DistributedOptimizer, Optimizer};
use wasmrpc_guest::{
    Error, Future, RRef, Result, Tensor, dist_autograd, progress, remote, remote_class,
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

/// One stage of the model, an object on its worker (the tutorial's stage
/// modules held in RRefs): `relu(x @ W + b)` or `x @ W + b`. Its methods
/// run one at a time (plugin objects are actors), so a stage takes one
/// micro-batch at a time.
pub struct Stage {
    w: Tensor,
    b: Tensor,
    relu: bool,
}

#[remote_class]
impl Stage {
    /// `Stage(inputs, outputs, seed, relu)`: fresh parameters `W` (`inputs
    /// x outputs`) and `b` that require grad, initialised as
    /// `torch.nn.Linear` does.
    #[constructor]
    fn new(inputs: i64, outputs: i64, seed: i64, relu: bool) -> Result<Stage> {
        if inputs < 1 || outputs < 1 {
            return Err(Error::value_error(format!(
                "Stage needs inputs and outputs >= 1, got {inputs} and {outputs}"
            )));
        }
        let mut rng = Rng::seeded(seed);
        let bound = 1.0 / (inputs as f32).sqrt();
        let w: Vec<f32> = (0..inputs * outputs)
            .map(|_| rng.symmetric(bound))
            .collect();
        let b: Vec<f32> = (0..outputs).map(|_| rng.symmetric(bound)).collect();
        Ok(Stage {
            w: Tensor::from_slice(&[inputs, outputs], &w)?.requires_grad_(true)?,
            b: Tensor::from_slice(&[outputs], &b)?.requires_grad_(true)?,
            relu,
        })
    }

    /// RRefs to the stage's parameters, for the optimizer.
    fn parameter_rrefs(&self) -> Result<Vec<RRef>> {
        Ok(vec![RRef::new(&self.w)?, RRef::new(&self.b)?])
    }

    /// The stage's output for one micro-batch (recorded by the caller's
    /// distributed autograd context).
    fn forward(&self, x: Tensor) -> Result<Tensor> {
        let pre = x.matmul(&self.w)?.add(&self.b)?;
        if self.relu { pre.relu() } else { Ok(pre) }
    }
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
    let s1 = remote("worker1", "Stage", (INPUTS as i64, hidden, 1i64, true))?;
    let s2 = remote("worker2", "Stage", (hidden, CLASSES as i64, 2i64, false))?;
    let mut params: Vec<RRef> = s1.rpc_sync().call("parameter_rrefs", ())?;
    params.extend(s2.rpc_sync().call::<Vec<RRef>>("parameter_rrefs", ())?);
    let optimizer =
        DistributedOptimizer::new(Optimizer::sgd(lr), &params.iter().collect::<Vec<_>>())?;
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
            targets.push(Tensor::from_slice(&[n as i64], &y)?);
        }
        let context = dist_autograd::context()?;
        // Forward through both stages.
        let logits: Vec<Tensor> = if pipelined {
            let first: Vec<Future> = inputs
                .iter()
                .map(|x| s1.rpc_async().call("forward", (x,)))
                .collect::<Result<_>>()?;
            let mut second = Vec::new();
            for f in &first {
                let h: Tensor = f.wait()?;
                second.push(s2.rpc_async().call("forward", (h,))?);
            }
            second.iter().map(|f| f.wait()).collect::<Result<_>>()?
        } else {
            let mut out = Vec::new();
            for x in &inputs {
                let h: Tensor = s1.rpc_sync().call("forward", (x,))?;
                out.push(s2.rpc_sync().call("forward", (h,))?);
            }
            out
        };
        // The batch's mean cross-entropy (micro-batches are equal in size).
        let mut total: Option<Tensor> = None;
        for (out, y) in logits.iter().zip(&targets) {
            let l = Tensor::call("aten::cross_entropy_loss", (out, y))?;
            total = Some(match total {
                Some(t) => t.add(&l)?,
                None => l,
            });
        }
        let total = total
            .ok_or_else(|| Error::value_error("no micro-batches"))?
            .div(micro_batches)?;
        dist_autograd::backward(context.id(), &[&total], false)?;
        optimizer.step(context.id())?;
        let loss = f64::from(total.to_vec::<f32>()?.first().copied().unwrap_or(f32::NAN));
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
