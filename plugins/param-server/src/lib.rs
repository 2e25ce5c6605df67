//! PyTorch's parameter server tutorial ("Implementing a Parameter Server
//! Using Distributed RPC Framework") on scikit-learn's digits: a parameter
//! server (worker0) holds an MLP's parameters and runs its forward pass;
//! trainers send it their batches.
//!
//! What is here today: the data ([`digits`], compiled into the plugin, so
//! workers need no file access), its split into a training set and a
//! held-out test set, the model's parameters on the parameter server
//! ([`init`]), its forward pass ([`forward`]) and the evaluation on the
//! held-out set ([`evaluate`]). The training loop (trainers running the
//! forward pass by RPC inside a distributed autograd context, backward,
//! and a `DistributedOptimizer` step) needs guest autograd, which the guest
//! SDK does not have yet.
//!
//! **Data.** `examples/data/digits.csv.gz` (see `examples/data/README.md`):
//! 1,797 8x8 images with pixels 0..16, scaled here to 0..1. Every fifth
//! image (index `i % 5 == 4`, 359 images) is held out for testing; the
//! other 1,438 are for training.
//!
//! **Model.** `logits = relu(x @ W1 + b1) @ W2 + b2`, `W1` 64xH, `W2` Hx10,
//! float32, initialised as `torch.nn.Linear` does (uniform in
//! +-1/sqrt(fan_in)) from a seeded xorshift generator. The parameters live
//! in the parameter server's globals `W1`, `b1`, `W2`, `b2`.

use wasmrpc_guest::{Error, Result, Tensor, global, remote, rpc_sync, set_global};

/// The data set, as shipped by scikit-learn (gzip of a CSV).
const DIGITS_GZ: &[u8] = include_bytes!("../../../examples/data/digits.csv.gz");
/// Pixels of one image.
pub const PIXELS: usize = 64;
/// Classes (digits 0..9).
pub const CLASSES: usize = 10;

/// One part of the data set: images (`PIXELS` floats in 0..1 each) and
/// their digits.
#[derive(Debug, Clone, Default)]
struct Split {
    images: Vec<f32>,
    labels: Vec<i64>,
}

impl Split {
    fn len(&self) -> usize {
        self.labels.len()
    }

    /// Rows `start..end` as a `(n x 64)` float tensor and an `(n)` int64
    /// tensor.
    fn tensors(&self, start: usize, end: usize) -> Result<(Tensor, Tensor)> {
        let end = end.min(self.len());
        let n = end.saturating_sub(start);
        let x = Tensor::from_slice(
            &[n as i64, PIXELS as i64],
            &self.images[start * PIXELS..end * PIXELS],
        )?;
        let y = Tensor::from_slice(&[n as i64], &self.labels[start..end])?;
        Ok((x, y))
    }
}

/// The gzip member's deflate stream (RFC 1952 header and trailer removed).
fn gunzip(data: &[u8]) -> Result<Vec<u8>> {
    let bad = |why: &str| Error::runtime_error(format!("the embedded digits data: {why}"));
    if data.len() < 18 || data[0] != 0x1f || data[1] != 0x8b || data[2] != 8 {
        return Err(bad("not a gzip stream"));
    }
    let flags = data[3];
    let mut at = 10;
    if flags & 4 != 0 {
        let extra = usize::from(u16::from_le_bytes([data[at], data[at + 1]]));
        at += 2 + extra;
    }
    for bit in [8u8, 16] {
        if flags & bit != 0 {
            let end = data[at..]
                .iter()
                .position(|&b| b == 0)
                .ok_or_else(|| bad("unterminated header field"))?;
            at += end + 1;
        }
    }
    if flags & 2 != 0 {
        at += 2;
    }
    let body = data
        .get(at..data.len() - 8)
        .ok_or_else(|| bad("truncated"))?;
    miniz_oxide::inflate::decompress_to_vec(body).map_err(|e| bad(&format!("{e:?}")))
}

