//! The RRef protocol's wire types: ids ([`GloballyUniqueId`]) and the
//! requests between users and owners ([`RRefMessage`]), each answered with
//! an empty response (PyTorch's `RRefAck`).

use serde::{Deserialize, Serialize};

use crate::transport::MessageKind;

/// An RRef or fork id: the worker that created it and a local counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GloballyUniqueId {
    /// The rank that created the id.
    pub created_on: u32,
    /// A counter local to that worker.
    pub local_id: u64,
}

impl std::fmt::Display for GloballyUniqueId {
    /// PyTorch's form: `GloballyUniqueId(created_on=0, local_id=1)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GloballyUniqueId(created_on={}, local_id={})",
            self.created_on, self.local_id
        )
    }
}

/// A user forked an RRef to a new user: the new user asks the owner to
/// count its fork (`RREF_FORK_REQUEST`).
pub const RREF_FORK: MessageKind = MessageKind::new("RRefFork");
/// The owner knows a fork: its user tells the parent that sent it
/// (`RREF_CHILD_ACCEPT`).
pub const RREF_CHILD_ACCEPT: MessageKind = MessageKind::new("RRefChildAccept");
/// A user RRef was deleted: its fork leaves the owner's count
/// (`RREF_USER_DELETE`).
pub const RREF_USER_DELETE: MessageKind = MessageKind::new("RRefUserDelete");

/// The kinds the RRef feature serves.
pub(crate) const KINDS: &[MessageKind] = &[RREF_FORK, RREF_CHILD_ACCEPT, RREF_USER_DELETE];

/// A request of the RRef protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RRefMessage {
    /// [`RREF_FORK`].
    Fork {
        /// The RRef.
        rref_id: GloballyUniqueId,
        /// The new fork.
        fork_id: GloballyUniqueId,
    },
    /// [`RREF_CHILD_ACCEPT`].
    ChildAccept {
        /// The fork being accepted.
        fork_id: GloballyUniqueId,
    },
    /// [`RREF_USER_DELETE`].
    UserDelete {
        /// The RRef.
        rref_id: GloballyUniqueId,
        /// The user's fork.
        fork_id: GloballyUniqueId,
    },
}

impl RRefMessage {
    /// The message's kind.
    pub fn kind(&self) -> MessageKind {
        match self {
            RRefMessage::Fork { .. } => RREF_FORK,
            RRefMessage::ChildAccept { .. } => RREF_CHILD_ACCEPT,
            RRefMessage::UserDelete { .. } => RREF_USER_DELETE,
        }
    }

    /// The request's body ([`RpcAgent::request`](crate::RpcAgent::request)).
    pub fn encode(&self) -> Vec<u8> {
        // Invariant: three variants of plain ids always encode.
        crate::abi::encode(self).unwrap_or_default()
    }
}
