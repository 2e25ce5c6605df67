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
    /// Whether it already served this exact plugin as its current version
    /// (nothing was loaded).
    pub already_served: bool,
    /// Whether it made the version current (the commit reached it).
    pub committed: bool,
}

/// The outcome of [`Deploy::deploy_plugin`](crate::Deploy::deploy_plugin) (or of a
/// [`rollback`](crate::Deploy::rollback_plugin)): the version and one
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
    /// Whether the commit was sent: every worker staged the version.
    /// When one refused, nobody committed and the staged versions were
    /// dropped (the group stays on its current version).
    pub committed: bool,
    /// What each worker did.
    pub workers: Vec<WorkerDeployment>,
}

impl DeployReport {
    /// Whether every worker serves the version as its current one.
    pub fn is_complete(&self) -> bool {
        self.committed && self.workers.iter().all(|w| w.result.is_ok() && w.committed)
    }

    /// The workers that do not serve the plugin, with why.
    pub fn failures(&self) -> impl Iterator<Item = (&WorkerInfo, &Error)> {
        self.workers
            .iter()
            .filter_map(|w| w.result.as_ref().err().map(|e| (&w.worker, e)))
    }

    /// `Ok` if every worker serves the version as its current one.
    ///
    /// # Errors
    /// A `RuntimeError` naming every worker that does not, with its error,
    /// and saying whether the group stayed on its old version.
    pub fn check(&self) -> Result<()> {
        let failed: Vec<String> = self
            .failures()
            .map(|(w, e)| format!("{}: {}", w.name, e.message()))
            .collect();
        if failed.is_empty() && self.is_complete() {
            return Ok(());
        }
        let short = &self.sha256[..self.sha256.len().min(16)];
        if self.committed {
            Err(Error::runtime(format!(
                "plugin {} (sha256 {short}) was not deployed to {} of {} workers: {}",
                self.plugin,
                failed.len(),
                self.workers.len(),
                failed.join("; ")
            )))
        } else {
            Err(Error::runtime(format!(
                "plugin {} (sha256 {short}) was not deployed: {} of {} workers refused it, so \
                 none made it current (the group stays on its current version): {}",
                self.plugin,
                failed.len(),
                self.workers.len(),
                failed.join("; ")
            )))
        }
    }
}
