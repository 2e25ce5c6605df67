//! `rpc_test.py`'s tests of areas B, C and D on the Python plugin
//! (`seed_fns_py::<name>`).

use anyhow::ensure;
use wasmrpc::prelude::*;
use wasmrpc::testing::{Worker, worker_name};
use wasmrpc::{Args, ErrorKind, Future, Payload, RRef, RRefProxyMode, Value, args, wait_all};
use wasmrpc_tests::{WORLD_SIZE, dist_with, expect_err, expect_tensor, ones, python_cluster};

const ADD: &str = "aten::add";

fn dist<F, Fut>(body: F)
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    dist_with(python_cluster(WORLD_SIZE), body);
}

fn n(w: &Worker) -> i64 {
    i64::from(w.rank) + 1
}

async fn here(w: &Worker, r: &RRef) -> anyhow::Result<Payload> {
    Ok(r.to_here(&w.agent, None).await?)
}

// ------------------------------------------------------ B: Python UDFs

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
            .rpc_sync(w.dst(), "seed_fns_py::my_function", a)
            .await?;
        ensure!(r.as_int()? == 3 * k + 3);
        Ok(())
    });
}

#[test]
fn test_py_no_return_result() {
    dist(|w| async move {
        ensure!(
            w.agent
                .rpc_sync(w.dst(), "seed_fns_py::no_result", args![])
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
                "seed_fns_py::my_tensor_function",
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
                    "seed_fns_py::my_tensor_function",
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
fn build_complex_tensors(a: &tch::Tensor) -> Payload {
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
            tensors: complex
                .tensors
                .iter()
                .map(tch::Tensor::shallow_clone)
                .collect(),
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
                "seed_fns_py::my_complex_tensor_function",
                args![a, record, c],
            )
            .await?;
        // res = a[0]; res += each of a (a[0] doubles first), then each dict
        // value.
        let items = got.items()?;
        ensure!(items.len() == 4);
        expect_tensor(&items[0], &(ones(&[k, k]) * 5))?;
        let complex_items = complex.items()?;
        for i in 0..3 {
            ensure!(
                items[i + 1].equal(&complex_items[i]),
                "complex tensor {i} differs"
            );
        }
        Ok(())
    });
}

/// A sparse tensor equal to `want` (the seeds compare sparse results
/// densely).
fn expect_sparse(p: &Payload, want: &tch::Tensor) -> anyhow::Result<()> {
    let got = p.as_tensor()?;
    ensure!(got.is_sparse(), "result is not sparse: {got:?}");
    let (g, w) = (got.to_dense(None, false), want.to_dense(None, false));
    ensure!(
        g.size() == w.size() && g.allclose(&w, 1e-5, 1e-8, false),
        "sparse mismatch {g:?} vs {w:?}"
    );
    Ok(())
}

/// The seeds' `build_sparse_tensor()`.
fn sparse() -> tch::Tensor {
    wasmrpc_tests::rref_fns::build_sparse_tensor()
}

/// Sparse tensors pass through Python (which cannot build them) and its
/// `+=` runs on them in the host.
#[test]
fn test_py_sparse_tensors_in_container() {
    dist(|w| async move {
        let a = Payload::list(vec![sparse().into(), sparse().into()]);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns_py::my_container_sum", args![a])
            .await?;
        expect_sparse(&r, &(sparse() + sparse()))
    });
}

#[test]
fn test_py_raise_in_user_func() {
    // The callee logs the error (the seed checks its stderr); the caller gets
    // the ValueError with its message. The Python `raise_func` is also
    // registered under a name of its own, so that this test's log lines are
    // its own.
    const RAISE: &str = "seed_fns_py::raise_func#test_py_raise_in_user_func";
    let logs = wasmrpc::testing::global_logs();
    let builder = python_cluster(WORLD_SIZE).functions(|r| {
        wasmrpc_tests::register_with_python(r);
        let raise_func = r
            .get("seed_fns_py::raise_func")
            .expect("register_with_python registers the Python plugin");
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
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns_py::raise_func_escape", args![])
            .await;
        let e = expect_err(r, ErrorKind::ValueError, "First line of error")?;
        ensure!(
            e.message() == "\nFirst line of error \n next line of error \n last line of error",
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn test_custom_exception_throw_during_reconstruction() {
    dist(|w| async move {
        if w.rank != 0 {
            let r = w
                .agent
                .rpc_sync(worker_name(0), "seed_fns_py::custom_raise_func", args![])
                .await;
            let e = expect_err(
                r,
                ErrorKind::RuntimeError,
                "Failed to create original exception type",
            )?;
            ensure!(
                e.message()
                    .contains("Original exception on remote side was CustomException: foo"),
                "{e}"
            );
        }
        Ok(())
    });
}

// ------------------------------------------- C: nested calls, stress

#[test]
fn test_nested_rpc() {
    dist(|w| async move {
        let me = worker_name(w.rank);
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns_py::nested_rpc", args![me.as_str()])
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 1))
    });
}

#[test]
fn test_stress_light_rpc() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..1000)
            .map(|_| {
                w.agent
                    .rpc_async(w.dst(), "seed_fns_py::light_rpc", args![])
            })
            .collect();
        for r in wait_all(&futs).await? {
            ensure!(r.as_int()? == 0);
        }
        Ok(())
    });
}

