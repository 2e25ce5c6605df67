//! Tests of `tls`.

use super::*;
use crate::CertificateAuthority;

#[test]
fn worker_dns_names_are_distinct_valid_short_enough_and_decode_back() {
    let long = "w".repeat(127);
    let names = ["worker0", "Worker0", "a_b", "a:b", "a-b", long.as_str()];
    let dns: Vec<String> = names.iter().map(|n| worker_dns_name(n)).collect();
    for (n, d) in names.iter().zip(&dns) {
        assert!(server_name(n).is_ok(), "{d}");
        assert!(d.len() <= 253 && d.split('.').all(|l| l.len() <= 63), "{d}");
        assert_eq!(worker_from_dns_name(d).as_deref(), Some(*n));
    }
    let unique: std::collections::BTreeSet<String> =
        dns.iter().map(|d| d.to_ascii_lowercase()).collect();
    assert_eq!(unique.len(), names.len(), "{dns:?}");
    assert_eq!(worker_from_dns_name("example.com"), None);
    assert_eq!(worker_from_dns_name("0.worker.wasmrpc"), None);
}

#[test]
fn issued_certificates_name_their_worker_and_chain_to_their_ca() {
    let ca = CertificateAuthority::generate().unwrap();
    let creds = ca.credentials_for("worker_1:a").unwrap();
    creds.check_worker("worker_1:a").unwrap();
    let e = creds.check_worker("worker2").unwrap_err();
    assert!(e.message().contains("another name"), "{e}");
    // A CA read back from its PEM issues certificates of the same chain.
    let again = CertificateAuthority::from_pem(ca.cert_pem(), &ca.key_pem()).unwrap();
    let (cert, key) = again.issue("worker3").unwrap();
    TlsCredentials::from_pem(ca.cert_pem(), &cert, &key)
        .unwrap()
        .check_worker("worker3")
        .unwrap();
    // Another CA's certificate does not chain.
    let other = CertificateAuthority::generate().unwrap();
    let (cert, key) = other.issue("worker3").unwrap();
    let foreign = TlsCredentials::from_pem(ca.cert_pem(), &cert, &key).unwrap();
    let e = foreign.check_worker("worker3").unwrap_err();
    assert!(e.message().contains("not signed by the cluster CA"), "{e}");
    // A CA key that does not go with the certificate is refused.
    assert!(CertificateAuthority::from_pem(ca.cert_pem(), &other.key_pem()).is_err());
    // Debug output never shows a key.
    let shown = format!("{creds:?} {ca:?}");
    assert!(!shown.contains("PRIVATE"), "{shown}");
}

#[test]
fn credentials_know_the_worker_they_name() {
    let ca = CertificateAuthority::generate().unwrap();
    // Names of every length class: the DER length byte of a long name is
    // itself a letter of the alphabet (100 = 'd').
    for name in [
        "worker0".to_string(),
        "Trainer_7:x".to_string(),
        "n".repeat(57),
        "m".repeat(127),
    ] {
        let creds = ca.credentials_for(&name).unwrap();
        assert_eq!(creds.worker_name().unwrap(), name);
    }
}

#[test]
fn a_certificate_without_a_worker_name_says_so() {
    // A certificate for a plain DNS name, as another tool would issue.
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["example.com".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let creds = TlsCredentials::from_pem(&cert.pem(), &cert.pem(), &key.serialize_pem()).unwrap();
    let e = creds.worker_name().unwrap_err();
    assert!(e.message().contains("names no worker"), "{e}");
}

#[test]
fn aes_128_gcm_is_preferred() {
    let first = provider().cipher_suites[0].suite();
    assert_eq!(first, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
}
