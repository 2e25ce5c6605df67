//! The handshake attacked as a hostile peer would: each refusal is checked
//! by its kind and its message.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, duplex};

use crate::auth::{Role, Transcript, mac};
use crate::wire::{self, Admitted, Hello, Proof, VERSION, Welcome};
use crate::{
    Binding, Dialed, Handshake, Identity, Limits, Protocol, Refusal, RefusalKind, accept, dial,
    generate_secret, random_bytes, read_message, write_message,
};

const SECRET: &[u8] = b"s3cret";
const SHORT: Duration = Duration::from_millis(300);

fn dialer() -> Identity {
    Identity::worker("dialer", 1)
}

fn acceptor() -> Identity {
    Identity::worker("acceptor", 0)
}

/// Runs an honest acceptor (bound to `bind_a`, holding `secret_a`, offering
/// `b"offer"`) and an honest dialer over one duplex stream; the dialer
/// hangs up as soon as it is done. Returns (dialer's, acceptor's) outcome.
async fn exchange(
    bind_d: Binding,
    secret_d: Option<&'static [u8]>,
    bind_a: Binding,
    secret_a: Option<&'static [u8]>,
) -> (Result<Dialed, Refusal>, Result<Identity, Refusal>) {
    let (mut ours, mut theirs) = duplex(1 << 16);
    let acceptor = tokio::spawn(async move {
        let me = acceptor();
        let hs = Handshake::new(&bind_a, secret_a, &me).with_timeout(SHORT * 4);
        accept(&mut theirs, &hs, b"offer").await
    });
    let me = dialer();
    let hs = Handshake::new(&bind_d, secret_d, &me).with_timeout(SHORT * 4);
    let dialed = dial(&mut ours, &hs).await;
    drop(ours);
    (dialed, acceptor.await.unwrap())
}

fn refused<T: std::fmt::Debug>(r: Result<T, Refusal>, kind: RefusalKind, says: &str) {
    let e = r.expect_err("the peer was accepted");
    assert_eq!(e.kind(), kind, "{e}");
    assert!(e.message().contains(says), "{e} does not say {says:?}");
}

/// An acceptor bound to c10d group "0" holding `secret`, under `timeout`.
fn c10d_acceptor(
    secret: Option<&'static [u8]>,
    timeout: Duration,
) -> (
    DuplexStream,
    tokio::task::JoinHandle<Result<Identity, Refusal>>,
) {
    let (ours, mut theirs) = duplex(1 << 16);
    let task = tokio::spawn(async move {
        let (binding, me) = (Binding::c10d("0"), Identity::of_rank(0));
        let hs = Handshake::new(&binding, secret, &me).with_timeout(timeout);
        accept(&mut theirs, &hs, b"offer").await
    });
    (ours, task)
}

/// The magic and hello of a hand-made dialer.
fn hello_bytes(protocol: Protocol, hello: &Hello) -> Vec<u8> {
    let mut out = protocol.magic().to_vec();
    out.extend(wire::encode(hello, "hello").unwrap());
    out
}

/// Reads the acceptor's magic and welcome.
async fn read_welcome(s: &mut DuplexStream) -> Welcome {
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).await.unwrap();
    assert_eq!(magic, Protocol::C10D.magic());
    wire::decode(
        &read_message(s, Limits::HANDSHAKE).await.unwrap(),
        "welcome",
    )
    .unwrap()
}

#[tokio::test]
async fn the_same_secret_authenticates_both_sides_and_delivers_the_extension() {
    let (d, a) = exchange(
        Binding::agent(),
        Some(SECRET),
        Binding::agent(),
        Some(SECRET),
    )
    .await;
    let d = d.unwrap();
    assert_eq!(d.peer, acceptor());
    assert_eq!(d.extension, b"offer");
    assert_eq!(a.unwrap(), dialer());
}

#[tokio::test]
async fn without_a_secret_names_and_ranks_still_travel() {
    let (d, a) = exchange(Binding::c10d("g"), None, Binding::c10d("g"), None).await;
    assert_eq!(d.unwrap().peer, acceptor());
    assert_eq!(a.unwrap(), dialer());
}

