//! The distributed optimizer (`wasmrpc::optim`), beyond the seeds (PyTorch
//! tests it in `dist_optimizer_test.py`, not part of the seed suites):
//! results against libtorch's own optimizers run locally, concurrency of
//! steps on one owner, errors naming the worker, and release of the owners'
//! state.

use std::time::Duration;
use wasmrpc::prelude::*;

use anyhow::{Context as _, ensure};
use tch::nn::{self, OptimizerConfig as _};
use tch::{Device, Kind, Tensor};
use wasmrpc::optim::{Adam, DistributedOptimizer, OptimizerConfig, Sgd, num_local_optimizers};
use wasmrpc::testing::Worker;
use wasmrpc::{Args, RRef, RpcAgent, args, dist_autograd};
use wasmrpc_tests::dist_with;

use super::fns::cluster;

/// The parameters' owners: workers 1 to 3 (the driver is worker0).
const OWNERS: [u32; 3] = [1, 2, 3];

/// The initial value of parameter `i` (what `optim::make_param` returns).
pub(super) fn initial_param(i: i64) -> Tensor {
    (Tensor::arange(9, (Kind::Double, Device::Cpu)).view([3, 3]) * (0.1 * (i + 1) as f64)) - 0.35
}

/// The driver's input of iteration `it`.
fn input(it: i64) -> Tensor {
    (Tensor::arange(9, (Kind::Double, Device::Cpu)).view([3, 3]) * 0.05 - 0.2 + 0.1 * it as f64)
        .cos()
}

/// `optim::forward(p, x)` on the owner: `tanh(p @ x)`.
pub(super) fn forward(p: &Tensor, x: &Tensor) -> wasmrpc::Result<Tensor> {
    Ok(p.f_matmul(x)?.f_tanh()?)
}

async fn make_params(a: &RpcAgent) -> anyhow::Result<Vec<RRef>> {
    OWNERS
        .iter()
        .map(|&r| {
            Ok(a.remote(
                wasmrpc::testing::worker_name(r),
                "optim::make_param",
                args![i64::from(r)],
            )?)
        })
        .collect()
}

/// Runs `iters` training steps through the distributed optimizer.
async fn train_dist(
    a: &RpcAgent,
    opt: &DistributedOptimizer,
    params: &[RRef],
    iters: i64,
) -> anyhow::Result<()> {
    train_dist_from(a, opt, params, 0, iters).await
}

/// Runs training steps `first..first + iters` (their inputs) through the
/// distributed optimizer.
async fn train_dist_from(
    a: &RpcAgent,
    opt: &DistributedOptimizer,
    params: &[RRef],
    first: i64,
    iters: i64,
) -> anyhow::Result<()> {
    for it in first..first + iters {
        let a2 = a.clone();
        dist_autograd::context(a, |ctx| async move {
            let a = a2;
            let mut loss: Option<Tensor> = None;
            for p in params {
                let out = a
                    .rpc_sync(p.owner_name(), "optim::forward", args![p, input(it)])
                    .await?
                    .as_tensor()?;
                let s = out.sum(None);
                loss = Some(match loss {
                    Some(l) => l + s,
                    None => s,
                });
            }
            let loss = loss.context("no parameters")?;
            dist_autograd::backward(&a, ctx, &[loss], false).await?;
            opt.step(ctx).await?;
            anyhow::Ok(())
        })
        .await??;
    }
    Ok(())
}

