//! The network layer every wasmrpc connection sits on: the agent's
//! transport (`wasmrpc::transport`) and the `tcp` process-group backend's
//! mesh (`wasmrpc-c10d`) both open their connections with it, so a fix to
//! authentication or to handshake framing is made here, once.
//!
//! It owns:
//! - [`random_bytes`] (every nonce, token and generated secret) and
//!   [`generate_secret`];
//! - the cluster-secret mutual authentication ([`dial`], [`accept`]):
//!   fresh nonces from both sides, a distinct label per direction,
//!   constant-time MAC checks, everything bound to a [`Binding`] (the
//!   [`Protocol`] and its context, e.g. the c10d group) and to the
//!   [`Identity`] each side claims, plus an opaque extension the acceptor
//!   sends only once the dialer proved itself (the agent's shared-memory
//!   offer);
//! - length-prefixed messages with a size limit and a timeout
//!   ([`read_message`], [`write_message`], [`Limits`]) and the handshake's
//!   wire messages ([`wire`]), which tests use to play a hostile peer;
//! - reading the frames of an open connection ([`frame`]: a prefix of the
//!   protocol's own, then the body it announces, with one set of rules for
//!   the end of the stream, the limit and the memory a declared length may
//!   reserve, FRAME-1 to FRAME-3);
//! - the liveness rules of a connection once it is open ([`liveness`]:
//!   when a heartbeat is due, when a peer is silent), which the agent's
//!   transport and the mesh both follow with heartbeat frames of their own.
//!
//! It must not touch: what a frame means once it is read (the agent's
//! headers, tensor storages, vectored writes, busy-poll and shared memory;
//! the mesh's tags and mailbox), admission control
//! and refusal logging (the agent's), which identity a caller expects of
//! its peer (the caller checks the [`Identity`] it gets back), and TLS and
//! the secret's source (`wasmrpc-credentials`). The plain-or-TLS stream
//! type stays with each caller: the agent splits it into a busy-polling
//! read half and a vectored write half on its hot path, the mesh into
//! boxed halves, and a shared enum would either add an indirection to the
//! agent's per-frame path or force the agent's halves on the mesh; both
//! already share the TLS stream itself (`wasmrpc_credentials::TlsStream`).
//! This is a crate of its own rather than part of `wasmrpc-credentials`
//! because that crate holds what the operator gives (keys, certificates,
//! the secret's file) and owns no protocol; this one owns a protocol and
//! no credential.
//!
//! # The handshake (version [`wire::VERSION`])
//! 1. The dialer sends its protocol's 4-byte magic, then
//!    `Hello { version, has_secret, identity_d, nonce_d }`.
//! 2. The acceptor answers the magic, then
//!    `Welcome { version, has_secret, identity_a, nonce_a, mac_a }` with
//!    `mac_a = HMAC-SHA256(secret, "wasmrpc-{protocol}-acceptor" | T)`.
//! 3. The dialer checks `mac_a` and sends `Proof { mac_d }` with
//!    `mac_d = HMAC-SHA256(secret, "wasmrpc-{protocol}-dialer" | T)`.
//! 4. The acceptor checks `mac_d` and sends `Admitted { extension, mac_x }`
//!    with `mac_x = HMAC-SHA256(secret, "wasmrpc-{protocol}-admitted" | T |
//!    extension)`; the dialer checks `mac_x`.
//!
//! `T`, the transcript, is the version, the protocol's name, the binding's
//! context, both nonces and both identities, each variable-length field
//! prefixed with its length. Every message after the magic is a `u16`
//! little-endian length and that many bytes of postcard, at most
//! [`MAX_HANDSHAKE`]; the whole exchange must end within the handshake's
//! timeout ([`HANDSHAKE_TIMEOUT`] unless the caller says otherwise).
//!
//! Without a secret a side sends zero MACs and checks none: the exchange
//! then only names both sides (an unauthenticated worker still learns its
//! peer's name and rank).
//!
//! # Invariants
//! - NET-1: nothing a peer sends can panic or hang a side: every message is
//!   read under the size limit and the timeout, and anything malformed is a
//!   [`Refusal`].
//! - NET-2: with a secret, a side returns a peer only after checking that
//!   peer's MAC over a transcript holding both fresh nonces; the checks are
//!   constant-time (`hmac`'s `verify_slice`).
//! - NET-3: a side with a secret refuses a side without one, and the
//!   reverse; both say which side lacks it.
//! - NET-4: a proof serves for one connection and one binding only: the
//!   transcript holds both nonces, the protocol, its context and both
//!   identities, and the labels differ by direction and by protocol (an
//!   agent proof is useless on the c10d mesh and the reverse).
//! - NET-5: the acceptor's extension is sent only after the dialer's proof
//!   checked, and (with a secret) is MACed with the transcript, so a dialer
//!   takes no extension a third party made.
//! - NET-6: a refusal names the peer's claimed identity or the stage that
//!   failed and never includes a secret or a MAC.

mod auth;
mod binding;
mod error;
pub mod frame;
pub mod liveness;
mod message;
mod random;
pub mod wire;

pub use auth::{Dialed, Handshake, accept, dial};
pub use binding::{Binding, Identity, Protocol};
pub use error::{Refusal, RefusalKind};
pub use message::{HANDSHAKE_TIMEOUT, Limits, MAX_HANDSHAKE, read_message, write_message};
pub use random::{generate_secret, random_bytes};

#[cfg(test)]
mod tests;