#[tokio::test]
async fn a_wrong_secret_is_refused_by_the_dialer_and_then_the_acceptor() {
    let (d, a) = exchange(
        Binding::agent(),
        Some(b"one"),
        Binding::agent(),
        Some(b"two"),
    )
    .await;
    refused(
        d,
        RefusalKind::BadProof,
        "worker acceptor did not prove that it holds the cluster secret",
    );
    // The dialer hung up instead of proving anything.
    refused(
        a,
        RefusalKind::Io,
        "a connection announcing worker dialer: the peer closed the connection before its whole proof",
    );
}

#[tokio::test]
async fn a_secret_on_one_side_only_is_refused_by_both() {
    let (d, a) = exchange(Binding::agent(), None, Binding::agent(), Some(SECRET)).await;
    refused(
        d,
        RefusalKind::SecretMismatch,
        "the peer has a cluster secret but this rank has none",
    );
    refused(
        a,
        RefusalKind::SecretMismatch,
        "the peer has no cluster secret but this rank has one",
    );
    let (d, a) = exchange(Binding::agent(), Some(SECRET), Binding::agent(), None).await;
    refused(
        d,
        RefusalKind::SecretMismatch,
        "the peer has no cluster secret but this rank has one",
    );
    refused(
        a,
        RefusalKind::SecretMismatch,
        "the peer has a cluster secret but this rank has none",
    );
}

#[tokio::test]
async fn another_group_or_protocol_with_the_same_secret_is_refused() {
    let (d, a) = exchange(
        Binding::c10d("a"),
        Some(SECRET),
        Binding::c10d("b"),
        Some(SECRET),
    )
    .await;
    refused(
        d,
        RefusalKind::BadProof,
        "did not prove that it holds the cluster secret",
    );
    assert!(a.is_err());
    let (d, a) = exchange(
        Binding::agent(),
        Some(SECRET),
        Binding::c10d(""),
        Some(SECRET),
    )
    .await;
    // The acceptor refuses the agent's magic at once and hangs up.
    refused(a, RefusalKind::NotAPeer, "not a wasmrpc c10d peer");
    refused(
        d,
        RefusalKind::Io,
        "the peer closed the connection before its whole handshake",
    );
}

/// A dialer that holds the secret but proves for `binding` and `claim`
/// instead of c10d group "0" and what it announced; the acceptor must
/// refuse unless both are the real ones.
async fn proof_for(binding: Binding, claim: Identity) -> Result<Identity, Refusal> {
    let (mut s, acceptor) = c10d_acceptor(Some(SECRET), SHORT * 4);
    let nonce_d = random_bytes::<32>();
    let announced = Identity::of_rank(1);
    let hello = Hello {
        version: VERSION,
        has_secret: true,
        identity: announced,
        nonce: nonce_d,
    };
    s.write_all(&hello_bytes(Protocol::C10D, &hello))
        .await
        .unwrap();
    let welcome = read_welcome(&mut s).await;
    let t = Transcript {
        binding: &binding,
        dialer: &claim,
        acceptor: &welcome.identity,
        nonce_d: &nonce_d,
        nonce_a: &welcome.nonce,
    };
    let proof = Proof {
        mac: mac(Some(SECRET), Role::Dialer, &t, &[]),
    };
    s.write_all(&wire::encode(&proof, "proof").unwrap())
        .await
        .unwrap();
    acceptor.await.unwrap()
}

#[tokio::test]
async fn a_proof_made_for_another_binding_or_identity_serves_for_nothing() {
    // The honest proof passes: the attack below differs only in what it
    // is bound to.
    assert_eq!(
        proof_for(Binding::c10d("0"), Identity::of_rank(1))
            .await
            .unwrap(),
        Identity::of_rank(1)
    );
    for (binding, claim) in [
        (Binding::agent(), Identity::of_rank(1)),
        (Binding::c10d("1"), Identity::of_rank(1)),
        (Binding::c10d("0"), Identity::of_rank(2)),
        (Binding::c10d("0"), Identity::worker("rank1", 1)),
    ] {
        refused(
            proof_for(binding, claim).await,
            RefusalKind::BadProof,
            "a connection announcing rank 1 did not prove that it holds the cluster secret",
        );
    }
}

