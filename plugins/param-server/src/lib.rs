//! PyTorch's parameter server tutorial ("Implementing a Parameter Server
//! Using Distributed RPC Framework") on scikit-learn's digits: a parameter
//! server (worker0) holds an MLP's parameters; trainers (worker1..) train
//! it on their shards of the data.
//!
//! [`run`] is the driver, on the parameter server: it initialises the
//! parameters ([`init`]), and each epoch has every trainer run
//! [`train_epoch`] on its shard, then evaluates the model on the held-out
//! images ([`evaluate`]). It reports progress (an `epoch` bar on the
//! parameter server, a `batch` bar per trainer) and returns the per-epoch
//! training loss, held-out loss and held-out accuracy.
//!
//! **How trainers train**, as in PyTorch's tutorial: a trainer gets RRefs
//! to the parameters ([`parameter_rrefs`]) and makes a
//! `DistributedOptimizer` (SGD) over them; for each batch, in a distributed
//! autograd context of its own, it runs the forward pass on the parameter
//! server by RPC ([`forward`]), computes the cross-entropy locally, runs
//! `dist_autograd::backward` (which reaches the parameters on the server)
//! and steps the optimizer. The optimizer updates the parameters in place,
//! which would invalidate another trainer's forward graph still waiting for
//! its backward pass; so the trainers go in rounds, with a [`barrier`] on
//! the parameter server after the backward passes and after the steps (a
//! synchronous variant of the tutorial, which lets trainers run freely).
//!
//! **Data.** Read from the file [`DATA_FILE`] in the folder the operator
//! grants the plugin at `/data` (`--grant-dir
//! param_server:/data=examples/data:ro`; `examples/data/README.md` says
//! where the file comes from): 1,797 8x8 images with pixels 0..16, scaled
//! here to 0..1. Every fifth image (index `i % 5 == 4`, 359 images) is
//! held out for testing; trainer `k` of `K` takes the training images `j`
//! with `j % K == k`.
//!
//! **Checkpoints.** When the operator also grants the parameter server a
//! read-write folder at [`CHECKPOINTS`] (`--grant-dir
//! param_server:/ckpt=target/demo/checkpoints:rw`), [`run`] saves a
//! checkpoint there after every epoch (`wasmrpc_guest::checkpoint`: the
//! parameters as the parameter server's shard, the settings and the
//! history so far in the manifest), and [`resume`] continues a run from
//! the last one. [`run`] itself resumes when its group was restarted after
//! a failure (`wasmrpc launch --max-restarts N`, torchrun:
//! `wasmrpc_guest::supervision::restart_count` above 0) and a checkpoint
//! is there. The trainers keep no state between epochs (their shards
//! are fixed and the optimizer is plain SGD), so the parameters and the
//! epoch are the whole state of the job.
//!
//! **Model.** `logits = relu(x @ W1 + b1) @ W2 + b2`, `W1` 64xH, `W2` Hx10,
//! float32, initialised as `torch.nn.Linear` does (uniform in
//! +-1/sqrt(fan_in)) from a seeded xorshift generator. The parameters live
//! in the parameter server's globals `W1`, `b1`, `W2`, `b2`.

use wasmrpc_guest::optim::{DistributedOptimizer, Optimizer};
use wasmrpc_guest::supervision;
use wasmrpc_guest::{
    Error, Future, RRef, Result, Tensor, Value, checkpoint, clear_global, dist_autograd, fs,
    get_worker_info, global, lock, progress, remote, rpc_async, rpc_sync, set_global,
};

mod data;

use data::{Split, digits};

/// The data set, as shipped by scikit-learn (gzip of a CSV), in the
/// folder granted at `/data`.
pub const DATA_FILE: &str = "/data/digits.csv.gz";
/// Where checkpoints go when the operator grants the folder.
pub const CHECKPOINTS: &str = "/ckpt";
/// The parameters, in the order of [`parameter_rrefs`].
const PARAMETERS: [&str; 4] = ["W1", "b1", "W2", "b2"];
/// Pixels of one image.
pub const PIXELS: usize = 64;
/// Classes (digits 0..9).
pub const CLASSES: usize = 10;

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
    // Leaves that require grad: trainers' distributed backward passes
    // reach them through `forward`.
    let leaf = |t: Tensor| t.requires_grad_(true);
    set_global(
        "W1",
        leaf(uniform(&mut rng, &[PIXELS as i64, hidden], b1)?)?,
    )?;
    set_global("b1", leaf(uniform(&mut rng, &[hidden], b1)?)?)?;
    set_global(
        "W2",
        leaf(uniform(&mut rng, &[hidden, CLASSES as i64], b2)?)?,
    )?;
    set_global("b2", leaf(uniform(&mut rng, &[CLASSES as i64], b2)?)?)?;
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

