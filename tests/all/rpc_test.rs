//! Port of PyTorch's `rpc_test.py` (seed `rpc_test`), CPU tests of areas A,
//! B, C, G, H, I, K, O, P, Q and R; the RRef tests (areas D, E, F, M, the
//! RRef parts of B, G and P) are in [`rref`], the `@async_execution`
//! function tests (area J) in [`async_execution`], the parameter server
//! (`test_my_parameter_server[_sparse]`) in [`autograd`]. Every test keeps
//! the seed's name. Area P's sparse variants share their dense sibling's
//! body (a helper taking the arguments or a `sparse` flag) and compare
//! sparse results densely ([`expect_sparse`]).
//!
//! The seeds' Python user functions are the seed-fns wasm plugin's
//! (`plugins/seed-fns`), which every test worker serves as
//! `seed_fns::<name>` (`wasmrpc_tests::register_all`): `seed_fns::my_function`,
//! `seed_fns::raise_func`, `seed_fns::add_use_future_cb`, ... A few remain
//! native stand-ins registered as `seed::<name>` because the test inspects
//! their worker-side state from Rust or the plugin cannot be them yet
//! (`set_value`, `timed_out_rpc`, the barrier counter, `MyClass` by value,
//! `non_cont_test`; see `wasmrpc_tests::seed_fns` for why each), and the
//! seeds' sparse builders (`seed::nested_rpc_sparse`, in
//! `wasmrpc_tests::rref_fns`: a plugin cannot build a sparse tensor). Builtin ops
//! (`aten::add`, ...) are the workers' own (`wasmrpc::BuiltinOps`), run under
//! the default op policy; attacks on that policy are in [`sandbox`]. The
//! agent's failure detection, which PyTorch does not have, is tested in
//! [`failures`].
//! `[D]` tests run under `dist` (the seeds' `@dist_init`: 4 workers, body on
//! every rank, graceful shutdown, leak check); `[M]` tests manage init and
//! shutdown themselves.
//!
//! The seed tests of these areas that are not ported are listed with their
//! reasons in `tests/support/not_applicable.tsv` and `not_yet_ported.tsv`
//! (`wasmrpc_tests::skips::unported`); [`seed_coverage`] checks
//! that every seed test is ported or listed.

mod async_class;
mod async_execution;
mod autograd;
mod backend_registry;
mod cuda;
mod extra;
mod failures;
mod memory_budget;
mod profiling;
mod rref;
mod sandbox;
mod transport_security;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use wasmrpc::prelude::*;

use anyhow::ensure;
use tch::Tensor;
use wasmrpc::testing::{Worker, fresh_store, store_barrier, wait_until_node_failure, worker_name};
use wasmrpc::{
    Args, ErrorKind, Future, Payload, RpcBackendOptions, Value, args, collect_all,
    collected_futures, init_rpc, wait_all, wait_all_scope, worker_info,
};
use wasmrpc_tests::seed_fns::{BarrierCount, TimedOutRpcEvent, ValueFuture};
use wasmrpc_tests::{
    WORLD_SIZE, cluster, dist, dist_with, expect_err, expect_tensor, ones, python_cluster, rand,
    register_all, timed,
};

const ADD: &str = "aten::add";

fn n(w: &Worker) -> i64 {
    i64::from(w.rank) + 1
}

/// The seeds' `build_sparse_tensor()` (area P's sparse variants).
fn sparse() -> Tensor {
    wasmrpc_tests::rref_fns::build_sparse_tensor()
}

/// `p` is a sparse tensor with `want`'s values (the seeds' `assertEqual`
/// on sparse tensors compares them densely).
fn expect_sparse(p: &Payload, want: &Tensor) -> anyhow::Result<()> {
    let got = p.as_tensor()?;
    ensure!(got.is_sparse(), "result is not sparse: {got:?}");
    let (g, w) = (got.to_dense(None, false), want.to_dense(None, false));
    ensure!(
        g.size() == w.size() && g.allclose(&w, 1e-5, 1e-8, false),
        "sparse mismatch {g:?} vs {w:?}"
    );
    Ok(())
}

/// [`expect_sparse`] for a sparse `want`, else [`expect_tensor`]: the
/// checks of the tests run with dense and sparse arguments.
fn expect_same(p: &Payload, want: &Tensor) -> anyhow::Result<()> {
    if want.is_sparse() {
        expect_sparse(p, want)
    } else {
        expect_tensor(p, want)
    }
}

/// The test cluster plus the native RRef/sparse stand-ins of
/// `wasmrpc_tests::rref_fns` (`seed::nested_rpc_sparse`, ...).
fn sparse_cluster() -> wasmrpc::testing::ClusterBuilder {
    wasmrpc::testing::Cluster::builder(wasmrpc_tests::WORLD_SIZE).functions(|r| {
        register_all(r);
        wasmrpc_tests::rref_fns::register(r);
    })
}

/// Runs `body` on every rank of a started 4-worker cluster without the
/// automatic shutdown (`[M]` tests shut down themselves).
fn manual<F, Fut>(body: F)
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    timed(async move {
        let c = cluster(4).start().await?;
        c.run_on_all(body).await?;
        Ok(())
    });
}

/// Every `rpc_test` seed test of the checked areas is a test here (or, for
/// those whose subject is Python itself, in `python_plugins::rpc_test`) or
/// listed with its reason in `tests/support/not_applicable.tsv` or
/// `not_yet_ported.tsv`, never both.
#[test]
fn seed_coverage() {
    let tsv = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/seed-tests.tsv");
    let Ok(table) = std::fs::read_to_string(tsv) else {
        println!("skipping: {tsv} is not available");
        return;
    };
    let source = concat!(
        include_str!("rpc_test.rs"),
        include_str!("rpc_test/rref.rs"),
        include_str!("rpc_test/async_execution.rs"),
        include_str!("rpc_test/async_class.rs"),
        include_str!("rpc_test/autograd.rs"),
        include_str!("rpc_test/profiling.rs"),
        include_str!("rpc_test/cuda.rs"),
        include_str!("rpc_test/backend_registry.rs"),
        include_str!("python_plugins/rpc_test.rs")
    );
    let ported = |name: &str| source.contains(&format!("fn {name}() {{"));
    let unported = wasmrpc_tests::skips::unported("rpc_test");
    let skipped = |name: &str| unported.iter().any(|(n, _)| *n == name);
    let mut missing = Vec::new();
    let mut seen = 0;
    for line in table.lines().skip(1) {
        let cols: Vec<&str> = line.split('\t').collect();
        if cols.len() < 6
            || cols[0] != "rpc_test"
            || !"ABCDEFGHIJKLMOPQR".contains(cols[3])
            || cols[3].len() != 1
        {
            continue;
        }
        seen += 1;
        let name = cols[2];
        match (ported(name), skipped(name)) {
            (true, false) | (false, true) => {}
            (true, true) => missing.push(format!("{name}: ported and skipped")),
            (false, false) => missing.push(format!("{name}: neither ported nor skipped")),
        }
    }
    assert!(seen > 100, "read only {seen} seed tests from {tsv}");
    assert!(missing.is_empty(), "{missing:#?}");
}

// ---------------------------------------------------------------- A: init

#[test]
fn test_worker_id() {
    dist(|w| async move {
        let me = w.agent.get_worker_info(None)?;
        ensure!(me.name == worker_name(w.rank));
        let peer = w.agent.get_worker_info(Some(&w.dst()))?;
        ensure!(peer.name == w.dst());
        expect_err(
            w.agent.get_worker_info(Some("WorkerUnknown")),
            ErrorKind::RuntimeError,
            "could not find destination",
        )?;
        Ok(())
    });
}

#[test]
fn test_get_worker_infos() {
    dist(|w| async move {
        let infos = w.agent.get_worker_infos();
        let names: BTreeSet<String> = infos.iter().map(|i| i.name.clone()).collect();
        let ids: BTreeSet<u32> = infos.iter().map(|i| i.id).collect();
        ensure!(names == (0..4).map(worker_name).collect::<BTreeSet<_>>());
        ensure!(ids == (0..4).collect::<BTreeSet<_>>());
        Ok(())
    });
}

