//! Tests of `stream`: real handshakes on loopback sockets.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::tls::handshake::establish;
use crate::{CertificateAuthority, TlsEndpoints, worker_server_name};

/// A connected pair (dialer, acceptor) of workers `a` and `b` of one CA,
/// sealing at most `records_per_key` records under one key.
async fn pair(records_per_key: u64) -> (TlsStream, TlsStream) {
    pair_reading_through(records_per_key, plain_socket_reader()).await
}

/// The socket reader a pair uses unless a test gives another: the socket
/// itself.
fn plain_socket_reader() -> Box<crate::SocketReaderFn> {
    Box::new(|half| Box::new(half))
}

/// [`pair`], with the acceptor reading its socket through `acceptor_reader`.
async fn pair_reading_through(
    records_per_key: u64,
    acceptor_reader: Box<crate::SocketReaderFn>,
) -> (TlsStream, TlsStream) {
    let ca = CertificateAuthority::generate().unwrap();
    let (a, b) = (
        ca.credentials_for("a").unwrap(),
        ca.credentials_for("b").unwrap(),
    );
    pair_of(a, b, records_per_key, acceptor_reader).await
}

/// [`pair_reading_through`] with the credentials `a` and `b`.
async fn pair_of(
    a: crate::TlsCredentials,
    b: crate::TlsCredentials,
    records_per_key: u64,
    acceptor_reader: Box<crate::SocketReaderFn>,
) -> (TlsStream, TlsStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Arc::new(b.server_config().unwrap());
    let accept = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let conn = rustls::server::UnbufferedServerConnection::new(server).unwrap();
        establish(conn, tcp, records_per_key, &*acceptor_reader)
            .await
            .unwrap()
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let conn = rustls::client::UnbufferedClientConnection::new(
        Arc::new(a.client_config().unwrap()),
        worker_server_name("b").unwrap(),
    )
    .unwrap();
    let dialer = establish(conn, tcp, records_per_key, &|half| Box::new(half))
        .await
        .unwrap();
    (dialer, accept.await.unwrap())
}

/// A socket reader that counts the reads that found the socket empty.
struct CountingReader {
    inner: tokio::net::tcp::OwnedReadHalf,
    empty: Arc<std::sync::atomic::AtomicUsize>,
}

impl AsyncRead for CountingReader {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let read = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        if read.is_pending() {
            this.empty.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        read
    }
}

#[tokio::test]
async fn a_read_that_returns_content_leaves_the_socket_to_the_next_read() {
    let empty = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = empty.clone();
    let reader = move |inner| -> crate::SocketReader {
        Box::new(CountingReader {
            inner,
            empty: counter.clone(),
        })
    };
    let (mut dialer, mut acceptor) =
        pair_reading_through(record::RECORDS_PER_KEY, Box::new(reader)).await;
    for message in [&b"first"[..], b"second", b"third"] {
        dialer.write_all(message).await.unwrap();
        dialer.flush().await.unwrap();
        // The record is in the acceptor's socket before it reads.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let before = empty.load(std::sync::atomic::Ordering::SeqCst);
        let mut got = vec![0; 64];
        let n = acceptor.read(&mut got).await.unwrap();
        assert_eq!(&got[..n], message);
        assert_eq!(
            empty.load(std::sync::atomic::Ordering::SeqCst),
            before,
            "the read looked at the empty socket after taking its record"
        );
    }
}

