//! `gloo` is libtorch's `c10d::ProcessGroupGloo`, compiled against Gloo
//! headers from Debian's `libgloo-dev` (the torch wheel ships none). These
//! tests are the proof that those headers agree with the Gloo compiled into
//! `libtorch_cpu.so` as far as the shim uses them: the engine is
//! constructed through libtorch's exported constructor and device factory,
//! names itself through its vtable, and computes every collective's numbers
//! (the seed expectations of `tcp_backend.rs`, which libtorch's Gloo must
//! reproduce). Also: PyTorch's error texts for what Gloo refuses, timeouts
//! with the rank, group and collective, and ordering of async collectives.

mod common;

use common::run_ranks;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use wasmrpc_c10d::{Error, InitOptions, NewGroupOptions, ReduceOp, World, engine};
use wasmrpc_store::FileStore;

async fn init(rank: usize, world_size: usize, file: &std::path::Path, timeout: Duration) -> World {
    common::init(Some("gloo"), rank, world_size, file, timeout).await
}

fn vals(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

fn close(a: &Tensor, b: &Tensor) -> bool {
    a.allclose(b, 1e-6, 1e-6, false)
}

#[test]
fn the_shim_compiled_against_debian_gloo_headers() {
    // libgloo-dev 0.0~git20220518 declares Gloo 0.5.0.
    assert_eq!(engine::gloo_header_version(), 500);
    // The object holds Gloo only through shared_ptrs: its size does not
    // depend on Gloo's own layouts.
    assert!(engine::gloo_sizeof_process_group() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_computes_across_four_ranks() {
    const N: usize = 4;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_secs(20)).await;
        let pg = world.default_group().unwrap();
        assert_eq!(pg.backend_for(Device::Cpu).unwrap().name(), "gloo");
        let r = rank as f32;

        let cases: [(ReduceOp, [f32; 2]); 4] = [
            (ReduceOp::SUM, [1. + 2. + 3. + 4., 4. * 10.]),
            (ReduceOp::PRODUCT, [24., 10000.]),
            (ReduceOp::MIN, [1., 10.]),
            (ReduceOp::MAX, [4., 10.]),
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
            (ReduceOp::BAND, 0b0000i64),
            (ReduceOp::BOR, 0b1111),
            (ReduceOp::BXOR, 0b1111),
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
        // libtorch 2.13's Gloo averages (older ones refused AVG).
        let t = vals(&[r + 1., 10.]);
        world
            .all_reduce(&t, ReduceOp::AVG, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(close(&t, &vals(&[2.5, 10.])), "AVG: {t}");
        // PREMUL_SUM is NCCL's: refused with PyTorch's text, naming the rank
        // and the collective.
        let err = world
            .all_reduce(&vals(&[1.]), ReduceOp::PremulSum(0.5), None)
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("Cannot use ReduceOp.PREMUL_SUM with Gloo")
                && text.contains(&format!("rank {rank}"))
                && text.contains("all_reduce"),
            "{text}"
        );
        assert_eq!(err.python_kind(), "DistBackendError");

        let t = vals(&[r, r]);
        world.broadcast(&t, 1, None).unwrap().wait().await.unwrap();
        assert!(t.equal(&vals(&[1., 1.])));

        let t = vals(&[r]);
        world
            .reduce(&t, 2, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        if rank == 2 {
            assert!(t.equal(&vals(&[6.])), "{t}");
        }

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

        // reduce_scatter: rank d gets the sum over s of (s * 10 + d).
        let inputs: Vec<Tensor> = (0..N).map(|d| vals(&[r * 10. + d as f32])).collect();
        let out = vals(&[0.]);
        world
            .reduce_scatter(&out, &inputs, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(out.equal(&vals(&[60. + 4. * r])), "{out}");

        let input = Tensor::from_slice(&[r * 10., r * 10. + 1., r * 10. + 2., r * 10. + 3.]);
        let output = Tensor::zeros([4], (Kind::Float, Device::Cpu));
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
        let input = Tensor::full([10], r as f64, (Kind::Float, Device::Cpu));
        let output = Tensor::zeros([4 * (rank as i64 + 1)], (Kind::Float, Device::Cpu));
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

        let ins: Vec<Tensor> = (0..N).map(|d| vals(&[r * 10. + d as f32])).collect();
        let outs: Vec<Tensor> = (0..N).map(|_| vals(&[-1.])).collect();
        world
            .all_to_all(&outs, &ins, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        for (s, out) in outs.iter().enumerate() {
            assert!(out.equal(&vals(&[s as f32 * 10. + r])), "{out}");
        }

        let ts = [vals(&[r, 1.]), vals(&[2. * r])];
        world
            .all_reduce_coalesced(&ts, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(ts[0].equal(&vals(&[6., 4.])) && ts[1].equal(&vals(&[12.])));

        // all_gather_coalesced issues one allgather per input, all at once,
        // and an all_reduce issued right after it must not slip between.
        let outs: Vec<Vec<Tensor>> = (0..N)
            .map(|_| vec![vals(&[-1.]), vals(&[-1., -1.])])
            .collect();
        let gathered = world
            .all_gather_coalesced(&outs, &[vals(&[r]), vals(&[r, 2. * r])], None)
            .unwrap();
        let after = vals(&[1.]);
        let summed = world.all_reduce(&after, ReduceOp::SUM, None).unwrap();
        gathered.wait().await.unwrap();
        summed.wait().await.unwrap();
        for (s, list) in outs.iter().enumerate() {
            let s = s as f32;
            assert!(list[0].equal(&vals(&[s])) && list[1].equal(&vals(&[s, 2. * s])));
        }
        assert!(after.equal(&vals(&[N as f32])));

        // Point to point in a ring, two tags received out of order.
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
async fn many_async_collectives_on_two_groups_keep_their_order() {
    const N: usize = 3;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_secs(20)).await;
        let other = world
            .new_group(&[], NewGroupOptions::default())
            .await
            .unwrap()
            .unwrap();
        // Many collectives in flight at once, on both groups, of different
        // sizes: the engine matches them by issue order.
        let ts: Vec<Tensor> = (0..40)
            .map(|i| {
                Tensor::full(
                    [i + 1],
                    (rank * 100) as f64 + i as f64,
                    (Kind::Float, Device::Cpu),
                )
            })
            .collect();
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
            let want = Tensor::full(
                [i as i64 + 1],
                300. + 3. * i as f64,
                (Kind::Float, Device::Cpu),
            );
            assert!(t.equal(&want), "{i}: {t}");
        }
        world.barrier(None).unwrap().wait().await.unwrap();
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_peer_times_out_with_context() {
    const N: usize = 2;
    run_ranks(N, |rank, file| async move {
        let world = init(rank, N, &file, Duration::from_millis(1000)).await;
        if rank == 0 {
            let t = vals(&[0.]);
            let started = Instant::now();
            let err = world
                .all_reduce(&t, ReduceOp::SUM, None)
                .unwrap()
                .wait()
                .await
                .unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(10));
            assert!(matches!(err, Error::Backend { .. }), "{err}");
            let text = err.to_string();
            for part in ["rank 0", "group 0", "all_reduce", "gloo", "Timed out"] {
                assert!(text.contains(part), "{text} lacks {part}");
            }
            world
                .default_store()
                .unwrap()
                .set("done", b"1")
                .await
                .unwrap();
        } else {
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
    let world = World::new();
    let started = Instant::now();
    let err = world
        .init_process_group(InitOptions {
            backend: Some("gloo".into()),
            store: Some(Arc::new(FileStore::new(&file, Some(2)))),
            rank: Some(0),
            world_size: Some(2),
            timeout: Some(Duration::from_millis(1000)),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(15));
    let text = err.to_string();
    assert!(text.contains("rank 0 of group 0"), "{text}");
    assert!(!world.is_initialized());
}

/// The engine's rendezvous calls back into the Rust store from other
/// threads: that works on a current-thread runtime too, whose one thread
/// drives the store's I/O and timers while the ranks wait.
#[tokio::test]
async fn a_current_thread_runtime_serves_the_rendezvous() {
    run_ranks(2, |rank, file| async move {
        let world = init(rank, 2, &file, Duration::from_secs(20)).await;
        let t = vals(&[rank as f32 + 1.]);
        world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(t.equal(&vals(&[3.])));
        world.barrier(None).unwrap().wait().await.unwrap();
        world.destroy_process_group(None).unwrap();
    })
    .await;
}