#[test]
fn test_duplicate_name() {
    timed(async {
        let store = fresh_store();
        let tasks: Vec<_> = (0..4u32)
            .map(|rank| {
                let store = store.clone();
                tokio::spawn(async move {
                    init_rpc(
                        "duplicate_name",
                        Some(rank),
                        Some(4),
                        store,
                        RpcBackendOptions::default(),
                    )
                    .await
                })
            })
            .collect();
        for t in tasks {
            expect_err(t.await?, ErrorKind::RuntimeError, "is not unique")?;
        }
        Ok(())
    });
}

#[test]
fn test_duplicate_name_2() {
    timed(async {
        let store = fresh_store();
        let tasks: Vec<_> = (0..4u32)
            .map(|rank| {
                let store = store.clone();
                tokio::spawn(async move {
                    let name = worker_name(rank % 3);
                    init_rpc(
                        &name,
                        Some(rank),
                        Some(4),
                        store,
                        RpcBackendOptions::default(),
                    )
                    .await
                })
            })
            .collect();
        for t in tasks {
            expect_err(t.await?, ErrorKind::RuntimeError, "is not unique")?;
        }
        Ok(())
    });
}

#[test]
fn test_reinit() {
    timed(async {
        let c = cluster(4).start().await?;
        let store = c.store().clone();
        c.run_on_all(move |w| {
            let store = store.clone();
            async move {
                w.store_barrier().await?;
                let again = init_rpc(
                    &worker_name(w.rank),
                    Some(w.rank),
                    Some(4),
                    store,
                    RpcBackendOptions::default(),
                )
                .await;
                expect_err(again, ErrorKind::RuntimeError, "is already initialized")?;
                w.agent.shutdown(true, Duration::ZERO).await?;
                anyhow::Ok(())
            }
        })
        .await?;
        Ok(())
    });
}

/// The seed's `_world_size_one(a, b)`: a one-worker group calls itself
/// with `rpc_sync`, `rpc_async` and `remote`.
fn world_size_one(a: fn() -> Tensor, b: fn() -> Tensor) {
    timed(async move {
        let options = RpcBackendOptions::default();
        register_all(&options.registry);
        let agent = init_rpc("me", Some(0), Some(1), fresh_store(), options).await?;
        let want = a() * 2;
        let f = "seed_fns::my_tensor_function";
        let r = agent.rpc_sync("me", f, args![a(), b()]).await?;
        expect_same(&r, &want)?;
        let r = agent.rpc_async("me", f, args![a(), b()]).await?;
        expect_same(&r, &want)?;
        let rref = agent.remote("me", f, args![a(), b()])?;
        expect_same(&rref.to_here(&agent, None).await?, &want)?;
        drop(rref);
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    });
}

#[test]
fn test_world_size_one() {
    world_size_one(|| ones(&[2, 2]), || ones(&[2, 2]));
}

#[test]
fn test_world_size_one_sparse() {
    world_size_one(sparse, sparse);
}

#[test]
fn test_invalid_names() {
    expect_err(
        worker_info("abc*", 0),
        ErrorKind::RuntimeError,
        "Worker name must match",
    )
    .unwrap();
    expect_err(
        worker_info(" ", 0),
        ErrorKind::RuntimeError,
        "Worker name must match",
    )
    .unwrap();
    expect_err(
        worker_info("", 0),
        ErrorKind::RuntimeError,
        "must be non-empty",
    )
    .unwrap();
    expect_err(
        worker_info(&"a".repeat(500), 0),
        ErrorKind::RuntimeError,
        "shorter than 128",
    )
    .unwrap();
    assert!(worker_info("worker-1:a_b", 3).is_ok());
}

#[test]
fn test_worker_info_pickle() {
    dist(|w| async move {
        let me = w.agent.get_worker_info(None)?;
        let back = w
            .agent
            .rpc_sync(w.dst(), "seed_fns::identity", args![me.clone()])
            .await?;
        ensure!(back.as_worker_info()? == me);
        Ok(())
    });
}

#[test]
fn test_deadlock() {
    // The seed's process-group init after a slow RPC becomes the harness's
    // out-of-band store barrier (issue #45089: RPC and PG init must not
    // deadlock).
    dist(|w| async move {
        if w.rank == 1 {
            let r = w
                .agent
                .rpc_async_with_timeout(
                    w.dst(),
                    "seed_fns::slow_add",
                    args![ones(&[2]), ones(&[2])],
                    Duration::from_secs(15),
                )
                .await?;
            expect_tensor(&r, &(ones(&[2]) * 2))?;
        }
        w.store_barrier().await?;
        Ok(())
    });
}

async fn add_then_barrier(w: &Worker) -> anyhow::Result<()> {
    let r = w
        .agent
        .rpc_sync(w.dst(), ADD, args![ones(&[2, 2]), 1])
        .await?;
    expect_tensor(&r, &(ones(&[2, 2]) + 1))?;
    w.store_barrier().await?;
    Ok(())
}

#[test]
fn test_init_pg_then_rpc() {
    // The "process group" is the store's out-of-band barrier, used before
    // RPC starts; then RPC works and the barrier still works.
    timed(async {
        let store = fresh_store();
        // One builder: its workers share the cluster's credentials.
        let c = cluster(4);
        let tasks: Vec<_> = (0..4u32)
            .map(|rank| {
                let (store, c) = (store.clone(), c.clone());
                tokio::spawn(async move {
                    store_barrier(&*store, "pg/before", 4).await?;
                    let agent = init_rpc(
                        &worker_name(rank),
                        Some(rank),
                        Some(4),
                        store.clone(),
                        c.options_for(rank),
                    )
                    .await?;
                    let r = agent
                        .rpc_sync((rank + 1) % 4, ADD, args![ones(&[2, 2]), 1])
                        .await?;
                    expect_tensor(&r, &(ones(&[2, 2]) + 1))?;
                    store_barrier(&*store, "pg/after", 4).await?;
                    agent.shutdown(true, Duration::ZERO).await?;
                    anyhow::Ok(())
                })
            })
            .collect();
        for t in tasks {
            t.await??;
        }
        Ok(())
    });
}

#[test]
fn test_init_rpc_then_pg() {
    dist(|w| async move { add_then_barrier(&w).await });
}

#[test]
fn test_init_rpc_twice() {
    timed(async {
        for round in 0..2 {
            let c = cluster(4).start().await?;
            c.run_on_all(move |w| async move {
                let r = w
                    .agent
                    .rpc_sync(w.dst(), ADD, args![ones(&[2, 2]), 1])
                    .await?;
                expect_tensor(&r, &(ones(&[2, 2]) + 1))?;
                if round == 1 {
                    let r = w
                        .agent
                        .rpc_sync(w.dst(), "seed_fns::foo_add", args![])
                        .await?;
                    expect_tensor(&r, &(ones(&[1]) * 2))?;
                }
                w.agent.shutdown(true, Duration::ZERO).await?;
                w.store_barrier().await?;
                anyhow::Ok(())
            })
            .await?;
        }
        Ok(())
    });
}

// ---------------------------------------------------------------- B: calls

#[test]
fn test_self_add() {
    dist(|w| async move {
        let me = w.agent.get_worker_info(None)?;
        let fut = w.agent.rpc_async(&me, ADD, args![ones(&[2, 2]), 1]);
        let r = w.agent.rpc_sync(&me, ADD, args![ones(&[2, 2]), 1]).await?;
        expect_tensor(&fut.await?, &(ones(&[2, 2]) + 1))?;
        expect_tensor(&r, &(ones(&[2, 2]) + 1))?;
        Ok(())
    });
}

#[test]
fn test_send_to_rank() {
    dist(|w| async move {
        let dst = (w.rank + 1) % w.world_size;
        let want = ones(&[2, 2]) + 1;
        let modes = [ExecMode::Sync, ExecMode::Async, ExecMode::Remote];
        for mode in modes {
            let r = run_func_in_mode(&w, dst, ADD, mode, args![ones(&[2, 2]), 1]).await?;
            expect_tensor(&r, &want).map_err(|e| e.context(format!("{mode:?}")))?;
        }
        // Invalid ranks: past the world, then negative.
        for bad in [i64::from(w.world_size) + 1, -1] {
            for mode in modes {
                let r = run_func_in_mode(&w, bad, ADD, mode, args![ones(&[2, 2]), 1]).await;
                expect_err(r, ErrorKind::RuntimeError, "")
                    .map_err(|e| e.context(format!("rank {bad}, {mode:?}")))?;
            }
        }
        // Non-integer ranks.
        for bad in [f64::from(dst) + 0.5, f64::from(dst) - 0.5] {
            for mode in modes {
                let r = run_func_in_mode(&w, bad, ADD, mode, args![ones(&[2, 2]), 1]).await;
                expect_err(r, ErrorKind::ValueError, "")
                    .map_err(|e| e.context(format!("rank {bad}, {mode:?}")))?;
            }
        }
        Ok(())
    });
}

