//! The `tcp` backend's data path (this crate's own backend), beyond what the seeds check: every
//! collective's numbers on three ranks, each reduce op, point-to-point
//! tags, timeouts that fail instead of hanging, errors that name the rank,
//! group and op, destroy failing pending operations, `tcp://` init, and
//! connections authenticated with the cluster secret or TLS credentials.

mod common;

use common::run_ranks;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use wasmrpc_c10d::tcp::{self, TcpOptions};
use wasmrpc_c10d::{
    Backend, BackendArgs, BackendCreator, Error, InitOptions, NewGroupOptions, ReduceOp, World,
};
use wasmrpc_store::FileStore;

async fn init(rank: usize, world_size: usize, file: &std::path::Path, timeout: Duration) -> World {
    common::init(Some("tcp"), rank, world_size, file, timeout).await
}

fn vals(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

fn close(a: &Tensor, b: &Tensor) -> bool {
    a.allclose(b, 1e-6, 1e-6, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_compute_across_three_ranks() {
    const N: usize = 3;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_secs(15)).await;
        let r = rank as f32;

        // all_reduce with every op.
        let cases: [(ReduceOp, [f32; 2]); 6] = [
            (ReduceOp::SUM, [1. + 2. + 3., 3. * 10.]),
            (ReduceOp::PRODUCT, [1. * 2. * 3., 1000.]),
            (ReduceOp::MIN, [1., 10.]),
            (ReduceOp::MAX, [3., 10.]),
            (ReduceOp::AVG, [2., 10.]),
            (ReduceOp::PremulSum(0.5), [3., 15.]),
        ];
        for (op, want) in cases {
            let t = vals(&[r + 1., 10.]);
            world
                .all_reduce(&t, op, None)
                .unwrap()
                .wait()
                .await
                .unwrap();
            assert!(close(&t, &vals(&want)), "{op:?}: {t}");
        }
        for (op, want) in [
            (ReduceOp::BAND, 0b000i64),
            (ReduceOp::BOR, 0b111),
            (ReduceOp::BXOR, 0b111),
        ] {
            let t = Tensor::from_slice(&[1i64 << rank]);
            world
                .all_reduce(&t, op, None)
                .unwrap()
                .wait()
                .await
                .unwrap();
            assert_eq!(t.int64_value(&[0]), want, "{op:?}");
        }

        // broadcast from rank 1.
        let t = vals(&[r, r]);
        world.broadcast(&t, 1, None).unwrap().wait().await.unwrap();
        assert!(t.equal(&vals(&[1., 1.])));

        // reduce to rank 2 (others keep their input).
        let t = vals(&[r]);
        world
            .reduce(&t, 2, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let want = if rank == 2 { 3. } else { r };
        assert!(t.equal(&vals(&[want])), "{t}");

        // all_gather.
        let outs: Vec<Tensor> = (0..N).map(|_| vals(&[-1., -1.])).collect();
        world
            .all_gather(&outs, &vals(&[r, r * 2.]), None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        for (s, out) in outs.iter().enumerate() {
            assert!(out.equal(&vals(&[s as f32, s as f32 * 2.])));
        }

        // gather to rank 0, scatter from rank 0.
        let outs: Vec<Tensor> = (0..N).map(|_| vals(&[-1.])).collect();
        let list = (rank == 0).then_some(outs.as_slice());
        world
            .gather(&vals(&[r * 3.]), list, 0, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        if rank == 0 {
            for (s, out) in outs.iter().enumerate() {
                assert!(out.equal(&vals(&[s as f32 * 3.])));
            }
        }
        let parts: Vec<Tensor> = (0..N).map(|s| vals(&[s as f32 + 100.])).collect();
        let list = (rank == 0).then_some(parts.as_slice());
        let out = vals(&[0.]);
        world
            .scatter(&out, list, 0, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(out.equal(&vals(&[r + 100.])));

        // reduce_scatter: rank d gets sum over s of (s * 10 + d).
        let inputs: Vec<Tensor> = (0..N).map(|d| vals(&[r * 10. + d as f32])).collect();
        let out = vals(&[0.]);
        world
            .reduce_scatter(&out, &inputs, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(out.equal(&vals(&[30. + 3. * r])), "{out}");

        // all_to_all_single with uneven splits: rank s sends s+1 rows of
        // value s*10+d to each d... here: 1 row per peer, equal splits.
        let input = Tensor::from_slice(&[r * 10., r * 10. + 1., r * 10. + 2.]);
        let output = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        world
            .all_to_all_single(&output, &input, &[], &[], None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let want: Vec<f32> = (0..N).map(|s| s as f32 * 10. + r).collect();
        assert!(output.equal(&vals(&want)), "{output}");

        // Uneven splits: rank s sends (d + 1) rows to rank d.
        let rows_out: Vec<i64> = vec![rank as i64 + 1; N];
        let rows_in: Vec<i64> = (0..N as i64).map(|d| d + 1).collect();
        let input = Tensor::full([6], r as f64, (Kind::Float, Device::Cpu));
        let output = Tensor::zeros([3 * (rank as i64 + 1)], (Kind::Float, Device::Cpu));
        world
            .all_to_all_single(&output, &input, &rows_out, &rows_in, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let want: Vec<f32> = (0..N)
            .flat_map(|s| std::iter::repeat_n(s as f32, rank + 1))
            .collect();
        assert!(output.equal(&vals(&want)), "{output}");

        // Point to point in a ring, two tags issued out of order.
        let next = (rank + 1) % N;
        let prev = (rank + N - 1) % N;
        let a = world.send(&vals(&[r]), next, None, 7).unwrap();
        let b = world.send(&vals(&[r + 0.5]), next, None, 8).unwrap();
        let got8 = vals(&[0.]);
        let got7 = vals(&[0.]);
        world
            .recv(&got8, prev, None, 8)
            .unwrap()
            .wait()
            .await
            .unwrap();
        world
            .recv(&got7, prev, None, 7)
            .unwrap()
            .wait()
            .await
            .unwrap();
        a.wait().await.unwrap();
        b.wait().await.unwrap();
        assert!(got7.equal(&vals(&[prev as f32])));
        assert!(got8.equal(&vals(&[prev as f32 + 0.5])));

        world.barrier(None).unwrap().wait().await.unwrap();
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_collectives_on_two_groups_do_not_mix() {
    const N: usize = 2;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_secs(15)).await;
        let other = world
            .new_group(&[], NewGroupOptions::default())
            .await
            .unwrap()
            .unwrap();
        // Several collectives in flight at once, on both groups.
        let ts: Vec<Tensor> = (0..6).map(|i| vals(&[(rank * 10 + i) as f32])).collect();
        let works: Vec<_> = ts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let g = (i % 2 == 1).then_some(&other);
                world.all_reduce(t, ReduceOp::SUM, g).unwrap()
            })
            .collect();
        for w in works {
            w.wait().await.unwrap();
        }
        for (i, t) in ts.iter().enumerate() {
            assert!(t.equal(&vals(&[(10 + 2 * i) as f32])), "{i}: {t}");
        }
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_peer_times_out_with_context() {
    const N: usize = 2;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_millis(500)).await;
        if rank == 0 {
            let t = vals(&[0.]);
            let started = Instant::now();
            let err = world
                .recv(&t, 1, None, 3)
                .unwrap()
                .wait()
                .await
                .unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(5));
            assert!(matches!(err, Error::Timeout { .. }), "{err}");
            let text = err.to_string();
            for part in ["Timeout", "rank 0", "group 0", "recv", "rank 1"] {
                assert!(text.contains(part), "{text} lacks {part}");
            }
            // A collective the peer never joins times out the same way.
            let err = world
                .all_reduce(&t, ReduceOp::SUM, None)
                .unwrap()
                .wait()
                .await
                .unwrap_err();
            assert!(matches!(err, Error::Timeout { .. }), "{err}");
            assert!(err.to_string().contains("all_reduce"), "{err}");
            world
                .default_store()
                .unwrap()
                .set("done", b"1")
                .await
                .unwrap();
        } else {
            // Stays connected, silent, until rank 0 is done.
            let store = world.default_store().unwrap();
            store
                .wait(&["done"], Duration::from_secs(20))
                .await
                .unwrap();
        }
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_fails_pending_operations() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("store");
    let (w0, w1) = tokio::join!(
        init(0, 2, &file, Duration::from_secs(30)),
        init(1, 2, &file, Duration::from_secs(30))
    );
    let t = vals(&[0.]);
    let pending = w0.recv(&t, 1, None, 0).unwrap();
    w0.destroy_process_group(None).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), pending.wait())
        .await
        .expect("destroy did not wake the pending recv")
        .unwrap_err();
    assert!(err.to_string().contains("destroyed"), "{err}");
    assert!(!w0.is_initialized());
    let err = w0.barrier(None).unwrap_err();
    assert!(
        err.to_string().contains("has not been initialized"),
        "{err}"
    );
    w1.destroy_process_group(None).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_sizes_fail_with_context() {
    const N: usize = 2;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_secs(15)).await;
        let t = Tensor::zeros([rank as i64 + 1], (Kind::Float, Device::Cpu));
        let err = world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("all_reduce") && text.contains("sizes differ"),
            "{text}"
        );
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_init_method_and_double_init() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    run_ranks(2, move |rank, _| async move {
        let world = World::new();
        let opts = InitOptions {
            backend: Some("tcp".into()),
            init_method: Some(format!("tcp://127.0.0.1:{port}")),
            rank: Some(rank as i64),
            world_size: Some(2),
            timeout: Some(Duration::from_secs(15)),
            ..Default::default()
        };
        world.init_process_group(opts.clone()).await.unwrap();
        assert_eq!(world.get_rank(None).unwrap(), rank as i64);
        assert_eq!(world.get_world_size(None).unwrap(), 2);
        let err = world.init_process_group(opts).await.unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
        let t = vals(&[rank as f32 + 1.]);
        world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(t.equal(&vals(&[3.])));
        // Rank 0 hosts the TCP store: it leaves last.
        world.barrier(None).unwrap().wait().await.unwrap();
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_collectives_are_named() {
    const N: usize = 2;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_secs(15)).await;
        let t = vals(&[1.]);
        let work = if rank == 0 {
            world.all_reduce(&t, ReduceOp::SUM, None).unwrap()
        } else {
            world.barrier(None).unwrap()
        };
        let result = work.wait().await;
        if rank == 0 {
            let text = result.unwrap_err().to_string();
            assert!(
                text.contains(
                    "collective #1 of the group is all_reduce here but barrier on rank 1"
                ),
                "{text}"
            );
            world
                .default_store()
                .unwrap()
                .set("done", b"1")
                .await
                .unwrap();
        } else {
            // Rank 1's barrier got rank 0's all_reduce frame: also refused.
            let text = result.unwrap_err().to_string();
            assert!(
                text.contains("is barrier here but all_reduce on rank 0"),
                "{text}"
            );
            let store = world.default_store().unwrap();
            store
                .wait(&["done"], Duration::from_secs(20))
                .await
                .unwrap();
        }
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_fails_when_a_rank_never_joins() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("store");
    // Rank 0 of 2 alone: rank 1 never connects.
    let world = World::new();
    let started = Instant::now();
    let err = world
        .init_process_group(InitOptions {
            backend: Some("tcp".into()),
            store: Some(Arc::new(FileStore::new(&file, Some(2)))),
            rank: Some(0),
            world_size: Some(2),
            timeout: Some(Duration::from_millis(500)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    let text = err.to_string();
    assert!(
        text.contains("rank 0 of group 0") && text.contains("not every higher rank connected"),
        "{text}"
    );
    assert!(!world.is_initialized());
}

/// Registers a plugin backend that is `tcp` with the options `opts(rank)`.
fn register_tcp_with(name: &str, opts: fn(usize) -> TcpOptions) {
    let creator: BackendCreator = Arc::new(move |args: BackendArgs| {
        let o = opts(args.group_rank);
        Box::pin(tcp::create_with(args, o))
    });
    Backend::register_backend(name, creator, None).unwrap();
}

fn secret(s: &'static str) -> Option<Arc<[u8]>> {
    Some(Arc::from(s.as_bytes()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_holding_the_cluster_secret_connect() {
    register_tcp_with("tcp_same_secret", |_| TcpOptions {
        secret: secret("s3cret"),
        ..Default::default()
    });
    run_ranks(3, |rank, file| async move {
        let world = common::init(
            Some("tcp_same_secret"),
            rank,
            3,
            &file,
            Duration::from_secs(15),
        )
        .await;
        let t = vals(&[rank as f32]);
        world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(t.equal(&vals(&[3.])));
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_another_secret_is_refused() {
    register_tcp_with("tcp_other_secret", |rank| TcpOptions {
        secret: if rank == 0 {
            secret("one")
        } else {
            secret("two")
        },
        ..Default::default()
    });
    run_ranks(2, |rank, file| async move {
        let world = World::new();
        let err = world
            .init_process_group(InitOptions {
                backend: Some("tcp_other_secret".into()),
                store: Some(Arc::new(FileStore::new(&file, Some(2)))),
                rank: Some(rank as i64),
                world_size: Some(2),
                timeout: Some(Duration::from_millis(1500)),
                ..Default::default()
            })
            .await
            .unwrap_err();
        let text = err.to_string();
        if rank == 1 {
            // The dialer checks the acceptor's proof first.
            assert!(
                text.contains("rank 1 of group 0")
                    && text.contains("rank 0 did not prove that it holds the cluster secret"),
                "{text}"
            );
        } else {
            assert!(
                text.contains("rank 0 of group 0")
                    && text.contains("not every higher rank connected"),
                "{text}"
            );
        }
        assert!(!world.is_initialized());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_the_secret_is_refused() {
    register_tcp_with("tcp_half_secret", |rank| TcpOptions {
        secret: if rank == 0 { secret("s3cret") } else { None },
        ..Default::default()
    });
    run_ranks(2, |rank, file| async move {
        let world = World::new();
        let err = world
            .init_process_group(InitOptions {
                backend: Some("tcp_half_secret".into()),
                store: Some(Arc::new(FileStore::new(&file, Some(2)))),
                rank: Some(rank as i64),
                world_size: Some(2),
                timeout: Some(Duration::from_millis(1500)),
                ..Default::default()
            })
            .await
            .unwrap_err();
        if rank == 1 {
            let text = err.to_string();
            assert!(
                text.contains("the peer has a cluster secret but this rank has none"),
                "{text}"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listening_beyond_loopback_needs_a_secret() {
    register_tcp_with("tcp_exposed", |_| TcpOptions {
        host: Some("0.0.0.0".into()),
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let world = World::new();
    let err = world
        .init_process_group(InitOptions {
            backend: Some("tcp_exposed".into()),
            store: Some(Arc::new(FileStore::new(dir.path().join("store"), Some(1)))),
            rank: Some(0),
            world_size: Some(1),
            ..Default::default()
        })
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("would listen on 0.0.0.0 without a cluster secret")
            && text.contains("WASMRPC_CLUSTER_SECRET"),
        "{text}"
    );
}

/// The CA of the TLS tests' groups.
fn cluster_ca() -> &'static wasmrpc_credentials::CertificateAuthority {
    static CA: std::sync::OnceLock<wasmrpc_credentials::CertificateAuthority> =
        std::sync::OnceLock::new();
    CA.get_or_init(|| wasmrpc_credentials::CertificateAuthority::generate().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_tls_credentials_run_collectives_over_tls_beyond_loopback() {
    // TLS credentials alone allow a non-loopback address (no secret, no
    // insecure flag).
    register_tcp_with("tcp_tls", |rank| TcpOptions {
        host: Some("0.0.0.0".into()),
        tls: Some(
            cluster_ca()
                .credentials_for(&format!("worker{rank}"))
                .unwrap(),
        ),
        ..Default::default()
    });
    run_ranks(3, |rank, file| async move {
        let world = common::init(Some("tcp_tls"), rank, 3, &file, Duration::from_secs(15)).await;
        let t = vals(&[rank as f32, 1.]);
        world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(t.equal(&vals(&[3., 3.])));
        let big = Tensor::full([1 << 18], rank as f64, (Kind::Float, Device::Cpu));
        world
            .all_reduce(&big, ReduceOp::MAX, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(big.equal(&Tensor::full([1 << 18], 2., (Kind::Float, Device::Cpu))));
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_a_certificate_of_another_ca_is_refused() {
    register_tcp_with("tcp_tls_foreign", |rank| TcpOptions {
        tls: Some(if rank == 0 {
            cluster_ca().credentials_for("worker0").unwrap()
        } else {
            wasmrpc_credentials::CertificateAuthority::generate()
                .unwrap()
                .credentials_for("worker1")
                .unwrap()
        }),
        ..Default::default()
    });
    run_ranks(2, |rank, file| async move {
        let world = World::new();
        let err = world
            .init_process_group(InitOptions {
                backend: Some("tcp_tls_foreign".into()),
                store: Some(Arc::new(FileStore::new(&file, Some(2)))),
                rank: Some(rank as i64),
                world_size: Some(2),
                timeout: Some(Duration::from_millis(1500)),
                ..Default::default()
            })
            .await
            .unwrap_err();
        let text = err.to_string();
        if rank == 1 {
            // The dialer cannot verify rank 0's certificate.
            assert!(
                text.contains("rank 1 of group 0")
                    && text.contains("TLS with worker worker0 failed"),
                "{text}"
            );
        } else {
            assert!(text.contains("not every higher rank connected"), "{text}");
        }
        assert!(!world.is_initialized());
    })
    .await;
}

/// With a failure window far shorter than its delay, a rank that is slow
/// to join a collective but alive is waited for, not failed: its
/// heartbeats keep its connections alive (LIVE-1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_live_rank_is_waited_for_not_failed() {
    register_tcp_with("tcp_short_window", |_| TcpOptions {
        failure_timeout: Some(Duration::from_millis(200)),
        ..Default::default()
    });
    run_ranks(2, |rank, file| async move {
        let world = common::init(
            Some("tcp_short_window"),
            rank,
            2,
            &file,
            Duration::from_secs(15),
        )
        .await;
        if rank == 1 {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        let t = vals(&[1.0 + rank as f32]);
        world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(t.equal(&vals(&[3.])));
        world.destroy_process_group(None).unwrap();
    })
    .await;
}
