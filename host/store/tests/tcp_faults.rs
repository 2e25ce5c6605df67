//! The TCP store under bad input, dead servers, many clients and cancelled
//! operations.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_port, timed};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use wasmrpc_store::{Error, Store, TcpStore, TcpStoreOptions, TcpStoreServer};

const LIMIT: Duration = Duration::from_secs(60);
const MAGIC: [u8; 4] = 0x3C85_F7CEu32.to_le_bytes();

fn options(timeout: Duration) -> TcpStoreOptions {
    TcpStoreOptions {
        timeout,
        ..Default::default()
    }
}

async fn client(server: &TcpStoreServer) -> TcpStore {
    TcpStore::connect("127.0.0.1", server.port(), options(Duration::from_secs(10)))
        .await
        .unwrap()
}

/// Sends `bytes` on a raw connection and tells whether the server closed it.
async fn closed_after(server: &TcpStoreServer, bytes: &[u8]) -> bool {
    let mut raw = TcpStream::connect(server.local_addr()).await.unwrap();
    raw.write_all(bytes).await.unwrap();
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), raw.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test]
async fn garbage_closes_only_that_connection() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let good = client(&server).await;
        good.set("before", b"1").await.unwrap();

        // No VALIDATE first, a wrong magic, an unknown command, a huge length.
        assert!(closed_after(&server, b"\x01garbage").await);
        assert!(closed_after(&server, &[0, 1, 2, 3, 4]).await);
        let mut unknown = vec![0];
        unknown.extend_from_slice(&MAGIC);
        unknown.push(200);
        assert!(closed_after(&server, &unknown).await);
        let mut huge = vec![0];
        huge.extend_from_slice(&MAGIC);
        huge.push(3); // GET
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(closed_after(&server, &huge).await);
        // ADD on a value that is not a number closes that connection (as
        // PyTorch's server does) and leaves the value alone.
        good.set("text", b"abc").await.unwrap();
        let mut bad_add = vec![0];
        bad_add.extend_from_slice(&MAGIC);
        bad_add.push(4);
        bad_add.extend_from_slice(&5u64.to_le_bytes());
        bad_add.extend_from_slice(b"/text");
        bad_add.extend_from_slice(&1i64.to_le_bytes());
        assert!(closed_after(&server, &bad_add).await);

        // A truncated request followed by a hang-up.
        {
            let mut raw = TcpStream::connect(server.local_addr()).await.unwrap();
            let mut partial = vec![0];
            partial.extend_from_slice(&MAGIC);
            partial.extend_from_slice(&[1, 100, 0, 0]);
            raw.write_all(&partial).await.unwrap();
        }

        // The well-behaved client never noticed.
        assert_eq!(good.get("before").await.unwrap(), b"1");
        assert_eq!(good.get("text").await.unwrap(), b"abc");
        good.set("after", b"2").await.unwrap();
        let other = client(&server).await;
        assert_eq!(other.get("after").await.unwrap(), b"2");
    })
    .await;
}

#[tokio::test]
async fn get_of_a_missing_key_times_out_in_about_the_timeout() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = TcpStore::connect("127.0.0.1", server.port(), options(Duration::from_secs(1)))
            .await
            .unwrap();
        let t0 = Instant::now();
        let err = store.get("missing").await.unwrap_err();
        let took = t0.elapsed();
        assert!(err.to_string().contains("Timeout"), "{err}");
        assert!(
            took >= Duration::from_millis(950) && took < Duration::from_secs(2),
            "{took:?}"
        );
        // The connection stays usable after the cancelled wait.
        store.set("missing", b"now").await.unwrap();
        assert_eq!(store.get("missing").await.unwrap(), b"now");
    })
    .await;
}

