//! Wasm plugins and builtin ops as RPC targets across the workers of an
//! in-process cluster: the seed-fns plugin (built from source by
//! `wasmrpc-plugins`) registered as `seed_fns::<function>` on every worker,
//! and libtorch's ops by schema name (`aten::add`).
//!
//! Every test runs under [`DEFAULT_TEST_TIMEOUT`] on loopback ports the
//! system picks.

use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmrpc::prelude::*;

use anyhow::{Context, Result, anyhow, bail, ensure};
use tch::{Device, Kind, Tensor};
use wasmrpc::testing::{Cluster, ClusterBuilder, DEFAULT_TEST_TIMEOUT, run};
use wasmrpc::{Args, ErrorKind, FunctionRegistry, Payload, PluginHost, RpcAgent, args, wait_all};

/// The seed-fns plugin, loaded once per process.
fn seed_fns(host: &PluginHost) -> Arc<wasmrpc::wasm::Plugin> {
    host.load_file(wasmrpc_plugins::SEED_FNS)
        .expect("the seed-fns plugin loads")
}

/// A cluster of `n` workers that all serve seed-fns.
fn plugin_cluster(n: u32) -> ClusterBuilder {
    let host = PluginHost::shared().expect("the process's plugin host starts");
    let plugin = seed_fns(&host);
    Cluster::builder(n).functions(move |r: &FunctionRegistry| {
        host.register(&plugin, r);
    })
}

/// Starts `n` workers serving seed-fns, runs `body` against the cluster,
/// then shuts it down gracefully; all under the test timeout.
fn with_cluster<F, Fut>(n: u32, body: F)
where
    F: FnOnce(Arc<Cluster>) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    with_builder(plugin_cluster(n), body);
}

fn with_builder<F, Fut>(builder: ClusterBuilder, body: F)
where
    F: FnOnce(Arc<Cluster>) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let r: Result<()> = run(DEFAULT_TEST_TIMEOUT, async move {
        let cluster = Arc::new(builder.start().await?);
        let outcome = body(cluster.clone()).await;
        let cluster =
            Arc::try_unwrap(cluster).map_err(|_| anyhow!("the test body kept the cluster"))?;
        let shutdown = cluster.shutdown().await.map_err(|e| anyhow!("{e}"));
        outcome.and(shutdown)
    });
    if let Err(e) = r {
        panic!("{e:#}");
    }
}

fn ones(shape: &[i64]) -> Tensor {
    Tensor::ones(shape, (Kind::Float, Device::Cpu))
}

fn expect_err(
    r: wasmrpc::Result<Payload>,
    kind: ErrorKind,
    needle: &str,
) -> Result<wasmrpc::Error> {
    match r {
        Ok(p) => bail!("expected {kind} containing {needle:?}, got {p:?}"),
        Err(e) if e.kind() == kind && e.message().contains(needle) => Ok(e),
        Err(e) => bail!("expected {kind} containing {needle:?}, got {e}"),
    }
}

fn expect_tensor(p: &Payload, want: &Tensor) -> Result<()> {
    let got = p.as_tensor()?;
    ensure!(
        got.size() == want.size() && got.kind() == want.kind() && got.equal(want),
        "tensor mismatch: got {got} want {want}"
    );
    Ok(())
}

fn agents(c: &Cluster) -> (RpcAgent, RpcAgent) {
    (c.agent(0).clone(), c.agent(1).clone())
}

#[test]
fn plugin_functions_take_positional_and_keyword_arguments() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let f = "seed_fns::my_function";
        let six = w0.rpc_sync("worker1", f, args![1, 2, 3]).await?;
        ensure!(six.as_int()? == 6, "{six:?}");
        let kw = Args::new().kwarg("a", 1).kwarg("b", 2).kwarg("c", 3);
        ensure!(w0.rpc_sync("worker1", f, kw).await?.as_int()? == 6);
        let mixed = args![1].kwarg("c", 10).kwarg("b", 0.5);
        ensure!(w0.rpc_sync("worker1", f, mixed).await?.as_float()? == 11.5);

        let e = expect_err(
            w0.rpc_sync("worker1", f, args![1, 2].kwarg("d", 3)).await,
            ErrorKind::TypeError,
            "my_function() got an unexpected keyword argument 'd'",
        )?;
        ensure!(e.to_string().contains("worker1"), "no worker in {e}");
        expect_err(
            w0.rpc_sync("worker1", f, args![1, 2]).await,
            ErrorKind::TypeError,
            "missing 1 required positional argument: 'c'",
        )?;
        // A function that returns nothing, and a worker's own id.
        ensure!(
            w0.rpc_sync("worker1", "seed_fns::no_result", args![])
                .await?
                .is_none()
        );
        let id = w0
            .rpc_sync("worker1", "seed_fns::return_callee_id", args![])
            .await?;
        ensure!(id.as_int()? == 1, "{id:?}");
        Ok(())
    });
}