#[tokio::test]
async fn a_proof_replayed_on_another_connection_is_refused() {
    let hello = Hello {
        version: VERSION,
        has_secret: true,
        identity: Identity::of_rank(1),
        nonce: [7; 32],
    };
    // The first connection: the proof is honest (the attacker observed it).
    let (mut s, first) = c10d_acceptor(Some(SECRET), SHORT * 4);
    s.write_all(&hello_bytes(Protocol::C10D, &hello))
        .await
        .unwrap();
    let welcome = read_welcome(&mut s).await;
    let t = Transcript {
        binding: &Binding::c10d("0"),
        dialer: &hello.identity,
        acceptor: &welcome.identity,
        nonce_d: &hello.nonce,
        nonce_a: &welcome.nonce,
    };
    let proof = wire::encode(
        &Proof {
            mac: mac(Some(SECRET), Role::Dialer, &t, &[]),
        },
        "proof",
    )
    .unwrap();
    s.write_all(&proof).await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Identity::of_rank(1));
    // The replay: the same hello and proof on a new connection.
    let (mut s, second) = c10d_acceptor(Some(SECRET), SHORT * 4);
    s.write_all(&hello_bytes(Protocol::C10D, &hello))
        .await
        .unwrap();
    let welcome2 = read_welcome(&mut s).await;
    assert_ne!(welcome.nonce, welcome2.nonce, "the acceptor reused a nonce");
    s.write_all(&proof).await.unwrap();
    refused(
        second.await.unwrap(),
        RefusalKind::BadProof,
        "a connection announcing rank 1 did not prove that it holds the cluster secret",
    );
    // No admission (and no extension) reached the replaying peer.
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).await.unwrap();
    assert!(
        rest.is_empty(),
        "the acceptor sent {rest:?} after a bad proof"
    );
}

#[tokio::test]
async fn an_extension_altered_in_flight_is_refused_by_the_dialer() {
    let (mut ours, mut theirs) = duplex(1 << 16);
    let binding = Binding::agent();
    let dialing = tokio::spawn(async move {
        let (binding, me) = (Binding::agent(), dialer());
        dial(&mut ours, &Handshake::new(&binding, Some(SECRET), &me)).await
    });
    // An acceptor that holds the secret, but whose admission a third party
    // rewrote: the MAC covers the offer it made, the dialer gets another.
    let mut magic = [0u8; 4];
    theirs.read_exact(&mut magic).await.unwrap();
    let hello: Hello = wire::decode(
        &read_message(&mut theirs, Limits::HANDSHAKE).await.unwrap(),
        "hello",
    )
    .unwrap();
    let me = acceptor();
    let nonce_a = [3; 32];
    let t = Transcript {
        binding: &binding,
        dialer: &hello.identity,
        acceptor: &me,
        nonce_d: &hello.nonce,
        nonce_a: &nonce_a,
    };
    let mut welcome = Protocol::AGENT.magic().to_vec();
    welcome.extend(
        wire::encode(
            &Welcome {
                version: VERSION,
                has_secret: true,
                identity: me.clone(),
                nonce: nonce_a,
                mac: mac(Some(SECRET), Role::Acceptor, &t, &[]),
            },
            "welcome",
        )
        .unwrap(),
    );
    theirs.write_all(&welcome).await.unwrap();
    read_message(&mut theirs, Limits::HANDSHAKE).await.unwrap();
    let admitted = Admitted {
        extension: b"attacker's offer".to_vec(),
        mac: mac(Some(SECRET), Role::Admitted, &t, b"offer"),
    };
    theirs
        .write_all(&wire::encode(&admitted, "admission").unwrap())
        .await
        .unwrap();
    refused(
        dialing.await.unwrap(),
        RefusalKind::BadProof,
        "the admission from worker acceptor did not prove that it holds the cluster secret",
    );
}

#[tokio::test]
async fn garbage_magic_is_refused_at_once() {
    let (mut s, acceptor) = c10d_acceptor(None, SHORT * 10);
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    refused(
        acceptor.await.unwrap(),
        RefusalKind::NotAPeer,
        "not a wasmrpc c10d peer (its first bytes are [47, 45, 54, 20])",
    );
}