/// The seed's `_run_func_in_mode`.
#[derive(Clone, Copy, Debug)]
enum ExecMode {
    Sync,
    Async,
    Remote,
}

async fn run_func_in_mode(
    w: &Worker,
    to: impl Into<wasmrpc::Dest>,
    f: &str,
    mode: ExecMode,
    args: Args,
) -> wasmrpc::Result<Payload> {
    match mode {
        ExecMode::Sync => w.agent.rpc_sync(to, f, args).await,
        ExecMode::Async => w.agent.rpc_async(to, f, args).wait().await,
        ExecMode::Remote => w.agent.remote(to, f, args)?.to_here(&w.agent, None).await,
    }
}

#[test]
fn test_send_to_rank_sparse() {
    dist(|w| async move {
        let dst = (w.rank + 1) % w.world_size;
        for coalesce in [false, true] {
            let build = || {
                let t = sparse();
                if coalesce { t.coalesce() } else { t }
            };
            for mode in [ExecMode::Sync, ExecMode::Async, ExecMode::Remote] {
                let (x, y) = (build(), build());
                let want = &x + &y;
                let r = run_func_in_mode(&w, dst, ADD, mode, args![x, y]).await?;
                expect_sparse(&r, &want)
                    .map_err(|e| e.context(format!("{mode:?}, coalesce={coalesce}")))?;
            }
        }
        Ok(())
    });
}

#[test]
fn test_add() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_sync(w.dst(), ADD, args![ones(&[k, k]), ones(&[k, k])])
            .await?;
        expect_tensor(&r, &(ones(&[k, k]) * 2))
    });
}

#[test]
fn test_int_callee() {
    dist(|w| async move {
        let dst = (w.rank + 1) % w.world_size;
        let r = w
            .agent
            .rpc_sync(dst, "seed_fns::return_callee_id", args![])
            .await?;
        ensure!(r.as_int()? == i64::from(dst));
        Ok(())
    });
}

#[test]
fn test_add_with_id() {
    dist(|w| async move {
        let k = n(&w);
        let info = w.agent.get_worker_info(Some(&w.dst()))?;
        let r = w
            .agent
            .rpc_sync(info, ADD, args![ones(&[k, k]), ones(&[k, k])])
            .await?;
        expect_tensor(&r, &(ones(&[k, k]) * 2))
    });
}

#[test]
fn test_scalar_add() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_sync(w.dst(), ADD, args![ones(&[k, k]), k])
            .await?;
        expect_tensor(&r, &(ones(&[k, k]) + k))
    });
}

#[test]
fn test_async_add() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_async(w.dst(), ADD, args![ones(&[k, k]), ones(&[k, k])])
            .wait()
            .await?;
        expect_tensor(&r, &(ones(&[k, k]) * 2))
    });
}

#[test]
fn test_nonzero() {
    dist(|w| async move {
        let x = ones(&[4, 4]);
        let r = i64::from(w.rank);
        let _ = x.get(r).get(r).fill_(0);
        let got = w
            .agent
            .rpc_sync(w.dst(), "aten::nonzero", args![&x])
            .await?;
        ensure!(got.as_tensor()?.equal(&x.nonzero()));
        Ok(())
    });
}

/// The seed's `_multi_rpc(sparse)`: 20 sequential adds on the next rank.
async fn multi_rpc(w: Worker, sparse_args: bool) -> anyhow::Result<()> {
    let dst = (w.rank + 1) % w.world_size;
    for i in 0..20 {
        let n = i + i64::from(w.rank) + 1;
        let (x, y) = if sparse_args {
            (sparse() * n, sparse() * n)
        } else {
            (ones(&[2, 2]), ones(&[2, 2]))
        };
        let want = &x * 2;
        let r = w.agent.rpc_sync(dst, ADD, args![x, y]).await?;
        expect_same(&r, &want)?;
    }
    Ok(())
}

#[test]
fn test_multi_rpc() {
    dist(|w| multi_rpc(w, false));
}

#[test]
fn test_multi_rpc_sparse() {
    dist(|w| multi_rpc(w, true));
}

#[test]
fn test_expected_src() {
    dist(|w| async move {
        let expected_src = (w.rank + w.world_size - 1) % w.world_size;
        w.agent
            .rpc_sync(w.dst(), "seed::set_value", args![w.rank])
            .await?;
        let v = w.agent.state::<ValueFuture>().get().wait().await?;
        ensure!(v.as_int()? == i64::from(expected_src));
        Ok(())
    });
}

#[test]
fn test_py_built_in() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_sync(w.dst(), "builtins.min", args![k, k + 1, k + 2])
            .await?;
        ensure!(r.as_int()? == k);
        Ok(())
    });
}

#[test]
fn test_py_user_defined() {
    dist(|w| async move {
        let k = n(&w);
        let a = Args::new()
            .kwarg("a", k)
            .kwarg("b", k + 1)
            .kwarg("c", k + 2);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns::my_function", a)
            .await?;
        ensure!(r.as_int()? == 3 * k + 3);
        Ok(())
    });
}

fn record_field(p: &Payload, field: &str) -> anyhow::Result<Payload> {
    match &p.value {
        Value::Record { fields, .. } => fields
            .iter()
            .find(|(f, _)| f == field)
            .map(|(_, v)| p.sub(v.clone()))
            .ok_or_else(|| anyhow::anyhow!("no field {field}")),
        other => anyhow::bail!("not a record: {other:?}"),
    }
}

#[test]
fn test_py_class_constructor() {
    dist(|w| async move {
        let k = n(&w);
        let obj = w.agent.rpc_sync(w.dst(), "seed::MyClass", args![k]).await?;
        ensure!(record_field(&obj, "a")?.as_int()? == k);
        Ok(())
    });
}

#[test]
fn test_py_class_instance_method() {
    dist(|w| async move {
        let k = n(&w);
        let obj = Payload::from_value(Value::Record {
            name: "MyClass".into(),
            fields: vec![("a".into(), Value::Int(2))],
        });
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed::MyClass.my_instance_method", args![obj, k])
            .await?;
        ensure!(r.as_int()? == 2 + k);
        Ok(())
    });
}

#[test]
fn test_py_class_method() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed::MyClass.my_class_method", args![k, k + 1])
            .await?;
        ensure!(r.as_int()? == 2 * k + 1);
        Ok(())
    });
}

#[test]
fn test_py_class_static_method() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed::MyClass.my_static_method", args![k + 10])
            .await?;
        ensure!(r.as_bool()?);
        Ok(())
    });
}

#[test]
fn test_py_multi_async_call() {
    dist(|w| async move {
        let k = n(&w);
        let info = w.agent.get_worker_info(Some(&w.dst()))?;
        let f1 = w
            .agent
            .rpc_async(&info, "seed::MyClass.my_static_method", args![k + 10]);
        let f2 = w
            .agent
            .rpc_async(&info, "builtins.min", args![k, k + 1, k + 2]);
        ensure!(f1.await?.as_bool()?);
        ensure!(f2.await?.as_int()? == k);
        Ok(())
    });
}

#[test]
fn test_py_no_return_result() {
    dist(|w| async move {
        ensure!(
            w.agent
                .rpc_sync(w.dst(), "seed_fns::no_result", args![])
                .await?
                .is_none()
        );
        Ok(())
    });
}

#[test]
fn test_py_tensors() {
    dist(|w| async move {
        let k = n(&w);
        let r = w
            .agent
            .rpc_sync(
                w.dst(),
                "seed_fns::my_tensor_function",
                args![ones(&[k, k]), ones(&[k, k])],
            )
            .await?;
        expect_tensor(&r, &(ones(&[k, k]) * 2))
    });
}

