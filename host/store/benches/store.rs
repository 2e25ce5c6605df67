//! Store throughput: our `TcpStoreServer` against PyTorch's own TCPStore
//! server (libuv backend), measured in the same run with the same client
//! (ours), so only the server differs. Prints each measurement and the
//! ratio torch / ours (above 1 means ours is faster).
//!
//! A plain `harness = false` program rather than criterion, to keep the
//! crate's dependency set unchanged. Run with `cargo bench -p wasmrpc-store`.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use wasmrpc_store::{Store, TcpStore, TcpStoreOptions, TcpStoreServer};

const ROUND_TRIPS: usize = 5_000;
const CLIENTS: usize = 64;
const ADDS_PER_CLIENT: usize = 500;

fn options() -> TcpStoreOptions {
    TcpStoreOptions {
        timeout: Duration::from_secs(30),
        wait_for_workers: false,
        ..Default::default()
    }
}

/// Mean microseconds of one `set` + `get` pair on one client.
async fn set_get_round_trip(port: u16) -> f64 {
    let store = TcpStore::connect("127.0.0.1", port, options())
        .await
        .unwrap();
    for i in 0..200 {
        store.set("warm", &[i as u8]).await.unwrap();
        store.get("warm").await.unwrap();
    }
    let value = vec![7u8; 64];
    let t0 = Instant::now();
    for i in 0..ROUND_TRIPS {
        let key = format!("rt{}", i % 100);
        store.set(&key, &value).await.unwrap();
        store.get(&key).await.unwrap();
    }
    t0.elapsed().as_secs_f64() * 1e6 / ROUND_TRIPS as f64
}

/// `add` operations per second with `CLIENTS` clients adding concurrently.
async fn concurrent_adds(port: u16) -> f64 {
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        clients.push(Arc::new(
            TcpStore::connect("127.0.0.1", port, options())
                .await
                .unwrap(),
        ));
    }
    static ROUND: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let round = ROUND.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let key = format!("adds{port}-{round}");
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in &clients {
        let (c, key) = (Arc::clone(c), key.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ADDS_PER_CLIENT {
                c.add(&key, 1).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let total = (CLIENTS * ADDS_PER_CLIENT) as i64;
    assert_eq!(clients[0].add(&key, 0).await.unwrap(), total);
    total as f64 / secs
}

async fn torch_server() -> Option<(Child, u16)> {
    let env = std::env::var_os("WASMRPC_ENV").map(PathBuf::from)?;
    let python = env.join("venv/bin/python");
    if !python.exists() {
        println!(
            "wasmrpc-skip: torch python not found at {}",
            python.display()
        );
        return None;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/torch_store_server.py");
    let mut child = Command::new(python)
        .arg(script)
        .arg("1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    let stdout = child.stdout.take()?;
    let line = BufReader::new(stdout).lines().next_line().await.ok()??;
    let port = line.trim().parse().ok()?;
    Some((child, port))
}

/// Our server on a runtime and thread of its own, as PyTorch's runs on its
/// own daemon thread, so it does not share the clients' threads.
fn our_server() -> (u16, std::sync::mpsc::Sender<()>) {
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
            port_tx.send(server.port()).unwrap();
            // Serve until the bench is over.
            let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
        });
    });
    (port_rx.recv().unwrap(), stop_tx)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

const ROUNDS: usize = 3;

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (our_port, _stop) = our_server();
    rt.block_on(async {
        let torch = torch_server().await;
        // Alternate the two servers so drifting machine load hits both.
        let (mut ours_rt, mut ours_add, mut torch_rt, mut torch_add) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            ours_rt.push(set_get_round_trip(our_port).await);
            ours_add.push(concurrent_adds(our_port).await);
            if let Some((_child, port)) = &torch {
                torch_rt.push(set_get_round_trip(*port).await);
                torch_add.push(concurrent_adds(*port).await);
            }
        }
        let (our_rt, our_adds) = (median(ours_rt), median(ours_add));
        println!(
            "ours : set+get round trip {our_rt:8.1} us   add x{CLIENTS} clients {our_adds:10.0} ops/s   (median of {ROUNDS})"
        );
        if torch.is_some() {
            let (torch_rt, torch_adds) = (median(torch_rt), median(torch_add));
            println!(
                "torch: set+get round trip {torch_rt:8.1} us   add x{CLIENTS} clients {torch_adds:10.0} ops/s   (median of {ROUNDS})"
            );
            println!(
                "ratio: round trip torch/ours {:.2}x, add throughput ours/torch {:.2}x (above 1: ours is faster)",
                torch_rt / our_rt,
                our_adds / torch_adds
            );
        }
    });
}