#[tokio::test]
async fn an_oversized_message_is_refused_before_it_is_read() {
    let (mut s, acceptor) = c10d_acceptor(None, SHORT * 10);
    let mut bytes = Protocol::C10D.magic().to_vec();
    bytes.extend_from_slice(&[0xff, 0xff]);
    s.write_all(&bytes).await.unwrap();
    refused(
        acceptor.await.unwrap(),
        RefusalKind::Oversized,
        "a hello of 65535 bytes is over the limit of 1024 bytes",
    );
    // The same limit on either end of a plain message.
    let (mut a, mut b) = duplex(1 << 16);
    let small = Limits {
        max_len: 8,
        timeout: SHORT,
    };
    refused(
        write_message(&mut a, &[0; 9], small).await,
        RefusalKind::Oversized,
        "a message of 9 bytes is over the limit of 8 bytes",
    );
    write_message(&mut a, &[1; 9], Limits::HANDSHAKE)
        .await
        .unwrap();
    refused(
        read_message(&mut b, small).await,
        RefusalKind::Oversized,
        "a message of 9 bytes is over the limit of 8 bytes",
    );
}

#[tokio::test]
async fn a_truncated_message_is_refused() {
    let (mut s, acceptor) = c10d_acceptor(Some(SECRET), SHORT * 10);
    let mut bytes = Protocol::C10D.magic().to_vec();
    bytes.extend_from_slice(&[100, 0]);
    bytes.extend_from_slice(&[1; 10]);
    s.write_all(&bytes).await.unwrap();
    drop(s);
    refused(
        acceptor.await.unwrap(),
        RefusalKind::Io,
        "the peer closed the connection before its whole hello",
    );
    // A hello that arrives whole but does not decode.
    let (mut s, acceptor) = c10d_acceptor(Some(SECRET), SHORT * 10);
    let mut bytes = Protocol::C10D.magic().to_vec();
    bytes.extend_from_slice(&[3, 0, 1, 1, 0xff]);
    s.write_all(&bytes).await.unwrap();
    refused(
        acceptor.await.unwrap(),
        RefusalKind::Malformed,
        "malformed hello",
    );
}

#[tokio::test]
async fn a_stalled_peer_is_refused_when_the_timeout_ends() {
    // It sends the magic and half a hello, then nothing, and stays open.
    let (mut s, acceptor) = c10d_acceptor(Some(SECRET), SHORT);
    let mut bytes = Protocol::C10D.magic().to_vec();
    bytes.extend_from_slice(&[40, 0, 1]);
    s.write_all(&bytes).await.unwrap();
    let started = std::time::Instant::now();
    refused(
        acceptor.await.unwrap(),
        RefusalKind::TimedOut,
        "no complete c10d handshake within 300ms",
    );
    assert!(started.elapsed() < SHORT * 5, "{:?}", started.elapsed());
    drop(s);
    // A plain message read times out the same way.
    let (_a, mut b) = duplex(64);
    refused(
        read_message(
            &mut b,
            Limits {
                max_len: 8,
                timeout: SHORT,
            },
        )
        .await,
        RefusalKind::TimedOut,
        "no complete message within 300ms",
    );
    // And a dialer whose acceptor never answers.
    let (mut ours, _theirs) = duplex(1 << 16);
    let (binding, me) = (Binding::agent(), dialer());
    refused(
        dial(
            &mut ours,
            &Handshake::new(&binding, None, &me).with_timeout(SHORT),
        )
        .await,
        RefusalKind::TimedOut,
        "no complete agent handshake within 300ms",
    );
}

#[tokio::test]
async fn another_version_is_refused() {
    let (mut s, acceptor) = c10d_acceptor(None, SHORT * 10);
    let hello = Hello {
        version: VERSION + 1,
        has_secret: false,
        identity: Identity::of_rank(1),
        nonce: [0; 32],
    };
    s.write_all(&hello_bytes(Protocol::C10D, &hello))
        .await
        .unwrap();
    refused(
        acceptor.await.unwrap(),
        RefusalKind::Version,
        "the peer speaks version 2 of the wasmrpc c10d handshake, this side 1",
    );
}

#[test]
fn the_protocols_differ_in_name_and_magic() {
    assert_ne!(Protocol::AGENT.name(), Protocol::C10D.name());
    assert_ne!(Protocol::AGENT.magic(), Protocol::C10D.magic());
    assert_eq!(Binding::c10d("7").to_string(), "c10d group 7");
    assert_eq!(Identity::of_rank(3).to_string(), "rank 3");
    assert_eq!(Identity::worker("w", 3).to_string(), "worker w");
}

#[test]
fn random_bytes_and_secrets_are_fresh() {
    assert_ne!(random_bytes::<32>(), random_bytes::<32>());
    let (a, b) = (generate_secret(), generate_secret());
    assert_ne!(a, b);
    assert_eq!(a.len(), 64);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
}
