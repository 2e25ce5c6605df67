//! Distributed autograd's wire types: the envelope calls and responses
//! carry inside a context (a field of the call, named `dist_autograd`),
//! and its two requests, gradients for a send record and context cleanup.

use serde::{Deserialize, Serialize};

use crate::abi::Value;
use crate::agent::{CallContext, Field};
use crate::error::{Error, Result};
use crate::transport::MessageKind;

/// The name of distributed autograd's fields.
pub(crate) const FEATURE: &str = "dist_autograd";

/// Gradients flowing back to a sender during distributed backward.
pub const PROPAGATE_GRADIENTS: MessageKind = MessageKind::new("PropagateGradients");
/// Release distributed autograd contexts (a batch of them, DA-8).
pub const CLEANUP_AUTOGRAD_CONTEXT: MessageKind = MessageKind::new("CleanupAutogradContext");

/// The kinds distributed autograd serves.
pub(crate) const KINDS: &[MessageKind] = &[PROPAGATE_GRADIENTS, CLEANUP_AUTOGRAD_CONTEXT];

/// The distributed-autograd envelope carried by calls and responses made
/// inside an autograd context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutogradEnvelope {
    /// The distributed autograd context.
    pub context_id: i64,
    /// The send/recv pair this message belongs to.
    pub message_id: i64,
    /// The sender's rank.
    pub from_worker: u32,
}

impl AutogradEnvelope {
    /// The envelope as a field's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        // Invariant: three integers always encode.
        crate::abi::encode(self).unwrap_or_default()
    }

    /// The envelope of a field's bytes.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        crate::abi::decode(bytes)
            .map_err(|e| Error::runtime(format!("malformed autograd envelope: {e}")))
    }

    /// The envelope as a field to send with a call
    /// ([`CallOptions::fields`](crate::CallOptions)).
    pub fn field(&self) -> Field {
        Field {
            feature: FEATURE.to_string(),
            bytes: self.encode(),
        }
    }

    /// The envelope a served call came with, when it was made inside an
    /// autograd context.
    pub fn of(ctx: &CallContext) -> Option<Self> {
        ctx.field(FEATURE).and_then(|b| Self::decode(b).ok())
    }
}

/// A request of distributed autograd.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AutogradMessage {
    /// [`PROPAGATE_GRADIENTS`].
    PropagateGradients {
        /// Which send function the gradients are for.
        envelope: AutogradEnvelope,
        /// The gradients (tensors in the frame's table).
        grads: Vec<Value>,
        /// Whether to keep the graph.
        retain_graph: bool,
    },
    /// [`CLEANUP_AUTOGRAD_CONTEXT`]: the contexts the sender released, in
    /// the order it released them (one request carries every release of a
    /// short window, DA-8).
    CleanupAutogradContext {
        /// The contexts.
        context_ids: Vec<i64>,
    },
}

impl AutogradMessage {
    /// The message's kind.
    pub fn kind(&self) -> MessageKind {
        match self {
            AutogradMessage::PropagateGradients { .. } => PROPAGATE_GRADIENTS,
            AutogradMessage::CleanupAutogradContext { .. } => CLEANUP_AUTOGRAD_CONTEXT,
        }
    }

    /// The request's body ([`RpcAgent::request`](crate::RpcAgent::request)).
    ///
    /// # Errors
    /// Gradients whose values do not encode.
    pub fn encode(&self) -> Result<Vec<u8>> {
        crate::abi::encode(self)
            .map_err(|e| Error::runtime(format!("cannot encode {}: {e}", self.kind())))
    }
}
