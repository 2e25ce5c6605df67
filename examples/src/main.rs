//! `wasmrpc-examples`: runs one of the examples on a local cluster in this
//! process and prints what it measured (see the crate docs and the guide's
//! "Examples" chapter, `docs/src/using/examples.md`).

use anyhow::Result;
use clap::{Parser, Subcommand};
use wasmrpc_examples::{param_server, pipeline, rl};

#[derive(Parser, Debug)]
#[command(about = "Runs wasmrpc's examples (PyTorch's RPC tutorials) on a local cluster")]
struct Cli {
    #[command(subcommand)]
    example: Example,
}

#[derive(Subcommand, Debug)]
enum Example {
    /// RL actor-learner on CartPole (REINFORCE): an agent and observers;
    /// by default the agent batches the observers' action requests with an
    /// async_execution function. `--compare` runs both modes.
    Rl {
        /// Observers (worker1..); worker0 is the agent.
        #[arg(long, default_value_t = 3)]
        observers: u32,
        /// Rounds of play, each followed by one policy update.
        #[arg(long, default_value_t = 40)]
        iterations: u32,
        /// Steps each observer plays per round.
        #[arg(long, default_value_t = 200)]
        steps: u32,
        /// REINFORCE step size.
        #[arg(long, default_value_t = 0.01)]
        lr: f64,
        /// Answer each request on its own instead of in batches.
        #[arg(long, conflicts_with = "compare")]
        no_batch: bool,
        /// Run unbatched, then batched, and compare their speed.
        #[arg(long)]
        compare: bool,
    },
    /// Parameter server: worker0 holds an MLP, trainers (worker1..) train
    /// it on scikit-learn's digits; prints the held-out accuracy per epoch.
    ParamServer {
        /// Trainers (worker1..); worker0 is the parameter server.
        #[arg(long, default_value_t = 3)]
        trainers: u32,
        /// Passes over the training images.
        #[arg(long, default_value_t = 10)]
        epochs: u32,
        /// Images per SGD step [default: the plugin's, 16].
        #[arg(long)]
        batch_size: Option<u32>,
        /// SGD step size [default: the plugin's, 0.1].
        #[arg(long)]
        lr: Option<f64>,
        /// Hidden units of the MLP [default: the plugin's, 32].
        #[arg(long)]
        hidden: Option<u32>,
    },
    /// Pipeline parallelism: an MLP split over worker1 and worker2, driven
    /// from worker0; trains with micro-batches one after another, then
    /// pipelined, and compares the times.
    Pipeline {
        /// Micro-batches per step.
        #[arg(long, default_value_t = 8)]
        micro_batches: u32,
        /// Samples per micro-batch.
        #[arg(long, default_value_t = 32)]
        micro_batch_size: u32,
        /// SGD steps.
        #[arg(long, default_value_t = 30)]
        steps: u32,
        /// Hidden units.
        #[arg(long, default_value_t = 256)]
        hidden: u32,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().example {
        Example::Rl {
            observers,
            iterations,
            steps,
            lr,
            no_batch,
            compare,
        } => {
            let modes: &[bool] = if compare {
                &[false, true]
            } else if no_batch {
                &[false]
            } else {
                &[true]
            };
            let mut times = Vec::new();
            for &batch in modes {
                let config = rl::Config {
                    observers,
                    iterations,
                    steps,
                    lr,
                    batch,
                };
                let out = rl::run(config).await?;
                println!(
                    "rl ({}): {observers} observers, {iterations} rounds of {steps} steps: \
                     average return {:.1} in the first quarter of rounds, {:.1} in the last; \
                     {} requests answered in {} policy passes; {:.2} s",
                    if batch { "batched" } else { "unbatched" },
                    out.quarter_mean(true),
                    out.quarter_mean(false),
                    out.requests,
                    out.batches,
                    out.elapsed.as_secs_f64()
                );
                times.push(out.elapsed.as_secs_f64());
            }
            if let [unbatched, batched] = times[..] {
                println!(
                    "rl: batching took {:.2}x the unbatched time",
                    batched / unbatched
                );
            }
        }
        Example::ParamServer {
            trainers,
            epochs,
            batch_size,
            lr,
            hidden,
        } => {
            let config = param_server::Config {
                trainers,
                epochs,
                batch_size,
                lr,
                hidden,
                ..param_server::Config::default()
            };
            let started = std::time::Instant::now();
            let history = param_server::train(config).await?;
            for (epoch, ((train, test), acc)) in history
                .train_loss
                .iter()
                .zip(&history.test_loss)
                .zip(&history.accuracy)
                .enumerate()
            {
                println!(
                    "epoch {:>2}: train loss {train:.3}, held-out loss {test:.3}, held-out accuracy {acc:.3}",
                    epoch + 1
                );
            }
            println!(
                "param-server: {trainers} trainers, {epochs} epochs in {:.2} s; held-out accuracy {:.3}",
                started.elapsed().as_secs_f64(),
                history.accuracy.last().copied().unwrap_or(f64::NAN)
            );
        }
        Example::Pipeline {
            micro_batches,
            micro_batch_size,
            steps,
            hidden,
        } => {
            let mut times = Vec::new();
            for pipelined in [false, true] {
                let config = pipeline::Config {
                    micro_batches,
                    micro_batch_size,
                    steps,
                    hidden,
                    pipelined,
                    ..pipeline::Config::default()
                };
                let out = pipeline::run(config).await?;
                println!(
                    "pipeline ({}): {steps} steps of {micro_batches} micro-batches of \
                     {micro_batch_size}: loss {:.3} -> {:.3}; {:.2} s",
                    if pipelined { "pipelined" } else { "sequential" },
                    out.losses.first().copied().unwrap_or(f64::NAN),
                    out.losses.last().copied().unwrap_or(f64::NAN),
                    out.elapsed.as_secs_f64()
                );
                times.push(out.elapsed.as_secs_f64());
            }
            if let [sequential, pipelined] = times[..] {
                println!(
                    "pipeline: speed-up of pipelining {:.2}x",
                    sequential / pipelined
                );
            }
        }
    }
    Ok(())
}
