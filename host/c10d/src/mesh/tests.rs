//! The mesh's connections under attack: over TLS, a dialer without a
//! certificate, with one of another CA, or with a valid certificate for
//! another worker than the rank it claims is refused, and the member keeps
//! waiting for its real peer, with which the mesh then forms.

use super::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use wasmrpc_credentials::{
    CertificateAuthority, TlsCredentials, probe_client_config, worker_server_name,
};
use wasmrpc_store::HashStore;

const GROUP: &str = "0";
const LIMIT: Duration = Duration::from_secs(20);

fn auth(creds: &TlsCredentials, secret: Option<&[u8]>) -> MeshAuth {
    MeshAuth {
        secret: secret.map(Arc::from),
        tls: Some(MeshTls {
            endpoints: creds.endpoints().unwrap(),
            name: creds.worker_name().unwrap(),
        }),
    }
}

/// Starts rank 0 of a group of 2 and returns it once its address is
/// published.
async fn start_rank0(
    store: &Arc<dyn Store>,
    auth: MeshAuth,
) -> (JoinHandle<Result<Mesh>>, std::net::SocketAddr) {
    let s = Arc::clone(store);
    let rank0 =
        tokio::spawn(async move { Mesh::connect(&s, "127.0.0.1", auth, 0, 2, GROUP, LIMIT).await });
    store.wait(&["addr/0"], LIMIT).await.unwrap();
    let addr = String::from_utf8(store.get("addr/0").await.unwrap()).unwrap();
    (rank0, addr.parse().unwrap())
}

/// Plays a dialer announcing rank 1: TLS as `client` (or plain TCP when
/// `None`), then the handshake. Returns whether rank 0 kept the connection
/// open after it (`false`: refused).
async fn attack(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    client: Option<&TlsCredentials>,
    tls: bool,
) -> bool {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let kept = async {
        if !tls {
            let mut tcp = tcp;
            crate::handshake::dial(&mut tcp, None, GROUP, 1, 0)
                .await
                .ok()?;
            let mut byte = [0u8; 1];
            return match tokio::time::timeout(Duration::from_millis(500), tcp.read(&mut byte)).await
            {
                Err(_) => Some(()),
                Ok(_) => None,
            };
        }
        let connector = probe_client_config(ca_pem, client).unwrap();
        let mut stream = connector
            .connect(worker_server_name("worker0").unwrap(), tcp)
            .await
            .ok()?;
        crate::handshake::dial(&mut stream, None, GROUP, 1, 0)
            .await
            .ok()?;
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut byte)).await {
            Err(_) => Some(()),
            Ok(_) => None,
        }
    };
    kept.await.is_some()
}