#[test]
fn test_stress_heavy_rpc() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..20)
            .map(|_| {
                w.agent
                    .rpc_async(w.dst(), "seed_fns_py::heavy_rpc", args![ones(&[100, 100])])
            })
            .collect();
        for r in wait_all(&futs).await? {
            ensure!(r.as_int()? == 0);
        }
        Ok(())
    });
}

#[test]
fn test_stress_heavy_rpc_sparse() {
    dist(|w| async move {
        let futs: Vec<Future> = (0..20)
            .map(|_| {
                w.agent
                    .rpc_async(w.dst(), "seed_fns_py::heavy_rpc", args![sparse()])
            })
            .collect();
        for r in wait_all(&futs).await? {
            ensure!(r.as_int()? == 0);
        }
        Ok(())
    });
}

#[test]
fn test_multi_layer_nested_async_rpc() {
    dist(|w| async move {
        let dst = i64::from((w.rank + 1) % w.world_size);
        let r = w
            .agent
            .rpc_sync(
                worker_name(w.rank),
                "seed_fns_py::multi_layer_nested_async_rpc",
                args![dst, 4i64, 20i64],
            )
            .await?;
        ensure!(r.as_int()? == 0);
        Ok(())
    });
}

// ------------------------------------------------------------- D: RRefs

#[test]
fn test_py_udf_remote() {
    dist(|w| async move {
        let k = n(&w);
        let r = w.agent.remote(
            w.dst(),
            "seed_fns_py::my_function",
            Args::new()
                .kwarg("a", k)
                .kwarg("b", k + 1)
                .kwarg("c", k + 2),
        )?;
        ensure!(here(&w, &r).await?.as_int()? == k + k + 1 + k + 2);
        Ok(())
    });
}

#[test]
fn test_multi_py_udf_remote() {
    dist(|w| async move {
        let mut rrefs = Vec::new();
        let mut k = n(&w);
        for i in 0..10i64 {
            k += i;
            rrefs.push((
                w.agent.remote(
                    w.dst(),
                    "seed_fns_py::my_function",
                    Args::new()
                        .kwarg("a", ones(&[k, k]))
                        .kwarg("b", ones(&[k, k]))
                        .kwarg("c", ones(&[k, k])),
                )?,
                k,
            ));
        }
        for (r, k) in rrefs {
            expect_tensor(&here(&w, &r).await?, &(ones(&[k, k]) * 3))?;
        }
        Ok(())
    });
}