/// On the parameter server: returns once `parties` calls have asked for the
/// barrier `name` (each call returns a `then`-less wait on the worker-wide
/// future `name`, which the last arrival completes).
#[remote(async_execution)]
fn barrier(name: String, parties: i64) -> Result<Future> {
    let _guard = lock("barrier")?;
    let key = format!("arrived:{name}");
    let arrived = global::<i64>(&key)?.unwrap_or(0) + 1;
    if arrived >= parties {
        clear_global(&key)?;
        let done = Future::take_shared(&name)?;
        done.set_result(())?;
        Ok(done)
    } else {
        set_global(&key, arrived)?;
        Future::shared(&name)
    }
}

/// On the parameter server: an RRef to each parameter (PyTorch's
/// `[RRef(p) for p in model.parameters()]`), for a `DistributedOptimizer`.
#[remote]
fn parameter_rrefs() -> Result<Vec<RRef>> {
    PARAMETERS
        .iter()
        .map(|name| RRef::new(parameter(name)?))
        .collect()
}

/// On trainer `rank` of `trainers` (1-based worker ranks; trainer `k`
/// takes the training images `j % trainers == k - 1`): one epoch over its
/// shard in batches of `batch_size` against the parameter server `ps`
/// (SGD with step `lr`), in the rounds of epoch `epoch` (the barriers'
/// names). Returns the mean training loss of its batches.
#[remote]
fn train_epoch(
    ps: String,
    rank: i64,
    trainers: i64,
    batch_size: i64,
    lr: f64,
    epoch: i64,
) -> Result<f64> {
    if trainers < 1 || !(1..=trainers).contains(&rank) || batch_size < 1 {
        return Err(Error::value_error(format!(
            "train_epoch needs 1 <= rank <= trainers and batch_size >= 1, got rank={rank}, \
             trainers={trainers}, batch_size={batch_size}"
        )));
    }
    let (train, _) = digits()?;
    let mut shard = Split::default();
    for j in (rank as usize - 1..train.len()).step_by(trainers as usize) {
        shard
            .images
            .extend_from_slice(&train.images[j * PIXELS..(j + 1) * PIXELS]);
        shard.labels.push(train.labels[j]);
    }
    // Every trainer takes part in every round, so all count the batches
    // of the largest shard.
    let batches = train
        .len()
        .div_ceil(trainers as usize)
        .div_ceil(batch_size as usize);
    let params: Vec<RRef> = rpc_sync(&ps, "param_server::parameter_rrefs", ())?;
    let optimizer =
        DistributedOptimizer::new(Optimizer::sgd(lr), &params.iter().collect::<Vec<_>>())?;
    let mut total = 0.0;
    let mut counted = 0usize;
    let barrier = |b: usize, phase: &str| -> Result<()> {
        rpc_sync::<()>(
            &ps,
            "param_server::barrier",
            (format!("epoch{epoch}-batch{b}-{phase}"), trainers),
        )
    };
    for b in 0..batches {
        let (start, end) = (
            (b * batch_size as usize).min(shard.len()),
            ((b + 1) * batch_size as usize).min(shard.len()),
        );
        let context = dist_autograd::context()?;
        let mut loss = f64::NAN;
        if end > start {
            let (x, y) = shard.tensors(start, end)?;
            let logits: Tensor = rpc_sync(&ps, "param_server::forward", (x,))?;
            let l = Tensor::call("aten::cross_entropy_loss", (&logits, &y))?;
            dist_autograd::backward(context.id(), &[&l], false)?;
            loss = f64::from(l.to_vec::<f32>()?.first().copied().unwrap_or(f32::NAN));
            total += loss;
            counted += 1;
        }
        // The optimizer updates the parameters in place, which would break
        // the graph of a forward pass still waiting for its backward pass:
        // every trainer's backward pass ends before any step, and every step
        // before the next forward pass.
        barrier(b, "backward")?;
        if end > start {
            optimizer.step(context.id())?;
        }
        barrier(b, "step")?;
        progress::report(
            "batch",
            b as u64 + 1,
            batches as u64,
            &format!("loss {loss:.3}"),
        );
    }
    Ok(total / counted.max(1) as f64)
}

/// Defaults of [`run`]'s optional arguments: SGD on batches of 16 with
/// step 0.1, 32 hidden units, seed 1 (about 0.95 held-out accuracy after 10
/// epochs).
const DEFAULT_BATCH_SIZE: i64 = 16;
const DEFAULT_LR: f64 = 0.1;
const DEFAULT_HIDDEN: i64 = 32;
const DEFAULT_SEED: i64 = 1;

