//! The handshake that opens every connection of the `tcp` backend's mesh:
//! who is connecting (its group rank), and, with a cluster secret, mutual
//! proof that both ends hold it, before any frame is read.
//!
//! 1. The dialer sends `MAGIC, has_secret u8, rank u64, nonce_c [32]`.
//! 2. The acceptor answers `MAGIC, has_secret u8, nonce_s [32], mac_s [32]`
//!    with `mac_s = HMAC-SHA256(secret, "wasmrpc-c10d-server" | group |
//!    nonce_c | nonce_s | acceptor rank)`.
//! 3. The dialer checks `mac_s` and sends `mac_c = HMAC-SHA256(secret,
//!    "wasmrpc-c10d-client" | group | nonce_s | nonce_c | dialer rank)`.
//! 4. The acceptor checks `mac_c`.
//!
//! This is the agent's cluster-secret handshake (fresh nonces from both
//! sides, distinct labels for the two directions, constant-time checks)
//! bound to the group's name and both ranks, so a proof for one connection
//! serves for no other. Without a secret both sides send zero MACs and the
//! exchange only names the dialer's rank; a side with a secret refuses a
//! side without one, and the reverse. With TLS the exchange runs inside
//! the TLS stream, and the mesh then checks the announced rank against the
//! peer's certificate. This module owns the wire format of the exchange and
//! the checks; the mesh decides what to do with a refused connection.

use std::io::Read;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const MAGIC: [u8; 4] = *b"WC10";
const SERVER: &[u8] = b"wasmrpc-c10d-server";
const CLIENT: &[u8] = b"wasmrpc-c10d-client";

/// How long an accepted connection may take to complete the handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a handshake failed: what the log and the error say.
pub(crate) type Refusal = String;

fn nonce() -> [u8; 32] {
    let mut out = [0u8; 32];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .is_ok()
    {
        return out;
    }
    // No /dev/urandom: hashed clock and counter values (as the agent).
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    for chunk in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
    }
    out
}

fn keyed(
    secret: &[u8],
    label: &[u8],
    group: &str,
    a: &[u8; 32],
    b: &[u8; 32],
    rank: usize,
) -> Hmac<Sha256> {
    // HMAC takes keys of any length: new_from_slice cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC rejected a key"));
    m.update(label);
    m.update(&(group.len() as u64).to_le_bytes());
    m.update(group.as_bytes());
    m.update(a);
    m.update(b);
    m.update(&(rank as u64).to_le_bytes());
    m
}

fn mac(
    secret: Option<&[u8]>,
    label: &[u8],
    group: &str,
    a: &[u8; 32],
    b: &[u8; 32],
    rank: usize,
) -> [u8; 32] {
    secret.map_or([0; 32], |s| {
        keyed(s, label, group, a, b, rank)
            .finalize()
            .into_bytes()
            .into()
    })
}

fn check(
    secret: &[u8],
    label: &[u8],
    group: &str,
    a: &[u8; 32],
    b: &[u8; 32],
    rank: usize,
    got: &[u8; 32],
) -> bool {
    keyed(secret, label, group, a, b, rank)
        .verify_slice(got)
        .is_ok()
}

fn secret_mismatch(ours: bool) -> Refusal {
    if ours {
        "the peer has no cluster secret but this rank has one (set the same \
         WASMRPC_CLUSTER_SECRET on every rank)"
            .to_owned()
    } else {
        "the peer has a cluster secret but this rank has none (set the same \
         WASMRPC_CLUSTER_SECRET on every rank)"
            .to_owned()
    }
}

async fn read_magic<S: AsyncRead + Unpin>(stream: &mut S) -> Result<(), Refusal> {
    let mut magic = [0u8; 4];
    stream
        .read_exact(&mut magic)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    if magic != MAGIC {
        return Err("handshake: not a wasmrpc c10d peer".to_owned());
    }
    Ok(())
}

/// The dialer's side, rank `rank` connecting to group rank `peer`.
///
/// # Errors
/// The refusal: I/O, a peer that is not one, a secret mismatch, or a proof
/// that does not check.
pub(crate) async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&[u8]>,
    group: &str,
    rank: usize,
    peer: usize,
) -> Result<(), Refusal> {
    let io = |e: std::io::Error| format!("handshake: {e}");
    let nonce_c = nonce();
    let mut hello = Vec::with_capacity(4 + 1 + 8 + 32);
    hello.extend_from_slice(&MAGIC);
    hello.push(u8::from(secret.is_some()));
    hello.extend_from_slice(&(rank as u64).to_le_bytes());
    hello.extend_from_slice(&nonce_c);
    stream.write_all(&hello).await.map_err(io)?;

    read_magic(stream).await?;
    let has_secret = stream.read_u8().await.map_err(io)? != 0;
    let mut nonce_s = [0u8; 32];
    let mut mac_s = [0u8; 32];
    stream.read_exact(&mut nonce_s).await.map_err(io)?;
    stream.read_exact(&mut mac_s).await.map_err(io)?;
    if has_secret != secret.is_some() {
        return Err(secret_mismatch(secret.is_some()));
    }
    if let Some(s) = secret
        && !check(s, SERVER, group, &nonce_c, &nonce_s, peer, &mac_s)
    {
        return Err(format!(
            "rank {peer} did not prove that it holds the cluster secret"
        ));
    }
    let mac_c = mac(secret, CLIENT, group, &nonce_s, &nonce_c, rank);
    stream.write_all(&mac_c).await.map_err(io)?;
    Ok(())
}

