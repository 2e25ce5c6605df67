//! `dist_autograd_test.py`'s CUDA tests (area O): `CudaDistAutogradTest`
//! (`test_gpu_simple`, `test_gpu_to_cpu_continuation`,
//! `test_gpu_to_cpu_continuation_gpu_root`), whose RPCs carry CPU tensors
//! only, and `TensorPipeCudaDistAutogradTest`, whose RPCs carry CUDA
//! tensors through device maps (`test_device_maps_backward_pass`,
//! `test_gradients_synchronizations`, `test_dist_autograd_sync_streams`):
//! there the gradients travel back toward each sender with the inverse of
//! the map its message came with, and land on the devices its tensors were
//! on. They need one or four GPUs and skip cleanly without them
//! (`wasmrpc_tests::require_gpus`).
//!
//! The seeds' modules (`WrapperModule` over `nn.Linear`, `MyRemoteCompute`)
//! are native functions registered here as `cuda::<name>`: plugin objects
//! see tensor elements, not devices. A layer is a `(weight, bias)` value an
//! RRef holds on its owner; its methods are functions given the RRef.

use anyhow::ensure;
use tch::{Device, Kind, Tensor};
use wasmrpc::prelude::*;
use wasmrpc::testing::{Cluster, ClusterBuilder, worker_name};
use wasmrpc::{Args, FunctionRegistry, Payload, RpcBackendOptions, dist_autograd};
use wasmrpc_tests::{WORLD_SIZE, dist_with, require_gpus};

use super::fns::{close, cluster};
use super::{ExecMode, exec_t, verify_backwards};

/// The seeds' module methods, run on the layer's owner.
fn register_modules(r: &FunctionRegistry) {
    super::fns::register(r);
    // `WrapperModule(model, device)`: the layer `(weight, bias)` moved to
    // `cuda:device`, its parameters fresh leaves there (`model.to(device)`).
    r.register_native("cuda::wrapper_module", |_ctx, a: Args| async move {
        let device = Device::Cuda(usize::try_from(a.get(2)?.as_int()?).unwrap_or(usize::MAX));
        let param = |i: usize| -> wasmrpc::Result<Payload> {
            let t = a.get(i)?.as_tensor()?.f_to_device(device)?;
            Ok(Payload::from(t.detach().set_requires_grad(true)))
        };
        Ok(Payload::tuple([param(0)?, param(1)?]))
    });
    // `WrapperModule.forward(x)`: `x @ weight.T + bias`, on the owner.
    r.register_native("cuda::wrapper_forward", |ctx, a: Args| async move {
        let layer = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        let (w, b) = (layer.tensor(0)?, layer.tensor(1)?);
        let x = a.get(1)?.as_tensor()?;
        Ok(Payload::from(x.f_linear(w, Some(b))?))
    });
    // `WrapperModule.gradients(ctx_id)`: the parameters' gradients in the
    // context.
    r.register_native("cuda::wrapper_gradients", |ctx, a: Args| async move {
        let layer = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        let grads = dist_autograd::get_gradients(ctx.agent(), a.get(1)?.as_int()?)?;
        let mut out = Vec::new();
        for i in 0..2 {
            let g = grads
                .get(layer.tensor(i)?)
                .ok_or_else(|| wasmrpc::Error::runtime(format!("parameter {i} has no gradient")))?;
            out.push(Payload::from(g));
        }
        Ok(Payload::list(out))
    });
    // `MyRemoteCompute.forward(input)`: `input * 2.0`.
    r.register_native("cuda::my_remote_compute", |_ctx, a: Args| async move {
        Ok(Payload::from(a.get(0)?.as_tensor()?.f_mul_scalar(2.0)?))
    });
}

/// The dist_autograd cluster with the seeds' per-rank device maps
/// (`configure(rank, options)`) and the module functions.
fn mapped_cluster(
    configure: impl Fn(u32, &mut RpcBackendOptions) -> wasmrpc::Result<()> + Send + Sync + 'static,
) -> ClusterBuilder {
    Cluster::builder(WORLD_SIZE)
        .functions(register_modules)
        .configure(move |rank, o| configure(rank, o).expect("the seed's device map is valid"))
}

fn cuda(rank: u32) -> Device {
    Device::Cuda(rank as usize)
}