/// Rank 1 joins for real; both ends exchange a frame.
async fn join_and_exchange(
    store: &Arc<dyn Store>,
    rank0: JoinHandle<Result<Mesh>>,
    auth1: MeshAuth,
) {
    let rank1 = Mesh::connect(store, "127.0.0.1", auth1, 1, 2, GROUP, LIMIT)
        .await
        .unwrap();
    let rank0 = rank0.await.unwrap().unwrap();
    let tag = Tag {
        kind: Kind::P2p,
        seq: 7,
        sub: 0,
        step: 0,
    };
    rank1
        .send("send", 0, tag, b"from rank 1", LIMIT)
        .await
        .unwrap();
    assert_eq!(
        rank0.recv("recv", 1, tag, LIMIT).await.unwrap(),
        b"from rank 1"
    );
    rank0
        .send("send", 1, tag, b"from rank 0", LIMIT)
        .await
        .unwrap();
    assert_eq!(
        rank1.recv("recv", 0, tag, LIMIT).await.unwrap(),
        b"from rank 0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_certificates_of_the_cluster_ca_connect_and_exchange_frames() {
    let ca = CertificateAuthority::generate().unwrap();
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let secret: &[u8] = b"s3cret";
    let (rank0, _) = start_rank0(
        &store,
        auth(&ca.credentials_for("worker0").unwrap(), Some(secret)),
    )
    .await;
    assert_eq!(store.get("name/0").await.unwrap(), b"worker0");
    join_and_exchange(
        &store,
        rank0,
        auth(&ca.credentials_for("worker1").unwrap(), Some(secret)),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialers_without_a_valid_certificate_for_their_rank_are_refused_and_the_mesh_forms() {
    let ca = CertificateAuthority::generate().unwrap();
    let other = CertificateAuthority::generate().unwrap();
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let (rank0, addr) =
        start_rank0(&store, auth(&ca.credentials_for("worker0").unwrap(), None)).await;
    // The real rank 1 publishes its name; it has not dialed yet.
    store.set("name/1", b"worker1").await.unwrap();

    // Plain TCP on a TLS port.
    assert!(
        !attack(addr, ca.cert_pem(), None, false).await,
        "a plaintext dialer was kept"
    );
    // TLS without a client certificate.
    assert!(
        !attack(addr, ca.cert_pem(), None, true).await,
        "a dialer without a certificate was kept"
    );
    // A certificate of another CA.
    let foreign = other.credentials_for("worker1").unwrap();
    assert!(
        !attack(addr, ca.cert_pem(), Some(&foreign), true).await,
        "another CA's certificate was kept"
    );
    // A valid certificate of the cluster CA, for another worker than the
    // one rank 1 published: a member cannot take another's rank.
    let mallory = ca.credentials_for("mallory").unwrap();
    assert!(
        !attack(addr, ca.cert_pem(), Some(&mallory), true).await,
        "an impersonator was kept"
    );

    join_and_exchange(
        &store,
        rank0,
        auth(&ca.credentials_for("worker1").unwrap(), None),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialer_refuses_an_acceptor_whose_certificate_names_another_worker() {
    let ca = CertificateAuthority::generate().unwrap();
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    // Rank 0 holds mallory's certificate but the store says rank 0 is
    // worker0 (e.g. rewritten by whoever reached the store).
    let (rank0, _) = start_rank0(&store, auth(&ca.credentials_for("mallory").unwrap(), None)).await;
    store.set("name/0", b"worker0").await.unwrap();
    let err = Mesh::connect(
        &store,
        "127.0.0.1",
        auth(&ca.credentials_for("worker1").unwrap(), None),
        1,
        2,
        GROUP,
        Duration::from_secs(2),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("TLS with worker worker0 failed"), "{err}");
    rank0.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_announcing_a_huge_length_allocates_nothing_up_front() {
    // A header claiming 2^60 bytes, then the connection ends: the reader
    // reports the short frame instead of aborting on the allocation.
    let (mut client, server) = tokio::io::duplex(1024);
    let mailbox = Arc::new(Mailbox::default());
    let reader = tokio::spawn(read_frames(0, Box::new(server), Arc::clone(&mailbox)));
    let mut header = [0u8; HEADER];
    header[0] = Kind::P2p as u8;
    header[18..26].copy_from_slice(&(1u64 << 60).to_le_bytes());
    client.write_all(&header).await.unwrap();
    client.write_all(b"only a few bytes").await.unwrap();
    drop(client);
    reader.await.unwrap();
    let why = mailbox.lock().closed.get(&0).cloned().unwrap();
    assert!(why.contains("16 of 1152921504606846976 bytes"), "{why}");
}

mod decoders {
    //! Arbitrary bytes from a peer: the handshake and the frame reader
    //! answer with an error or frames, never a panic, a hang or an
    //! allocation beyond what arrived.

    use super::*;
    use proptest::prelude::*;

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn the_handshake_refuses_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            secret in proptest::option::of(proptest::collection::vec(any::<u8>(), 1..8)),
        ) {
            let outcome = run(async {
                let (mut peer, mut ours) = tokio::io::duplex(4096);
                peer.write_all(&bytes).await.unwrap();
                drop(peer);
                let shake = crate::handshake::accept(&mut ours, secret.as_deref(), GROUP, 0);
                tokio::time::timeout(Duration::from_secs(5), shake).await
            });
            let outcome = outcome.expect("the handshake hung on a closed stream");
            // Only a well-formed hello without a secret can pass.
            if outcome.is_ok() {
                prop_assert!(secret.is_none() && bytes.starts_with(b"WC10"));
            }
        }

        #[test]
        fn the_frame_reader_takes_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            let why = run(async {
                let (mut peer, ours) = tokio::io::duplex(4096);
                let mailbox = Arc::new(Mailbox::default());
                let reader = tokio::spawn(read_frames(1, Box::new(ours), Arc::clone(&mailbox)));
                peer.write_all(&bytes).await.unwrap();
                drop(peer);
                tokio::time::timeout(Duration::from_secs(5), reader)
                    .await
                    .expect("the reader hung on a closed stream")
                    .unwrap();
                mailbox.lock().closed.get(&1).cloned()
            });
            prop_assert!(why.is_some(), "the reader ended without saying why");
        }
    }
}

fn p2p(seq: u64) -> Tag {
    Tag {
        kind: Kind::P2p,
        seq,
        sub: 0,
        step: 0,
    }
}

/// LIVE-2 on the mesh: rank 1 passes the handshake and then sends nothing
/// (a stopped process): rank 0's `recv` from it fails once the window has
/// passed, naming the cause, long before the collective's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_rank_fails_a_waiting_recv_within_the_window() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let plain = || MeshAuth {
        secret: None,
        tls: None,
    };
    let (rank0, addr) = start_rank0(&store, plain()).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    crate::handshake::dial(&mut silent, None, GROUP, 1, 0)
        .await
        .unwrap();
    let mut rank0 = rank0.await.unwrap().unwrap();
    rank0.watch_liveness(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let e = rank0.recv("recv", 1, p2p(1), LIMIT).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        e.to_string()
            .contains("rank 1 failed: no heartbeat for 0.3 s"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < LIMIT / 2,
        "{took:?}"
    );
    // Rank 0 sent heartbeats (a header of kind 2, nothing else) meanwhile.
    let mut header = [0u8; HEADER];
    silent.read_exact(&mut header).await.unwrap();
    assert_eq!(header[0], Kind::Heartbeat as u8);
    assert!(header[1..].iter().all(|&b| b == 0));
}

/// LIVE-1 on the mesh: two members with nothing to say keep their
/// connection over many windows, and frames still arrive after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_members_stay_connected_on_heartbeats() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let plain = || MeshAuth {
        secret: None,
        tls: None,
    };
    let (rank0, _) = start_rank0(&store, plain()).await;
    let mut rank1 = Mesh::connect(&store, "127.0.0.1", plain(), 1, 2, GROUP, LIMIT)
        .await
        .unwrap();
    let mut rank0 = rank0.await.unwrap().unwrap();
    for mesh in [&mut rank0, &mut rank1] {
        mesh.watch_liveness(Duration::from_millis(200));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    rank1
        .send("send", 0, p2p(2), b"still here", LIMIT)
        .await
        .unwrap();
    assert_eq!(
        rank0.recv("recv", 1, p2p(2), LIMIT).await.unwrap(),
        b"still here"
    );
    let heartbeats = rank0.activity[1].as_ref().unwrap().frames_sent();
    assert!(heartbeats >= 5, "{heartbeats} frames sent while idle");
}

/// A hostile peer's heartbeat that claims a payload is a protocol error:
/// the connection is failed (a `recv` from it says why), not read as if the
/// payload were the next frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_with_a_payload_is_a_protocol_error() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let plain = MeshAuth {
        secret: None,
        tls: None,
    };
    let (rank0, addr) = start_rank0(&store, plain).await;
    let mut hostile = TcpStream::connect(addr).await.unwrap();
    crate::handshake::dial(&mut hostile, None, GROUP, 1, 0)
        .await
        .unwrap();
    let rank0 = rank0.await.unwrap().unwrap();
    let mut header = [0u8; HEADER];
    header[0] = Kind::Heartbeat as u8;
    header[18..26].copy_from_slice(&5u64.to_le_bytes());
    hostile.write_all(&header).await.unwrap();
    hostile.write_all(b"hello").await.unwrap();
    let e = rank0.recv("recv", 1, p2p(3), LIMIT).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("protocol error: a heartbeat with a payload"),
        "{e}"
    );
}