/// The same steps with libtorch's optimizer on local copies.
fn train_local(config: OptimizerConfig, iters: i64) -> anyhow::Result<Vec<Tensor>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    vs.set_kind(Kind::Double);
    let params: Vec<Tensor> = OWNERS
        .iter()
        .map(|&r| {
            vs.root()
                .var_copy(&format!("p{r}"), &initial_param(i64::from(r)))
        })
        .collect();
    let mut opt = match config {
        OptimizerConfig::Sgd(s) => nn::Sgd {
            momentum: s.momentum,
            dampening: s.dampening,
            wd: s.weight_decay,
            nesterov: s.nesterov,
        }
        .build(&vs, s.lr)?,
        OptimizerConfig::Adam(a) => nn::Adam {
            beta1: a.betas.0,
            beta2: a.betas.1,
            wd: a.weight_decay,
            eps: a.eps,
            amsgrad: false,
        }
        .build(&vs, a.lr)?,
    };
    for it in 0..iters {
        let loss = params
            .iter()
            .map(|p| forward(p, &input(it)).map(|o| o.sum(None)))
            .collect::<wasmrpc::Result<Vec<_>>>()?
            .into_iter()
            .reduce(|a, b| a + b)
            .context("no parameters")?;
        opt.backward_step(&loss);
    }
    Ok(params.iter().map(|p| p.detach().copy()).collect())
}

async fn matches_local(w: Worker, config: OptimizerConfig) -> anyhow::Result<()> {
    if w.rank == 0 {
        let a = w.agent.clone();
        let params = make_params(&a).await?;
        let opt = DistributedOptimizer::new(&a, config, &params).await?;
        ensure!(opt.owners().len() == 3);
        train_dist(&a, &opt, &params, 4).await?;
        let want = train_local(config, 4)?;
        for (p, l) in params.iter().zip(want) {
            let got = p.to_here(&a, None).await?.as_tensor()?;
            let diff = (&got - &l).abs().max().double_value(&[]);
            ensure!(
                diff < 1e-6,
                "{}: differs from local by {diff}",
                p.owner_name()
            );
            ensure!(
                (&got - initial_param(i64::from(p.owner_info().id)))
                    .abs()
                    .max()
                    .double_value(&[])
                    > 1e-3,
                "the parameter did not move"
            );
        }
        opt.close().await?;
    }
    w.store_barrier().await?;
    Ok(())
}

/// The largest element-wise difference between two lists of tensors.
fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// A job stopped after 2 steps and resumed with a new optimizer that loads
/// the old one's state (`state_dict` / `load_state_dict`) continues as an
/// uninterrupted job: 4 steps of libtorch's own optimizer. Without the
/// state (momentum, Adam's moments and step counts start afresh) it does
/// not.
async fn resumes_from_state(w: Worker, config: OptimizerConfig) -> anyhow::Result<()> {
    if w.rank == 0 {
        let a = w.agent.clone();
        let want = train_local(config, 4)?;
        for load in [true, false] {
            let params = make_params(&a).await?;
            let first = DistributedOptimizer::new(&a, config, &params).await?;
            train_dist(&a, &first, &params, 2).await?;
            let state = first.state_dict().await?;
            first.close().await?;
            let second = DistributedOptimizer::new(&a, config, &params).await?;
            if load {
                second.load_state_dict(state).await?;
            }
            train_dist_from(&a, &second, &params, 2, 2).await?;
            second.close().await?;
            let mut got = Vec::new();
            for p in &params {
                got.push(p.to_here(&a, None).await?.as_tensor()?);
            }
            let diff = max_diff(&got, &want);
            if load {
                ensure!(diff < 1e-6, "resumed with the state, off by {diff}");
            } else {
                ensure!(
                    diff > 1e-4,
                    "resumed without the state, yet off by only {diff}"
                );
            }
        }
    }
    w.store_barrier().await?;
    Ok(())
}

#[test]
fn sgd_momentum_resumes_from_its_state_dict() {
    dist_with(cluster(), |w| {
        resumes_from_state(w, Sgd::new(0.05).momentum(0.9).into())
    });
}

#[test]
fn adam_resumes_from_its_state_dict() {
    dist_with(cluster(), |w| {
        resumes_from_state(w, Adam::new(0.05).betas(0.8, 0.99).into())
    });
}

