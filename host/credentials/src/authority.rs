//! The cluster certificate authority: makes a CA and issues worker
//! certificates that name their worker.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use crate::tls::{TlsCredentials, worker_dns_name};
use crate::{Error, Result};

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
        .map_err(|e| Error::Failed(format!("CA parameters: {e}")))?;
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
            .map_err(|e| Error::Failed(format!("cannot generate a CA key: {e}")))?;
        let params = ca_params()?;
        let cert_pem = params
            .self_signed(&key)
            .map_err(|e| Error::Failed(format!("cannot sign the CA certificate: {e}")))?
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
            .map_err(|e| Error::Invalid(format!("the CA key is not a usable PEM key: {e}")))?;
        let ca = CertificateAuthority {
            params: ca_params()?,
            key,
            cert_pem: cert_pem.to_string(),
        };
        let probe = "ca-check";
        ca.credentials_for(probe)?
            .check_worker(probe)
            .map_err(|e| {
                Error::Invalid(format!(
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

    /// Issues worker `worker` a certificate naming it and a fresh key:
    /// `(certificate PEM, key PEM)`. Callers check that `worker` is a valid
    /// worker name first (the agent's rules live with the agent).
    ///
    /// # Errors
    /// Key generation or signing failed, or the name gives no valid DNS
    /// name.
    pub fn issue(&self, worker: &str) -> Result<(String, String)> {
        if worker.is_empty() {
            return Err(Error::Invalid("a certificate needs a worker name".into()));
        }
        let key = KeyPair::generate()
            .map_err(|e| Error::Failed(format!("cannot generate a key for {worker}: {e}")))?;
        let mut params = CertificateParams::new(vec![worker_dns_name(worker)])
            .map_err(|e| Error::Invalid(format!("certificate parameters for {worker}: {e}")))?;
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
            .map_err(|e| Error::Failed(format!("cannot sign {worker}'s certificate: {e}")))?;
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