#[test]
fn test_py_tensors_multi_async_call() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..100)
            .map(|i| {
                w.agent.rpc_async(
                    w.dst(),
                    "seed_fns::my_tensor_function",
                    args![ones(&[i, i]), ones(&[i, i])],
                )
            })
            .collect();
        let results = wait_all(&futs).await?;
        for (i, r) in results.iter().enumerate() {
            let i = i as i64;
            expect_tensor(r, &(ones(&[i, i]) * 2))?;
        }
        Ok(())
    });
}

/// The seed's `build_complex_tensors()`: one tensor aliased everywhere, also
/// as a dict key.
fn build_complex_tensors(a: &Tensor) -> Payload {
    let t = || Payload::from(a);
    let b = || Payload::list(vec![t(), t()]);
    let c = Payload::list(vec![b(), b()]);
    let d = || Payload::list(vec![t(), b()]);
    let e = Payload::dict(vec![(t(), d())]);
    Payload::list(vec![t(), b(), c, d(), e])
}

#[test]
fn test_py_tensors_in_container() {
    dist(|w| async move {
        let k = n(&w);
        let a = Payload::list(vec![ones(&[k, k]).into(), ones(&[k, k]).into()]);
        let shared = ones(&[3, 3]);
        let complex = build_complex_tensors(&shared);
        let record = Payload {
            value: Value::Record {
                name: "TensorClass".into(),
                fields: vec![("tensors".into(), complex.value.clone())],
            },
            tensors: complex.tensors.iter().map(Tensor::shallow_clone).collect(),
            rrefs: Vec::new(),
        };
        let c = Payload::dict(vec![
            ("foo".into(), ones(&[k, k]).into()),
            ("bar".into(), ones(&[k, k]).into()),
        ]);
        let got = w
            .agent
            .rpc_sync(
                w.dst(),
                "seed_fns::my_complex_tensor_function",
                args![a.clone(), record.clone(), c.clone()],
            )
            .await?;
        // The local result: res = a[0]; res += each of a (a[0] doubles first),
        // then each dict value.
        let want_res = ones(&[k, k]) * 5;
        let items = got.items()?;
        ensure!(items.len() == 4);
        expect_tensor(&items[0], &want_res)?;
        let complex_items = complex.items()?;
        for i in 0..3 {
            ensure!(
                items[i + 1].equal(&complex_items[i]),
                "complex tensor {i} differs"
            );
        }
        // Aliasing survives: the tensors of one message that share a storage
        // share one again on arrival.
        let nested = items[2].items()?;
        let p0 = nested[0].as_tensor()?.data_ptr();
        let p1 = nested[1].as_tensor()?.data_ptr();
        ensure!(p0 == p1, "aliased tensors arrived as copies");
        Ok(())
    });
}

#[test]
fn test_py_sparse_tensors_in_container() {
    dist(|w| async move {
        let a = Payload::list(vec![sparse().into(), sparse().into()]);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns::my_container_sum", args![a])
            .await?;
        expect_sparse(&r, &(sparse() + sparse()))
    });
}

// ------------------------------------------------- C: nested, stress, chains

#[test]
fn test_nested_rpc() {
    dist(|w| async move {
        let me = worker_name(w.rank);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns::nested_rpc", args![me.as_str()])
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 1))
    });
}

#[test]
fn test_nested_rpc_sparse() {
    dist_with(sparse_cluster(), |w| async move {
        let me = worker_name(w.rank);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed::nested_rpc_sparse", args![me.as_str()])
            .await?;
        expect_sparse(&r, &(sparse() * 2))
    });
}

#[test]
fn test_stress_light_rpc() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..1000)
            .map(|_| w.agent.rpc_async(w.dst(), "seed_fns::light_rpc", args![]))
            .collect();
        for r in wait_all(&futs).await? {
            ensure!(r.as_int()? == 0);
        }
        Ok(())
    });
}

/// The seed's `_stress_test_rpc(f, repeat=20, args)`. The plugin's
/// `heavy_rpc` is the seeds' `heavy_rpc_sparse` too: both multiply in
/// place and divide, which for the caller's copy of the tensor is the same.
async fn stress_heavy_rpc(w: Worker, arg: fn() -> Tensor) -> anyhow::Result<()> {
    let futs: Vec<Future> = (0..20)
        .map(|_| {
            w.agent
                .rpc_async(w.dst(), "seed_fns::heavy_rpc", args![arg()])
        })
        .collect();
    for r in wait_all(&futs).await? {
        ensure!(r.as_int()? == 0);
    }
    Ok(())
}

#[test]
fn test_stress_heavy_rpc() {
    dist(|w| stress_heavy_rpc(w, || ones(&[100, 100])));
}

#[test]
fn test_stress_heavy_rpc_sparse() {
    dist(|w| stress_heavy_rpc(w, sparse));
}

#[test]
fn test_multi_layer_nested_async_rpc() {
    // Fire-and-forget chains of 20 hops; the graceful shutdown of `dist`
    // must drain them without timeouts or connection errors.
    dist(|w| async move {
        let dst = i64::from((w.rank + 1) % w.world_size);
        let r = w
            .agent
            .rpc_sync(
                worker_name(w.rank),
                "seed_fns::multi_layer_nested_async_rpc",
                args![dst, 4i64, 20i64],
            )
            .await?;
        ensure!(r.as_int()? == 0);
        Ok(())
    });
}

// ------------------------------------------------------------- G: timeouts

#[test]
fn test_set_and_get_default_rpc_timeout() {
    timed(async {
        let options = RpcBackendOptions {
            rpc_timeout: Duration::from_millis(500),
            ..Default::default()
        };
        let c = cluster(4).options(options).start().await?;
        c.run_on_all(|w| async move {
            ensure!(w.agent.get_rpc_timeout() == Duration::from_millis(500));
            Ok(())
        })
        .await?;
        c.shutdown().await?;
        Ok(())
    });
}

const TIMEOUT_TEXT: &str = "RPC ran for more than";

#[test]
fn test_default_timeout_used() {
    dist(|w| async move {
        let dst = w.dst();
        w.agent.set_rpc_timeout(Duration::from_millis(1));
        let futs: Vec<Future> = (0..10)
            .map(|_| w.agent.rpc_async(&dst, "seed_fns::my_sleep_func", args![]))
            .collect();
        for f in futs {
            expect_err(f.await, ErrorKind::RuntimeError, TIMEOUT_TEXT)?;
        }
        w.agent.set_rpc_timeout(Duration::from_secs(200));
        let f1 = w.agent.rpc_async(&dst, "seed_fns::my_sleep_func", args![1]);
        w.agent.set_rpc_timeout(Duration::from_millis(1));
        let f2 = w.agent.rpc_async(&dst, "seed_fns::my_sleep_func", args![1]);
        expect_err(f2.await, ErrorKind::RuntimeError, TIMEOUT_TEXT)?;
        f1.await?;
        w.agent.set_rpc_timeout(Duration::ZERO);
        w.agent
            .rpc_async(&dst, "seed_fns::my_sleep_func", args![])
            .await?;
        w.agent.set_rpc_timeout(wasmrpc::DEFAULT_RPC_TIMEOUT);
        Ok(())
    });
}

#[test]
fn test_rpc_timeouts() {
    dist(|w| async move {
        let dst = w.dst();
        let t = Duration::from_millis(100);
        let a = &w.agent;
        expect_err(
            a.rpc_async_with_timeout(&dst, "seed_fns::my_sleep_func", args![1], t)
                .await,
            ErrorKind::RuntimeError,
            TIMEOUT_TEXT,
        )?;
        a.rpc_async(&dst, "seed_fns::my_sleep_func", args![1])
            .await?;
        expect_err(
            a.rpc_sync_with_timeout(&dst, "seed_fns::my_sleep_func", args![1], t)
                .await,
            ErrorKind::RuntimeError,
            TIMEOUT_TEXT,
        )?;
        a.rpc_sync(&dst, "seed_fns::my_sleep_func", args![1])
            .await?;
        a.set_rpc_timeout(Duration::from_millis(1));
        expect_err(
            a.rpc_async(&dst, "seed_fns::my_sleep_func", args![1]).await,
            ErrorKind::RuntimeError,
            TIMEOUT_TEXT,
        )?;
        a.rpc_async_with_timeout(
            &dst,
            "seed_fns::my_sleep_func",
            args![1],
            Duration::from_secs(5),
        )
        .await?;
        a.rpc_async_with_timeout(&dst, "seed_fns::my_sleep_func", args![1], Duration::ZERO)
            .await?;
        a.rpc_sync_with_timeout(
            &dst,
            "seed_fns::my_sleep_func",
            args![1],
            Duration::from_secs(5),
        )
        .await?;
        a.rpc_sync_with_timeout(&dst, "seed_fns::my_sleep_func", args![1], Duration::ZERO)
            .await?;
        a.set_rpc_timeout(wasmrpc::DEFAULT_RPC_TIMEOUT);
        Ok(())
    });
}

