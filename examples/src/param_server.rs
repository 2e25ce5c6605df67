//! The parameter server (PyTorch's "Implementing a Parameter Server Using
//! Distributed RPC Framework") on scikit-learn's digits: the
//! `param_server` plugin (`plugins/param-server`).
//!
//! [`train`] runs the plugin's driver (`param_server::run`) on a local
//! cluster: the parameter server on worker0, trainers on worker1..; see
//! the plugin's docs for how trainers train (forward by RPC in a
//! distributed autograd context, backward, `DistributedOptimizer` step).

use anyhow::{Context, Result, ensure};
use wasmrpc::wasm::FolderGrant;
use wasmrpc::{Args, Payload};

/// The folder of the digits (`examples/data`), granted to the plugin
/// read-only at `/data`, where it reads them.
///
/// # Errors
/// Never for this fixed spec; kept fallible as the parser is.
pub fn data_grant() -> Result<FolderGrant> {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/data");
    FolderGrant::parse(&format!("param_server:/data={data}:ro"))
        .map_err(|e| anyhow::anyhow!(e.message))
}

/// The data set as the plugin sees it.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Training images.
    pub train: i64,
    /// Held-out images.
    pub test: i64,
    /// Images per digit 0..9.
    pub per_class: Vec<i64>,
}

/// The model's held-out loss and accuracy.
#[derive(Debug, Clone, Copy)]
pub struct Evaluation {
    /// Mean cross-entropy.
    pub loss: f64,
    /// Fraction of the held-out images classified right.
    pub accuracy: f64,
}

/// Starts a parameter server and one more worker; reads the data set's
/// summary, initialises an MLP with `hidden` units on the parameter server
/// and evaluates it from worker1.
///
/// # Errors
/// A cluster that does not start, or a failing call.
pub async fn untrained(hidden: i64, seed: i64) -> Result<(Summary, Evaluation)> {
    let cluster = crate::Cluster::start_with_folders(
        2,
        &[wasmrpc_plugins::PARAM_SERVER],
        std::time::Duration::from_secs(60),
        vec![data_grant()?],
    )
    .await?;
    let outcome = async {
        let s = cluster.run("param_server::summary", Args::new()).await?;
        let s = s.items().context("summary returns a tuple")?;
        ensure!(s.len() == 3, "summary returned {} items", s.len());
        let summary = Summary {
            train: s[0].as_int()?,
            test: s[1].as_int()?,
            per_class: s[2]
                .items()?
                .iter()
                .map(|c| c.as_int().map_err(anyhow::Error::from))
                .collect::<Result<_>>()?,
        };
        cluster
            .run("param_server::init", Args::new().arg(hidden).arg(seed))
            .await?;
        let e = cluster
            .call_on(
                "worker1",
                "param_server::evaluate",
                Args::new().arg("worker0"),
            )
            .await?;
        let e = e.items().context("evaluate returns a tuple")?;
        ensure!(e.len() == 2, "evaluate returned {} items", e.len());
        Ok((
            summary,
            Evaluation {
                loss: e[0].as_float()?,
                accuracy: e[1].as_float()?,
            },
        ))
    }
    .await;
    let stopped = cluster.shutdown().await;
    let outcome = outcome?;
    stopped?;
    Ok(outcome)
}

/// How a training run is set up; `None` takes the plugin's default
/// (`param_server::run`'s docs).
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Trainers (worker1..; worker0 is the parameter server).
    pub trainers: u32,
    /// Passes over the training images.
    pub epochs: u32,
    /// Images per SGD step.
    pub batch_size: Option<u32>,
    /// SGD step size.
    pub lr: Option<f64>,
    /// Hidden units of the MLP.
    pub hidden: Option<u32>,
    /// Seed of the initial parameters.
    pub seed: Option<u32>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            trainers: 3,
            epochs: 10,
            batch_size: None,
            lr: None,
            hidden: None,
            seed: None,
        }
    }
}

/// Per-epoch results of a training run.
#[derive(Debug, Clone)]
pub struct History {
    /// Mean training loss of the epoch's batches, averaged over trainers.
    pub train_loss: Vec<f64>,
    /// Held-out loss after each epoch.
    pub test_loss: Vec<f64>,
    /// Held-out accuracy after each epoch.
    pub accuracy: Vec<f64>,
}

/// Trains on a local cluster of `trainers + 1` workers.
///
/// # Errors
/// A cluster that does not start, or a failing call.
pub async fn train(config: Config) -> Result<History> {
    let optional = |v: Option<u32>| v.map_or_else(Payload::none, |v| Payload::from(i64::from(v)));
    let args = Args::new()
        .arg(i64::from(config.trainers))
        .arg(i64::from(config.epochs))
        .arg(optional(config.batch_size))
        .arg(config.lr.map_or_else(Payload::none, Payload::from))
        .arg(optional(config.hidden))
        .arg(optional(config.seed));
    let result = crate::run_on_cluster(
        config.trainers + 1,
        &[wasmrpc_plugins::PARAM_SERVER],
        vec![data_grant()?],
        "param_server::run",
        args,
    )
    .await?;
    let column = |name: &str| -> Result<Vec<f64>> {
        let list = result
            .get(name)?
            .with_context(|| format!("param_server::run returned no {name}"))?;
        crate::floats(&list)
    };
    Ok(History {
        train_loss: column("train_loss")?,
        test_loss: column("test_loss")?,
        accuracy: column("accuracy")?,
    })
}
