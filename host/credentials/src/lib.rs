//! What a wasmrpc worker authenticates its connections with, and where it
//! gets it: the operator, never the store.
//!
//! - [`TlsCredentials`]: the cluster CA's certificate, this worker's
//!   certificate (which **names the worker**, see [`worker_dns_name`]) and
//!   its private key; [`TlsEndpoints`] turns them into a TLS 1.3 acceptor
//!   and connector with mutual authentication, whose [`TlsStream`] splits
//!   into halves that need no lock between them.
//! - [`CertificateAuthority`]: a cluster CA that issues worker
//!   certificates (`wasmrpc cert init` / `cert issue`, and the ephemeral CA
//!   of `wasmrpc launch`).
//! - [`secret`]: the cluster secret read from a private file or the
//!   environment.
//!
//! Both the agent's transport (`wasmrpc`) and the `tcp` process-group
//! backend (`wasmrpc-c10d`) authenticate with these, so a worker needs one
//! set of credentials for all its connections. This crate owns the
//! credentials and the TLS configuration; what runs over a connection, and
//! which name a peer must prove, is the caller's.
//!
//! Nothing here prints a key or a secret: `Debug` output redacts them and
//! error messages name files and parts, never their content.

mod authority;
pub mod secret;
mod tls;

pub use authority::CertificateAuthority;
pub use tls::{
    SocketReader, SocketReaderFn, TLS_CA_ENV, TLS_CA_PEM_ENV, TLS_CERT_ENV, TLS_CERT_PEM_ENV,
    TLS_KEY_ENV, TLS_KEY_PEM_ENV, TlsCredentials, TlsEndpoints, TlsReadHalf, TlsStream,
    TlsWriteHalf, check_names, check_peer_names, probe_client_config, worker_dns_name,
    worker_server_name,
};

/// Why credentials could not be read or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// What the operator gave is unusable: a file that cannot be read or
    /// that others may read, PEM that does not parse, a key that does not
    /// go with its certificate, a certificate of another CA or name.
    #[error("{0}")]
    Invalid(String),
    /// An operation failed: key generation, signing, a TLS handshake, or a
    /// peer's certificate that names someone else.
    #[error("{0}")]
    Failed(String),
}

impl Error {
    /// The message, without the kind.
    pub fn message(&self) -> &str {
        match self {
            Error::Invalid(m) | Error::Failed(m) => m,
        }
    }
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, Error>;
