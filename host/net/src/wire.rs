//! The handshake's messages as they travel, public so that tests can play
//! a hostile peer byte by byte (see the crate docs for the exchange).

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::binding::Identity;
use crate::error::{Refusal, RefusalKind};
use crate::message::{MAX_HANDSHAKE, frame};

/// The handshake's version; a side refuses any other.
pub const VERSION: u32 = 1;

/// The dialer's first message (after its protocol's magic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`VERSION`].
    pub version: u32,
    /// Whether the dialer holds a cluster secret.
    pub has_secret: bool,
    /// Who the dialer claims to be.
    pub identity: Identity,
    /// The dialer's fresh nonce.
    pub nonce: [u8; 32],
}

/// The acceptor's answer (after its protocol's magic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// [`VERSION`].
    pub version: u32,
    /// Whether the acceptor holds a cluster secret.
    pub has_secret: bool,
    /// Who the acceptor claims to be.
    pub identity: Identity,
    /// The acceptor's fresh nonce.
    pub nonce: [u8; 32],
    /// The acceptor's MAC over the transcript (zero without a secret).
    pub mac: [u8; 32],
}

/// The dialer's proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proof {
    /// The dialer's MAC over the transcript (zero without a secret).
    pub mac: [u8; 32],
}

/// The acceptor's last message, sent only after the dialer's proof checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admitted {
    /// The caller's opaque extension (the agent's shared-memory offer).
    pub extension: Vec<u8>,
    /// The acceptor's MAC over the transcript and the extension (zero
    /// without a secret).
    pub mac: [u8; 32],
}

/// `msg` as it travels: its `u16` length, then its postcard bytes.
///
/// # Errors
/// [`RefusalKind::Malformed`] if it does not encode, and
/// [`RefusalKind::Oversized`] if it is over [`MAX_HANDSHAKE`] bytes.
pub fn encode<T: Serialize>(msg: &T, what: &str) -> Result<Vec<u8>, Refusal> {
    let body = postcard::to_allocvec(msg).map_err(|e| {
        Refusal::new(
            RefusalKind::Malformed,
            format!("the {what} does not encode: {e}"),
        )
    })?;
    frame(&body, MAX_HANDSHAKE, what)
}

/// Decodes a message body `what` (without its length).
///
/// # Errors
/// [`RefusalKind::Malformed`] if it does not decode.
pub fn decode<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T, Refusal> {
    postcard::from_bytes(body)
        .map_err(|e| Refusal::new(RefusalKind::Malformed, format!("malformed {what}: {e}")))
}
