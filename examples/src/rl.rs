//! The RL actor-learner (PyTorch's "Getting Started with Distributed RPC
//! Framework") and its batched variant ("Implementing Batch RPC Processing
//! Using Asynchronous Executions"): the `rl` plugin (`plugins/rl`) on one
//! agent and N observers playing CartPole.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use wasmrpc::Args;

/// How a run is set up.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Observers (workers 1..=N; worker0 is the agent).
    pub observers: u32,
    /// Rounds of play followed by one policy update.
    pub iterations: u32,
    /// Steps each observer plays per round.
    pub steps: u32,
    /// The REINFORCE step size.
    pub lr: f64,
    /// Answer action requests in batches of all observers (the
    /// `async_execution` batching) instead of one by one.
    pub batch: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            observers: 3,
            iterations: 40,
            steps: 200,
            lr: 0.01,
            batch: true,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The average return of the episodes finished in each round.
    pub returns: Vec<f64>,
    /// How many times the agent ran its policy to answer requests.
    pub batches: i64,
    /// How many action requests the agent answered.
    pub requests: i64,
    /// Wall time of the driver's call.
    pub elapsed: Duration,
}

impl Outcome {
    /// The mean of the first (`first = true`) or last quarter of the
    /// rounds' average returns.
    pub fn quarter_mean(&self, first: bool) -> f64 {
        let k = (self.returns.len() / 4).max(1);
        let part = if first {
            &self.returns[..k.min(self.returns.len())]
        } else {
            &self.returns[self.returns.len().saturating_sub(k)..]
        };
        part.iter().sum::<f64>() / part.len().max(1) as f64
    }
}

/// Trains the policy on a local cluster of `observers + 1` workers.
///
/// # Errors
/// A cluster that does not start, or a failing call.
pub async fn run(config: Config) -> Result<Outcome> {
    ensure!(
        config.observers >= 1,
        "the example needs at least one observer"
    );
    let args = Args::new()
        .arg(i64::from(config.observers))
        .arg(i64::from(config.iterations))
        .arg(i64::from(config.steps))
        .arg(config.lr)
        .arg(config.batch);
    let started = Instant::now();
    let result = crate::run_on_cluster(
        config.observers + 1,
        &[wasmrpc_plugins::RL],
        Vec::new(),
        "rl::run",
        args,
    )
    .await?;
    let elapsed = started.elapsed();
    let items = result.items().context("rl::run returns a tuple")?;
    ensure!(
        items.len() == 3,
        "rl::run returned {} items, not 3",
        items.len()
    );
    Ok(Outcome {
        returns: crate::floats(&items[0])?,
        batches: items[1].as_int()?,
        requests: items[2].as_int()?,
        elapsed,
    })
}