/// A run's settings, as [`run`] takes them and a checkpoint keeps them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Settings {
    trainers: i64,
    batch_size: i64,
    lr: f64,
    hidden: i64,
    seed: i64,
}

impl Settings {
    fn metadata(&self) -> Vec<(&'static str, String)> {
        vec![
            ("trainers", self.trainers.to_string()),
            ("batch_size", self.batch_size.to_string()),
            ("lr", format!("{:?}", self.lr)),
            ("hidden", self.hidden.to_string()),
            ("seed", self.seed.to_string()),
        ]
    }

    fn from_checkpoint(manifest: &checkpoint::Manifest) -> Result<Settings> {
        fn field<T: core::str::FromStr>(m: &checkpoint::Manifest, key: &str) -> Result<T> {
            m.get(key).and_then(|v| v.parse().ok()).ok_or_else(|| {
                Error::runtime_error(format!(
                    "the checkpoint in {CHECKPOINTS} has no setting {key}: it was not written \
                     by param_server::run"
                ))
            })
        }
        Ok(Settings {
            trainers: field(manifest, "trainers")?,
            batch_size: field(manifest, "batch_size")?,
            lr: field(manifest, "lr")?,
            hidden: field(manifest, "hidden")?,
            seed: field(manifest, "seed")?,
        })
    }
}

/// Per-epoch results so far.
#[derive(Debug, Clone, Default)]
struct History {
    train_loss: Vec<f64>,
    test_loss: Vec<f64>,
    accuracy: Vec<f64>,
}

impl History {
    fn columns(&self) -> [(&'static str, &Vec<f64>); 3] {
        [
            ("train_loss", &self.train_loss),
            ("test_loss", &self.test_loss),
            ("accuracy", &self.accuracy),
        ]
    }

    fn into_value(self) -> Value {
        let list = |v: &Vec<f64>| Value::List(v.iter().map(|x| Value::Float(*x)).collect());
        Value::Dict(
            self.columns()
                .iter()
                .map(|(name, column)| (Value::Str((*name).into()), list(column)))
                .collect(),
        )
    }

    /// Each column as comma-separated floats, for a checkpoint's metadata.
    fn metadata(&self) -> Vec<(&'static str, String)> {
        self.columns()
            .iter()
            .map(|(name, column)| {
                let text: Vec<String> = column.iter().map(|x| format!("{x:?}")).collect();
                (*name, text.join(","))
            })
            .collect()
    }

    fn from_checkpoint(manifest: &checkpoint::Manifest) -> Result<History> {
        let column = |key: &str| -> Result<Vec<f64>> {
            let text = manifest.get(key).unwrap_or("");
            text.split(',')
                .filter(|x| !x.is_empty())
                .map(|x| {
                    x.parse::<f64>().map_err(|e| {
                        Error::runtime_error(format!(
                            "the checkpoint in {CHECKPOINTS}: {key} holds {x:?}: {e}"
                        ))
                    })
                })
                .collect()
        };
        Ok(History {
            train_loss: column("train_loss")?,
            test_loss: column("test_loss")?,
            accuracy: column("accuracy")?,
        })
    }
}

/// Whether the operator granted the checkpoint folder (a plugin without the
/// grant trains without checkpoints).
fn checkpoints_granted() -> bool {
    fs::list(CHECKPOINTS).is_ok()
}

/// Saves the parameters after `epoch` with the settings and the history.
fn save_checkpoint(epoch: i64, settings: &Settings, history: &History) -> Result<()> {
    let params = PARAMETERS
        .iter()
        .map(|name| Ok((*name, parameter(name)?)))
        .collect::<Result<Vec<_>>>()?;
    let named: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (*n, t)).collect();
    let shard = checkpoint::save_shard(CHECKPOINTS, epoch, &named)?;
    let mut metadata = settings.metadata();
    metadata.extend(history.metadata());
    let metadata: Vec<(&str, &str)> = metadata.iter().map(|(k, v)| (*k, v.as_str())).collect();
    checkpoint::commit(CHECKPOINTS, epoch, &[shard], &metadata)
}