/// The acceptor's side, at group rank `rank`: returns the dialer's rank once
/// it is proven (or, without a secret, announced).
///
/// # Errors
/// The refusal, as [`dial`].
pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&[u8]>,
    group: &str,
    rank: usize,
) -> Result<usize, Refusal> {
    let io = |e: std::io::Error| format!("handshake: {e}");
    read_magic(stream).await?;
    let has_secret = stream.read_u8().await.map_err(io)? != 0;
    let peer = stream.read_u64_le().await.map_err(io)?;
    let mut nonce_c = [0u8; 32];
    stream.read_exact(&mut nonce_c).await.map_err(io)?;
    let peer = usize::try_from(peer).map_err(|_| format!("handshake: rank {peer} out of range"))?;

    let nonce_s = nonce();
    let mut welcome = Vec::with_capacity(4 + 1 + 32 + 32);
    welcome.extend_from_slice(&MAGIC);
    welcome.push(u8::from(secret.is_some()));
    welcome.extend_from_slice(&nonce_s);
    welcome.extend_from_slice(&mac(secret, SERVER, group, &nonce_c, &nonce_s, rank));
    stream.write_all(&welcome).await.map_err(io)?;
    if has_secret != secret.is_some() {
        return Err(secret_mismatch(secret.is_some()));
    }
    let mut mac_c = [0u8; 32];
    stream.read_exact(&mut mac_c).await.map_err(io)?;
    if let Some(s) = secret
        && !check(s, CLIENT, group, &nonce_s, &nonce_c, peer, &mac_c)
    {
        return Err(format!(
            "a connection announcing rank {peer} did not prove that it holds the cluster secret"
        ));
    }
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    /// Runs both sides over loopback; returns (dialer's, acceptor's) outcome.
    async fn exchange(
        dialer: Option<&'static [u8]>,
        acceptor: Option<&'static [u8]>,
    ) -> (Result<(), Refusal>, Result<usize, Refusal>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            accept(&mut s, acceptor, "0", 0).await
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        let dialed = dial(&mut c, dialer, "0", 3, 0).await;
        drop(c);
        (dialed, server.await.unwrap())
    }

    #[tokio::test]
    async fn the_same_secret_authenticates_both_ways() {
        let (d, a) = exchange(Some(b"s3cret"), Some(b"s3cret")).await;
        assert_eq!(d, Ok(()));
        assert_eq!(a, Ok(3));
    }

    #[tokio::test]
    async fn no_secret_on_either_side_only_names_the_rank() {
        let (d, a) = exchange(None, None).await;
        assert_eq!(d, Ok(()));
        assert_eq!(a, Ok(3));
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_by_the_dialer() {
        let (d, a) = exchange(Some(b"one"), Some(b"two")).await;
        let d = d.unwrap_err();
        assert!(d.contains("did not prove"), "{d}");
        // The dialer hangs up instead of answering: the acceptor refuses.
        assert!(a.is_err());
    }

    #[tokio::test]
    async fn a_missing_secret_is_refused_by_both() {
        let (d, a) = exchange(None, Some(b"s3cret")).await;
        assert!(d.unwrap_err().contains("has a cluster secret"));
        assert!(a.unwrap_err().contains("has no cluster secret"));
        let (d, a) = exchange(Some(b"s3cret"), None).await;
        assert!(d.unwrap_err().contains("has no cluster secret"));
        assert!(a.unwrap_err().contains("has a cluster secret"));
    }

    #[tokio::test]
    async fn a_forged_proof_is_refused_by_the_acceptor() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            accept(&mut s, Some(b"s3cret"), "0", 0).await
        });
        // A dialer that claims a secret, then answers with a MAC of its own
        // making (the server's proof replayed).
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut hello = MAGIC.to_vec();
        hello.push(1);
        hello.extend_from_slice(&1u64.to_le_bytes());
        hello.extend_from_slice(&[9; 32]);
        c.write_all(&hello).await.unwrap();
        let mut welcome = [0u8; 4 + 1 + 32 + 32];
        c.read_exact(&mut welcome).await.unwrap();
        c.write_all(&welcome[37..69]).await.unwrap();
        let refused = server.await.unwrap().unwrap_err();
        assert!(refused.contains("did not prove"), "{refused}");
    }

    #[tokio::test]
    async fn garbage_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            accept(&mut s, None, "0", 0).await
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let refused = server.await.unwrap().unwrap_err();
        assert!(refused.contains("not a wasmrpc c10d peer"), "{refused}");
    }
}