/// A state that does not fit is refused by the owner, naming it, and the
/// optimizer keeps its own.
#[test]
fn a_state_that_does_not_fit_is_refused() {
    dist_with(cluster(), |w| async move {
        if w.rank == 0 {
            let a = w.agent.clone();
            let params = make_params(&a).await?;
            let adam = DistributedOptimizer::new(&a, Adam::new(0.05), &params).await?;
            train_dist(&a, &adam, &params, 1).await?;
            let adam_state = adam.state_dict().await?;
            let sgd = DistributedOptimizer::new(&a, Sgd::new(0.05).momentum(0.9), &params).await?;
            let e = sgd
                .load_state_dict(adam_state)
                .await
                .err()
                .context("an Adam state was loaded into SGD")?;
            ensure!(
                e.to_string()
                    .contains("state with 4 fields, which a SGD optimizer cannot take"),
                "{e}"
            );
            let e = sgd
                .load_state_dict(wasmrpc::Payload::dict(Vec::new()))
                .await
                .err()
                .context("an empty state was loaded")?;
            ensure!(e.to_string().contains("has no entry for worker"), "{e}");
            adam.close().await?;
            sgd.close().await?;
        }
        w.store_barrier().await?;
        Ok(())
    });
}

#[test]
fn sgd_matches_local_tch() {
    dist_with(cluster(), |w| matches_local(w, Sgd::new(0.1).into()));
}

#[test]
fn sgd_momentum_weight_decay_matches_local_tch() {
    dist_with(cluster(), |w| {
        matches_local(
            w,
            Sgd::new(0.05)
                .momentum(0.9)
                .dampening(0.1)
                .weight_decay(0.01)
                .into(),
        )
    });
}

#[test]
fn sgd_nesterov_matches_local_tch() {
    dist_with(cluster(), |w| {
        matches_local(w, Sgd::new(0.05).momentum(0.8).nesterov(true).into())
    });
}

#[test]
fn adam_matches_local_tch() {
    dist_with(cluster(), |w| {
        matches_local(w, Adam::new(0.05).betas(0.8, 0.99).eps(1e-6).into())
    });
}

#[test]
fn adam_weight_decay_matches_local_tch() {
    dist_with(cluster(), |w| {
        matches_local(w, Adam::new(0.02).weight_decay(0.1).into())
    });
}

/// Steps of one optimizer from two contexts at once serialize on each owner
/// (OPT-2): plain SGD's two updates add up.
#[test]
fn concurrent_steps_serialize() {
    dist_with(cluster(), |w| async move {
        if w.rank == 0 {
            let a = w.agent.clone();
            let params = make_params(&a).await?;
            let opt = DistributedOptimizer::new(&a, Sgd::new(0.5), &params).await?;
            let (c1, c2) = (
                dist_autograd::new_context(&a)?,
                dist_autograd::new_context(&a)?,
            );
            let (id1, id2) = (c1.context_id(), c2.context_id());
            for (ctx, it) in [(id1, 0), (id2, 1)] {
                let loss = dist_autograd::with_context(ctx, async {
                    let mut l = Vec::new();
                    for p in &params {
                        let out = a
                            .rpc_sync(p.owner_name(), "optim::forward", args![p, input(it)])
                            .await?
                            .as_tensor()?;
                        l.push(out.sum(None));
                    }
                    anyhow::Ok(l.into_iter().reduce(|x, y| x + y).context("empty")?)
                })
                .await??;
                dist_autograd::backward(&a, ctx, &[loss], false).await?;
            }
            let (r1, r2) = tokio::join!(opt.step(id1), opt.step(id2));
            r1?;
            r2?;
            // The expected value, from local autograd on copies.
            for p in &params {
                let r = i64::from(p.owner_info().id);
                let mut want = initial_param(r);
                for it in 0..2 {
                    let local = initial_param(r).set_requires_grad(true);
                    forward(&local, &input(it))?.sum(None).backward();
                    want -= local.grad() * 0.5;
                }
                let got = p.to_here(&a, None).await?.as_tensor()?;
                let diff = (&got - &want).abs().max().double_value(&[]);
                ensure!(diff < 1e-9, "{}: off by {diff}", p.owner_name());
            }
            dist_autograd::release_context(&a, id1)?;
            dist_autograd::release_context(&a, id2)?;
            opt.close().await?;
        }
        w.store_barrier().await?;
        Ok(())
    });
}

