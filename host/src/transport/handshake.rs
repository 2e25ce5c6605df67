//! Mutual authentication of a new connection with the cluster secret.
//!
//! 1. The dialer sends `Hello { name, rank, nonce_c }`.
//! 2. The acceptor answers `Welcome { name, rank, nonce_s, mac_s }` with
//!    `mac_s = HMAC(secret, "wasmrpc-server" | nonce_c | nonce_s | name_s)`.
//! 3. The dialer checks `mac_s` and sends `Proof { mac_c }` with
//!    `mac_c = HMAC(secret, "wasmrpc-client" | nonce_s | nonce_c | name_c)`.
//! 4. The acceptor checks `mac_c` and answers `Admitted { shm }`: its
//!    offer of a shared-memory link (`shm`, TR-9), made only for a peer
//!    that proved itself. Only then are frames exchanged (TR-2).
//!
//! An unauthenticated worker (no credentials, loopback or `--insecure`:
//! `agent::rendezvous`) runs the same exchange with an empty secret: the
//! MACs then prove nothing, but the names and ranks still travel, and a
//! worker holding a secret refuses such a peer (and is refused by it).
//!
//! Handshake messages are tiny and length-prefixed (u16); anything longer
//! than [`MAX_HANDSHAKE`] bytes, or slower than the handshake timeout, fails.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::shm::ShmOffer;
use crate::error::{Error, Result};