// ------------------------------------------------------ H: error propagation

#[test]
fn test_py_function_exception() {
    dist(|w| async move {
        expect_err(
            w.agent
                .rpc_sync(w.dst(), "seed_fns::no_result", args![10])
                .await,
            ErrorKind::TypeError,
            "no_result()",
        )?;
        Ok(())
    });
}

#[test]
fn test_py_raise_in_user_func() {
    // The callee logs the error (the seed checks its stderr); the caller gets
    // the ValueError with its message. The plugin's `raise_func` is also
    // registered under a name of its own, so that this test's log lines are
    // its own.
    const RAISE: &str = "seed_fns::raise_func#test_py_raise_in_user_func";
    let logs = wasmrpc::testing::global_logs();
    let builder = cluster(4).functions(|r| {
        register_all(r);
        let raise_func = r
            .get("seed_fns::raise_func")
            .expect("register_all registers the seed-fns plugin");
        r.register(RAISE, raise_func);
    });
    dist_with(builder, |w| async move {
        w.store_barrier().await?;
        let r = w.agent.rpc_async(w.dst(), RAISE, args![]).await;
        expect_err(r, ErrorKind::ValueError, "Expected error")?;
        w.store_barrier().await?;
        Ok(())
    });
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(RAISE)).collect();
    assert_eq!(lines.len(), 4, "expected one log line per callee:\n{text}");
    assert!(
        lines.iter().all(|l| l.contains("Expected error")),
        "{lines:?}"
    );
}

#[test]
fn test_py_raise_in_user_func_escaped_str() {
    dist(|w| async move {
        let e = expect_err(
            w.agent
                .rpc_sync(w.dst(), "seed_fns::raise_func_escape", args![])
                .await,
            ErrorKind::ValueError,
            "",
        )?;
        ensure!(e.message() == "\nFirst line of error \n next line of error \n last line of error");
        ensure!(!e.message().contains("\\n"));
        Ok(())
    });
}

/// The plugin's `custom_raise_func` raises `CustomException(True, "foo")`,
/// a class outside `ErrorKind`: errors cross as a kind and a message, so no
/// caller can rebuild it, and the caller gets the `RuntimeError` that names
/// the remote class and message.
#[test]
fn test_custom_exception_throw_during_reconstruction() {
    dist(|w| async move {
        if w.rank != 0 {
            let r = w
                .agent
                .rpc_sync(worker_name(0), "seed_fns::custom_raise_func", args![])
                .await;
            let e = expect_err(
                r,
                ErrorKind::RuntimeError,
                "Original exception on remote side was",
            )?;
            ensure!(e.message().contains("CustomException"), "{e}");
            ensure!(e.message().contains("CustomException: foo"), "{e}");
        }
        Ok(())
    });
}

#[test]
fn test_function_not_on_callee() {
    dist(|w| async move {
        if w.rank == 1 {
            ensure!(w.agent.registry().unregister("seed_fns::foo_add").is_some());
            w.agent
                .rpc_sync("worker0", "seed::set_value", args![w.rank])
                .await?;
        }
        if w.rank == 0 {
            w.agent.state::<ValueFuture>().get().wait().await?;
            ensure!(w.agent.registry().get("seed_fns::foo_add").is_some());
            let r = w
                .agent
                .rpc_sync("worker1", "seed_fns::foo_add", args![])
                .await;
            expect_err(r, ErrorKind::RuntimeError, "RPC pickler does not serialize")?;
            // The callee did not crash.
            expect_tensor(
                &w.agent
                    .rpc_sync("worker1", ADD, args![ones(&[1]), 1])
                    .await?,
                &(ones(&[1]) + 1),
            )?;
        }
        Ok(())
    });
}

#[test]
fn test_op_with_invalid_args() {
    dist(|w| async move {
        let r = w.agent.rpc_sync(w.dst(), ADD, args![]).await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "Overloaded torch operator invoked from Python failed to match any schema",
        )?;
        Ok(())
    });
}

// ------------------------------------------------------ I: futures, callbacks

#[test]
fn test_future_wait_twice() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..20)
            .map(|_| w.agent.rpc_async(w.dst(), "seed_fns::raise_func", args![]))
            .collect();
        expect_err(
            wait_all(&futs).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        for f in &futs {
            expect_err(f.wait().await, ErrorKind::ValueError, "Expected error")?;
        }
        Ok(())
    });
}

#[test]
fn test_wait_all() {
    dist(|w| async move {
        let agent = w.agent.clone();
        let dst = w.dst();
        let fut = wait_all_scope(async move {
            ensure_ok(
                collected_futures().is_some_and(|l| l.is_empty()),
                "collector not empty",
            )?;
            let fut = agent.rpc_async(&dst, ADD, args![ones(&[2, 2]), 1]);
            ensure_ok(
                collected_futures().is_some_and(|l| l.len() == 1),
                "future not collected",
            )?;
            Ok(fut)
        })
        .await?;
        ensure!(fut.done());
        expect_tensor(&fut.wait().await?, &(ones(&[2, 2]) + 1))?;
        ensure!(collected_futures().is_none());
        Ok(())
    });
}

fn ensure_ok(cond: bool, what: &str) -> wasmrpc::Result<()> {
    if cond {
        Ok(())
    } else {
        Err(wasmrpc::Error::runtime(what))
    }
}

#[test]
fn test_wait_all_multiple_call() {
    dist(|w| async move {
        let agent = w.agent.clone();
        let dst = w.dst();
        wait_all_scope(async move {
            for i in 0..20i64 {
                let fut = agent.rpc_async(&dst, ADD, args![ones(&[i, i]), 1]);
                let r = agent.rpc_sync(&dst, ADD, args![ones(&[i, i]), 1]).await?;
                ensure_ok(r.as_tensor()?.equal(&(ones(&[i, i]) + 1)), "sync result")?;
                ensure_ok(
                    fut.wait().await?.as_tensor()?.equal(&(ones(&[i, i]) + 1)),
                    "async result",
                )?;
            }
            // `rpc_sync` calls are not collected; only the 20 `rpc_async`.
            let got = collected_futures().map(|l| l.len());
            ensure_ok(got == Some(20), &format!("collected {got:?}"))?;
            Ok(())
        })
        .await?;
        ensure!(collected_futures().is_none());
        Ok(())
    });
}

#[test]
fn test_wait_all_timeout() {
    dist(|w| async move {
        let agent = w.agent.clone();
        let dst = w.dst();
        let r = wait_all_scope(async move {
            let _ = agent.rpc_async_with_timeout(
                &dst,
                "seed_fns::my_sleep_func",
                args![1],
                Duration::from_millis(100),
            );
            Ok(())
        })
        .await;
        expect_err(r, ErrorKind::RuntimeError, TIMEOUT_TEXT)?;
        ensure!(collected_futures().is_none());
        Ok(())
    });
}

#[test]
fn test_wait_all_raise_in_user_func() {
    dist(|w| async move {
        let agent = w.agent.clone();
        let dst = w.dst();
        let r = wait_all_scope(async move {
            let _ = agent.rpc_async(&dst, "seed_fns::raise_func", args![]);
            Ok(())
        })
        .await;
        expect_err(r, ErrorKind::ValueError, "Expected error")?;
        ensure!(collected_futures().is_none());
        Ok(())
    });
}

#[test]
fn test_wait_all_raise_in_body() {
    dist(|_w| async move {
        let r: wasmrpc::Result<()> =
            wait_all_scope(async { Err(wasmrpc::Error::value("Expected error")) }).await;
        expect_err(r, ErrorKind::ValueError, "Expected error")?;
        ensure!(collected_futures().is_none());
        Ok(())
    });
}