/// A failed step names the worker it failed on.
#[test]
fn step_errors_name_the_worker() {
    dist_with(cluster(), |w| async move {
        if w.rank == 0 {
            let a = w.agent.clone();
            let params = make_params(&a).await?;
            let opt = DistributedOptimizer::new(&a, Sgd::new(0.1), &params[..1]).await?;
            let e = opt.step(12345).await.err().context("step succeeded")?;
            let msg = e.to_string();
            ensure!(
                msg.contains("worker1")
                    && msg.contains("Could not find autograd context with id: 12345"),
                "{msg}"
            );
            let e = DistributedOptimizer::new(&a, Sgd::new(-0.1), &params)
                .await
                .err()
                .context("accepted a negative learning rate")?;
            ensure!(e.message() == "Invalid learning rate: -0.1", "{e}");
            let not_tensor = a.remote("worker2", "seed::my_scalar_add", args![1i64, 2i64])?;
            let e = DistributedOptimizer::new(&a, Sgd::new(0.1), &[not_tensor])
                .await
                .err()
                .context("accepted an RRef to an int")?;
            let msg = e.to_string();
            ensure!(
                msg.contains("worker2") && msg.contains("does not hold a tensor"),
                "{msg}"
            );
            opt.close().await?;
        }
        w.store_barrier().await?;
        Ok(())
    });
}

