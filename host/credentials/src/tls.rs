//! TLS 1.3 with mutual authentication, and the certificates that name
//! workers.
//!
//! Every worker holds the cluster CA's certificate and a certificate of its
//! own, signed by that CA, that **names the worker**: a DNS subject
//! alternative name [`worker_dns_name`] derived from the worker name (and
//! the name itself as the common name, for people). On a connection:
//!
//! - TLS-1: the acceptor requires a client certificate chaining to the
//!   cluster CA; a peer without one, or with one from another CA, fails the
//!   TLS handshake before any byte of the caller's protocol is read.
//! - TLS-2: the dialer verifies that the acceptor's certificate chains to
//!   the CA **and names the worker it meant to dial** (the server name it
//!   asks for is that worker's [`worker_dns_name`]).
//! - TLS-3: the acceptor learns who the dialer claims to be from the
//!   caller's own handshake and checks it with [`check_names`]: a worker
//!   cannot claim another's name.
//!
//! Only TLS 1.3 is offered, with the `ring` crypto provider. rustls runs
//! the handshake (`handshake`) and keeps the key schedule; once the
//! connection is established, the record layer is this crate's own
//! (`record`, `stream`: as kernel TLS would take it over, through rustls's
//! `kernel` API), so that a large tensor is opened in place in one read
//! buffer and each half of a [`TlsStream`] works without the other's lock.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::AsyncRead;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;

use crate::secret::check_private;
use crate::{Error, Result};

/// The environment variable naming the CA certificate file (PEM).
pub const TLS_CA_ENV: &str = "WASMRPC_TLS_CA";
/// The environment variable naming this worker's certificate file (PEM,
/// the chain from the worker's certificate up).
pub const TLS_CERT_ENV: &str = "WASMRPC_TLS_CERT";
/// The environment variable naming this worker's private key file (PEM,
/// readable by its owner only).
pub const TLS_KEY_ENV: &str = "WASMRPC_TLS_KEY";
/// `wasmrpc launch` hands each child its credentials in these variables as
/// PEM text (the environment is readable by the same user only), not as
/// file paths.
pub const TLS_CA_PEM_ENV: &str = "WASMRPC_TLS_CA_PEM";
/// See [`TLS_CA_PEM_ENV`].
pub const TLS_CERT_PEM_ENV: &str = "WASMRPC_TLS_CERT_PEM";
/// See [`TLS_CA_PEM_ENV`].
pub const TLS_KEY_PEM_ENV: &str = "WASMRPC_TLS_KEY_PEM";

/// The suffix of every worker's DNS name.
const DNS_SUFFIX: &str = "worker.wasmrpc";

/// The base32 alphabet of [`worker_dns_name`] (RFC 4648, lowercase).
const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

pub use stream::{TlsReadHalf, TlsStream, TlsWriteHalf};

/// The DNS name a worker's certificate carries: the worker name in
/// lowercase base32 (so case, `_` and `:`, which DNS names cannot tell
/// apart or hold, survive), split into labels of at most 63 characters,
/// then `.worker.wasmrpc`. Distinct worker names give distinct DNS names.
pub fn worker_dns_name(worker: &str) -> String {
    let mut encoded = String::new();
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &byte in worker.as_bytes() {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            encoded.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        encoded.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    let mut labels: Vec<&str> = Vec::new();
    let mut rest = encoded.as_str();
    while !rest.is_empty() {
        let (label, tail) = rest.split_at(rest.len().min(63));
        labels.push(label);
        rest = tail;
    }
    labels.push(DNS_SUFFIX);
    labels.join(".")
}

/// The worker name a [`worker_dns_name`] encodes, or `None` if `dns` is
/// not one.
fn worker_from_dns_name(dns: &str) -> Option<String> {
    let encoded = dns.strip_suffix(DNS_SUFFIX)?.strip_suffix('.')?;
    let (mut buffer, mut bits, mut out) = (0u32, 0u32, Vec::new());
    for c in encoded.bytes().filter(|&c| c != b'.') {
        let value = ALPHABET.iter().position(|&a| a == c)? as u32;
        buffer = (buffer << 5) | value;
        bits += 5;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
        }
    }
    String::from_utf8(out).ok()
}

fn server_name(worker: &str) -> Result<ServerName<'static>> {
    ServerName::try_from(worker_dns_name(worker)).map_err(|e| {
        Error::Invalid(format!(
            "worker name {worker} gives no valid certificate name: {e}"
        ))
    })
}