async fn exit_early(
    w: &Worker,
    failing: &str,
    fail_args: Args,
    kind: ErrorKind,
    needle: &str,
) -> anyhow::Result<()> {
    w.store_barrier().await?;
    let dst = w.dst();
    let f1 = w.agent.rpc_async(&dst, "seed::timed_out_rpc", args![]);
    let f2 = w.agent.rpc_async(&dst, failing, fail_args.clone());
    let f3 = w.agent.rpc_async(&dst, failing, fail_args);
    // Fails on the first error without waiting for `f1`, which stays
    // blocked until our successor releases it below.
    expect_err(wait_all(&[f1.clone(), f2, f3]).await, kind, needle)?;
    // Unblock the call our predecessor made to us.
    w.agent.state::<TimedOutRpcEvent>().set();
    f1.await?;
    Ok(())
}

#[test]
fn test_wait_all_exit_early_python() {
    dist(|w| async move {
        exit_early(
            &w,
            "seed_fns::raise_func",
            args![],
            ErrorKind::ValueError,
            "Expected error",
        )
        .await
    });
}

#[test]
fn test_wait_all_exit_early_builtin() {
    dist(|w| async move {
        exit_early(
            &w,
            ADD,
            args![rand(&[10]), rand(&[5])],
            ErrorKind::RuntimeError,
            "size of tensor",
        )
        .await
    });
}

#[test]
fn test_callback_simple() {
    dist(|w| async move {
        let k = n(&w);
        let set_by_cb = Future::new();
        let s = set_by_cb.clone();
        let fut = w
            .agent
            .rpc_async(w.dst(), ADD, args![ones(&[k, k]), ones(&[k, k])]);
        let _ = fut.then(move |f| {
            let r = f.wait_blocking()?;
            s.set_result(r.as_tensor()? + 1)?;
            Ok(Payload::none())
        });
        expect_tensor(&fut.wait().await?, &(ones(&[k, k]) * 2))?;
        expect_tensor(&set_by_cb.wait().await?, &(ones(&[k, k]) * 2 + 1))?;
        expect_tensor(&fut.wait().await?, &(ones(&[k, k]) * 2))?;
        Ok(())
    });
}

/// The seed's `fut.then(my_function)`: `then` hands its callback one
/// argument, and `my_function(a, b, c)` takes three. The callback is the
/// Python plugin's `my_function` (`seed_fns_py`), called through the
/// worker's registry with the one argument `then` has, so the error is
/// CPython's own for the call.
#[test]
fn test_callback_wrong_arg_num() {
    dist_with(python_cluster(WORLD_SIZE), |w| async move {
        let k = n(&w);
        let fut = w
            .agent
            .rpc_async(w.dst(), ADD, args![ones(&[k, k]), ones(&[k, k])]);
        let agent = w.agent.clone();
        let cb_fut = fut.then_async(move |f| async move {
            let value = f.wait().await?;
            agent
                .call_local("seed_fns_py::my_function", args![value])
                .await
        });
        expect_tensor(&fut.wait().await?, &(ones(&[k, k]) * 2))?;
        expect_err(
            cb_fut.wait().await,
            ErrorKind::RuntimeError,
            "my_function() missing 2 required positional arguments",
        )?;
        Ok(())
    });
}

#[test]
fn test_callback_multi() {
    dist(|w| async move {
        let k = n(&w);
        let fut = w
            .agent
            .rpc_async(w.dst(), ADD, args![ones(&[k, k]), ones(&[k, k])]);
        let children: Vec<Future> = (0..10i64)
            .map(|idx| fut.then(move |f| Ok((f.wait_blocking()?.as_tensor()? + idx).into())))
            .collect();
        for (idx, c) in children.iter().enumerate() {
            expect_tensor(&c.wait().await?, &(ones(&[k, k]) * 2 + idx as i64))?;
        }
        expect_tensor(&fut.wait().await?, &(ones(&[k, k]) * 2))?;
        Ok(())
    });
}

#[test]
fn test_callback_chain() {
    dist(|w| async move {
        let k = n(&w);
        let mut fut = w.agent.rpc_async(w.dst(), ADD, args![ones(&[k, k]), 1]);
        for _ in 0..20 {
            fut = fut.then(|f| Ok((f.wait_blocking()?.as_tensor()? + 1).into()));
        }
        expect_tensor(&fut.wait().await?, &(ones(&[k, k]) + 1 + 20))
    });
}

#[test]
fn test_callback_in_rpc() {
    dist(|w| async move {
        let r = w
            .agent
            .rpc_sync(
                w.peer(1),
                "seed_fns::add_use_future_cb",
                args![w.peer(2), ones(&[2, 2]), 1, 2],
            )
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 3))
    });
}

#[test]
fn test_callback_with_ret() {
    dist(|w| async move {
        let dst = w.dst();
        let agent = w.agent.clone();
        let fut3 = w
            .agent
            .rpc_async(&dst, ADD, args![ones(&[2, 2]), 1])
            .then_async(move |fut0| async move {
                let fut2 = agent
                    .rpc_async(&dst, ADD, args![fut0.wait().await?, 1])
                    .then(|fut1| Ok((fut1.wait_blocking()?.as_tensor()? + 1).into()));
                fut2.wait().await
            });
        expect_tensor(&fut3.wait().await?, &(ones(&[2, 2]) + 3))
    });
}

#[test]
fn test_callback_with_error() {
    dist(|w| async move {
        let fut = w.agent.rpc_async(w.dst(), "seed_fns::raise_func", args![]);
        let saw = Arc::new(AtomicBool::new(false));
        let s = saw.clone();
        let cb_fut = fut.then(move |f| {
            if let Err(e) = f.wait_blocking()
                && e.kind() == ErrorKind::ValueError
                && e.message() == "Expected error"
            {
                s.store(true, Ordering::SeqCst);
            }
            Err(wasmrpc::Error::runtime("Another expected error"))
        });
        expect_err(
            cb_fut.wait().await,
            ErrorKind::RuntimeError,
            "Another expected error",
        )?;
        ensure!(
            saw.load(Ordering::SeqCst),
            "callback did not see the parent's error"
        );
        Ok(())
    });
}

#[test]
fn test_add_done_callback() {
    dist(|w| async move {
        let k = n(&w);
        let set_by_cb = Arc::new(AtomicBool::new(false));
        let s = set_by_cb.clone();
        let fut = w
            .agent
            .rpc_async(w.dst(), ADD, args![ones(&[k, k]), ones(&[k, k])]);
        fut.add_done_callback(move |f| {
            let _ = f.wait_blocking();
            s.store(true, Ordering::SeqCst);
        });
        let fut_then = fut.then(|_| Ok(true.into()));
        expect_tensor(&fut.wait().await?, &(ones(&[k, k]) * 2))?;
        fut_then.wait().await?;
        ensure!(set_by_cb.load(Ordering::SeqCst));
        Ok(())
    });
}

#[test]
fn test_mark_future_twice() {
    dist(|w| async move {
        let fut = w.agent.rpc_async(
            w.dst(),
            ADD,
            args![Tensor::zeros([2, 2], tch::kind::FLOAT_CPU), 1],
        );
        expect_tensor(
            &fut.wait().await?,
            &(Tensor::zeros([2, 2], tch::kind::FLOAT_CPU) + 1),
        )?;
        expect_err(
            fut.set_result(1).map(|()| 0),
            ErrorKind::RuntimeError,
            "Future can only be marked completed once",
        )?;
        Ok(())
    });
}

#[test]
fn test_future_done() {
    dist(|w| async move {
        let fut = w.agent.rpc_async(w.dst(), ADD, args![ones(&[2, 2]), 1]);
        fut.wait().await?;
        ensure!(fut.done());
        Ok(())
    });
}

#[test]
fn test_future_done_exception() {
    dist(|w| async move {
        let fut = w.agent.rpc_async(w.dst(), "seed_fns::raise_func", args![]);
        expect_err(fut.wait().await, ErrorKind::ValueError, "Expected error")?;
        ensure!(fut.done());
        Ok(())
    });
}

#[test]
fn test_future_in_rpc() {
    dist(|w| async move {
        let r = w
            .agent
            .rpc_sync(
                w.peer(1),
                "seed_fns::add_use_future_set_result",
                args![w.peer(2), ones(&[2, 2]), 1, 2],
            )
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 3))
    });
}

