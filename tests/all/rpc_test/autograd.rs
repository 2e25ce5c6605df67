//! `rpc_test` area N: distributed autograd through RRefs
//! (`RRef.backward`) and the parameter server of `test_my_parameter_server`.
//!
//! `MyParameterServer` is a Python class held in an RRef whose static
//! methods the trainers call through RRef proxies; plugin classes in RRefs
//! are not there yet, so its natural equivalent here is an RRef holding the
//! number of trainers, per-worker server state keyed by that RRef's id, and
//! its two static methods as native functions (`average` is asynchronous:
//! it completes when every trainer of the iteration has reported).

use std::collections::HashMap;
use std::sync::Mutex;
use wasmrpc::prelude::*;

use anyhow::{Context as _, ensure};
use tch::{Device, Kind, Tensor};
use wasmrpc::dist_autograd::{self, RREF_BACKWARD_NOT_TENSOR};
use wasmrpc::testing::{Cluster, ClusterBuilder, Worker};
use wasmrpc::{Args, CallContext, ErrorKind, FunctionRegistry, Payload, RRef, args};
use wasmrpc_tests::{dist_with, expect_err, register_all};

const ADD: &str = "aten::add";

/// The suite's functions plus `RpcTest._sum` and `RpcTest._identity`.
fn cluster() -> ClusterBuilder {
    Cluster::builder(wasmrpc_tests::WORLD_SIZE).functions(|r: &FunctionRegistry| {
        register_all(r);
        r.register_native("seed::RpcTest._sum", |_c, a: Args| async move {
            Ok(a.get(0)?.as_tensor()?.f_sum(None)?.into())
        });
        r.register_native(
            "seed::RpcTest._identity",
            |_c, a: Args| async move { a.get(0) },
        );
        r.register_native("seed::MyParameterServer.average", average);
        r.register_native(
            "seed::MyParameterServer.get_gradient",
            |c: CallContext, a: Args| async move {
                let rref = a.get(0)?.as_rref()?;
                let servers = c.agent().state::<ParameterServers>();
                let g = servers
                    .0
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&rref.id())
                    .and_then(|s| s.gradient.as_ref().map(Tensor::shallow_clone));
                Ok(g.map_or_else(Payload::none, Payload::from))
            },
        );
        r.register_native("seed::RpcTest._trainer_func", trainer_func);
    })
}

/// `MyParameterServer`'s state, one per server RRef on its owner.
struct ParameterServer {
    trainers: i64,
    iteration: i64,
    updates: i64,
    futures: Vec<tokio::sync::oneshot::Sender<Tensor>>,
    total: Option<Tensor>,
    gradient: Option<Tensor>,
}

#[derive(Default)]
struct ParameterServers(Mutex<HashMap<wasmrpc::RRefId, ParameterServer>>);

/// `MyParameterServer.average(rref, riteration, tensor)`
/// (`@async_execution`): completes with `total / trainers` once every
/// trainer has reported for the iteration.
async fn average(c: CallContext, a: Args) -> wasmrpc::Result<Payload> {
    let rref = a.get(0)?.as_rref()?;
    let riteration = a.get(1)?.as_int()?;
    let tensor = a.get(2)?.as_tensor()?;
    let trainers = rref.local_value(c.agent()).await?.as_int()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    {
        let servers = c.agent().state::<ParameterServers>();
        let mut servers = servers.0.lock().unwrap_or_else(|p| p.into_inner());
        let s = servers.entry(rref.id()).or_insert_with(|| ParameterServer {
            trainers,
            iteration: 0,
            updates: 0,
            futures: Vec::new(),
            total: None,
            gradient: None,
        });
        if riteration > s.iteration {
            s.iteration = riteration;
            s.updates = 0;
            s.futures.clear();
        }
        s.futures.push(tx);
        s.total = Some(match s.total.take() {
            None => tensor,
            Some(t) => t.f_add(&tensor)?,
        });
        s.updates += 1;
        if s.trainers == s.updates
            && let Some(total) = &s.total
        {
            let avg = total.f_div_scalar(s.trainers as f64)?;
            s.gradient = Some(avg.shallow_clone());
            for f in s.futures.drain(..) {
                let _ = f.send(avg.copy());
            }
        }
    }
    let avg = rx
        .await
        .map_err(|_| wasmrpc::Error::runtime("the parameter server dropped an iteration"))?;
    Ok(avg.into())
}

