//! The handshake that opens every connection of the `tcp` backend's mesh:
//! who is connecting (its group rank), and, with a cluster secret, mutual
//! proof that both ends hold it, before any frame is read.
//!
//! The exchange itself is `wasmrpc-net`'s ([`wasmrpc_net::dial`],
//! [`wasmrpc_net::accept`]), bound to the c10d protocol and the group's
//! name ([`Binding::c10d`]) and to both ranks, so a proof for one
//! connection, group or protocol serves for no other (NET-4). Without a
//! secret the exchange only names the ranks; a side with a secret refuses
//! a side without one, and the reverse. With TLS the exchange runs inside
//! the TLS stream, and the mesh then checks the announced rank against the
//! peer's certificate. This module turns ranks into identities and back
//! and checks that the acceptor is the rank dialed; the mesh decides what
//! to do with a refused connection.

use tokio::io::{AsyncRead, AsyncWrite};
use wasmrpc_net::{Binding, Handshake, Identity};

pub(crate) use wasmrpc_net::HANDSHAKE_TIMEOUT;

/// Why a handshake failed: what the log and the error say.
pub(crate) type Refusal = String;

/// The dialer's side, rank `rank` connecting to group rank `peer`.
///
/// # Errors
/// The refusal: I/O, a peer that is not one, a secret mismatch, a proof
/// that does not check, or an acceptor at another rank than `peer`.
pub(crate) async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&[u8]>,
    group: &str,
    rank: usize,
    peer: usize,
) -> Result<(), Refusal> {
    let binding = Binding::c10d(group);
    let me = Identity::of_rank(rank as u64);
    let dialed = wasmrpc_net::dial(stream, &Handshake::new(&binding, secret, &me))
        .await
        .map_err(wasmrpc_net::Refusal::into_message)?;
    if dialed.peer != Identity::of_rank(peer as u64) {
        return Err(format!(
            "dialed rank {peer} of group {group} but {} answered",
            dialed.peer
        ));
    }
    Ok(())
}

/// The acceptor's side, at group rank `rank`: returns the dialer's rank once
/// it is proven (or, without a secret, announced).
///
/// # Errors
/// The refusal, as [`dial`], or a dialer that announces no rank (or one
/// out of range).
pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&[u8]>,
    group: &str,
    rank: usize,
) -> Result<usize, Refusal> {
    let binding = Binding::c10d(group);
    let me = Identity::of_rank(rank as u64);
    let peer = wasmrpc_net::accept(stream, &Handshake::new(&binding, secret, &me), &[])
        .await
        .map_err(wasmrpc_net::Refusal::into_message)?;
    match peer.rank.map(usize::try_from) {
        Some(Ok(r)) if peer.name.is_empty() => Ok(r),
        _ => Err(format!(
            "handshake: {peer} is not a rank of group {group} (a c10d peer announces a rank only)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use wasmrpc_net::wire;

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
        let mut hello = wasmrpc_net::Protocol::C10D.magic().to_vec();
        let announce = wire::Hello {
            version: wire::VERSION,
            has_secret: true,
            identity: Identity::of_rank(1),
            nonce: [9; 32],
        };
        hello.extend(wire::encode(&announce, "hello").unwrap());
        c.write_all(&hello).await.unwrap();
        let mut magic = [0u8; 4];
        c.read_exact(&mut magic).await.unwrap();
        let welcome = wasmrpc_net::read_message(&mut c, wasmrpc_net::Limits::HANDSHAKE)
            .await
            .unwrap();
        let welcome: wire::Welcome = wire::decode(&welcome, "welcome").unwrap();
        let replayed = wire::Proof { mac: welcome.mac };
        c.write_all(&wire::encode(&replayed, "proof").unwrap())
            .await
            .unwrap();
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