/// The credentials one worker authenticates its connections with: the
/// cluster CA's certificate, this worker's certificate chain and its
/// private key. Its `Debug` output never shows the key.
pub struct TlsCredentials {
    ca: Vec<CertificateDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for TlsCredentials {
    fn clone(&self) -> Self {
        TlsCredentials {
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl std::fmt::Debug for TlsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCredentials")
            .field("ca_certificates", &self.ca.len())
            .field("chain", &self.chain.len())
            .field("key", &"<redacted>")
            .finish()
    }
}

/// The `aws-lc-rs` provider with AES-128-GCM first: both ends are ours, so
/// the preference decides, and AES-128 encrypts large tensors about a
/// third faster than AES-256 with the same hardware support.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|suite| suite.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

fn pem_roots(pem: &str) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| Error::Invalid(format!("bad CA PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| Error::Invalid(format!("bad CA certificate: {e}")))?;
    }
    Ok(roots)
}

impl TlsCredentials {
    /// Credentials from PEM text: the CA certificate(s), this worker's
    /// certificate chain (its own certificate first), its private key.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a part holds no certificate or no key, or
    /// does not parse (the error names the part, never the key's content).
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let certs = |what: &str, pem: &str| -> Result<Vec<CertificateDer<'static>>> {
            let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::Invalid(format!("the {what} is not valid PEM: {e}")))?;
            if certs.is_empty() {
                return Err(Error::Invalid(format!("the {what} holds no certificate")));
            }
            Ok(certs)
        };
        let ca = certs("CA certificate", ca_pem)?;
        let chain = certs("worker certificate", cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| Error::Invalid(format!("the private key holds no usable PEM key: {e}")))?;
        let creds = TlsCredentials { ca, chain, key };
        // Fails early on a key that does not match or an unusable CA.
        creds.server_config()?;
        Ok(creds)
    }

    /// Credentials from PEM files. The key file must be readable by its
    /// owner only.
    ///
    /// # Errors
    /// A file that cannot be read, a key file that group or others may
    /// access, or as [`from_pem`](Self::from_pem); the error names the file.
    pub fn from_files(
        ca: impl AsRef<Path>,
        cert: impl AsRef<Path>,
        key: impl AsRef<Path>,
    ) -> Result<Self> {
        let read = |path: &Path| {
            std::fs::read_to_string(path)
                .map_err(|e| Error::Invalid(format!("cannot read {}: {e}", path.display())))
        };
        let (ca, cert, key) = (ca.as_ref(), cert.as_ref(), key.as_ref());
        check_private(key)?;
        let (ca_pem, cert_pem, key_pem) = (read(ca)?, read(cert)?, read(key)?);
        Self::from_pem(&ca_pem, &cert_pem, &key_pem).map_err(|e| {
            Error::Invalid(format!(
                "TLS credentials {}, {}, {}: {}",
                ca.display(),
                cert.display(),
                key.display(),
                e.message()
            ))
        })
    }

    /// Credentials from the environment, or `None` if it names none: the
    /// PEM text in [`TLS_CA_PEM_ENV`] and its siblings (as `wasmrpc launch`
    /// hands them to its workers), else the files named by [`TLS_CA_ENV`],
    /// [`TLS_CERT_ENV`] and [`TLS_KEY_ENV`] (as a Kubernetes secret mounts
    /// them).
    ///
    /// # Errors
    /// Some but not all of a set of variables are set, or as
    /// [`from_pem`](Self::from_pem) and [`from_files`](Self::from_files).
    pub fn from_env() -> Result<Option<Self>> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        for (set, is_pem) in [
            ([TLS_CA_PEM_ENV, TLS_CERT_PEM_ENV, TLS_KEY_PEM_ENV], true),
            ([TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV], false),
        ] {
            let values: Vec<Option<String>> = set.iter().map(|n| var(n)).collect();
            match values.as_slice() {
                [None, None, None] => continue,
                [Some(ca), Some(cert), Some(key)] => {
                    return if is_pem {
                        Self::from_pem(ca, cert, key).map(Some)
                    } else {
                        Self::from_files(ca, cert, key).map(Some)
                    };
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "set all of {} or none",
                        set.join(", ")
                    )));
                }
            }
        }
        Ok(None)
    }

    /// Checks that these credentials are worker `worker`'s: its certificate
    /// chains to the CA and names it.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the worker otherwise.
    pub fn check_worker(&self, worker: &str) -> Result<()> {
        let verifier = self.client_verifier()?;
        let (end, intermediates) = self
            .chain
            .split_first()
            .ok_or_else(|| Error::Invalid("the worker certificate chain is empty".into()))?;
        verifier
            .verify_client_cert(end, intermediates, rustls::pki_types::UnixTime::now())
            .map_err(|e| {
                Error::Invalid(format!(
                    "worker {worker}'s certificate is not signed by the cluster CA: {e}"
                ))
            })?;
        check_names(&self.chain, worker).map_err(|e| Error::Invalid(e.message().to_string()))
    }

    /// The worker these credentials name: the worker name their
    /// certificate's [`worker_dns_name`] encodes, confirmed by the same
    /// check a peer makes ([`check_names`]). Process-group members, which
    /// are told no worker name, publish it so peers know whom to expect.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the certificate names no worker (e.g. it was
    /// issued by another tool without a `*.worker.wasmrpc` name).
    pub fn worker_name(&self) -> Result<String> {
        let end = self
            .chain
            .first()
            .ok_or_else(|| Error::Invalid("the worker certificate chain is empty".into()))?;
        dns_names_in(end.as_ref())
            .into_iter()
            .filter_map(|dns| worker_from_dns_name(&dns))
            .find(|name| check_names(&self.chain, name).is_ok())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "the worker certificate names no worker (no DNS name ending in .{DNS_SUFFIX}; \
                     issue it with `wasmrpc cert issue NAME`)"
                ))
            })
    }

    fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        for cert in &self.ca {
            roots
                .add(cert.clone())
                .map_err(|e| Error::Invalid(format!("the CA certificate is not usable: {e}")))?;
        }
        Ok(Arc::new(roots))
    }

    fn client_verifier(&self) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>> {
        WebPkiClientVerifier::builder_with_provider(self.roots()?, provider())
            .build()
            .map_err(|e| Error::Invalid(format!("the CA certificate is not usable: {e}")))
    }

    /// The acceptor's configuration. The record layer after the handshake
    /// is `stream`'s, so rustls hands over its keys (secret extraction),
    /// and sends no session tickets (nothing resumes).
    fn server_config(&self) -> Result<ServerConfig> {
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Failed(format!("TLS set-up failed: {e}")))?
            .with_client_cert_verifier(self.client_verifier()?)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| {
                Error::Invalid(format!(
                    "the worker certificate and private key do not go together: {e}"
                ))
            })?;
        config.enable_secret_extraction = true;
        config.send_tls13_tickets = 0;
        Ok(config)
    }

    /// The dialer's configuration: as [`server_config`](Self::server_config).
    fn client_config(&self) -> Result<ClientConfig> {
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Failed(format!("TLS set-up failed: {e}")))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| {
                Error::Invalid(format!(
                    "the worker certificate and private key do not go together: {e}"
                ))
            })?;
        config.enable_secret_extraction = true;
        config.resumption = rustls::client::Resumption::disabled();
        Ok(config)
    }

    /// The acceptor and connector of these credentials.
    ///
    /// # Errors
    /// As [`from_pem`](Self::from_pem) (credentials made by it never fail
    /// here).
    pub fn endpoints(&self) -> Result<TlsEndpoints> {
        Ok(TlsEndpoints {
            server: Arc::new(self.server_config()?),
            client: Arc::new(self.client_config()?),
            socket_reader: Arc::new(|half| Box::new(half)),
        })
    }
}

