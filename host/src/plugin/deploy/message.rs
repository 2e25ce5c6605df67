//! Plugin deployment's wire types: the [`DEPLOY_PLUGIN`] request (a
//! deployment's first phase, or a one-shot deployment) and the
//! [`PLUGIN_SWITCH`] request (its second phase, an abort, a rollback).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::transport::MessageKind;

/// The request that installs a wasm plugin on the receiving worker:
/// stages it (loaded, compiled, checked, not yet what its names call), or
/// with `stage` false also makes it current at once. Answered with
/// `(already_served: bool, names: [str])`.
pub const DEPLOY_PLUGIN: MessageKind = MessageKind::new("DeployPlugin");

/// The request that makes a version the worker holds current (a commit,
/// or a rollback) or drops a staged one (an abort).
pub const PLUGIN_SWITCH: MessageKind = MessageKind::new("PluginSwitch");

/// A [`DEPLOY_PLUGIN`] request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployPlugin {
    /// The plugin's name (from its manifest), for messages.
    pub name: String,
    /// The sha256 of `wasm`: the plugin's identity (content-addressed).
    pub sha256: [u8; 32],
    /// The module's bytes.
    pub wasm: Vec<u8>,
    /// Only stage it: a [`PLUGIN_SWITCH`] commit makes it current.
    pub stage: bool,
}

/// A [`PLUGIN_SWITCH`] request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginSwitch {
    /// The plugin's namespace (`hello`).
    pub namespace: String,
    /// The version's sha256.
    pub sha256: [u8; 32],
    /// Commit (make it current) or abort (drop it if staged).
    pub commit: bool,
}

impl DeployPlugin {
    /// The request's body.
    ///
    /// # Errors
    /// Never for a plugin that fits in memory; an encoding failure otherwise.
    pub fn encode(&self) -> Result<Vec<u8>> {
        crate::abi::encode(self)
            .map_err(|e| Error::runtime(format!("cannot encode plugin {}: {e}", self.name)))
    }
}

impl PluginSwitch {
    /// The request's body.
    ///
    /// # Errors
    /// An encoding failure.
    pub fn encode(&self) -> Result<Vec<u8>> {
        crate::abi::encode(self).map_err(|e| {
            Error::runtime(format!(
                "cannot encode a switch of plugin {}: {e}",
                self.namespace
            ))
        })
    }
}