#[test]
fn test_future_nested_callback() {
    dist(|w| async move {
        let r = w
            .agent
            .rpc_sync(
                w.peer(1),
                "seed_fns::add_use_future_nested_cb",
                args![w.peer(2), ones(&[2, 2]), 1, 2],
            )
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 3))
    });
}

#[test]
fn test_wait_all_with_exception() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..10)
            .map(|_| w.agent.rpc_async(w.dst(), "seed_fns::raise_func", args![]))
            .collect();
        expect_err(
            wait_all(&futs).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        Ok(())
    });
}

#[test]
fn test_wait_all_with_partial_exception() {
    dist(|w| async move {
        let mut futs: Vec<Future> = (0..10)
            .map(|_| w.agent.rpc_async(w.dst(), ADD, args![ones(&[2, 2]), 1]))
            .collect();
        futs.push(w.agent.rpc_async(w.dst(), "seed_fns::raise_func", args![]));
        expect_err(
            wait_all(&futs).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        Ok(())
    });
}

// --------------------------------------- K: shutdown, join, barrier, gather

/// The seed's `_run_uneven_workload`: only rank 0 works.
async fn run_uneven_workload(w: &Worker, f: &str, x: Tensor) -> anyhow::Result<()> {
    if w.rank != 0 {
        return Ok(());
    }
    ensure!(w.world_size >= 3);
    let futs: Vec<Future> = (0..30)
        .map(|_| w.agent.rpc_async("worker1", f, args![&x]))
        .collect();
    for r in collect_all(&futs).await {
        ensure!(r?.as_int()? == 0);
    }
    let futs: Vec<Future> = (0..30)
        .map(|_| w.agent.rpc_async("worker2", f, args![&x]))
        .collect();
    for r in wait_all(&futs).await? {
        ensure!(r.as_int()? == 0);
    }
    Ok(())
}

#[test]
fn test_graceful_shutdown_with_uneven_workload() {
    dist(
        |w| async move { run_uneven_workload(&w, "seed_fns::heavy_rpc", ones(&[100, 100])).await },
    );
}

/// The seed's `_wait_all_workers(f, x)` (`twice`: `_wait_all_workers_twice`).
async fn wait_all_workers(w: Worker, x: Tensor, twice: bool) -> anyhow::Result<()> {
    run_uneven_workload(&w, "seed_fns::heavy_rpc", x).await?;
    w.agent.wait_all_workers(Duration::ZERO).await?;
    if twice {
        w.agent.wait_all_workers(Duration::ZERO).await?;
    }
    w.store_barrier().await?;
    w.agent.shutdown(false, Duration::ZERO).await?;
    Ok(())
}

#[test]
fn test_wait_all_workers_dense() {
    manual(|w| wait_all_workers(w, ones(&[100, 100]), false));
}

#[test]
fn test_wait_all_workers_twice_dense() {
    manual(|w| wait_all_workers(w, ones(&[100, 100]), true));
}

#[test]
fn test_wait_all_workers_sparse() {
    manual(|w| wait_all_workers(w, sparse(), false));
}

#[test]
fn test_wait_all_workers_twice_sparse() {
    manual(|w| wait_all_workers(w, sparse(), true));
}

fn slow_calls() -> wasmrpc::FaultInjection {
    // The seeds' SlowPickleClass(0.5): every call takes 0.5 s to get out.
    wasmrpc::FaultInjection::new().delay(wasmrpc::message_kinds::CALL, Duration::from_millis(500))
}

fn slow_cluster() -> wasmrpc::testing::ClusterBuilder {
    (0..4).fold(cluster(4), |b, r| b.faults(r, slow_calls()))
}

#[test]
fn test_wait_all_workers_timeout() {
    timed(async {
        let c = slow_cluster().start().await?;
        c.run_on_all(|w| async move {
            let r = w.agent.shutdown(true, Duration::from_millis(10)).await;
            expect_err(r, ErrorKind::RuntimeError, "")?;
            ensure!(!w.agent.is_running());
            w.store_barrier().await?;
            Ok(())
        })
        .await?;
        Ok(())
    });
}

#[test]
fn test_all_gather() {
    dist(|w| async move {
        let me = w.agent.get_worker_info(None)?;
        let got = w.agent.all_gather(me.id.into(), None, None).await?;
        ensure!(got.len() == 4);
        for r in 0..4u32 {
            ensure!(got.get(&worker_name(r)).map(|p| p.as_int().ok()) == Some(Some(i64::from(r))));
        }
        Ok(())
    });
}

#[test]
fn test_all_gather_timeout() {
    dist_with(slow_cluster(), |w| async move {
        w.agent.set_rpc_timeout(Duration::from_millis(100));
        let r = w.agent.all_gather(Payload::from(w.rank), None, None).await;
        if w.rank == 0 {
            expect_err(
                r,
                ErrorKind::RuntimeError,
                "timed out in _all_gather after 0.10 seconds",
            )?;
        } else {
            expect_err(r, ErrorKind::RuntimeError, TIMEOUT_TEXT)?;
        }
        w.agent.set_rpc_timeout(wasmrpc::DEFAULT_RPC_TIMEOUT);
        Ok(())
    });
}

/// The seed's `_test_barrier_helper`.
async fn barrier_helper(w: &Worker, names: &[String], multi_threaded: bool) -> anyhow::Result<()> {
    let mut names = names.to_vec();
    names.sort();
    let leader = names[0].clone();
    let me = w.agent.name().to_string();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    w.agent
        .rpc_sync(&leader, "seed::_reset_count", args![])
        .await?;
    let count = || w.agent.state::<BarrierCount>().0.load(Ordering::SeqCst);
    if !multi_threaded && me == leader {
        ensure!(count() == 0);
    }
    w.agent.barrier(&refs).await;
    w.agent
        .rpc_sync(&leader, "seed::_increment_count", args![])
        .await?;
    w.agent.barrier(&refs).await;
    if !multi_threaded && me == leader {
        ensure!(
            count() == names.len() as i64,
            "count {} != {}",
            count(),
            names.len()
        );
    }
    Ok(())
}

#[test]
fn test_rpc_barrier_all() {
    dist(|w| async move {
        let names: Vec<String> = w
            .agent
            .get_worker_infos()
            .into_iter()
            .map(|i| i.name)
            .collect();
        barrier_helper(&w, &names, false).await
    });
}

#[test]
fn test_rpc_barrier_subset() {
    dist(|w| async move {
        let odd = w.rank % 2;
        let names: Vec<String> = w
            .agent
            .get_worker_infos()
            .into_iter()
            .filter(|i| i.id % 2 == odd)
            .map(|i| i.name)
            .collect();
        barrier_helper(&w, &names, false).await
    });
}

#[test]
fn test_rpc_barrier_partial_subset() {
    dist(|w| async move {
        let names: Vec<String> = if w.rank % 2 == 1 {
            w.agent
                .get_worker_infos()
                .into_iter()
                .filter(|i| i.id % 2 == 1)
                .map(|i| i.name)
                .collect()
        } else {
            vec![worker_name(w.rank)]
        };
        barrier_helper(&w, &names, false).await
    });
}

#[test]
fn test_rpc_barrier_multithreaded() {
    dist(|w| async move {
        let names: Vec<String> = w
            .agent
            .get_worker_infos()
            .into_iter()
            .map(|i| i.name)
            .collect();
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let (w, names) = (w.clone(), names.clone());
                tokio::spawn(async move { barrier_helper(&w, &names, true).await })
            })
            .collect();
        for t in tasks {
            t.await??;
        }
        Ok(())
    });
}