/// The DNS subject alternative names in a DER certificate that look like
/// [`worker_dns_name`]s: `[2] IA5String` values ending in the suffix. Only
/// a hint: [`TlsCredentials::worker_name`] confirms each with webpki.
fn dns_names_in(der: &[u8]) -> Vec<String> {
    let suffix = format!(".{DNS_SUFFIX}").into_bytes();
    let is_name_byte = |b: u8| b == b'.' || ALPHABET.contains(&b);
    let mut names = Vec::new();
    for end in (suffix.len()..=der.len()).filter(|&e| der[..e].ends_with(&suffix)) {
        let mut start = end - suffix.len();
        while start > 0 && is_name_byte(der[start - 1]) {
            start -= 1;
        }
        // Walk forward over bytes that are themselves name bytes but in
        // fact the length (or tag) before the name.
        while start < end - suffix.len() {
            let len = end - start;
            let short = start >= 2 && der[start - 2] == 0x82 && usize::from(der[start - 1]) == len;
            let long = start >= 3
                && der[start - 3] == 0x82
                && der[start - 2] == 0x81
                && usize::from(der[start - 1]) == len;
            if short || long {
                if let Ok(name) = std::str::from_utf8(&der[start..end]) {
                    names.push(name.to_owned());
                }
                break;
            }
            start += 1;
        }
    }
    names
}

/// A connection's TLS ends, built once from [`TlsCredentials`].
#[derive(Clone)]
pub struct TlsEndpoints {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    socket_reader: Arc<SocketReaderFn>,
}

/// What an established connection's read half reads its ciphertext through:
/// the TCP read half, or a reader its owner puts around it.
pub type SocketReader = Box<dyn AsyncRead + Send + Unpin>;