/// `MyEmbeddingBagModel` (`EmbeddingBag(10, 10, sparse)`, mode mean) on
/// `torch.rand(10, 10).long()` (all zeros), with `MSELoss` against
/// `rand(10, 10)`; 10 iterations, each averaged by the server.
async fn trainer_func(c: CallContext, a: Args) -> wasmrpc::Result<Payload> {
    let agent = c.agent().clone();
    let rref = a.get(0)?.as_rref()?;
    let sparse = a.get(1)?.as_bool()?;
    let owner = rref.owner_name().to_string();
    let weight = Tensor::randn([10, 10], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let input = Tensor::zeros([100], (Kind::Int64, Device::Cpu));
    let offsets = Tensor::arange_start_step(0, 100, 10, (Kind::Int64, Device::Cpu));
    let dense = |t: Tensor| {
        if t.is_sparse() {
            t.to_dense(None, false).to_kind(Kind::Double)
        } else {
            t
        }
    };
    for i in 0..10i64 {
        let outputs = Tensor::f_embedding_bag(
            &weight,
            &input,
            &offsets,
            false,
            1,
            sparse,
            None::<Tensor>,
            false,
        )?
        .0;
        let target = Tensor::rand([10, 10], (Kind::Float, Device::Cpu));
        outputs
            .f_mse_loss(&target, tch::Reduction::Mean)?
            .f_backward()?;
        let gradient = weight.grad();
        let gradient = agent
            .rpc_async(
                owner.as_str(),
                "seed::MyParameterServer.average",
                args![&rref, i, gradient],
            )
            .wait()
            .await?
            .as_tensor()?;
        let ps_gradient = agent
            .rpc_sync(
                owner.as_str(),
                "seed::MyParameterServer.get_gradient",
                args![&rref],
            )
            .await?
            .as_tensor()?;
        if !dense(gradient).equal(&dense(ps_gradient)) {
            return Err(wasmrpc::Error::runtime(format!(
                "iteration {i}: the averaged gradient differs from the server's"
            )));
        }
    }
    Ok(Payload::none())
}

fn rand_rg(size: &[i64]) -> Tensor {
    Tensor::rand(size, (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

#[test]
fn test_owner_rref_backward() {
    dist_with(cluster(), |w: Worker| async move {
        let a = w.agent.clone();
        let dst = w.dst();
        let t1 = rand_rg(&[10, 10]);
        let rref = RRef::new(&a, t1.sum(None) + t1.sum(None));
        rref.backward(&a, None, false).await?;
        let expected_grad = t1.ones_like() * 2;
        ensure!(t1.grad().equal(&expected_grad), "local backward");

        // Local backward keeping the graph: a second pass accumulates, a
        // pass over a freed graph is libtorch's error.
        // (MulBackward saves its inputs, so the graph's buffers matter.)
        let rref = RRef::new(&a, (&t1 * &t1).sum(None));
        rref.backward(&a, None, true).await?;
        rref.backward(&a, None, false).await?;
        let expected_grad = expected_grad + &t1 * 4;
        ensure!(
            t1.grad().allclose(&expected_grad, 1e-6, 1e-6, false),
            "local retain_graph"
        );
        expect_err(
            rref.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            "Trying to backward through the graph a second time",
        )?;

        let a2 = a.clone();
        let (t, d) = (t1.shallow_clone(), dst.clone());
        dist_autograd::context(&a, |ctx| async move {
            let a = a2;
            let t2 = a
                .rpc_sync(d, ADD, args![t.shallow_clone(), t.shallow_clone()])
                .await?
                .as_tensor()?;
            let rref = RRef::new(&a, t2.sum(None));
            rref.backward(&a, Some(ctx), false).await?;
            let g = dist_autograd::get_gradients(&a, ctx)?;
            ensure!(g.get(&t).is_some_and(|g| g.equal(&(t.ones_like() * 2))));
            anyhow::Ok(())
        })
        .await??;

        let a2 = a.clone();
        let t = t1.shallow_clone();
        dist_autograd::context(&a, |ctx| async move {
            let a = a2;
            let t2 = a
                .rpc_sync(dst, ADD, args![t.shallow_clone(), t.shallow_clone()])
                .await?
                .as_tensor()?;
            let rref = RRef::new(&a, t2.sum(None));
            rref.backward(&a, Some(ctx), true).await?;
            rref.backward(&a, Some(ctx), false).await?;
            let g = dist_autograd::get_gradients(&a, ctx)?;
            ensure!(g.get(&t).is_some_and(|g| g.equal(&(t.ones_like() * 4))));
            anyhow::Ok(())
        })
        .await??;

        let r = RRef::new(&a, Tensor::rand([10], (Kind::Float, Device::Cpu)));
        expect_err(
            r.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            "tensors does not require grad and does not have a grad_fn",
        )?;
        let r = RRef::new(&a, rand_rg(&[10]));
        expect_err(
            r.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            "grad can be implicitly created only for scalar outputs",
        )?;
        let r = RRef::new(&a, rand_rg(&[10]).sum(None));
        expect_err(
            r.backward(&a, Some(100), false).await,
            ErrorKind::RuntimeError,
            "Could not find autograd context with id: 100",
        )?;
        let r = RRef::new(&a, Payload::from("foo"));
        expect_err(
            r.backward(&a, None, false).await,
            ErrorKind::RuntimeError,
            RREF_BACKWARD_NOT_TENSOR,
        )?;
        Ok(())
    });
}

#[test]
fn test_user_rref_backward() {
    dist_with(cluster(), |w: Worker| async move {
        let a = w.agent.clone();
        let dst = w.dst();
        let t = rand_rg(&[10]);
        let a2 = a.clone();
        let (t_, d) = (t.shallow_clone(), dst.clone());
        dist_autograd::context(&a, |ctx| async move {
            let a = a2;
            let rref = a.remote(d, "seed::RpcTest._sum", args![t_.shallow_clone()])?;
            rref.backward(&a, Some(ctx), true).await?;
            rref.backward(&a, Some(ctx), false).await?;
            let g = dist_autograd::get_gradients(&a, ctx)?;
            ensure!(g.get(&t_).is_some_and(|g| g.equal(&(t_.ones_like() * 2))));
            anyhow::Ok(())
        })
        .await??;

        let a2 = a.clone();
        dist_autograd::context(&a, |ctx| async move {
            let a = a2;
            let rref = a.remote(dst, "seed::RpcTest._identity", args!["foo"])?;
            expect_err(
                rref.backward(&a, Some(ctx), false).await,
                ErrorKind::RuntimeError,
                RREF_BACKWARD_NOT_TENSOR,
            )?;
            expect_err(
                rref.backward(&a, None, false).await,
                ErrorKind::RuntimeError,
                "User RRefs require 'dist_autograd_ctx_id' to be specified",
            )?;
            anyhow::Ok(())
        })
        .await??;
        Ok(())
    });
}

/// The seed's `_my_parameter_server(sparse)`: every rank serves 3
/// trainers on the other ranks; each trainer's averaged gradient equals the
/// server's.
fn my_parameter_server(sparse: bool) {
    dist_with(cluster(), move |w: Worker| async move {
        let a = w.agent.clone();
        let ps_rref = RRef::new(&a, Payload::from(3i64));
        let futures: Vec<_> = (1..=3)
            .map(|k| {
                a.rpc_async(
                    w.peer(k),
                    "seed::RpcTest._trainer_func",
                    args![&ps_rref, sparse],
                )
            })
            .collect();
        for f in futures {
            f.wait().await.context("a trainer failed")?;
        }
        Ok(())
    });
}

#[test]
fn test_my_parameter_server() {
    my_parameter_server(false);
}

#[test]
fn test_my_parameter_server_sparse() {
    my_parameter_server(true);
}

/// Not a seed test: a method called through an RRef proxy inside a
/// distributed autograd context is recorded like any RPC of the context,
/// in every proxy mode, so gradients flow back to the caller's tensor.
#[test]
fn proxy_calls_inside_a_context_record_autograd() {
    dist_with(cluster(), |w: Worker| async move {
        let a = w.agent.clone();
        let ones = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        let owned = a.remote(w.dst(), ADD, args![ones, 1])?;
        let x = rand_rg(&[2, 2]);
        for mode in 0..3 {
            let (a2, owned2, x2) = (a.clone(), owned.clone(), x.shallow_clone());
            dist_autograd::context(&a, |ctx| async move {
                let a = a2;
                let call = args![x2.shallow_clone()];
                let out = match mode {
                    0 => owned2.rpc_sync(&a, None).call("add", call).await?,
                    1 => {
                        owned2
                            .rpc_async(&a, None)
                            .call_async("add", call)
                            .wait()
                            .await?
                    }
                    _ => {
                        let r = owned2.remote(&a, None).call_remote("add", call).await?;
                        r.to_here(&a, None).await?
                    }
                }
                .as_tensor()?;
                dist_autograd::backward(&a, ctx, &[out.sum(None)], false).await?;
                let g = dist_autograd::get_gradients(&a, ctx)?;
                ensure!(
                    g.get(&x2).is_some_and(|g| g.equal(&x2.ones_like())),
                    "proxy mode {mode}: the caller's tensor has no gradient"
                );
                anyhow::Ok(())
            })
            .await??;
        }
        Ok(())
    });
}
