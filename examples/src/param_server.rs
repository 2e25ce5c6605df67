//! The parameter server (PyTorch's "Implementing a Parameter Server Using
//! Distributed RPC Framework") on scikit-learn's digits: the
//! `param_server` plugin (`plugins/param-server`).
//!
//! Today this runs the parts that exist: the data set compiled into the
//! plugin, the model's parameters on the parameter server (worker0), and
//! the evaluation of the (untrained) model on the held-out images from
//! another worker. Training needs guest autograd (not in the SDK yet).

use anyhow::{Context, Result, ensure};
use wasmrpc::Args;

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
    let cluster = crate::Cluster::start(
        2,
        &[wasmrpc_plugins::PARAM_SERVER],
        std::time::Duration::from_secs(60),
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