/// The driver, on the parameter server (worker0): trains an MLP with
/// `hidden` hidden units for `epochs` epochs on `trainers` trainers
/// (worker1..), SGD with step `lr` on batches of `batch_size` (see the
/// defaults above). Returns `{"train_loss": [...], "test_loss": [...],
/// "accuracy": [...]}`, one entry per epoch (the held-out loss and accuracy
/// after it). With the checkpoint folder granted, saves a checkpoint after
/// every epoch (see the module docs).
#[remote]
fn run(
    trainers: i64,
    epochs: i64,
    batch_size: Option<i64>,
    lr: Option<f64>,
    hidden: Option<i64>,
    seed: Option<i64>,
) -> Result<Value> {
    let settings = Settings {
        trainers,
        batch_size: batch_size.unwrap_or(DEFAULT_BATCH_SIZE),
        lr: lr.unwrap_or(DEFAULT_LR),
        hidden: hidden.unwrap_or(DEFAULT_HIDDEN),
        seed: seed.unwrap_or(DEFAULT_SEED),
    };
    if trainers < 1 || epochs < 1 {
        return Err(Error::value_error(format!(
            "run needs trainers >= 1 and epochs >= 1, got trainers={trainers}, epochs={epochs}"
        )));
    }
    // A group restarted after a failure (`wasmrpc launch --max-restarts`,
    // torchrun) goes on from its last checkpoint.
    if checkpoints_granted()
        && supervision::restart_count()? > 0
        && checkpoint::latest(CHECKPOINTS)?.is_some()
    {
        return resume_training(trainers, epochs);
    }
    init(settings.hidden, settings.seed)?;
    train(&settings, epochs, History::default())
}

/// The driver, continuing the run whose last checkpoint is in the folder
/// granted at [`CHECKPOINTS`] up to `epochs` epochs in all, with the
/// settings it was started with (`trainers` must match them). Returns what
/// [`run`] returns, the checkpointed epochs' results included.
#[remote]
fn resume(trainers: i64, epochs: i64) -> Result<Value> {
    resume_training(trainers, epochs)
}

/// [`resume`]'s work, which [`run`] does too when its group was restarted.
fn resume_training(trainers: i64, epochs: i64) -> Result<Value> {
    if !checkpoints_granted() {
        return Err(Error::runtime_error(format!(
            "param_server::resume needs the checkpoint folder: grant it with --grant-dir \
             param_server:{CHECKPOINTS}=HOST_FOLDER:rw"
        )));
    }
    let manifest = checkpoint::latest(CHECKPOINTS)?.ok_or_else(|| {
        Error::runtime_error(format!(
            "no checkpoint to resume from in {CHECKPOINTS}: start with param_server::run"
        ))
    })?;
    let settings = Settings::from_checkpoint(&manifest)?;
    if settings.trainers != trainers {
        return Err(Error::value_error(format!(
            "the checkpoint of epoch {} was trained by {} trainers, not {trainers}",
            manifest.step, settings.trainers
        )));
    }
    let history = History::from_checkpoint(&manifest)?;
    if history.accuracy.len() != usize::try_from(manifest.step).unwrap_or(usize::MAX) {
        return Err(Error::runtime_error(format!(
            "the checkpoint of epoch {} holds the results of {} epochs",
            manifest.step,
            history.accuracy.len()
        )));
    }
    let me = get_worker_info()?.name;
    for (name, tensor) in checkpoint::load_shard(CHECKPOINTS, &manifest, &me)? {
        if !PARAMETERS.contains(&name.as_str()) {
            return Err(Error::runtime_error(format!(
                "the checkpoint's shard holds {name:?}, which is no parameter of the model"
            )));
        }
        set_global(&name, tensor.requires_grad_(true)?)?;
    }
    for name in PARAMETERS {
        parameter(name)?;
    }
    progress::report(
        "epoch",
        manifest.step as u64,
        epochs.max(manifest.step) as u64,
        &format!("resumed from the checkpoint of epoch {}", manifest.step),
    );
    train(&settings, epochs, history)
}

/// Trains epochs `history.len() + 1 ..= epochs` from the parameters on
/// this worker, checkpointing each when the folder is granted.
fn train(settings: &Settings, epochs: i64, mut history: History) -> Result<Value> {
    let Settings {
        trainers,
        batch_size,
        lr,
        ..
    } = *settings;
    let ps = get_worker_info()?.name;
    let checkpoints = checkpoints_granted();
    let first = history.accuracy.len() as i64 + 1;
    for epoch in first..=epochs {
        let mut calls = Vec::new();
        for rank in 1..=trainers {
            calls.push(rpc_async(
                &format!("worker{rank}"),
                "param_server::train_epoch",
                (ps.clone(), rank, trainers, batch_size, lr, epoch),
            )?);
        }
        let mut loss = 0.0;
        for call in calls {
            loss += call.wait::<f64>()?;
        }
        let (held_out_loss, acc) = evaluate(ps.clone())?;
        progress::report(
            "epoch",
            epoch as u64,
            epochs as u64,
            &format!(
                "train loss {:.3}, held-out loss {held_out_loss:.3}, accuracy {acc:.3}",
                loss / trainers as f64
            ),
        );
        history.train_loss.push(loss / trainers as f64);
        history.test_loss.push(held_out_loss);
        history.accuracy.push(acc);
        if checkpoints {
            save_checkpoint(epoch, settings, &history)?;
        }
    }
    Ok(history.into_value())
}