/// The digits data set, split into (training, held-out test) parts.
fn digits() -> Result<(Split, Split)> {
    let text = gunzip(DIGITS_GZ)?;
    let text = core::str::from_utf8(&text)
        .map_err(|e| Error::runtime_error(format!("the embedded digits data: {e}")))?;
    let (mut train, mut test) = (Split::default(), Split::default());
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != PIXELS + 1 {
            return Err(Error::runtime_error(format!(
                "the embedded digits data: line {} has {} fields, not {}",
                i + 1,
                fields.len(),
                PIXELS + 1
            )));
        }
        let number = |s: &str| {
            s.trim().parse::<f32>().map_err(|e| {
                Error::runtime_error(format!("the embedded digits data: line {}: {e}", i + 1))
            })
        };
        let part = if i % 5 == 4 { &mut test } else { &mut train };
        for f in &fields[..PIXELS] {
            part.images.push(number(f)? / 16.0);
        }
        part.labels.push(number(fields[PIXELS])? as i64);
    }
    Ok((train, test))
}

/// `(training images, held-out images, images per digit over both)`.
#[remote]
fn summary() -> Result<(i64, i64, Vec<i64>)> {
    let (train, test) = digits()?;
    let mut per_class = vec![0i64; CLASSES];
    for &y in train.labels.iter().chain(&test.labels) {
        if let Some(c) = usize::try_from(y).ok().and_then(|y| per_class.get_mut(y)) {
            *c += 1;
        }
    }
    Ok((train.len() as i64, test.len() as i64, per_class))
}

/// xorshift64, for reproducible initial weights.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        ((x >> 40) as f32) / (1u64 << 24) as f32
    }
}

/// A `rows x cols` float32 tensor uniform in `+-bound`.
fn uniform(rng: &mut Rng, shape: &[i64], bound: f32) -> Result<Tensor> {
    let n: i64 = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| (rng.uniform() * 2.0 - 1.0) * bound)
        .collect();
    Tensor::from_slice(shape, &data)
}

/// On the parameter server: fresh parameters of an MLP with `hidden`
/// hidden units, from `seed`.
#[remote]
fn init(hidden: i64, seed: i64) -> Result<()> {
    if hidden < 1 {
        return Err(Error::value_error(format!(
            "init needs hidden >= 1, got {hidden}"
        )));
    }
    let mut rng = Rng((seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let b1 = 1.0 / (PIXELS as f32).sqrt();
    let b2 = 1.0 / (hidden as f32).sqrt();
    set_global("W1", uniform(&mut rng, &[PIXELS as i64, hidden], b1)?)?;
    set_global("b1", uniform(&mut rng, &[hidden], b1)?)?;
    set_global("W2", uniform(&mut rng, &[hidden, CLASSES as i64], b2)?)?;
    set_global("b2", uniform(&mut rng, &[CLASSES as i64], b2)?)?;
    Ok(())
}

fn parameter(name: &str) -> Result<Tensor> {
    global::<Tensor>(name)?.ok_or_else(|| {
        Error::runtime_error(format!(
            "the parameter server has no parameter {name}: call param_server::init first"
        ))
    })
}

/// On the parameter server: the MLP's logits for a batch `x` (`n x 64`).
#[remote]
fn forward(x: Tensor) -> Result<Tensor> {
    let hidden = x
        .matmul(&parameter("W1")?)?
        .add(&parameter("b1")?)?
        .relu()?;
    hidden.matmul(&parameter("W2")?)?.add(&parameter("b2")?)
}

/// The mean cross-entropy of `logits` against `labels`, and how many
/// predictions (the largest logit) are right.
fn loss_and_correct(logits: &Tensor, labels: &Tensor) -> Result<(f64, i64)> {
    let loss = Tensor::call("aten::cross_entropy_loss", (logits, labels))?;
    let predicted = Tensor::call("aten::argmax", (logits, 1i64))?;
    let correct = Tensor::call("aten::eq", (&predicted, labels))?.sum()?;
    let loss = loss.to_vec::<f32>()?.first().copied().unwrap_or(f32::NAN);
    let correct = correct.to_vec::<i64>()?.first().copied().unwrap_or(0);
    Ok((f64::from(loss), correct))
}

/// The model on parameter server `ps`, on the held-out images: `(mean
/// cross-entropy, accuracy)`.
#[remote]
fn evaluate(ps: String) -> Result<(f64, f64)> {
    let (_, test) = digits()?;
    let (x, y) = test.tensors(0, test.len())?;
    let logits: Tensor = rpc_sync(&ps, "param_server::forward", (x,))?;
    let (loss, correct) = loss_and_correct(&logits, &y)?;
    Ok((loss, correct as f64 / test.len() as f64))
}