#[tokio::test]
async fn server_going_away_fails_every_waiter_promptly() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let mut waiters = Vec::new();
        for i in 0..20 {
            let store = client(&server).await;
            waiters.push(tokio::spawn(async move {
                let t0 = Instant::now();
                let result = if i % 2 == 0 {
                    store.wait(&["never"], Duration::from_secs(120)).await
                } else {
                    store.set_timeout(Duration::from_secs(120));
                    store.get("never").await.map(|_| ())
                };
                (result, t0.elapsed())
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t0 = Instant::now();
        server.shutdown().await;
        for w in waiters {
            let (result, _) = w.await.unwrap();
            let err = result.unwrap_err();
            assert!(
                matches!(err, Error::ConnectionClosed { .. } | Error::Io { .. }),
                "{err:?}"
            );
        }
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    })
    .await;
}

#[tokio::test]
async fn dropping_the_server_closes_connections() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = client(&server).await;
        let waiter =
            tokio::spawn(async move { store.wait(&["x"], Duration::from_secs(120)).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(server);
        let err = waiter.await.unwrap().unwrap_err();
        assert!(
            matches!(err, Error::ConnectionClosed { .. } | Error::Io { .. }),
            "{err:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_dropped_operation_does_not_desync_the_client() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = client(&server).await;
        // Abandon a wait half-way: its STOP_WAITING would otherwise be read
        // as the reply to the next request.
        let abandoned = tokio::time::timeout(
            Duration::from_millis(100),
            store.wait(&["k"], Duration::from_secs(60)),
        )
        .await;
        assert!(abandoned.is_err());
        store.set("k", b"v").await.unwrap();
        assert_eq!(store.add("n", 7).await.unwrap(), 7);
        assert_eq!(store.get("k").await.unwrap(), b"v");
    })
    .await;
}

#[tokio::test]
async fn clients_can_cancel_a_wait_and_keep_going() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = client(&server).await;
        for _ in 0..5 {
            assert!(matches!(
                store.wait(&["nope"], Duration::from_millis(50)).await,
                Err(Error::Timeout { .. })
            ));
        }
        // Race the key's arrival against the cancel, many times.
        let setter = client(&server).await;
        for i in 0..30 {
            let key = format!("race{i}");
            let k2 = key.clone();
            let delay = Duration::from_millis(i % 10);
            let keys = [key.as_str()];
            let (set, waited) = tokio::join!(
                async {
                    tokio::time::sleep(delay).await;
                    setter.set(&k2, b"1").await
                },
                store.wait(&keys, Duration::from_millis(5))
            );
            set.unwrap();
            assert!(
                matches!(waited, Ok(()) | Err(Error::Timeout { .. })),
                "{waited:?}"
            );
            assert_eq!(store.get(&key).await.unwrap(), b"1");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_clients() {
    timed(Duration::from_secs(120), async {
        let server = Arc::new(TcpStoreServer::bind("127.0.0.1:0").await.unwrap());
        let n = 2000;
        // Everybody connects at once.
        let port = server.port();
        let connects: Vec<_> = (0..n)
            .map(|_| {
                tokio::spawn(async move {
                    TcpStore::connect("127.0.0.1", port, options(Duration::from_secs(60))).await
                })
            })
            .collect();
        let mut clients = Vec::with_capacity(n);
        for c in connects {
            clients.push(Arc::new(c.await.unwrap().unwrap()));
        }
        // Everybody waits for one key, then counts itself.
        let mut tasks = Vec::new();
        for c in &clients {
            let c = Arc::clone(c);
            tasks.push(tokio::spawn(async move {
                c.wait(&["start"], Duration::from_secs(60)).await?;
                c.add("count", 1).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        clients[0].set("start", b"go").await.unwrap();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(clients[1].add("count", 0).await.unwrap(), n as i64);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_masters_on_one_port_share_the_server() {
    timed(LIMIT, async {
        let port = free_port();
        let opts = TcpStoreOptions {
            timeout: Duration::from_secs(10),
            wait_for_workers: false,
            ..Default::default()
        };
        let (a, b) = tokio::join!(
            TcpStore::start_master("127.0.0.1", port, opts.clone()),
            TcpStore::start_master("127.0.0.1", port, opts.clone())
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(Arc::ptr_eq(a.server().unwrap(), b.server().unwrap()));
        a.set("shared", b"yes").await.unwrap();
        assert_eq!(b.get("shared").await.unwrap(), b"yes");
        // The server lives while any master store does.
        drop(a);
        assert_eq!(b.get("shared").await.unwrap(), b"yes");
    })
    .await;
}

#[tokio::test]
async fn a_closed_connection_is_replaced_on_the_next_operation() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = client(&server).await;
        store.set("text", b"not a number").await.unwrap();
        // The server closes the connection on ADD to a non-integer value.
        let err = store.add("text", 1).await.unwrap_err();
        assert!(matches!(err, Error::ConnectionClosed { .. }), "{err:?}");
        // CLI-3: the next operation opens a fresh connection.
        assert_eq!(store.get("text").await.unwrap(), b"not a number");
        assert_eq!(store.add("n", 2).await.unwrap(), 2);
    })
    .await;
}

#[tokio::test]
async fn master_times_out_waiting_for_workers() {
    timed(LIMIT, async {
        let opts = TcpStoreOptions {
            timeout: Duration::from_secs(1),
            world_size: Some(2),
            wait_for_workers: true,
        };
        let t0 = Instant::now();
        let err = TcpStore::start_master("127.0.0.1", 0, opts)
            .await
            .unwrap_err();
        assert_eq!(err.python_kind(), "DistStoreError");
        assert_eq!(
            err.to_string(),
            "Timed out after 1 seconds waiting for clients. 1/2 clients joined."
        );
        assert!(t0.elapsed() < Duration::from_secs(3));
    })
    .await;
}

/// A fake server: validates and answers the ping like a real one, then
/// answers the next request with `reply` and closes.
async fn lying_server(reply: Vec<u8>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut hello = [0u8; 10]; // VALIDATE + magic, PING + nonce
        sock.read_exact(&mut hello).await.unwrap();
        sock.write_all(&hello[6..10]).await.unwrap();
        let mut request = [0u8; 64];
        let _ = sock.read(&mut request).await.unwrap();
        sock.write_all(&reply).await.unwrap();
    });
    port
}

#[tokio::test]
async fn a_lying_server_gives_errors_not_panics() {
    timed(LIMIT, async {
        // CHECK answered with a byte that is neither READY nor NOT_READY.
        let port = lying_server(vec![7]).await;
        let store = TcpStore::connect("127.0.0.1", port, options(Duration::from_secs(5)))
            .await
            .unwrap();
        let err = store.check(&["k"]).await.unwrap_err();
        assert!(matches!(err, Error::Protocol(_)), "{err:?}");
        assert!(
            err.to_string().contains(&format!("127.0.0.1:{port}")),
            "{err}"
        );

        // A reply announcing u64::MAX bytes, then a hang-up: no huge
        // allocation, just a closed connection.
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"abc");
        let port = lying_server(huge).await;
        let store = TcpStore::connect("127.0.0.1", port, options(Duration::from_secs(5)))
            .await
            .unwrap();
        let err = store.compare_set("k", b"", b"v").await.unwrap_err();
        assert!(matches!(err, Error::ConnectionClosed { .. }), "{err:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_up_to_the_limit_pass_and_larger_ones_are_refused_up_front() {
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let store = client(&server).await;
        let max = vec![0xABu8; 8 * 1024 * 1024];
        store.set("big", &max).await.unwrap();
        assert_eq!(store.get("big").await.unwrap(), max);
        let too_big = vec![0u8; 8 * 1024 * 1024 + 1];
        let err = store.set("bigger", &too_big).await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        let long_key = "k".repeat(8 * 1024);
        let err = store.set(&long_key, b"v").await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
        let key_at_limit = "k".repeat(8 * 1024 - 1); // plus the "/" prefix
        store.set(&key_at_limit, b"v").await.unwrap();
        assert_eq!(store.get(&key_at_limit).await.unwrap(), b"v");
    })
    .await;
}