/// Makes the [`SocketReader`] of each established connection.
pub type SocketReaderFn = dyn Fn(OwnedReadHalf) -> SocketReader + Send + Sync;

impl std::fmt::Debug for TlsEndpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsEndpoints")
    }
}

impl TlsEndpoints {
    /// These endpoints, whose connections read their sockets through
    /// `reader` once established (the handshake reads the socket itself).
    #[must_use]
    pub fn reading_sockets_through(
        mut self,
        reader: impl Fn(OwnedReadHalf) -> SocketReader + Send + Sync + 'static,
    ) -> Self {
        self.socket_reader = Arc::new(reader);
        self
    }

    /// Dials worker `peer` over `tcp`: TLS-2.
    ///
    /// # Errors
    /// [`Error::Failed`] when the TLS handshake fails (the peer's
    /// certificate is not the CA's or does not name `peer`).
    pub async fn connect(&self, tcp: TcpStream, peer: &str) -> Result<TlsStream> {
        let failed = |e: String| Error::Failed(format!("TLS with worker {peer} failed: {e}"));
        let conn = rustls::client::UnbufferedClientConnection::new(
            self.client.clone(),
            server_name(peer)?,
        )
        .map_err(|e| failed(e.to_string()))?;
        handshake::establish(conn, tcp, record::RECORDS_PER_KEY, &*self.socket_reader)
            .await
            .map_err(failed)
    }

    /// Accepts a TLS connection on `tcp`: TLS-1.
    ///
    /// # Errors
    /// [`Error::Failed`] when the TLS handshake fails (no client
    /// certificate, one of another CA, not TLS at all).
    pub async fn accept(&self, tcp: TcpStream) -> Result<TlsStream> {
        let failed = |e: String| Error::Failed(format!("TLS handshake failed: {e}"));
        let conn = rustls::server::UnbufferedServerConnection::new(self.server.clone())
            .map_err(|e| failed(e.to_string()))?;
        handshake::establish(conn, tcp, record::RECORDS_PER_KEY, &*self.socket_reader)
            .await
            .map_err(failed)
    }
}

/// TLS-3: fails unless the end-entity certificate of `chain` (already
/// verified against the CA by the TLS handshake) names worker `claimed`.
///
/// # Errors
/// [`Error::Failed`] saying the peer holds a certificate for another name
/// (or none, or a malformed one).
pub fn check_names(chain: &[CertificateDer<'_>], claimed: &str) -> Result<()> {
    let end = chain.first().ok_or_else(|| {
        Error::Failed(format!("peer claiming to be {claimed} has no certificate"))
    })?;
    let parsed = rustls::server::ParsedCertificate::try_from(end).map_err(|e| {
        Error::Failed(format!(
            "peer claiming to be {claimed} has a malformed certificate: {e}"
        ))
    })?;
    rustls::client::verify_server_name(&parsed, &server_name(claimed)?).map_err(|_| {
        Error::Failed(format!(
            "peer claiming to be worker {claimed} holds a certificate for another name"
        ))
    })
}

/// TLS-3 on an accepted stream: fails unless the certificate the peer
/// presented in the TLS handshake names worker `claimed`.
///
/// # Errors
/// As [`check_names`].
pub fn check_peer_names(stream: &TlsStream, claimed: &str) -> Result<()> {
    check_names(stream.peer_certificates(), claimed)
}

/// The client side a test's foreign peer dials with: trusts the CA
/// certificate(s) in `ca_pem` and presents `client`'s certificate, or
/// none. It is a stock tokio-rustls client on purpose: a worker's record
/// layer must be plain TLS 1.3 to any peer.
///
/// # Errors
/// [`Error::Invalid`] for CA PEM or client credentials that do not parse.
pub fn probe_client_config(
    ca_pem: &str,
    client: Option<&TlsCredentials>,
) -> Result<tokio_rustls::TlsConnector> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| Error::Failed(format!("TLS set-up failed: {e}")))?
        .with_root_certificates(pem_roots(ca_pem)?);
    let config = match client {
        Some(c) => builder
            .with_client_auth_cert(c.chain.clone(), c.key.clone_key())
            .map_err(|e| Error::Invalid(format!("bad client credentials: {e}")))?,
        None => builder.with_no_client_auth(),
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// The server name a probe asks for when it means to reach worker `worker`.
///
/// # Errors
/// [`Error::Invalid`] for a name that gives no valid DNS name.
pub fn worker_server_name(worker: &str) -> Result<ServerName<'static>> {
    server_name(worker)
}

mod handshake;
mod record;
mod stream;

#[cfg(test)]
mod tests;
