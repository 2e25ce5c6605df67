//! Round trip of a native no-op taking an int, against a raw TCP ping-pong
//! of 8 bytes on the same machine, in the same run (the design's "round trip,
//! small call" performance anchor). Prints the ratio, since only ratios measured in one
//! run are comparable.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wasmrpc::store::HashStore;
use wasmrpc::{Payload, RpcAgent, RpcBackendOptions, args, init_rpc};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

async fn agents() -> (RpcAgent, RpcAgent) {
    let store: Arc<dyn wasmrpc::store::Store> = Arc::new(HashStore::new());
    let start = |rank: u32| {
        let store = store.clone();
        async move {
            let options = RpcBackendOptions::default();
            options
                .registry
                .register_native("bench::noop", |_ctx, args| async move { args.get(0) });
            init_rpc(
                &format!("worker{rank}"),
                Some(rank),
                Some(2),
                store,
                options,
            )
            .await
        }
    };
    let (a, b) = tokio::join!(start(0), start(1));
    (a.expect("worker0 starts"), b.expect("worker1 starts"))
}

async fn rpc_round_trips(agent: &RpcAgent, iters: u64) -> Duration {
    let t = Instant::now();
    for i in 0..iters {
        let r = agent
            .rpc_sync("worker1", "bench::noop", args![i as i64])
            .await
            .expect("the call succeeds");
        debug_assert_eq!(r.as_int().ok(), Some(i as i64));
        std::hint::black_box(r);
    }
    t.elapsed()
}

async fn tcp_pair() -> TcpStream {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let _ = s.set_nodelay(true);
        let mut buf = [0u8; 8];
        while s.read_exact(&mut buf).await.is_ok() {
            if s.write_all(&buf).await.is_err() {
                break;
            }
        }
    });
    let s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    s
}

async fn tcp_round_trips(s: &mut TcpStream, iters: u64) -> Duration {
    let t = Instant::now();
    let mut buf = [0u8; 8];
    for i in 0..iters {
        s.write_all(&i.to_le_bytes()).await.expect("write");
        s.read_exact(&mut buf).await.expect("read");
    }
    t.elapsed()
}

fn main() {
    let rt = runtime();
    let (a0, a1) = rt.block_on(agents());
    let mut tcp = rt.block_on(tcp_pair());
    let _ = Payload::none();

    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("round_trip");
    g.bench_function("rpc_sync_native_noop_int", |b| {
        b.iter_custom(|iters| rt.block_on(rpc_round_trips(&a0, iters)))
    });
    g.bench_function("raw_tcp_ping_pong_8_bytes", |b| {
        b.iter_custom(|iters| rt.block_on(tcp_round_trips(&mut tcp, iters)))
    });
    g.finish();

    // The ratio, from one interleaved measurement.
    let n = 5_000;
    let (mut rpc, mut raw) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..5 {
        rpc += rt.block_on(rpc_round_trips(&a0, n / 5));
        raw += rt.block_on(tcp_round_trips(&mut tcp, n / 5));
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
    println!(
        "round trip: rpc_sync native no-op {:.1} us, raw TCP ping-pong {:.1} us, ratio {:.2}",
        per(rpc),
        per(raw),
        per(rpc) / per(raw)
    );
    c.final_summary();
    rt.block_on(async {
        let (r0, r1) = tokio::join!(
            a0.shutdown(true, Duration::ZERO),
            a1.shutdown(true, Duration::ZERO)
        );
        r0.and(r1).expect("graceful shutdown");
    });
}