#[test]
fn plugin_functions_take_and_return_tensors() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let (a, b) = (
            ones(&[2, 3]),
            Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]),
        );
        let sum = w0
            .rpc_sync("worker1", "seed_fns::my_tensor_function", args![&a, &b])
            .await?;
        expect_tensor(&sum, &(&a + &b))?;

        // Scalars and tensors mix as Python's `+` mixes them.
        let t = w0
            .rpc_sync("worker1", "seed_fns::my_function", args![&a, 1, 2.5])
            .await?;
        expect_tensor(&t, &(&a + 3.5))?;

        // A value tree with tensors comes back whole, the same tensor twice
        // included.
        let tree = Payload::tuple(vec![
            Payload::from(&a),
            Payload::list(vec![Payload::from("x"), Payload::from(&b)]),
            Payload::from(&a),
        ]);
        let echoed = w0
            .rpc_sync("worker1", "seed_fns::identity", args![tree.clone()])
            .await?;
        ensure!(echoed.equal(&tree), "{echoed:?} != {tree:?}");

        // 198 ops on the callee's copy: the caller's tensor is untouched.
        let x = ones(&[4]);
        let r = w0
            .rpc_sync("worker1", "seed_fns::heavy_rpc", args![&x])
            .await?;
        ensure!(r.as_int()? == 0 && x.equal(&ones(&[4])));

        // dtypes other than float32 survive the guest's data reads.
        let ints = Tensor::from_slice(&[1i64, 2, 3]);
        let r = w0
            .rpc_sync("worker1", "seed_fns::my_function", args![&ints, 1, 1])
            .await?;
        expect_tensor(&r, &Tensor::from_slice(&[3i64, 4, 5]))?;
        Ok(())
    });
}

#[test]
fn plugin_nested_rpc_back_to_the_caller_and_to_itself() {
    with_cluster(2, |c| async move {
        let (w0, w1) = agents(&c);
        // worker1's guest calls aten::add back on worker0 while worker0
        // waits for worker1.
        let r = w0
            .rpc_sync("worker1", "seed_fns::nested_rpc", args!["worker0"])
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 1))?;
        // A guest's bare function name is its own plugin's function, on
        // the caller, on itself, and from a call to self.
        for (caller, to, dst) in [
            (&w0, "worker1", "worker0"),
            (&w0, "worker1", "worker1"),
            (&w1, "worker1", "worker1"),
        ] {
            let r = caller
                .rpc_sync(to, "seed_fns::nested_udf", args![dst, 4])
                .await
                .with_context(|| format!("{} -> {to} -> {dst}", caller.name()))?;
            ensure!(r.as_int()? == 7, "{r:?}");
        }
        // Many nested calls at once, in both directions, do not deadlock.
        let futs: Vec<_> = (0..16)
            .map(|i| {
                let (from, to, dst) = if i % 2 == 0 {
                    (&w0, "worker1", "worker0")
                } else {
                    (&w1, "worker0", "worker1")
                };
                from.rpc_async(to, "seed_fns::nested_udf", args![dst, i])
            })
            .collect();
        let results = wait_all(&futs).await?;
        for (i, r) in results.iter().enumerate() {
            ensure!(r.as_int()? == i as i64 + 3, "call {i}: {r:?}");
        }
        Ok(())
    });
}

#[test]
fn plugin_errors_keep_their_kind_and_text() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let e = expect_err(
            w0.rpc_sync("worker1", "seed_fns::raise_func", args![])
                .await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        ensure!(e.message() == "Expected error", "{e}");
        let text = e.to_string();
        ensure!(
            text.contains("worker1") && text.contains("seed_fns::raise_func"),
            "no context in {text}"
        );
        // An argument the guest cannot take, with Python's text.
        expect_err(
            w0.rpc_sync("worker1", "seed_fns::nested_udf", args!["worker0", "x"])
                .await,
            ErrorKind::TypeError,
            "nested_udf() argument 'n': expected int, got str",
        )?;
        // The error of a nested call (made by the guest on worker1) reaches
        // the first caller with its kind and text.
        expect_err(
            w0.rpc_sync("worker1", "seed_fns::nested_udf", args!["worker9", 1])
                .await,
            ErrorKind::RuntimeError,
            "name:worker9, could not find destination",
        )?;
        // Unknown functions are not served; plugin classes only through
        // remote() (their objects stay on their owner).
        expect_err(
            w0.rpc_sync("worker1", "seed_fns::no_such_function", args![1])
                .await,
            ErrorKind::RuntimeError,
            "is not registered on worker worker1",
        )?;
        expect_err(
            w0.rpc_sync("worker1", "seed_fns::MyClass", args![1]).await,
            ErrorKind::TypeError,
            "seed_fns::MyClass is a plugin class, called by rpc_sync/rpc_async from worker worker0 on worker worker1",
        )?;
        Ok(())
    });
}

