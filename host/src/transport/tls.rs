//! TLS 1.3 with mutual authentication for the agent's connections, and the
//! certificates it needs.
//!
//! Every worker holds the cluster CA's certificate and a certificate of its
//! own, signed by that CA, that **names the worker**: a DNS subject
//! alternative name [`worker_dns_name`] derived from the worker name (and
//! the name itself as the common name, for people). On a connection:
//!
//! - TLS-1: the acceptor requires a client certificate chaining to the
//!   cluster CA; a peer without one, or with one from another CA, fails the
//!   TLS handshake before any byte of the agent's protocol is read.
//! - TLS-2: the dialer verifies that the acceptor's certificate chains to
//!   the CA **and names the worker it meant to dial** (the server name it
//!   asks for is the dialed worker's [`worker_dns_name`]).
//! - TLS-3: after TLS, the name a dialer announces in the agent's handshake
//!   (`handshake::Hello`) must be one its certificate names; otherwise the
//!   connection is refused, so a worker cannot claim another's name.
//!
//! Only TLS 1.3 is offered, with the `ring` crypto provider.
//!
//! Certificates: [`CertificateAuthority`] makes a cluster CA (ECDSA P-256)
//! and issues worker certificates (`wasmrpc cert init` / `cert issue` write
//! them to files; `wasmrpc launch` keeps an ephemeral one in memory).
//! [`TlsCredentials`] is what one worker is given: the CA certificate, its
//! certificate chain and its private key. Its `Debug` output never shows
//! the key.

use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::error::{Error, Result};

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

/// The DNS name a worker's certificate carries: the worker name in
/// lowercase base32 (so case, `_` and `:`, which DNS names cannot tell
/// apart or hold, survive), split into labels of at most 63 characters,
/// then `.worker.wasmrpc`. Distinct worker names give distinct DNS names.
pub fn worker_dns_name(worker: &str) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
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

fn server_name(worker: &str) -> Result<ServerName<'static>> {
    ServerName::try_from(worker_dns_name(worker)).map_err(|e| {
        Error::runtime(format!(
            "worker name {worker} gives no valid certificate name: {e}"
        ))
    })
}

/// The credentials one worker authenticates its connections with: the
/// cluster CA's certificate, this worker's certificate chain and its
/// private key.
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

impl TlsCredentials {
    /// Credentials from PEM text: the CA certificate(s), this worker's
    /// certificate chain (its own certificate first), its private key.
    ///
    /// # Errors
    /// `ValueError` when a part holds no certificate or no key, or does not
    /// parse (the error names the part, never the key's content).
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let certs = |what: &str, pem: &str| -> Result<Vec<CertificateDer<'static>>> {
            let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::value(format!("the {what} is not valid PEM: {e}")))?;
            if certs.is_empty() {
                return Err(Error::value(format!("the {what} holds no certificate")));
            }
            Ok(certs)
        };
        let ca = certs("CA certificate", ca_pem)?;
        let chain = certs("worker certificate", cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| Error::value(format!("the private key holds no usable PEM key: {e}")))?;
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
                .map_err(|e| Error::value(format!("cannot read {}: {e}", path.display())))
        };
        let (ca, cert, key) = (ca.as_ref(), cert.as_ref(), key.as_ref());
        check_private(key)?;
        let (ca_pem, cert_pem, key_pem) = (read(ca)?, read(cert)?, read(key)?);
        Self::from_pem(&ca_pem, &cert_pem, &key_pem).map_err(|e| {
            Error::value(format!(
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
                    return Err(Error::value(format!(
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
    /// `ValueError` naming the worker otherwise.
    pub fn check_worker(&self, worker: &str) -> Result<()> {
        let verifier = self.client_verifier()?;
        let (end, intermediates) = self
            .chain
            .split_first()
            .ok_or_else(|| Error::value("the worker certificate chain is empty"))?;
        verifier
            .verify_client_cert(end, intermediates, rustls::pki_types::UnixTime::now())
            .map_err(|e| {
                Error::value(format!(
                    "worker {worker}'s certificate is not signed by the cluster CA: {e}"
                ))
            })?;
        check_names(&self.chain, worker).map_err(|e| Error::value(e.message().to_string()))
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        for cert in &self.ca {
            roots
                .add(cert.clone())
                .map_err(|e| Error::value(format!("the CA certificate is not usable: {e}")))?;
        }
        Ok(Arc::new(roots))
    }

    fn client_verifier(&self) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>> {
        WebPkiClientVerifier::builder_with_provider(self.roots()?, Self::provider())
            .build()
            .map_err(|e| Error::value(format!("the CA certificate is not usable: {e}")))
    }

    fn server_config(&self) -> Result<ServerConfig> {
        ServerConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::runtime(format!("TLS set-up failed: {e}")))?
            .with_client_cert_verifier(self.client_verifier()?)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| {
                Error::value(format!(
                    "the worker certificate and private key do not go together: {e}"
                ))
            })
    }

    fn client_config(&self) -> Result<ClientConfig> {
        ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::runtime(format!("TLS set-up failed: {e}")))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| {
                Error::value(format!(
                    "the worker certificate and private key do not go together: {e}"
                ))
            })
    }

    /// The acceptor and connector of a transport.
    pub(crate) fn endpoints(&self) -> Result<TlsEndpoints> {
        Ok(TlsEndpoints {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(self.server_config()?)),
            connector: tokio_rustls::TlsConnector::from(Arc::new(self.client_config()?)),
        })
    }
}

/// A transport's TLS ends, built once from its [`TlsCredentials`].
#[derive(Clone)]
pub(crate) struct TlsEndpoints {
    pub(crate) acceptor: tokio_rustls::TlsAcceptor,
    pub(crate) connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for TlsEndpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsEndpoints")
    }
}