#[test]
fn test_gpu_simple() {
    if !require_gpus(1) {
        return;
    }
    dist_with(cluster(), |w| async move {
        let a = w.agent.clone();
        let t1 = Tensor::rand([3, 3], (Kind::Float, Device::Cuda(0))).set_requires_grad(true);
        let t2 = Tensor::rand([3, 3], (Kind::Float, Device::Cuda(0))).set_requires_grad(true);
        (&t1 + &t2).sum(Kind::Float).backward();
        let (g1, g2) = (t1.grad().copy(), t2.grad().copy());
        let (c1, c2) = (t1.shallow_clone(), t2.shallow_clone());
        dist_autograd::context(&a, |ctx| {
            let a = a.clone();
            async move {
                let root = (&c1 + &c2).sum(Kind::Float);
                dist_autograd::backward(&a, ctx, &[root], false).await?;
                let grads = dist_autograd::get_gradients(&a, ctx)?;
                ensure!(grads.len() == 2, "{} gradients", grads.len());
                ensure!(close(&grads.get(&c1).unwrap_or_default(), &g1));
                ensure!(close(&grads.get(&c2).unwrap_or_default(), &g2));
                anyhow::Ok(())
            }
        })
        .await??;
        Ok(())
    });
}

/// `test_gpu_to_cpu_continuation` (`gpu_root == false`: the root `t7` is on
/// the CPU) and `_gpu_root` (no `t7`; the root `t6.sum()` is on cuda:0).
fn gpu_to_cpu_continuation(gpu_root: bool) {
    if !require_gpus(1) {
        return;
    }
    dist_with(cluster(), move |w| async move {
        let a = w.agent.clone();
        let dst = w.dst();
        let t1 = Tensor::rand([3, 3], (Kind::Float, Device::Cuda(0))).set_requires_grad(true);
        let t2 = Tensor::rand([3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        for _ in 0..3 {
            for t in [&t1, &t2] {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let mut local = None;
            for mode in [ExecMode::Local, ExecMode::RpcSync] {
                let (a2, dst, t1, t2) = (
                    a.clone(),
                    dst.clone(),
                    t1.shallow_clone(),
                    t2.shallow_clone(),
                );
                let l = local.as_ref().map(|v: &Vec<Option<Tensor>>| {
                    v.iter().map(|g| g.as_ref().map(Tensor::copy)).collect()
                });
                let r = dist_autograd::context(&a, |ctx| async move {
                    let add = |x: &Tensor, y: &Tensor| {
                        exec_t(&a2, mode, &dst, "aten::add", vec![x.into(), y.into()])
                    };
                    let t3 = add(&t2, &t2).await?;
                    let t4 = t3.to_device(Device::Cuda(0)) + &t1;
                    let t5 = add(&t4.to_device(Device::Cpu), &t2).await?;
                    let t6 = t5.to_device(Device::Cuda(0)) + &t4;
                    let root = if gpu_root {
                        t6.sum(Kind::Float)
                    } else {
                        add(&t6.to_device(Device::Cpu), &t5).await?.sum(Kind::Float)
                    };
                    verify_backwards(&a2, mode, vec![root], ctx, l, vec![t1, t2]).await
                })
                .await??;
                local = r.or(local);
            }
        }
        Ok(())
    });
}

#[test]
fn test_gpu_to_cpu_continuation() {
    gpu_to_cpu_continuation(false);
}

#[test]
fn test_gpu_to_cpu_continuation_gpu_root() {
    gpu_to_cpu_continuation(true);
}

#[test]
fn test_device_maps_backward_pass() {
    if !require_gpus(4) {
        return;
    }
    // `options.set_device_map(dst, {rank: (rank + 1) % world_size})`.
    let builder = mapped_cluster(|rank, o| {
        o.set_device_map(
            &worker_name((rank + 1) % WORLD_SIZE),
            [(rank, (rank + 1) % WORLD_SIZE)],
        )
    });
    dist_with(builder, |w| async move {
        let a = w.agent.clone();
        let dst = w.dst();
        let t1 = Tensor::rand([10], (Kind::Float, cuda(w.rank))).set_requires_grad(true);
        let t2 = Tensor::rand([10], (Kind::Float, cuda(w.rank))).set_requires_grad(true);
        dist_autograd::context(&a, |ctx| {
            let a = a.clone();
            async move {
                let res = a
                    .rpc_sync(&dst, "aten::add", wasmrpc::args![&t1, &t2])
                    .await?
                    .as_tensor()?;
                dist_autograd::backward(&a, ctx, &[res.sum(Kind::Float)], false).await?;
                let grads = dist_autograd::get_gradients(&a, ctx)?;
                for t in [&t1, &t2] {
                    let g = grads.get(t).unwrap_or_default();
                    ensure!(g.defined(), "no gradient for a sent tensor");
                    ensure!(g.device() == t.device(), "gradient on {:?}", g.device());
                    ensure!(close(&g, &Tensor::ones([10], (Kind::Float, t.device()))));
                }
                anyhow::Ok(())
            }
        })
        .await??;
        Ok(())
    });
}

/// `test_dist_autograd_sync_streams`: the distributed gradient of a
/// `(1000, 10000)` input on `cuda:rank`, computed through `MyRemoteCompute`
/// on the next rank's GPU (device map `{rank: rank + 1}`), equals the local
/// gradient, ten times. The seed runs no side stream of its own either:
/// what it checks is that the gradients crossing back wait for the
/// backward work that made them.
#[test]
fn test_dist_autograd_sync_streams() {
    if !require_gpus(4) {
        return;
    }
    let builder = mapped_cluster(|rank, o| {
        o.set_device_map(
            &worker_name((rank + 1) % WORLD_SIZE),
            [(rank, (rank + 1) % WORLD_SIZE)],
        )
    });
    dist_with(builder, |w| async move {
        let a = w.agent.clone();
        for _ in 0..10 {
            let input =
                Tensor::rand([1000, 10000], (Kind::Float, cuda(w.rank))).set_requires_grad(true);
            let r: f64 = Tensor::rand([1], (Kind::Double, Device::Cpu)).double_value(&[0]);
            ((&input * 2.0).sum(Kind::Float) * r).backward();
            let local = input.grad().copy();
            let (a2, dst, x) = (a.clone(), w.dst(), input.shallow_clone());
            dist_autograd::context(&a, |ctx| async move {
                // `MyLocalCompute(remote_compute)(input)`.
                let result = a2
                    .rpc_sync(&dst, "cuda::my_remote_compute", wasmrpc::args![&x])
                    .await?
                    .as_tensor()?;
                let loss = result.sum(Kind::Float) * r;
                dist_autograd::backward(&a2, ctx, &[loss], false).await?;
                let g = dist_autograd::get_gradients(&a2, ctx)?
                    .get(&x)
                    .unwrap_or_default();
                ensure!(g.defined() && g.device() == x.device(), "gradient {g:?}");
                ensure!(close(&g, &local), "distributed and local gradients differ");
                anyhow::Ok(())
            })
            .await??;
        }
        Ok(())
    });
}

#[test]
fn test_gradients_synchronizations() {
    if !require_gpus(4) {
        return;
    }
    // `options.set_device_map(worker_name(peer), {rank: peer})` for every
    // peer.
    let builder = mapped_cluster(|rank, o| {
        for peer in 0..WORLD_SIZE {
            o.set_device_map(&worker_name(peer), [(rank, peer)])?;
        }
        Ok(())
    });
    dist_with(builder, |w| async move {
        if w.rank != 0 {
            return Ok(());
        }
        let a = w.agent.clone();
        // `nn.Linear(2000, 2000)` layers, moved to cuda:0 in place
        // (`l.to(0)`), so the local and the sent layers are the same.
        let bound = 1.0 / 2000f64.sqrt();
        let linear = || {
            let p = |shape: &[i64]| {
                (Tensor::rand(shape, (Kind::Float, Device::Cuda(0))) * (2.0 * bound) - bound)
                    .set_requires_grad(true)
            };
            (p(&[2000, 2000]), p(&[2000]))
        };
        let layers: Vec<(Tensor, Tensor)> = (1..WORLD_SIZE).map(|_| linear()).collect();
        let mut remote_layers = Vec::new();
        for (rank, (w_, b_)) in (1..WORLD_SIZE).zip(&layers) {
            remote_layers.push(a.remote(
                worker_name(rank).as_str(),
                "cuda::wrapper_module",
                wasmrpc::args![w_, b_, i64::from(rank)],
            )?);
        }
        let x = Tensor::randn([5000, 2000], (Kind::Float, Device::Cuda(0)));
        // The local iteration: `nn.Sequential(*local_layers)(x).sum().backward()`.
        let mut y = x.shallow_clone();
        for (w_, b_) in &layers {
            y = y.linear(w_, Some(b_));
        }
        y.sum(Kind::Float).backward();
        let (a2, x2) = (a.clone(), x.shallow_clone());
        let remotes = remote_layers.clone();
        dist_autograd::context(&a, |ctx| async move {
            let mut y = x2;
            for layer in &remotes {
                y = a2
                    .rpc_sync(
                        layer.owner_name(),
                        "cuda::wrapper_forward",
                        wasmrpc::args![layer, &y],
                    )
                    .await?
                    .as_tensor()?;
            }
            dist_autograd::backward(&a2, ctx, &[y.sum(Kind::Float)], false).await?;
            let mut futs = Vec::new();
            for layer in &remotes {
                futs.push(a2.rpc_async(
                    layer.owner_name(),
                    "cuda::wrapper_gradients",
                    wasmrpc::args![layer, ctx],
                ));
            }
            for (i, f) in futs.into_iter().enumerate() {
                let remote = f.wait().await?.items()?;
                ensure!(remote.len() == 2, "layer {i}: {} gradients", remote.len());
                let (w_, b_) = &layers[i];
                for (got, param) in remote.iter().zip([w_, b_]) {
                    let got = got.as_tensor()?;
                    ensure!(
                        close(&got, &param.grad()),
                        "layer {i}: remote and local gradients differ"
                    );
                }
            }
            anyhow::Ok(())
        })
        .await??;
        Ok(())
    });
}