#[test]
fn plugin_trap_is_an_error_and_the_worker_keeps_serving() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        for round in 0..3 {
            let e = expect_err(
                w0.rpc_sync(
                    "worker1",
                    "seed_fns::panic_func",
                    args![format!("boom {round}")],
                )
                .await,
                ErrorKind::RuntimeError,
                "trapped",
            )?;
            ensure!(e.message().contains(&format!("boom {round}")), "{e}");
            ensure!(e.message().contains("panic_func"), "{e}");
            let six = w0
                .rpc_sync("worker1", "seed_fns::my_function", args![1, 2, 3])
                .await?;
            ensure!(six.as_int()? == 6);
        }
        Ok(())
    });
}

#[test]
fn plugin_rrefs_in_arguments_and_results() {
    with_cluster(3, |c| async move {
        let (w0, _) = agents(&c);
        // A host RRef owned by worker2, used by a plugin on worker1.
        let rref = w0.remote("worker2", "aten::add", args![ones(&[2]), 1])?;
        let r = w0
            .rpc_sync("worker1", "seed_fns::add_rref_to_value", args![&rref, 1])
            .await?;
        expect_tensor(&r, &(ones(&[2]) + 2))?;
        // A local RRef owned by the caller, sent to the plugin and back.
        let local = wasmrpc::RRef::new(&w0, ones(&[2]) * 3);
        let r = w0
            .rpc_sync(
                "worker1",
                "seed_fns::my_rref_function",
                args![&rref, &local],
            )
            .await?;
        expect_tensor(&r, &(ones(&[2]) * 5))?;
        // RRefs a plugin creates with remote() and returns.
        let r = w0
            .rpc_sync("worker1", "seed_fns::rpc_return_rref", args!["worker2"])
            .await?
            .as_rref()?;
        ensure!(r.owner_name() == "worker2", "owner {}", r.owner_name());
        expect_tensor(&r.to_here(&w0, None).await?, &(ones(&[2, 2]) + 1))?;
        let pair = w0
            .rpc_sync("worker1", "seed_fns::nested_rref", args!["worker2"])
            .await?;
        for (i, p) in pair.items()?.iter().enumerate() {
            let inner = p.as_rref()?;
            expect_tensor(
                &inner.to_here(&w0, None).await?,
                &(ones(&[2, 2]) + (i + 1) as f64),
            )?;
        }
        let r = w0
            .rpc_sync("worker1", "seed_fns::nested_remote", args!["worker2"])
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 3))?;
        Ok(())
    });
}

#[test]
fn plugin_async_execution_completes_with_its_future() {
    with_cluster(3, |c| async move {
        let (w0, _) = agents(&c);
        let (x, y) = (ones(&[2]), ones(&[2]) * 2);
        // worker1's guest returns the future of an add on worker2.
        let r = w0
            .rpc_sync("worker1", "seed_fns::async_add", args!["worker2", &x, &y])
            .await?;
        expect_tensor(&r, &(&x + &y))?;
        let r = w0
            .rpc_sync(
                "worker1",
                "seed_fns::async_add_chained",
                args!["worker2", &x, &y, 10],
            )
            .await?;
        expect_tensor(&r, &(&x + &y + 10))?;
        let r = w0
            .rpc_sync(
                "worker1",
                "seed_fns::async_add_with_future_ctor",
                args!["worker0", &x, &y, 1],
            )
            .await?;
        expect_tensor(&r, &(&x + &y + 1))?;
        expect_err(
            w0.rpc_sync("worker1", "seed_fns::async_raise_func", args![])
                .await,
            ErrorKind::RuntimeError,
            "Expected error",
        )?;
        // The future of an add that fails fails the call.
        expect_err(
            w0.rpc_sync(
                "worker1",
                "seed_fns::async_add",
                args!["worker2", &x, ones(&[3])],
            )
            .await,
            ErrorKind::RuntimeError,
            "The size of tensor a (2) must match the size of tensor b (3)",
        )?;
        Ok(())
    });
}