/// A fresh CA, worker "b"'s endpoints, and a loopback listener for them.
async fn worker_b_listening() -> (
    CertificateAuthority,
    TlsEndpoints,
    TcpListener,
    std::net::SocketAddr,
) {
    let ca = CertificateAuthority::generate().unwrap();
    let server = ca.credentials_for("b").unwrap().endpoints().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (ca, server, listener, addr)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// Sends `len` bytes from `from` while `to` reads them, in writes of
/// `chunk` bytes, and checks they arrive unchanged.
async fn exchange(
    mut from: TlsWriteHalf,
    mut to: TlsReadHalf,
    len: usize,
    chunk: usize,
) -> (TlsWriteHalf, TlsReadHalf) {
    let send = tokio::spawn(async move {
        for part in pattern(len).chunks(chunk) {
            from.write_all(part).await.unwrap();
        }
        from.flush().await.unwrap();
        from
    });
    let mut got = vec![0; len];
    to.read_exact(&mut got).await.unwrap();
    assert!(
        got == pattern(len),
        "bytes changed on the way ({len} bytes)"
    );
    (send.await.unwrap(), to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_directions_carry_small_and_large_writes_at_once() {
    let (a, b) = pair(record::RECORDS_PER_KEY).await;
    assert!(!a.peer_certificates().is_empty() && !b.peer_certificates().is_empty());
    let ((mut a_read, mut a_write), (mut b_read, mut b_write)) = (a.into_split(), b.into_split());
    for (len, chunk) in [
        (1, 1),
        (100, 7),
        (MAX_FRAGMENT + 1, 1000),
        (3 << 20, 3 << 20),
    ] {
        (a_write, b_read) = exchange(a_write, b_read, len, chunk).await;
        (b_write, a_read) = exchange(b_write, a_read, len, chunk).await;
    }
    let there = tokio::spawn(exchange(a_write, b_read, 8 << 20, 1 << 20));
    exchange(b_write, a_read, 8 << 20, 1 << 20).await;
    there.await.unwrap();
}

#[tokio::test]
async fn keys_are_updated_before_their_limit_on_both_sides() {
    // Four records per key: a few hundred key updates each way.
    let (a, b) = pair(4).await;
    let ((a_read, a_write), (b_read, b_write)) = (a.into_split(), b.into_split());
    let (_, b_read) = exchange(a_write, b_read, 300 * MAX_FRAGMENT, 5000).await;
    let (_, _) = exchange(b_write, a_read, 300 * MAX_FRAGMENT, 5000).await;
    drop(b_read);
}

#[tokio::test]
async fn close_notify_ends_the_stream_and_a_bare_close_is_an_error() {
    let (mut a, mut b) = pair(record::RECORDS_PER_KEY).await;
    a.write_all(b"last words").await.unwrap();
    a.shutdown().await.unwrap();
    let mut got = Vec::new();
    b.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"last words");

    let (a, mut b) = pair(record::RECORDS_PER_KEY).await;
    drop(a);
    let e = b.read(&mut [0; 10]).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    assert!(e.to_string().contains("close_notify"), "{e}");
    // STREAM-2: it stays failed.
    assert!(b.read(&mut [0; 10]).await.is_err());
}

#[tokio::test]
async fn a_forged_record_fails_the_stream() {
    let (a, b) = pair(record::RECORDS_PER_KEY).await;
    let (_a_read, mut a_write) = a.into_split();
    let (mut b_read, _b_write) = b.into_split();
    // Plausible framing, wrong key: a peer on the path cannot inject.
    let mut forged = vec![record::APPLICATION_DATA, 3, 3, 0, 40];
    forged.extend([0x55; 40]);
    a_write.tcp.write_all(&forged).await.unwrap();
    let e = b_read.read(&mut [0; 10]).await.unwrap_err();
    assert!(e.to_string().contains("does not decrypt"), "{e}");
}

#[tokio::test]
async fn a_buffered_rustls_client_talks_to_this_record_layer() {
    // The probes of the integration tests are tokio-rustls clients: the
    // record layer must be plain TLS 1.3 to them.
    let (ca, server, listener, addr) = worker_b_listening().await;
    let accept = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut stream = server.accept(tcp).await.unwrap();
        let mut got = vec![0; 100_000];
        stream.read_exact(&mut got).await.unwrap();
        stream.write_all(&got).await.unwrap();
        stream.shutdown().await.unwrap();
    });
    let client = ca.credentials_for("a").unwrap();
    let connector = crate::probe_client_config(ca.cert_pem(), Some(&client)).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut stream = connector
        .connect(worker_server_name("b").unwrap(), tcp)
        .await
        .unwrap();
    stream.write_all(&pattern(50_000)).await.unwrap();
    // rustls asks for a key update (update_requested): this side must
    // follow the client's new key and answer with its own (STREAM-1).
    stream.get_mut().1.refresh_traffic_keys().unwrap();
    stream.write_all(&pattern(100_000)[50_000..]).await.unwrap();
    stream.flush().await.unwrap();
    let mut back = Vec::new();
    stream.read_to_end(&mut back).await.unwrap();
    assert!(back == pattern(100_000));
    accept.await.unwrap();
}

