//! [`TcpOptions`]: how the members of a `tcp` group listen and prove
//! themselves to each other, from the caller or the environment.

use std::sync::Arc;

use wasmrpc_credentials::TlsCredentials;

use super::{HOST_ENV, INSECURE_ENV};
use crate::error::{Error, Result};

/// How the members of a `tcp` group listen and prove themselves to each
/// other.
#[derive(Clone, Default)]
pub struct TcpOptions {
    /// The address to listen on (`127.0.0.1` when `None`).
    pub host: Option<String>,
    /// The cluster secret every member must hold: each connection opens
    /// with a mutual HMAC-SHA256 proof of it (see the crate's handshake).
    pub secret: Option<Arc<[u8]>>,
    /// TLS credentials: every connection is TLS 1.3 with mutual
    /// authentication, and a peer's certificate must name the worker
    /// published for its rank.
    pub tls: Option<TlsCredentials>,
    /// Allow a non-loopback address without credentials.
    pub insecure: bool,
    /// How long a member may send nothing (no frame, no heartbeat) before
    /// the others fail its collectives at once, with "rank 2 failed: no
    /// heartbeat for 2.0 s", instead of waiting for the group's timeout
    /// (`wasmrpc_net::liveness`). `None`: no heartbeats.
    pub failure_timeout: Option<std::time::Duration>,
}

impl std::fmt::Debug for TcpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOptions")
            .field("host", &self.host)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("tls", &self.tls.as_ref().map(|_| "<set>"))
            .field("insecure", &self.insecure)
            .field("failure_timeout", &self.failure_timeout)
            .finish()
    }
}

impl TcpOptions {
    /// From the environment, as the agent takes its credentials:
    /// [`HOST_ENV`], the TLS variables of
    /// [`TlsCredentials::from_env`], [`SECRET_ENV`] (else
    /// [`SECRET_FILE_ENV`]), [`INSECURE_ENV`], and [`FAILURE_TIMEOUT_ENV`]
    /// (seconds; 0 for no heartbeats; 2 s when unset).
    ///
    /// # Errors
    /// [`Error::Runtime`] for credentials that cannot be read or used (a
    /// file that group or others may read, PEM that does not parse).
    pub fn from_env() -> Result<TcpOptions> {
        let credentials = |e: wasmrpc_credentials::Error| Error::Runtime(e.to_string());
        Ok(TcpOptions {
            host: std::env::var(HOST_ENV).ok().filter(|h| !h.is_empty()),
            secret: wasmrpc_credentials::secret::secret_from_env()
                .map_err(credentials)?
                .map(Arc::from),
            tls: TlsCredentials::from_env().map_err(credentials)?,
            insecure: std::env::var(INSECURE_ENV).is_ok_and(|v| v == "1"),
            failure_timeout: failure_timeout_from_env()?,
        })
    }
}

/// The variable that sets the `tcp` backend's failure window, in seconds
/// ([`TcpOptions::failure_timeout`]).
pub const FAILURE_TIMEOUT_ENV: &str = "WASMRPC_C10D_FAILURE_TIMEOUT";

fn failure_timeout_from_env() -> Result<Option<std::time::Duration>> {
    let Ok(text) = std::env::var(FAILURE_TIMEOUT_ENV) else {
        return Ok(Some(wasmrpc_net::liveness::DEFAULT_FAILURE_TIMEOUT));
    };
    let window = text
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            Error::Runtime(format!(
                "{FAILURE_TIMEOUT_ENV}={text:?} is not a number of seconds"
            ))
        })?;
    Ok((!window.is_zero()).then_some(window))
}