const MAGIC: u32 = 0x5752_5043; // "WRPC"
const VERSION: u32 = 1;
const MAX_HANDSHAKE: usize = 1024;
/// How long a handshake may take.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Serialize, Deserialize)]
struct Hello {
    magic: u32,
    version: u32,
    name: String,
    rank: u32,
    nonce: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct Welcome {
    name: String,
    rank: u32,
    nonce: [u8; 32],
    mac: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct Proof {
    mac: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct Admitted {
    shm: Option<ShmOffer>,
}

/// The peer a handshake authenticated.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    pub(crate) name: String,
    pub(crate) rank: u32,
    /// The acceptor's offer of a shared-memory link (dialers only).
    pub(crate) shm: Option<ShmOffer>,
}

/// `N` random bytes from the OS (falling back to hashed clock and counter
/// values if `/dev/urandom` cannot be read).
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .is_ok()
    {
        return out;
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    use std::hash::{BuildHasher, Hasher};
    for chunk in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        let bytes = h.finish().to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    out
}

/// A fresh random cluster secret: 32 bytes from the OS as 64 hex digits
/// (`wasmrpc launch` hands one to its workers; test clusters get one each).
pub fn generate_secret() -> String {
    random_bytes::<32>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn mac(secret: &[u8], label: &[u8], a: &[u8; 32], b: &[u8; 32], name: &str) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| {
        // HMAC accepts keys of any length; this branch cannot be taken.
        <Hmac<Sha256> as Mac>::new_from_slice(&[0u8; 32]).unwrap_or_else(|_| unreachable_hmac())
    });
    m.update(label);
    m.update(a);
    m.update(b);
    m.update(name.as_bytes());
    m.finalize().into_bytes().into()
}

fn unreachable_hmac() -> ! {
    // Invariant: `Hmac::new_from_slice` is infallible for every key length.
    panic!("HMAC rejected a key")
}

fn verify(
    secret: &[u8],
    label: &[u8],
    a: &[u8; 32],
    b: &[u8; 32],
    name: &str,
    got: &[u8; 32],
) -> bool {
    let Ok(mut m) = <Hmac<Sha256> as Mac>::new_from_slice(secret) else {
        return false;
    };
    m.update(label);
    m.update(a);
    m.update(b);
    m.update(name.as_bytes());
    m.verify_slice(got).is_ok()
}

async fn send<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> Result<()> {
    let body = crate::abi::encode(msg)
        .map_err(|e| Error::runtime(format!("handshake encoding failed: {e}")))?;
    let len =
        u16::try_from(body.len()).map_err(|_| Error::runtime("handshake message too long"))?;
    let mut buf = len.to_le_bytes().to_vec();
    buf.extend_from_slice(&body);
    w.write_all(&buf)
        .await
        .map_err(|e| Error::runtime(format!("handshake write failed: {e}")))
}

async fn recv<R: AsyncRead + Unpin, T: DeserializeOwned>(r: &mut R) -> Result<T> {
    let mut len = [0u8; 2];
    r.read_exact(&mut len)
        .await
        .map_err(|e| Error::runtime(format!("handshake read failed: {e}")))?;
    let len = u16::from_le_bytes(len) as usize;
    if len > MAX_HANDSHAKE {
        return Err(Error::runtime(format!(
            "handshake message of {len} bytes is too long"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| Error::runtime(format!("handshake read failed: {e}")))?;
    crate::abi::decode(&body)
        .map_err(|e| Error::runtime(format!("malformed handshake message: {e}")))
}

/// The dialer's side. Returns the authenticated acceptor.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
    name: &str,
    rank: u32,
) -> Result<Peer> {
    let nonce_c = random_bytes::<32>();
    send(
        stream,
        &Hello {
            magic: MAGIC,
            version: VERSION,
            name: name.into(),
            rank,
            nonce: nonce_c,
        },
    )
    .await?;
    let w: Welcome = recv(stream).await?;
    if !verify(
        secret,
        b"wasmrpc-server",
        &nonce_c,
        &w.nonce,
        &w.name,
        &w.mac,
    ) {
        return Err(Error::runtime(format!(
            "worker {} failed to prove it knows the cluster secret",
            w.name
        )));
    }
    send(
        stream,
        &Proof {
            mac: mac(secret, b"wasmrpc-client", &w.nonce, &nonce_c, name),
        },
    )
    .await?;
    let admitted: Admitted = recv(stream).await?;
    Ok(Peer {
        name: w.name,
        rank: w.rank,
        shm: admitted.shm,
    })
}

/// The acceptor's side. Returns the authenticated dialer, to whom it sent
/// `shm` after the dialer's proof (never before).
pub(crate) async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
    name: &str,
    rank: u32,
    shm: Option<ShmOffer>,
) -> Result<Peer> {
    let h: Hello = recv(stream).await?;
    if h.magic != MAGIC || h.version != VERSION {
        return Err(Error::runtime(format!(
            "peer speaks protocol {:#x} version {}, expected {MAGIC:#x} version {VERSION}",
            h.magic, h.version
        )));
    }
    let nonce_s = random_bytes::<32>();
    let mac_s = mac(secret, b"wasmrpc-server", &h.nonce, &nonce_s, name);
    send(
        stream,
        &Welcome {
            name: name.into(),
            rank,
            nonce: nonce_s,
            mac: mac_s,
        },
    )
    .await?;
    let p: Proof = recv(stream).await?;
    if !verify(
        secret,
        b"wasmrpc-client",
        &nonce_s,
        &h.nonce,
        &h.name,
        &p.mac,
    ) {
        return Err(Error::runtime(format!(
            "peer claiming to be {} failed to prove it knows the cluster secret",
            h.name
        )));
    }
    send(stream, &Admitted { shm }).await?;
    Ok(Peer {
        name: h.name,
        rank: h.rank,
        shm: None,
    })
}

/// Dials `addr` and authenticates as `name` with `secret`; returns the raw
/// stream, on which the acceptor now expects frames. Tests use it to play a
/// misbehaving peer.
///
/// # Errors
/// Fails if the connection or the handshake fails.
pub async fn connect(addr: std::net::SocketAddr, secret: &[u8], name: &str) -> Result<TcpStream> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| Error::runtime(format!("cannot connect to {addr}: {e}")))?;
    client(&mut stream, secret, name, u32::MAX).await?;
    Ok(stream)
}