#[test]
fn test_shutdown_followed_by_rpc() {
    manual(|w| async move {
        let r = w
            .agent
            .rpc_sync(w.dst(), ADD, args![ones(&[2, 2]), ones(&[2, 2])])
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) * 2))?;
        w.agent.shutdown(true, Duration::ZERO).await?;
        let e = expect_err(
            w.agent
                .rpc_sync(w.dst(), ADD, args![ones(&[2, 2]), 1])
                .await,
            ErrorKind::RuntimeError,
            "",
        )?;
        ensure!(
            e.message().starts_with("RPC has not been initialized"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn test_local_shutdown() {
    manual(|w| async move {
        w.agent.shutdown(false, Duration::ZERO).await?;
        Ok(())
    });
}

#[test]
fn test_local_shutdown_with_rpc() {
    manual(|w| async move {
        w.agent
            .rpc_sync(w.dst(), ADD, args![ones(&[2, 2]), 1])
            .await?;
        w.store_barrier().await?;
        w.agent.shutdown(false, Duration::ZERO).await?;
        Ok(())
    });
}

#[test]
fn test_handle_send_exceptions() {
    manual(|w| async move {
        w.agent.set_rpc_timeout(Duration::from_secs(10));
        w.store_barrier().await?;
        if w.rank == 1 {
            let _ = wait_until_node_failure(&w.agent, 2, "").await;
            let r = w
                .agent
                .rpc_async("worker2", ADD, args![ones(&[1]), 3])
                .await;
            expect_err(r, ErrorKind::RuntimeError, "")?;
        }
        w.agent.shutdown(false, Duration::ZERO).await?;
        Ok(())
    });
}

#[test]
fn test_shutdown_errors() {
    // As in the seed, followers run the leader's broadcast but fail to answer
    // it (an injected fault on their first response, which the agent turns
    // into an error reply), and their RRef-deletion step (a shutdown hook
    // here) raises 'simulation rref'.
    timed(async {
        let faults =
            || wasmrpc::FaultInjection::new().fail_sends(&[wasmrpc::message_kinds::RESPONSE], 1);
        let builder = (1..4).fold(cluster(4), |b, r| b.faults(r, faults()));
        let c = builder.start().await?;
        c.run_on_all(|w| async move {
            if w.rank != 0 {
                w.agent.add_shutdown_hook(Arc::new(|_agent| {
                    Box::pin(async { Err(wasmrpc::Error::runtime("simulation rref")) })
                }));
            }
            let r = w.agent.shutdown(true, Duration::ZERO).await;
            if w.rank == 0 {
                expect_err(r, ErrorKind::RuntimeError, "timed out in _all_gather")?;
            } else {
                expect_err(r, ErrorKind::RuntimeError, "simulation rref")?;
            }
            ensure!(!w.agent.is_running());
            w.store_barrier().await?;
            Ok(())
        })
        .await?;
        Ok(())
    });
}

// --------------------------------------------------------- O: serialization

#[test]
fn test_non_cont_tensors() {
    dist(|w| async move {
        if w.rank == 0 {
            let t = rand(&[5, 5]);
            let t_view = t.narrow(1, 2, 2);
            ensure!(!t_view.is_contiguous());
            let t_cont = t_view.contiguous();
            ensure!(t_cont.is_contiguous());
            ensure!(t_view.equal(&t_cont));
            let got = w
                .agent
                .rpc_sync(w.dst(), "seed::non_cont_test", args![&t_view, &t_cont])
                .await?
                .as_tensor()?;
            ensure!(!got.is_contiguous());
            ensure!(got.equal(&t_view));
            ensure!(got.stride() == t_view.stride());
        }
        Ok(())
    });
}

// ------------------------------------------------- Q: dynamic membership

/// Runs one task per rank on a shared store, failing if any fails.
fn per_rank<F, Fut>(world_size: u32, body: F)
where
    F: Fn(u32, Arc<dyn wasmrpc::store::Store>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    timed(async move {
        let store = fresh_store();
        let tasks: Vec<_> = (0..world_size)
            .map(|r| tokio::spawn(body(r, store.clone())))
            .collect();
        for (r, t) in tasks.into_iter().enumerate() {
            t.await?.map_err(|e| anyhow::anyhow!("rank {r}: {e:#}"))?;
        }
        Ok(())
    });
}

fn opts() -> RpcBackendOptions {
    let o = RpcBackendOptions::default();
    register_all(&o.registry);
    o
}

#[test]
fn test_dynamic_rpc_init_rpc() {
    per_rank(4, |rank, store| async move {
        let agent = init_rpc(&worker_name(rank), Some(rank), None, store, opts()).await?;
        ensure!(!agent.is_static_group());
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    });
}

fn scalar_one() -> Tensor {
    Tensor::from(1i64)
}

#[test]
fn test_dynamic_rpc_new_rank_can_communicated_with_existing_rank() {
    per_rank(4, |rank, store| async move {
        let agent = if rank == 0 {
            let a = init_rpc("worker0", Some(0), None, store.clone(), opts()).await?;
            store_barrier(&*store, "joined0", 4).await?;
            a
        } else {
            store_barrier(&*store, "joined0", 4).await?;
            let a = init_rpc(&worker_name(rank), Some(rank), None, store.clone(), opts()).await?;
            let r = a
                .rpc_sync("worker0", ADD, args![scalar_one(), scalar_one()])
                .await?;
            ensure!(r.as_tensor()?.int64_value(&[]) == 2);
            a
        };
        store_barrier(&*store, "done", 4).await?;
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    });
}

#[test]
fn test_dynamic_rpc_existing_rank_can_communicate_with_new_rank() {
    per_rank(4, |rank, store| async move {
        if rank != 0 {
            store_barrier(&*store, "joined0", 4).await?;
        }
        let agent = init_rpc(&worker_name(rank), Some(rank), None, store.clone(), opts()).await?;
        if rank == 0 {
            store_barrier(&*store, "joined0", 4).await?;
        }
        store_barrier(&*store, "all_joined", 4).await?;
        if rank == 0 {
            for r in 1..4u32 {
                let got = agent
                    .rpc_sync(worker_name(r), ADD, args![scalar_one(), scalar_one()])
                    .await?;
                ensure!(got.as_tensor()?.int64_value(&[]) == 2);
            }
        }
        store_barrier(&*store, "done", 4).await?;
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    });
}

#[test]
fn test_dynamic_rpc_init_rpc_without_rank() {
    timed(async {
        for method in ["file:///tmp/wasmrpc-init", "tcp://127.0.0.1:23456"] {
            let o = RpcBackendOptions {
                init_method: method.into(),
                ..opts()
            };
            expect_err(
                init_rpc("worker0", None, None, fresh_store(), o).await,
                ErrorKind::ValueError,
                "rank parameter missing",
            )?;
        }
        if std::env::var_os("RANK").is_some() {
            println!("skipping the env:// case: RANK is set in this environment");
        } else {
            let o = RpcBackendOptions {
                init_method: "env://".into(),
                ..opts()
            };
            expect_err(
                init_rpc("worker0", None, None, fresh_store(), o).await,
                ErrorKind::ValueError,
                "environment variable RANK expected",
            )?;
        }
        Ok(())
    });
}

#[test]
fn test_dynamic_and_static_init_rpc_together() {
    per_rank(4, |rank, store| async move {
        if rank < 3 {
            let agent = init_rpc(
                &worker_name(rank),
                Some(rank),
                Some(3),
                store.clone(),
                opts(),
            )
            .await?;
            store_barrier(&*store, "static_up", 4).await?;
            store_barrier(&*store, "tried", 4).await?;
            agent.shutdown(true, Duration::ZERO).await?;
        } else {
            store_barrier(&*store, "static_up", 4).await?;
            let r = init_rpc(&worker_name(rank), Some(rank), None, store.clone(), opts()).await;
            expect_err(
                r,
                ErrorKind::RuntimeError,
                "RPC group mixes statically and dynamically initialized members which is not supported.",
            )?;
            store_barrier(&*store, "tried", 4).await?;
        }
        Ok(())
    });
}

// ------------------------------------------------------------ R: options

#[test]
fn test_set_and_get_num_worker_threads() {
    timed(async {
        let options = RpcBackendOptions {
            num_worker_threads: 27,
            ..Default::default()
        };
        let c = cluster(4).options(options).start().await?;
        for a in c.agents() {
            ensure!(
                a.get_debug_info()
                    .get("agent.thread_pool_size")
                    .map(String::as_str)
                    == Some("27")
            );
        }
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_tensorpipe_set_default_timeout() {
    timed(async {
        let options = RpcBackendOptions {
            rpc_timeout: Duration::from_secs(100),
            ..Default::default()
        };
        let c = cluster(4).options(options).start().await?;
        for a in c.agents() {
            ensure!(a.get_rpc_timeout() == Duration::from_secs(100));
        }
        c.shutdown().await?;
        Ok(())
    });
}