/// Owners hold a local optimizer while the optimizer lives and none after
/// it is closed or dropped (OPT-4).
#[test]
fn optimizer_state_released() {
    dist_with(cluster(), |w| async move {
        let a = w.agent.clone();
        let mut opt = None;
        if w.rank == 0 {
            let params = make_params(&a).await?;
            opt = Some(DistributedOptimizer::new(&a, Adam::new(0.1), &params).await?);
            let second = DistributedOptimizer::new(&a, Sgd::new(0.1), &params).await?;
            w.store_barrier().await?;
            w.store_barrier().await?;
            second.close().await?;
        } else {
            w.store_barrier().await?;
            ensure!(
                num_local_optimizers(&a) == 2,
                "{}",
                num_local_optimizers(&a)
            );
            w.store_barrier().await?;
        }
        w.store_barrier().await?;
        let want = usize::from(w.rank != 0);
        ensure!(
            num_local_optimizers(&a) == want,
            "after close: {}",
            num_local_optimizers(&a)
        );
        // Every rank has looked before the drop's requests can arrive.
        w.store_barrier().await?;
        drop(opt);
        w.store_barrier().await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while num_local_optimizers(&a) != 0 {
            ensure!(
                tokio::time::Instant::now() < deadline,
                "not released after drop"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    });
}

/// The functions the tests above call.
pub(super) fn register(r: &wasmrpc::FunctionRegistry) {
    r.register_native("optim::make_param", |_c, a: Args| async move {
        Ok(initial_param(a.get(0)?.as_int()?)
            .set_requires_grad(true)
            .into())
    });
    r.register_native(
        "optim::forward",
        |c: wasmrpc::CallContext, a: Args| async move {
            let p = a
                .get(0)?
                .as_rref()?
                .local_value(c.agent())
                .await?
                .as_tensor()?;
            Ok(forward(&p, &a.get(1)?.as_tensor()?)?.into())
        },
    );
}

// ------------------------------------------------- autograd from a plugin

/// The suite's cluster, with the autograd-fns plugin on every worker
/// (`autograd_fns::<function>`).
fn plugin_cluster() -> wasmrpc::testing::ClusterBuilder {
    let host = wasmrpc::PluginHost::shared().expect("the process's plugin host starts");
    let plugin = host
        .load_file(wasmrpc_plugins::AUTOGRAD_FNS)
        .expect("the autograd-fns plugin loads");
    wasmrpc::testing::Cluster::builder(wasmrpc_tests::WORLD_SIZE).functions(move |r| {
        super::fns::register(r);
        host.register(&plugin, r);
    })
}

/// A trainer that is a plugin (forward through RPCs to the owners, dist
/// backward, distributed optimizer step) ends with the parameters the same
/// steps give in the host with libtorch's SGD.
#[test]
fn guest_trainer_matches_host() {
    dist_with(plugin_cluster(), |w| async move {
        if w.rank == 0 {
            let a = w.agent.clone();
            let params = make_params(&a).await?;
            let iters = 3;
            let inputs = wasmrpc::Payload::list((0..iters).map(|it| input(it).into()));
            let list = wasmrpc::Payload::list(params.iter().map(wasmrpc::Payload::from));
            let steps = a
                .rpc_sync(
                    "worker0",
                    "autograd_fns::train",
                    args![list, inputs, 0.1f64, 0.9f64],
                )
                .await?
                .as_int()?;
            ensure!(steps == iters, "{steps} steps");
            let want = train_local(Sgd::new(0.1).momentum(0.9).into(), iters)?;
            for (p, l) in params.iter().zip(want) {
                let got = p.to_here(&a, None).await?.as_tensor()?;
                let diff = (&got - &l).abs().max().double_value(&[]);
                ensure!(
                    diff < 1e-6,
                    "{}: differs from the host by {diff}",
                    p.owner_name()
                );
            }
        }
        w.store_barrier().await?;
        // The plugin's optimizer died with its call (OPT-4).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while num_local_optimizers(&w.agent) != 0 {
            ensure!(
                tokio::time::Instant::now() < deadline,
                "optimizer state leaked"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    });
}

/// A plugin's trainer, `function(params, inputs, lr, momentum, state)`,
/// resumed with the optimizer state its earlier call returned
/// (`state_dict` / `load_state_dict` through a guest SDK) ends where one
/// uninterrupted run of libtorch's SGD with momentum does.
async fn plugin_trainer_resumes(w: Worker, function: &'static str) -> anyhow::Result<()> {
    if w.rank == 0 {
        let a = w.agent.clone();
        let params = make_params(&a).await?;
        let list = || wasmrpc::Payload::list(params.iter().map(wasmrpc::Payload::from));
        let inputs =
            |its: std::ops::Range<i64>| wasmrpc::Payload::list(its.map(|it| input(it).into()));
        let state = a
            .rpc_sync(
                "worker0",
                function,
                args![
                    list(),
                    inputs(0..2),
                    0.1f64,
                    0.9f64,
                    wasmrpc::Payload::none()
                ],
            )
            .await?;
        ensure!(!state.is_none(), "{function}: no optimizer state came back");
        a.rpc_sync(
            "worker0",
            function,
            args![list(), inputs(2..4), 0.1f64, 0.9f64, state],
        )
        .await?;
        let want = train_local(Sgd::new(0.1).momentum(0.9).into(), 4)?;
        let mut got = Vec::new();
        for p in &params {
            got.push(p.to_here(&a, None).await?.as_tensor()?);
        }
        let diff = max_diff(&got, &want);
        ensure!(diff < 1e-6, "{function}: resumed, off by {diff}");
    }
    w.store_barrier().await?;
    Ok(())
}

/// The Rust guest SDK (`autograd_fns::train_resuming`).
#[test]
fn guest_trainer_resumes_from_its_optimizer_state() {
    dist_with(plugin_cluster(), |w| {
        plugin_trainer_resumes(w, "autograd_fns::train_resuming")
    });
}

/// The Python kit (`torch_api_py::dist_train_resuming`).
#[test]
fn python_trainer_resumes_from_its_optimizer_state() {
    let host = wasmrpc::PluginHost::shared().expect("the process's plugin host starts");
    let plugin = host
        .load_file(wasmrpc_plugins::TORCH_API_PY)
        .expect("the torch-api-py plugin loads");
    let cluster =
        wasmrpc::testing::Cluster::builder(wasmrpc_tests::WORLD_SIZE).functions(move |r| {
            super::fns::register(r);
            host.register(&plugin, r);
        });
    dist_with(cluster, |w| {
        plugin_trainer_resumes(w, "torch_api_py::dist_train_resuming")
    });
}

/// Local autograd in a plugin: `requires_grad_`, `backward`, `grad`,
/// `no_grad` + `sub_`, `detach`, against the same step in the host.
#[test]
fn guest_local_autograd_step() {
    dist_with(plugin_cluster(), |w| async move {
        let a = w.agent.clone();
        let (wt, x) = (initial_param(w.rank.into()), input(w.rank.into()));
        let out = a
            .rpc_sync(
                w.dst(),
                "autograd_fns::local_sgd_step",
                args![wt.shallow_clone(), x.shallow_clone(), 0.5f64],
            )
            .await?
            .items()?;
        let (got_w, got_g) = (out[0].as_tensor()?, out[1].as_tensor()?);
        let local = wt.copy().set_requires_grad(true);
        forward(&local, &x)?.sum(None).backward();
        let g = local.grad();
        ensure!(got_g.allclose(&g, 1e-9, 1e-12, false), "gradient");
        ensure!(
            got_w.allclose(&(&wt - &g * 0.5), 1e-9, 1e-12, false),
            "step"
        );
        ensure!(!got_w.requires_grad(), "the result is detached");
        let e = a
            .rpc_sync(w.dst(), "autograd_fns::in_place_on_leaf", args![wt])
            .await
            .err()
            .context("an in-place op on a leaf that requires grad succeeded")?;
        ensure!(
            e.message().contains(
                "a leaf Variable that requires grad is being used in an in-place operation"
            ),
            "{e}"
        );
        Ok(())
    });
}

/// A context a plugin opens is carried by its RPCs (the callee records a
/// recv and the backward reaches the plugin's tensors), its gradients are
/// found by tensor, and it is released when the guard drops.
#[test]
fn guest_dist_autograd_context() {
    dist_with(plugin_cluster(), |w| async move {
        let a = w.agent.clone();
        let (t1, t2) = (
            Tensor::rand([3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
            Tensor::rand([3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
        );
        // The plugin runs on the next worker and adds on the one after.
        let out = a
            .rpc_sync(
                w.dst(),
                "autograd_fns::dist_add_grads",
                args![w.peer(2), t1, t2],
            )
            .await?
            .items()?;
        let ctx_id = out[0].as_int()?;
        let ones = Tensor::ones([3, 3], (Kind::Float, Device::Cpu));
        ensure!(out[1].as_tensor()?.equal(&ones) && out[2].as_tensor()?.equal(&ones));
        ensure!(
            ctx_id >> 48 == i64::from((w.rank + 1) % w.world_size),
            "the context was made by the plugin's worker"
        );
        let e = a
            .rpc_sync(w.dst(), "autograd_fns::nested_context", Args::new())
            .await
            .err()
            .context("a nested context opened")?;
        ensure!(e.message() == wasmrpc::ALREADY_HAVE_AUTOGRAD_CONTEXT, "{e}");
        w.store_barrier().await?;
        // Released on every worker it reached once the guard dropped.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while dist_autograd::get_debug_info(&a)["num_autograd_contexts"] != "0" {
            ensure!(tokio::time::Instant::now() < deadline, "contexts left");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    });
}