impl TlsEndpoints {
    /// Dials worker `peer` over `tcp`: TLS-2.
    pub(crate) async fn connect(
        &self,
        tcp: tokio::net::TcpStream,
        peer: &str,
    ) -> Result<tokio_rustls::TlsStream<tokio::net::TcpStream>> {
        let name = server_name(peer)?;
        self.connector
            .connect(name, tcp)
            .await
            .map(tokio_rustls::TlsStream::Client)
            .map_err(|e| Error::runtime(format!("TLS with worker {peer} failed: {e}")))
    }

    /// Accepts a TLS connection on `tcp`: TLS-1.
    pub(crate) async fn accept(
        &self,
        tcp: tokio::net::TcpStream,
    ) -> Result<tokio_rustls::TlsStream<tokio::net::TcpStream>> {
        self.acceptor
            .accept(tcp)
            .await
            .map(tokio_rustls::TlsStream::Server)
            .map_err(|e| Error::runtime(format!("TLS handshake failed: {e}")))
    }
}

/// TLS-3: fails unless the end-entity certificate of `chain` (already
/// verified against the CA by the TLS handshake) names worker `claimed`.
pub(crate) fn check_names(chain: &[CertificateDer<'_>], claimed: &str) -> Result<()> {
    let end = chain.first().ok_or_else(|| {
        Error::runtime(format!("peer claiming to be {claimed} has no certificate"))
    })?;
    let parsed = rustls::server::ParsedCertificate::try_from(end).map_err(|e| {
        Error::runtime(format!(
            "peer claiming to be {claimed} has a malformed certificate: {e}"
        ))
    })?;
    rustls::client::verify_server_name(&parsed, &server_name(claimed)?).map_err(|_| {
        Error::runtime(format!(
            "peer claiming to be worker {claimed} holds a certificate for another name"
        ))
    })
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
    let roots = {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(tls.ca_pem.as_bytes()) {
            let cert = cert.map_err(|e| Error::value(format!("bad CA PEM: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| Error::value(format!("bad CA certificate: {e}")))?;
        }
        roots
    };
    let builder = ClientConfig::builder_with_provider(TlsCredentials::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| Error::runtime(format!("TLS set-up failed: {e}")))?
        .with_root_certificates(roots);
    let config = match &tls.client {
        Some(c) => builder
            .with_client_auth_cert(c.chain.clone(), c.key.clone_key())
            .map_err(|e| Error::value(format!("bad client credentials: {e}")))?,
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| Error::runtime(format!("cannot connect to {addr}: {e}")))?;
    let mut stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(server_name(&tls.server)?, tcp)
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

/// Fails unless `file` is readable by its owner only.
fn check_private(file: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file)
        .map_err(|e| Error::value(format!("cannot read {}: {e}", file.display())))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(Error::value(format!(
            "{} is accessible to group or others (mode {:o}); a private key must be readable \
             by its owner only: run `chmod 600 {}`",
            file.display(),
            mode & 0o777,
            file.display()
        )));
    }
    Ok(())
}

/// A cluster certificate authority: an ECDSA P-256 key and its self-signed
/// certificate, which issues one certificate per worker.
///
/// Its certificate's subject is fixed ("wasmrpc cluster CA"), so a CA read
/// back from its files ([`from_pem`](Self::from_pem)) issues certificates
/// that chain to the same certificate. CAs made elsewhere (e.g. by openssl)
/// work as [`TlsCredentials`] but cannot be loaded here to issue.
pub struct CertificateAuthority {
    params: CertificateParams,
    key: KeyPair,
    cert_pem: String,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("key", &"<redacted>")
            .finish()
    }
}

fn ca_params() -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(|e| Error::runtime(format!("CA parameters: {e}")))?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "wasmrpc");
    dn.push(DnType::CommonName, "wasmrpc cluster CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

impl CertificateAuthority {
    /// A new CA with a fresh key.
    ///
    /// # Errors
    /// Key generation or signing failed.
    pub fn generate() -> Result<Self> {
        let key = KeyPair::generate()
            .map_err(|e| Error::runtime(format!("cannot generate a CA key: {e}")))?;
        let params = ca_params()?;
        let cert_pem = params
            .self_signed(&key)
            .map_err(|e| Error::runtime(format!("cannot sign the CA certificate: {e}")))?
            .pem();
        Ok(CertificateAuthority {
            params,
            key,
            cert_pem,
        })
    }

    /// The CA of [`generate`](Self::generate) read back from its
    /// certificate and key (`ca.pem`, `ca.key`); checks that they go
    /// together by issuing a certificate and verifying it.
    ///
    /// # Errors
    /// The key does not parse, or certificates it issues do not chain to
    /// `cert_pem`.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem)
            .map_err(|e| Error::value(format!("the CA key is not a usable PEM key: {e}")))?;
        let ca = CertificateAuthority {
            params: ca_params()?,
            key,
            cert_pem: cert_pem.to_string(),
        };
        let probe = "ca-check";
        ca.credentials_for(probe)?
            .check_worker(probe)
            .map_err(|e| {
                Error::value(format!(
                    "the CA certificate and key do not go together (or the CA was not made by \
                     `wasmrpc cert init`): {}",
                    e.message()
                ))
            })?;
        Ok(ca)
    }

    /// The CA's certificate (PEM): every worker needs it.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key (PKCS#8 PEM): keep it off the workers.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// Issues worker `worker` a certificate naming it (TLS-3) and a fresh
    /// key: `(certificate PEM, key PEM)`.
    ///
    /// # Errors
    /// An invalid worker name, or key generation or signing failed.
    pub fn issue(&self, worker: &str) -> Result<(String, String)> {
        crate::worker::validate_worker_name(worker)?;
        let key = KeyPair::generate()
            .map_err(|e| Error::runtime(format!("cannot generate a key for {worker}: {e}")))?;
        let mut params = CertificateParams::new(vec![worker_dns_name(worker)])
            .map_err(|e| Error::runtime(format!("certificate parameters for {worker}: {e}")))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "wasmrpc");
        dn.push(DnType::CommonName, worker);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|e| Error::runtime(format!("cannot sign {worker}'s certificate: {e}")))?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Worker `worker`'s credentials, issued now.
    ///
    /// # Errors
    /// As [`issue`](Self::issue).
    pub fn credentials_for(&self, worker: &str) -> Result<TlsCredentials> {
        let (cert, key) = self.issue(worker)?;
        TlsCredentials::from_pem(&self.cert_pem, &cert, &key)
    }
}

#[cfg(test)]
mod tests;
