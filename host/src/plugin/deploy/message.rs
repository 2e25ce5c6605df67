//! Plugin deployment's wire type: the [`DEPLOY_PLUGIN`] request.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::transport::MessageKind;

/// The request that installs a wasm plugin on the receiving worker and
/// registers its functions, answered with `(already_served: bool, names:
/// [str])`.
pub const DEPLOY_PLUGIN: MessageKind = MessageKind::new("DeployPlugin");

/// A [`DEPLOY_PLUGIN`] request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployPlugin {
    /// The plugin's name (from its manifest), for messages.
    pub name: String,
    /// The sha256 of `wasm`: the plugin's identity (content-addressed).
    pub sha256: [u8; 32],
    /// The module's bytes.
    pub wasm: Vec<u8>,
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