#[test]
fn plugin_calls_run_concurrently() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        // 64 calls that each sleep one second in the guest: they overlap.
        let started = Instant::now();
        let futs: Vec<_> = (0..64)
            .map(|i| w0.rpc_async("worker1", "seed_fns::slow_add", args![i, 1]))
            .collect();
        let results = wait_all(&futs).await?;
        let took = started.elapsed();
        for (i, r) in results.iter().enumerate() {
            ensure!(r.as_int()? == i as i64 + 1, "call {i}: {r:?}");
        }
        ensure!(
            took < Duration::from_secs(20),
            "64 one-second calls took {took:?}"
        );
        // And 64 quick calls, twice, on warm instances.
        for _ in 0..2 {
            let futs: Vec<_> = (0..64)
                .map(|i| w0.rpc_async("worker1", "seed_fns::my_function", args![i, i, i]))
                .collect();
            for (i, r) in wait_all(&futs).await?.iter().enumerate() {
                ensure!(r.as_int()? == 3 * i as i64);
            }
        }
        Ok(())
    });
}

#[test]
fn plugin_globals_and_locks_are_per_worker() {
    with_cluster(2, |c| async move {
        let (w0, w1) = agents(&c);
        w0.rpc_sync("worker1", "seed_fns::_reset_count", args![])
            .await?;
        w0.rpc_sync("worker0", "seed_fns::_reset_count", args![])
            .await?;
        // The guest reads, sleeps, then writes under a worker-wide lock:
        // without the lock concurrent increments would be lost.
        let futs: Vec<_> = (0..24)
            .map(|_| w0.rpc_async("worker1", "seed_fns::_increment_count", args![]))
            .collect();
        let mut seen: Vec<i64> = wait_all(&futs)
            .await?
            .iter()
            .map(Payload::as_int)
            .collect::<wasmrpc::Result<_>>()?;
        seen.sort_unstable();
        ensure!(seen == (1..=24).collect::<Vec<_>>(), "{seen:?}");
        // worker0's counter is its own.
        let one = w1
            .rpc_sync("worker0", "seed_fns::_increment_count", args![])
            .await?;
        ensure!(one.as_int()? == 1, "{one:?}");

        // A global holds a tensor across calls.
        let t = Tensor::from_slice(&[1.5f32, 2.5]);
        w0.rpc_sync("worker1", "seed_fns::set_value", args![&t])
            .await?;
        let back = w0
            .rpc_sync("worker1", "seed_fns::get_value", args![])
            .await?;
        expect_tensor(&back, &t)?;
        let none = w0
            .rpc_sync("worker0", "seed_fns::get_value", args![])
            .await?;
        ensure!(none.is_none(), "worker0 sees worker1's global: {none:?}");
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// Builtin ops as RPC targets.

#[test]
fn builtin_add_of_two_tensors() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let (a, b) = (
            ones(&[2, 2]),
            Tensor::full([2, 2], 3.0, (Kind::Float, Device::Cpu)),
        );
        let r = w0.rpc_sync("worker1", "aten::add", args![&a, &b]).await?;
        expect_tensor(&r, &(&a + &b))?;
        // PyTorch RPC's wire name and keyword arguments.
        let r = w0
            .rpc_sync(
                "worker1",
                "torch.ops.aten.add",
                args![&a, &b].kwarg("alpha", 2),
            )
            .await?;
        expect_tensor(&r, &(&a + &b * 2))?;
        // Several outputs are a tuple.
        let r = w0
            .rpc_sync(
                "worker1",
                "aten::max",
                args![Tensor::from_slice(&[1.0f32, 7.0, 3.0]), 0],
            )
            .await?;
        let items = r.items()?;
        ensure!(
            items.len() == 2 && items[1].as_tensor()?.int64_value(&[]) == 1,
            "{r:?}"
        );
        // A Python builtin.
        let r = w0
            .rpc_sync("worker1", "builtins.min", args![3, 1, 2])
            .await?;
        ensure!(r.as_int()? == 1);
        Ok(())
    });
}

#[test]
fn builtin_add_of_a_tensor_and_a_scalar() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let a = ones(&[3]);
        let r = w0.rpc_sync("worker1", "aten::add", args![&a, 2]).await?;
        expect_tensor(&r, &(&a + 2))?;
        let r = w0.rpc_sync("worker1", "aten::mul", args![&a, 2.5]).await?;
        expect_tensor(&r, &(&a * 2.5))?;
        Ok(())
    });
}

