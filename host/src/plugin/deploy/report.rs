//! What a deployment did: one [`WorkerDeployment`] per worker, in a
//! [`DeployReport`].

use crate::abi::WorkerInfo;
use crate::error::{Error, Result};

/// What one worker did with a deployment.
#[derive(Debug, Clone)]
pub struct WorkerDeployment {
    /// The worker.
    pub worker: WorkerInfo,
    /// The functions it now serves from the plugin, or why it does not.
    pub result: Result<Vec<String>>,
    /// Whether it already served this exact plugin (nothing was loaded).
    pub already_served: bool,
}

/// The outcome of [`Deploy::deploy_plugin`](crate::Deploy::deploy_plugin): the plugin and one
/// [`WorkerDeployment`] per worker, in the order the workers were given.
#[derive(Debug, Clone)]
pub struct DeployReport {
    /// The plugin's manifest name.
    pub plugin: String,
    /// The namespace its functions are served under.
    pub namespace: String,
    /// The plugin's version (from its manifest).
    pub version: String,
    /// The sha256 of its bytes, in hex: its identity.
    pub sha256: String,
    /// What each worker did.
    pub workers: Vec<WorkerDeployment>,
}

impl DeployReport {
    /// Whether every worker serves the plugin.
    pub fn is_complete(&self) -> bool {
        self.workers.iter().all(|w| w.result.is_ok())
    }

    /// The workers that do not serve the plugin, with why.
    pub fn failures(&self) -> impl Iterator<Item = (&WorkerInfo, &Error)> {
        self.workers
            .iter()
            .filter_map(|w| w.result.as_ref().err().map(|e| (&w.worker, e)))
    }

    /// `Ok` if every worker serves the plugin.
    ///
    /// # Errors
    /// A `RuntimeError` naming every worker that does not, with its error.
    pub fn check(&self) -> Result<()> {
        let failed: Vec<String> = self
            .failures()
            .map(|(w, e)| format!("{}: {}", w.name, e.message()))
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Error::runtime(format!(
                "plugin {} was not deployed to {} of {} workers: {}",
                self.plugin,
                failed.len(),
                self.workers.len(),
                failed.join("; ")
            )))
        }
    }
}