/// Dials `addr` and runs the dialer's handshake with `secret`, then waits up
/// to `linger` for the acceptor to keep the connection open. Returns
/// `Ok(())` only if the acceptor accepted the proof and did not close the
/// connection; tests use it to check that a wrong secret is refused.
///
/// # Errors
/// Fails if the connection fails, the acceptor cannot prove the secret, or
/// the acceptor closes the connection after the proof.
pub async fn probe(
    addr: std::net::SocketAddr,
    secret: &[u8],
    name: &str,
    linger: Duration,
) -> Result<()> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| Error::runtime(format!("cannot connect to {addr}: {e}")))?;
    client(&mut stream, secret, name, u32::MAX).await?;
    let mut byte = [0u8; 1];
    match tokio::time::timeout(linger, stream.read(&mut byte)).await {
        Err(_) => Ok(()),
        Ok(Ok(0)) => Err(Error::runtime(format!(
            "{addr} closed the connection after the handshake"
        ))),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Error::runtime(format!(
            "{addr} reset the connection after the handshake: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECRET: &[u8] = b"property secret";

    /// A handshake message as `send` writes it.
    fn framed<T: Serialize>(msg: &T) -> Vec<u8> {
        let mut out = Vec::new();
        futures::executor::block_on(send(&mut out, msg)).unwrap();
        out
    }

    /// What an honest dialer sends (its proof cannot match a fresh nonce of
    /// the acceptor, but it decodes).
    fn dialer_bytes(name: &str) -> Vec<u8> {
        let mut bytes = framed(&Hello {
            magic: MAGIC,
            version: VERSION,
            name: name.into(),
            rank: 3,
            nonce: [7; 32],
        });
        bytes.extend(framed(&Proof { mac: [9; 32] }));
        bytes
    }

    /// What an acceptor sends.
    fn acceptor_bytes(name: &str) -> Vec<u8> {
        framed(&Welcome {
            name: name.into(),
            rank: 0,
            nonce: [5; 32],
            mac: [1; 32],
        })
    }

    use wasmrpc_mutation::mutate;

    /// Mutations that plant large little-endian `u16`s (a handshake length).
    fn mutation() -> impl Strategy<Value = wasmrpc_mutation::Mutation> {
        wasmrpc_mutation::mutation(any::<u16>().prop_map(u64::from), 2)
    }

    /// Runs one side of the handshake against a peer that sent `bytes` and
    /// then stopped writing (its reading side stays open, so the side under
    /// test can write); the side must fail, within 5 s, without a panic.
    fn must_refuse(bytes: Vec<u8>, acceptor: bool) -> std::result::Result<(), TestCaseError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got = rt.block_on(async move {
            let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
            theirs.write_all(&bytes).await.unwrap();
            theirs.shutdown().await.unwrap();
            let side = async {
                if acceptor {
                    server(&mut ours, SECRET, "acceptor", 0, None).await
                } else {
                    client(&mut ours, SECRET, "dialer", 1).await
                }
            };
            let got = tokio::time::timeout(Duration::from_secs(5), side).await;
            drop(theirs);
            got
        });
        match got {
            Err(_) => Err(TestCaseError::fail("the handshake hung")),
            Ok(Ok(peer)) => Err(TestCaseError::fail(format!(
                "a peer without the secret was accepted: {peer:?}"
            ))),
            Ok(Err(_)) => Ok(()),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_bytes_to_the_acceptor_are_refused(
            bytes in proptest::collection::vec(any::<u8>(), 0..1200),
        ) {
            must_refuse(bytes, true)?;
        }

        #[test]
        fn arbitrary_bytes_to_the_dialer_are_refused(
            bytes in proptest::collection::vec(any::<u8>(), 0..1200),
        ) {
            must_refuse(bytes, false)?;
        }

        #[test]
        fn mutated_dialer_messages_are_refused(
            name in ".{0,40}",
            ms in proptest::collection::vec(mutation(), 0..4),
        ) {
            must_refuse(mutate(dialer_bytes(&name), &ms), true)?;
        }

        #[test]
        fn mutated_acceptor_messages_are_refused(
            name in ".{0,40}",
            ms in proptest::collection::vec(mutation(), 0..4),
        ) {
            must_refuse(mutate(acceptor_bytes(&name), &ms), false)?;
        }
    }

    #[test]
    fn an_honest_exchange_still_authenticates() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (a, b) = rt.block_on(async {
            let (mut x, mut y) = tokio::io::duplex(1 << 16);
            tokio::join!(
                server(&mut x, SECRET, "acceptor", 0, None),
                client(&mut y, SECRET, "dialer", 1)
            )
        });
        assert_eq!(a.unwrap().name, "dialer");
        assert_eq!(b.unwrap().name, "acceptor");
    }
}
