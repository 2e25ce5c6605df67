//! Pipeline parallelism (PyTorch's "Distributed Pipeline Parallelism Using
//! RPC"): the `pipeline` plugin (`plugins/pipeline`), an MLP split over two
//! stage workers, trained from a driver, with micro-batches pipelined or
//! one after another.

use std::time::{Duration, Instant};

use anyhow::Result;
use wasmrpc::Args;

/// How a run is set up.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Micro-batches per step.
    pub micro_batches: u32,
    /// Samples per micro-batch.
    pub micro_batch_size: u32,
    /// SGD steps.
    pub steps: u32,
    /// SGD step size.
    pub lr: f64,
    /// Hidden units (stage 1's outputs, stage 2's inputs).
    pub hidden: u32,
    /// Pipeline the micro-batches (else one after another).
    pub pipelined: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            micro_batches: 8,
            micro_batch_size: 32,
            steps: 30,
            lr: 2.0,
            hidden: 256,
            pipelined: true,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The loss of each step.
    pub losses: Vec<f64>,
    /// Wall time of the driver's call.
    pub elapsed: Duration,
}

/// Trains on a local cluster of 3 workers (driver, stage 1, stage 2).
///
/// # Errors
/// A cluster that does not start, or a failing call.
pub async fn run(config: Config) -> Result<Outcome> {
    let cluster =
        crate::Cluster::start(3, &[wasmrpc_plugins::PIPELINE], Duration::from_secs(120)).await?;
    let args = Args::new()
        .arg(i64::from(config.micro_batches))
        .arg(i64::from(config.micro_batch_size))
        .arg(i64::from(config.steps))
        .arg(config.lr)
        .arg(i64::from(config.hidden))
        .arg(config.pipelined);
    let started = Instant::now();
    let result = cluster.run("pipeline::run", args).await;
    let elapsed = started.elapsed();
    let stopped = cluster.shutdown().await;
    let losses = crate::floats(&result?)?;
    stopped?;
    Ok(Outcome { losses, elapsed })
}