#[tokio::test]
async fn large_reads_take_records_straight_into_the_callers_buffer_to_the_end() {
    let (mut a, mut b) = pair(7).await;
    let sent = pattern(300_000);
    a.write_all(&sent).await.unwrap();
    a.shutdown().await.unwrap();
    // Reads of 1 MiB take the direct path, key updates (every 7 records)
    // and close_notify included.
    let (mut got, mut buf) = (Vec::new(), vec![0; 1 << 20]);
    loop {
        let n = b.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got == sent, "{} bytes back", got.len());

    // A close in the middle of a record is an error there too.
    let (a, mut b) = pair(record::RECORDS_PER_KEY).await;
    let (_a_read, mut a_write) = a.into_split();
    a_write.write_all(&pattern(100_000)).await.unwrap();
    a_write.flush().await.unwrap();
    assert_eq!(a_write.filled, 0, "everything went out");
    // Half a record, then the end.
    let mut half = vec![0; record::record_len(1000)];
    a_write
        .tx
        .seal(&mut half, record::APPLICATION_DATA, &[&[1; 1000]])
        .unwrap();
    a_write.tcp.write_all(&half[..500]).await.unwrap();
    drop(a_write);
    let mut got = vec![0; 100_000];
    b.read_exact(&mut got).await.unwrap();
    assert!(got == pattern(100_000));
    let e = b.read(&mut vec![0; 1 << 20]).await.unwrap_err();
    assert!(e.to_string().contains("middle of a TLS record"), "{e}");
}

#[tokio::test]
async fn bytes_that_are_not_tls_are_refused_at_once() {
    // An HTTP request claims, read as a TLS header, a record of 8239 bytes:
    // the acceptor must not wait for them (the dialer keeps its socket open).
    let (_ca, server, listener, addr) = worker_b_listening().await;
    let accept = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        server.accept(tcp).await.map(drop)
    });
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let refused = tokio::time::timeout(std::time::Duration::from_secs(5), accept)
        .await
        .expect("the acceptor still waits for the rest of a record that is not TLS")
        .unwrap();
    let e = refused.unwrap_err();
    assert!(e.to_string().contains("not a TLS record"), "{e}");
    assert_eq!(
        tcp.read(&mut [0; 16]).await.unwrap(),
        0,
        "the socket is closed"
    );
}

#[tokio::test]
async fn handshake_messages_over_several_records_are_taken_in_both_directions() {
    // Chains padded with 60 copies of the CA certificate: Certificate
    // messages of about 30 KiB, over several records, more than the
    // handshake buffer holds at first.
    let ca = CertificateAuthority::generate().unwrap();
    let padded = |name: &str| {
        let (cert, key) = ca.issue(name).unwrap();
        let chain = format!("{cert}{}", ca.cert_pem().repeat(60));
        assert!(chain.len() > 2 * (record::HEADER + record::MAX_BODY));
        crate::TlsCredentials::from_pem(ca.cert_pem(), &chain, &key).unwrap()
    };
    let (a, b) = pair_of(
        padded("a"),
        padded("b"),
        record::RECORDS_PER_KEY,
        plain_socket_reader(),
    )
    .await;
    assert_eq!(a.peer_certificates().len(), 61);
    let ((_a_read, a_write), (b_read, _b_write)) = (a.into_split(), b.into_split());
    exchange(a_write, b_read, 1000, 100).await;
}