#[test]
fn builtin_bad_arguments_fail_to_match_any_schema() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let e = expect_err(
            w0.rpc_sync("worker1", "aten::add", args!["a", ones(&[2])])
                .await,
            ErrorKind::RuntimeError,
            "Overloaded torch operator invoked from Python failed to match any schema",
        )?;
        ensure!(
            e.message().contains("aten::add.Tensor"),
            "no schema listed: {e}"
        );
        ensure!(e.to_string().contains("worker1"), "no worker in {e}");
        expect_err(
            w0.rpc_sync("worker1", "aten::no_such_op", args![1]).await,
            ErrorKind::RuntimeError,
            "aten::no_such_op is not registered on worker worker1",
        )?;
        Ok(())
    });
}

#[test]
fn builtin_size_mismatch_keeps_libtorchs_message() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        expect_err(
            w0.rpc_sync("worker1", "aten::add", args![ones(&[2]), ones(&[3])])
                .await,
            ErrorKind::RuntimeError,
            "The size of tensor a (2) must match the size of tensor b (3) at non-singleton dimension 0",
        )?;
        Ok(())
    });
}

#[test]
fn builtin_sparse_add() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        let indices = Tensor::from_slice(&[0i64, 1, 1, 0, 1, 2]).view([2, 3]);
        let values = Tensor::from_slice(&[3.0f32, 4.0, 5.0]);
        let s = Tensor::sparse_coo_tensor_indices_size(
            &indices,
            &values,
            [2, 3],
            (Kind::Float, Device::Cpu),
            false,
        );
        let r = w0.rpc_sync("worker1", "aten::add", args![&s, &s]).await?;
        let got = r.as_tensor()?;
        ensure!(got.is_sparse(), "sparse + sparse came back dense");
        let want = s.to_dense(None, false) * 2;
        ensure!(got.to_dense(None, false).equal(&want), "{got}");
        Ok(())
    });
}

#[test]
fn registered_functions_win_over_builtin_ops() {
    let builder = Cluster::builder(2).functions(|r: &FunctionRegistry| {
        r.register_native("aten::add", |_ctx, _args| async {
            Ok(Payload::from("stand-in"))
        });
    });
    with_builder(builder, |c| async move {
        let (w0, _) = agents(&c);
        let r = w0
            .rpc_sync("worker1", "aten::add", args![ones(&[1]), 1])
            .await?;
        ensure!(r.as_str()? == "stand-in", "{r:?}");
        let r = w0
            .rpc_sync("worker1", "aten::mul", args![ones(&[1]), 3])
            .await?;
        expect_tensor(&r, &(ones(&[1]) * 3))?;
        Ok(())
    });
}

#[test]
fn plugin_op_errors_keep_libtorchs_message() {
    with_cluster(2, |c| async move {
        let (w0, _) = agents(&c);
        // The guest's `aten::add` runs on worker1's host and fails there.
        expect_err(
            w0.rpc_sync(
                "worker1",
                "seed_fns::my_tensor_function",
                args![ones(&[2]), ones(&[3])],
            )
            .await,
            ErrorKind::RuntimeError,
            "The size of tensor a (2) must match the size of tensor b (3)",
        )?;
        Ok(())
    });
}

/// The README demo (`plugins/demo`): worker0's driver spreads a sum over
/// three workers with `rpc_async`, each worker computes its slice with aten
/// ops and makes a nested call to its neighbour, and the total matches the
/// closed form.
#[test]
fn demo_run_spreads_the_sum_over_every_worker() {
    let host = PluginHost::shared().expect("the process's plugin host starts");
    let demo = host
        .load_file(wasmrpc_plugins::DEMO)
        .expect("the demo plugin loads");
    let builder = Cluster::builder(3).functions(move |r: &FunctionRegistry| {
        host.register(&demo, r);
    });
    with_builder(builder, |c| async move {
        let report = c
            .agent(0)
            .rpc_sync("worker0", "demo::run", args![3, 1000])
            .await?;
        let report = report.as_str()?;
        ensure!(
            report.starts_with("3 workers summed k^2 for k in 1..=1000: 333833500, which matches"),
            "{report}"
        );
        for (who, neighbour) in [
            ("worker0", "worker1"),
            ("worker1", "worker2"),
            ("worker2", "worker0"),
        ] {
            ensure!(
                report.contains(&format!("{who}: sum of k^2"))
                    && report.contains(&format!("its neighbour answered as {neighbour}")),
                "{who} missing from {report}"
            );
        }
        Ok(())
    });
}
