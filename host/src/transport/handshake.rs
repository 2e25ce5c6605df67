//! Mutual authentication of a new connection with the cluster secret: the
//! agent's thin adapter over `wasmrpc-net`'s handshake ([`wasmrpc_net::dial`],
//! [`wasmrpc_net::accept`]; the exchange, its framing, its limits and its
//! invariants NET-1 to NET-6 are there).
//!
//! The agent binds the exchange to its protocol ([`Binding::agent`]) and to
//! each side's worker name and rank. The acceptor's extension is its offer
//! of a shared-memory link (`shm`, TR-9), which `wasmrpc-net` sends only to
//! a dialer that proved itself (NET-5). Only then are frames exchanged
//! (TR-2).
//!
//! An unauthenticated worker (no credentials, loopback or `--insecure`:
//! `agent::rendezvous`) has an empty secret, which this adapter passes as
//! no secret: the names and ranks still travel, and a worker holding a
//! secret refuses such a peer (and is refused by it, NET-3).
//!
//! This module keeps what is the agent's: the `Peer` it hands the
//! transport, the shared-memory offer's encoding, and the probes tests use
//! to play a foreign peer.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use wasmrpc_net::{Binding, Handshake, Identity};

use super::shm::ShmOffer;
use crate::error::{Error, Result};

pub(crate) use wasmrpc_net::HANDSHAKE_TIMEOUT;
pub use wasmrpc_net::generate_secret;
pub(crate) use wasmrpc_net::random_bytes;

/// The peer a handshake authenticated.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    pub(crate) name: String,
    pub(crate) rank: u32,
    /// The acceptor's offer of a shared-memory link (dialers only).
    pub(crate) shm: Option<ShmOffer>,
}

/// The empty secret of an unauthenticated worker is no secret.
fn secret(secret: &[u8]) -> Option<&[u8]> {
    (!secret.is_empty()).then_some(secret)
}

/// The worker name and rank `who` claimed, as the agent knows them.
fn worker(who: Identity, side: &str) -> Result<(String, u32)> {
    match who.rank.map(u32::try_from) {
        Some(Ok(rank)) if !who.name.is_empty() => Ok((who.name, rank)),
        _ => Err(Error::runtime(format!(
            "the {side} announced {who}, not a worker name and rank"
        ))),
    }
}

/// The dialer's side. Returns the authenticated acceptor.
pub(crate) async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret_: &[u8],
    name: &str,
    rank: u32,
) -> Result<Peer> {
    let binding = Binding::agent();
    let me = Identity::worker(name, u64::from(rank));
    let dialed = wasmrpc_net::dial(stream, &Handshake::new(&binding, secret(secret_), &me))
        .await
        .map_err(|e| Error::runtime(format!("handshake of worker {name}: {e}")))?;
    let (peer, peer_rank) = worker(dialed.peer, "acceptor")?;
    let shm: Option<ShmOffer> = crate::abi::decode(&dialed.extension).map_err(|e| {
        Error::runtime(format!(
            "worker {peer} sent a malformed shared-memory offer: {e}"
        ))
    })?;
    Ok(Peer {
        name: peer,
        rank: peer_rank,
        shm,
    })
}

/// The acceptor's side. Returns the authenticated dialer, to whom it sent
/// `shm` after the dialer's proof (never before).
pub(crate) async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret_: &[u8],
    name: &str,
    rank: u32,
    shm: Option<ShmOffer>,
) -> Result<Peer> {
    let binding = Binding::agent();
    let me = Identity::worker(name, u64::from(rank));
    let offer = crate::abi::encode(&shm)
        .map_err(|e| Error::runtime(format!("cannot encode the shared-memory offer: {e}")))?;
    let who = wasmrpc_net::accept(
        stream,
        &Handshake::new(&binding, secret(secret_), &me),
        &offer,
    )
    .await
    .map_err(|e| Error::runtime(e.into_message()))?;
    let (peer, peer_rank) = worker(who, "dialer")?;
    Ok(Peer {
        name: peer,
        rank: peer_rank,
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

    use tokio::io::AsyncWriteExt;
    use wasmrpc_net::wire::{self, Hello, Proof, VERSION, Welcome};

    const SECRET: &[u8] = b"property secret";

    /// A handshake message as `wasmrpc_net` writes it, after the agent's
    /// magic when `magic`.
    fn framed<T: serde::Serialize>(msg: &T, magic: bool) -> Vec<u8> {
        let mut out = Vec::new();
        if magic {
            out.extend(wasmrpc_net::Protocol::AGENT.magic());
        }
        out.extend(wire::encode(msg, "message").unwrap());
        out
    }

    /// What an honest dialer sends (its proof cannot match a fresh nonce of
    /// the acceptor, but it decodes).
    fn dialer_bytes(name: &str) -> Vec<u8> {
        let mut bytes = framed(
            &Hello {
                version: VERSION,
                has_secret: true,
                identity: Identity::worker(name, 3),
                nonce: [7; 32],
            },
            true,
        );
        bytes.extend(framed(&Proof { mac: [9; 32] }, false));
        bytes
    }

    /// What an acceptor sends.
    fn acceptor_bytes(name: &str) -> Vec<u8> {
        framed(
            &Welcome {
                version: VERSION,
                has_secret: true,
                identity: Identity::worker(name, 0),
                nonce: [5; 32],
                mac: [1; 32],
            },
            true,
        )
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