#[test]
fn test_nested_remote() {
    dist(|w| async move {
        let r = w
            .agent
            .remote(w.dst(), "seed_fns_py::nested_remote", args![w.peer(2)])?;
        expect_tensor(&here(&w, &r).await?, &(ones(&[2, 2]) + 3))
    });
}

#[test]
fn test_remote_with_exception() {
    dist(|w| async move {
        let r = w
            .agent
            .remote(w.dst(), "seed_fns_py::raise_func", args![])?;
        expect_err(
            r.to_here(&w.agent, None).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        let r = w
            .agent
            .remote(worker_name(w.rank), "seed_fns_py::raise_func", args![])?;
        expect_err(
            r.local_value(&w.agent).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        Ok(())
    });
}

#[test]
fn test_remote_throw() {
    dist(|w| async move {
        let r = w
            .agent
            .remote(w.dst(), "seed_fns_py::raise_or_inc", args![ones(&[2])])?;
        expect_err(
            r.to_here(&w.agent, None).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        Ok(())
    });
}

#[test]
fn test_py_rref_args() {
    dist(|w| async move {
        let a = w.agent.remote(w.dst(), ADD, args![ones(&[2, 2]), 1])?;
        let b = w.agent.remote(w.dst(), ADD, args![ones(&[2, 2]), 2])?;
        let c = w
            .agent
            .remote(w.dst(), "seed_fns_py::my_rref_function", args![&a, &b])?;
        expect_tensor(&here(&w, &c).await?, &(ones(&[2, 2]) * 2 + 3))
    });
}

#[test]
fn test_py_rref_args_user_share() {
    dist(|w| async move {
        let owner = w.dst();
        let a = w.agent.remote(
            owner.as_str(),
            "seed_fns_py::my_function",
            args![ones(&[2, 2]), 1, 2],
        )?;
        let b = w.agent.remote(
            owner.as_str(),
            "seed_fns_py::my_function",
            args![ones(&[2, 2]), 3, 4],
        )?;
        let c = w
            .agent
            .remote(w.peer(2), "seed_fns_py::my_rref_function", args![&a, &b])?;
        expect_tensor(&here(&w, &c).await?, &(ones(&[2, 2]) * 2 + 10))
    });
}

#[test]
fn test_py_rpc_rref_args() {
    dist(|w| async move {
        let a = w.agent.remote(
            w.dst(),
            "seed_fns_py::my_function",
            args![ones(&[2, 2]), 1, 2],
        )?;
        let b = w.agent.remote(
            w.dst(),
            "seed_fns_py::my_function",
            args![ones(&[2, 2]), 3, 4],
        )?;
        let c = w
            .agent
            .rpc_sync(w.dst(), "seed_fns_py::my_rref_function", args![&a, &b])
            .await?;
        expect_tensor(&c, &(ones(&[2, 2]) * 2 + 10))
    });
}

/// The seed's `_nested_rref(f, expected1, expected2)`: `f` on the next rank
/// returns two RRefs owned by the one after it.
async fn nested_rref_once(w: &Worker) -> anyhow::Result<()> {
    let r = w
        .agent
        .remote(w.dst(), "seed_fns_py::nested_rref", args![w.peer(2)])?;
    let pair: Vec<RRef> = here(w, &r)
        .await?
        .items()?
        .iter()
        .map(Payload::as_rref)
        .collect::<wasmrpc::Result<_>>()?;
    ensure!(pair.len() == 2, "expected 2 RRefs, got {}", pair.len());
    for (inner, add) in pair.into_iter().zip([1, 2]) {
        ensure!(
            inner.owner_name() == w.peer(2),
            "owner {}",
            inner.owner_name()
        );
        expect_tensor(&here(w, &inner).await?, &(ones(&[2, 2]) + add))?;
    }
    Ok(())
}

#[test]
fn test_nested_rref_stress() {
    dist(|w| async move {
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let w = w.clone();
            tasks.push(tokio::spawn(async move { nested_rref_once(&w).await }));
        }
        for t in tasks {
            t.await??;
        }
        Ok(())
    });
}

#[test]
fn test_nested_rref() {
    dist(|w| async move { nested_rref_once(&w).await });
}

#[test]
fn test_rpc_return_rref() {
    dist(|w| async move {
        let r = w
            .agent
            .rpc_sync(w.dst(), "seed_fns_py::rpc_return_rref", args![w.peer(2)])
            .await?
            .as_rref()?;
        ensure!(r.owner_name() == w.peer(2));
        expect_tensor(&here(&w, &r).await?, &(ones(&[2, 2]) + 1))
    });
}

async fn via(
    w: &Worker,
    rref: &RRef,
    mode: RRefProxyMode,
    method: &str,
    args: Args,
) -> anyhow::Result<Payload> {
    Ok(match mode {
        RRefProxyMode::Sync => rref.rpc_sync(&w.agent, None).call(method, args).await?,
        RRefProxyMode::Async => {
            rref.rpc_async(&w.agent, None)
                .call_async(method, args)
                .wait()
                .await?
        }
        RRefProxyMode::Remote => {
            let r = rref
                .remote(&w.agent, None)
                .call_remote(method, args)
                .await?;
            here(w, &r).await?
        }
    })
}

const MODES: [RRefProxyMode; 3] = [
    RRefProxyMode::Sync,
    RRefProxyMode::Async,
    RRefProxyMode::Remote,
];

/// The seed's `_test_rref_proxy_class(dst)` over the Python `MyClass`.
async fn rref_proxy_class(w: Worker, dst: String) -> anyhow::Result<()> {
    let rref = w
        .agent
        .remote(dst.as_str(), "seed_fns_py::MyClass", args![7])?;
    let mut expected = 7;
    for mode in MODES {
        let v = via(&w, &rref, mode, "get_value", args![]).await?;
        ensure!(v.as_int()? == expected, "{mode:?}: get_value {v:?}");
    }
    expected += 3;
    for mode in MODES {
        let v = via(&w, &rref, mode, "increment_value", args![1]).await?;
        ensure!(v.is_none(), "{mode:?}: increment_value returned {v:?}");
    }
    for mode in MODES {
        let v = via(&w, &rref, mode, "get_value", args![]).await?;
        ensure!(v.as_int()? == expected, "{mode:?}: get_value {v:?}");
    }
    for (mode, b) in MODES.into_iter().zip([2, 3, 4]) {
        let v = via(&w, &rref, mode, "my_instance_method", args![b]).await?;
        ensure!(
            v.as_int()? == expected + b,
            "{mode:?}: my_instance_method {v:?}"
        );
    }
    for (mode, f) in MODES.into_iter().zip([9, 10, 11]) {
        let v = via(&w, &rref, mode, "my_static_method", args![f]).await?;
        ensure!(v.as_bool()? == (f > 10), "{mode:?}: my_static_method {v:?}");
    }
    let tensors = [
        tch::Tensor::zeros([2, 2], (tch::Kind::Float, tch::Device::Cpu)),
        ones(&[3, 3]),
        ones(&[4, 4]),
    ];
    for (mode, t) in MODES.into_iter().zip(tensors) {
        let want = &t + 2;
        let v = via(&w, &rref, mode, "my_class_method", args![2, t]).await?;
        expect_tensor(&v, &want)?;
    }
    Ok(())
}

#[test]
fn test_rref_proxy_class() {
    dist(|w| async move {
        let dst = w.dst();
        rref_proxy_class(w, dst).await
    });
}

#[test]
fn test_rref_proxy_class_self() {
    dist(|w| async move {
        let dst = worker_name(w.rank);
        rref_proxy_class(w, dst).await
    });
}

// ------------------------------------- the kit's other host services

/// Not a seed test: a worker-wide named future (`Future.shared`) completed
/// by one call of the Python plugin and awaited by another, and a
/// `record_function` range with a progress report around a tensor add.
#[test]
fn python_shared_futures_profiling_ranges_and_progress() {
    dist(|w| async move {
        let key = format!("from-{}", w.rank);
        let waiting = w.agent.rpc_async(
            w.dst(),
            "seed_fns_py::shared_future_wait",
            args![key.as_str()],
        );
        w.agent
            .rpc_sync(
                w.dst(),
                "seed_fns_py::shared_future_set",
                args![key.as_str(), 7],
            )
            .await?;
        ensure!(waiting.wait().await?.as_int()? == 7);
        let sum = w
            .agent
            .rpc_sync(
                w.dst(),
                "seed_fns_py::profiled_add",
                args![ones(&[2]), ones(&[2])],
            )
            .await?;
        expect_tensor(&sum, &(ones(&[2]) * 2))
    });
}

// ------------------------------------------- O: futures are not values

const PICKLE_FUTURE: &str = "Can not pickle torch.futures.Future";

/// The seed's three calls, made by the Python plugin on `w.dst()`'s side:
/// a `Future` as the argument of `rpc_sync`, `rpc_async` and `remote`
/// raises `RuntimeError` at call time. (A Rust guest cannot write these
/// calls: `guest-sdk/macros/tests/ui/pickle_future.rs`.)
#[test]
fn test_pickle_future() {
    dist(|w| async move {
        let raised = w
            .agent
            .rpc_sync(
                w.dst(),
                "seed_fns_py::pickle_future",
                args![worker_name((w.rank + 2) % w.world_size)],
            )
            .await?
            .items()?;
        ensure!(raised.len() == 3, "{raised:?}");
        for (call, r) in ["rpc_sync", "rpc_async", "remote"].iter().zip(&raised) {
            let r = r.items()?;
            ensure!(
                r[0].as_str()? == "RuntimeError" && r[1].as_str()?.contains(PICKLE_FUTURE),
                "{call} with a Future argument raised {r:?}"
            );
        }
        Ok(())
    });
}

/// `return_future()`, not `async_execution`, returns a `Future`: the call
/// fails with `RuntimeError` in `mode`. (A Rust guest cannot write the
/// function: `guest-sdk/macros/tests/ui/return_future.rs`.)
async fn return_future_in_mode(w: &Worker, mode: &str) -> anyhow::Result<()> {
    let f = "seed_fns_py::return_future";
    let r = match mode {
        "sync" => w.agent.rpc_sync(w.dst(), f, args![]).await,
        "async" => w.agent.rpc_async(w.dst(), f, args![]).wait().await,
        _ => {
            w.agent
                .remote(w.dst(), f, args![])?
                .to_here(&w.agent, None)
                .await
        }
    };
    expect_err(r, ErrorKind::RuntimeError, PICKLE_FUTURE)?;
    Ok(())
}

#[test]
fn test_return_future() {
    dist(|w| async move { return_future_in_mode(&w, "sync").await });
}

#[test]
fn test_return_future_async() {
    dist(|w| async move { return_future_in_mode(&w, "async").await });
}

#[test]
fn test_return_future_remote() {
    dist(|w| async move { return_future_in_mode(&w, "remote").await });
}

#[test]
fn test_callback_wrong_arg_type() {
    dist(|w| async move {
        let me = worker_name(w.rank);
        let r = w
            .agent
            .rpc_sync(me, "seed_fns_py::callback_wrong_arg_type", args![w.dst()])
            .await;
        // Python's own `Future + int` error, raised in the callback.
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "unsupported operand type(s) for +: 'Future' and 'int'",
        )?;
        Ok(())
    });
}

#[test]
fn test_callback_none() {
    dist(|w| async move {
        let me = worker_name(w.rank);
        let r = w
            .agent
            .rpc_sync(me, "seed_fns_py::callback_none", args![w.dst()])
            .await;
        expect_err(r, ErrorKind::TypeError, "incompatible function arguments.")?;
        Ok(())
    });
}
