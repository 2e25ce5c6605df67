//! TLS in the agent's transport. The credentials, the CA and the TLS
//! configuration are `wasmrpc-credentials`' (shared with the `tcp`
//! process-group backend); the rules TLS-1 to TLS-3 are stated there. What
//! this module adds is the agent's side of TLS-3: after TLS, the name a
//! dialer announces in the agent's handshake (`wasmrpc_net::wire::Hello`) must be
//! one its certificate names (the accept task calls [`check_peer_names`]),
//! otherwise the connection is refused. And the probes tests use to play a
//! foreign TLS peer.

pub use wasmrpc_credentials::{
    CertificateAuthority, TLS_CA_ENV, TLS_CA_PEM_ENV, TLS_CERT_ENV, TLS_CERT_PEM_ENV, TLS_KEY_ENV,
    TLS_KEY_PEM_ENV, TlsCredentials, worker_dns_name,
};
pub(crate) use wasmrpc_credentials::{TlsEndpoints, check_peer_names};

use crate::error::{Error, Result};

impl From<wasmrpc_credentials::Error> for Error {
    fn from(e: wasmrpc_credentials::Error) -> Self {
        match e {
            wasmrpc_credentials::Error::Invalid(m) => Error::value(m),
            wasmrpc_credentials::Error::Failed(m) => Error::runtime(m),
        }
    }
}

/// How a test's foreign peer dials over TLS ([`probe_tls`]).
#[derive(Debug, Clone)]
pub struct TlsProbe {
    /// The CA the probe trusts for the acceptor's certificate (PEM).
    pub ca_pem: String,
    /// The certificate the probe presents, if any.
    pub client: Option<TlsCredentials>,
    /// The worker the probe expects to reach (its certificate must name it).
    pub server: String,
}

/// Dials `addr` over TLS as `tls` says and runs the dialer's handshake as
/// `name` with `secret`; returns the stream, on which the acceptor now
/// expects frames. Tests use it to play a misbehaving TLS peer.
///
/// # Errors
/// Fails if the connection, TLS, or the handshake fails.
pub async fn connect_tls(
    addr: std::net::SocketAddr,
    tls: &TlsProbe,
    secret: &[u8],
    name: &str,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let connector = wasmrpc_credentials::probe_client_config(&tls.ca_pem, tls.client.as_ref())?;
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| Error::runtime(format!("cannot connect to {addr}: {e}")))?;
    let mut stream = connector
        .connect(wasmrpc_credentials::worker_server_name(&tls.server)?, tcp)
        .await
        .map_err(|e| Error::runtime(format!("TLS with {addr} failed: {e}")))?;
    super::handshake::client(&mut stream, secret, name, u32::MAX).await?;
    Ok(stream)
}

/// [`connect_tls`], then waits up to `linger` for the acceptor to keep the
/// connection open: `Ok(())` only if the acceptor took the peer. Tests use
/// it to play peers with no, foreign or mislabelled certificates.
///
/// # Errors
/// Fails if the connection, TLS, or the handshake fails, or the acceptor
/// closes the connection after the handshake.
pub async fn probe_tls(
    addr: std::net::SocketAddr,
    tls: &TlsProbe,
    secret: &[u8],
    name: &str,
    linger: std::time::Duration,
) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut stream = connect_tls(addr, tls, secret, name).await?;
    let mut byte = [0u8; 1];
    match tokio::time::timeout(linger, stream.read(&mut byte)).await {
        Err(_) | Ok(Ok(1..)) => Ok(()),
        Ok(Ok(0)) => Err(Error::runtime(format!(
            "{addr} closed the connection after the handshake"
        ))),
        Ok(Err(e)) => Err(Error::runtime(format!(
            "{addr} refused the connection after the handshake: {e}"
        ))),
    }
}
