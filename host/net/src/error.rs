//! Why a handshake or a message failed.

/// What kind of failure a [`Refusal`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// Reading or writing failed, or the peer closed the connection.
    Io,
    /// The peer did not complete in time.
    TimedOut,
    /// The peer's first bytes are not this protocol's magic.
    NotAPeer,
    /// The peer speaks another version of the handshake.
    Version,
    /// A message is over the size limit.
    Oversized,
    /// A message does not decode, or claims what it may not.
    Malformed,
    /// One side holds a cluster secret and the other does not.
    SecretMismatch,
    /// A MAC did not check: the peer does not hold the same secret, or
    /// replayed a proof made for another connection or binding.
    BadProof,
}

/// Why a connection was refused: its kind and a message naming the peer
/// (as it claimed to be) or the stage that failed. Never holds a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    kind: RefusalKind,
    message: String,
}

impl Refusal {
    /// A refusal of `kind` saying `message`.
    pub fn new(kind: RefusalKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> RefusalKind {
        self.kind
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message, owned.
    pub fn into_message(self) -> String {
        self.message
    }
}
