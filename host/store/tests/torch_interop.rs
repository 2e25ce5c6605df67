//! Wire compatibility with PyTorch 2.13's `TCPStore`, both ways: PyTorch's
//! client against our server, and our client against PyTorch's server (libuv
//! and legacy backends); and one file shared by our `FileStore` and PyTorch's.
//! Skips, printing `wasmrpc-skip: ...`, when the
//! project's torch venv is missing.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{conformance, free_port, script, timed, torch_python};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use wasmrpc_store::{FileStore, Store, TcpStore, TcpStoreOptions, TcpStoreServer, rendezvous};

const LIMIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torch_client_against_our_server() {
    torch_client_against_our_server_with(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torch_non_libuv_client_against_our_server() {
    torch_client_against_our_server_with(false).await;
}

async fn torch_client_against_our_server_with(use_libuv: bool) {
    let Some(python) = torch_python() else {
        return;
    };
    timed(LIMIT, async {
        let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
        let ours = TcpStore::connect(
            "127.0.0.1",
            server.port(),
            TcpStoreOptions {
                timeout: Duration::from_secs(10),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        ours.set("from_rust", b"rust").await.unwrap();

        let output = Command::new(&python)
            .arg(script("torch_store_client.py"))
            .arg("127.0.0.1")
            .arg(server.port().to_string())
            .arg(if use_libuv { "1" } else { "0" })
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stdout.lines().any(|l| l == "OK"),
            "torch client failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
        // What PyTorch's client wrote, our client reads.
        assert_eq!(ours.get("from_torch").await.unwrap(), b"torch");
        assert_eq!(ours.get("late").await.unwrap(), b"here");
        assert_eq!(ours.get("c").await.unwrap(), b"3");
    })
    .await;
}

/// Our client through every operation against a server someone else runs.
async fn drive_our_client(store: Arc<TcpStore>) {
    assert_eq!(store.get("from_torch_server").await.unwrap(), b"hello");
    conformance(Arc::clone(&store) as Arc<dyn Store>).await;
    store.ping().await.unwrap();
    store.set("from_rust", b"rust").await.unwrap();
}

async fn our_client_against_torch_server(use_libuv: bool) {
    let Some(python) = torch_python() else {
        return;
    };
    timed(LIMIT, async {
        let mut child = Command::new(&python)
            .arg(script("torch_store_server.py"))
            .arg(if use_libuv { "1" } else { "0" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port: u16 = lines
            .next_line()
            .await
            .unwrap()
            .expect("the server script printed no port")
            .trim()
            .parse()
            .unwrap();

        let store = Arc::new(
            TcpStore::connect(
                "127.0.0.1",
                port,
                TcpStoreOptions {
                    timeout: Duration::from_secs(10),
                    world_size: Some(2),
                    ..Default::default()
                },
            )
            .await
            .unwrap(),
        );
        drive_our_client(Arc::clone(&store)).await;

        // PyTorch's own client sees what ours wrote.
        stdin.write_all(b"check\n").await.unwrap();
        assert_eq!(
            lines.next_line().await.unwrap().as_deref(),
            Some("CHECK OK")
        );
        drop(stdin);
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{status}");

        // The server is gone: a waiting operation fails promptly.
        let t0 = Instant::now();
        assert!(store.get("anything").await.is_err());
        assert!(t0.elapsed() < Duration::from_secs(3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_against_torch_libuv_server() {
    our_client_against_torch_server(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_against_torch_legacy_server() {
    our_client_against_torch_server(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_file_store_shares_a_file_with_torch() {
    let Some(python) = torch_python() else {
        return;
    };
    timed(LIMIT, async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared");
        let store = FileStore::new(&path, None);
        store.set_timeout(Duration::from_secs(10));
        store.set("from_rust", b"rust").await.unwrap();
        store.add("n", 2).await.unwrap();
        store.set("to_delete", b"x").await.unwrap();

        let output = Command::new(&python)
            .arg(script("torch_file_store.py"))
            .arg(&path)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stdout.lines().any(|l| l == "OK"),
            "torch FileStore failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
        assert_eq!(store.get("from_torch").await.unwrap(), b"torch");
        assert_eq!(store.add("n", 0).await.unwrap(), 7);
        assert!(!store.check(&["to_delete"]).await.unwrap());
    })
    .await;
}

/// Our rank and PyTorch's `torch.distributed.rendezvous` rank meet on one
/// `tcp://` store; `torch_is_master` picks which side is rank 0 and hosts it.
async fn mixed_rendezvous(torch_is_master: bool) {
    let Some(python) = torch_python() else {
        return;
    };
    timed(LIMIT, async {
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let (torch_rank, our_rank) = if torch_is_master { (0, 1) } else { (1, 0) };
        let peer = Command::new(&python)
            .arg(script("torch_rendezvous_peer.py"))
            .arg(&url)
            .arg(torch_rank.to_string())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let ours = async {
            if torch_is_master {
                // Let PyTorch bind first; our client retries until it can.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let (store, rank, world_size) = rendezvous(&url, our_rank, 2, Duration::from_secs(30))
                .await
                .unwrap();
            assert_eq!((rank, world_size), (our_rank, 2));
            store
                .set(&format!("rank{rank}"), rank.to_string().as_bytes())
                .await
                .unwrap();
            for other in 0..2 {
                let got = store.get(&format!("rank{other}")).await.unwrap();
                assert_eq!(got, other.to_string().as_bytes());
            }
            store.add("done", 1).await.unwrap();
            while store.add("done", 0).await.unwrap() < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Rank 1's last operation is "bye"; rank 0 hosts the store and
            // waits for it, so it outlives rank 1.
            if our_rank == 0 {
                store.wait(&["bye"], Duration::from_secs(30)).await.unwrap();
            } else {
                store.set("bye", b"1").await.unwrap();
            }
            store
        };
        let (output, store) = tokio::join!(peer, ours);
        let output = output.unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stdout.lines().any(|l| l == "OK"),
            "torch rank failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
        drop(store);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torch_rank_joins_our_tcp_rendezvous() {
    mixed_rendezvous(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_rank_joins_torch_tcp_rendezvous() {
    mixed_rendezvous(true).await;
}
