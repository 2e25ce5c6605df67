//! `dist_autograd_test.py`'s CUDA tests (area O): `CudaDistAutogradTest`
//! (`test_gpu_simple`, `test_gpu_to_cpu_continuation`,
//! `test_gpu_to_cpu_continuation_gpu_root`). They need one GPU and skip
//! cleanly without it (`wasmrpc_tests::require_gpus`). The RPCs of these
//! tests carry CPU tensors only; the GPU part of the graph is local.
//!
//! Not ported (the `TensorPipeCudaDistAutogradTest` suite): gradients
//! travelling backwards toward a device-mapped sender need per-recv-function
//! device maps (PyTorch's `RecvRpcBackward` keeps the reverse map of the
//! forward message); wasmrpc sends gradients with the request maps only, so
//! `test_device_maps_backward_pass`, `test_dist_autograd_sync_streams` and
//! `test_gradients_synchronizations` are not ported yet (the last two also
//! need CUDA streams or `nn.Linear` modules on GPUs in RRefs).

use anyhow::ensure;
use tch::{Device, Kind, Tensor};
use wasmrpc::autograd;
use wasmrpc_tests::{dist_with, require_gpus};

use super::fns::{close, cluster};
use super::{ExecMode, exec_t, verify_backwards};

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
        autograd::context(&a, |ctx| {
            let a = a.clone();
            async move {
                let root = (&c1 + &c2).sum(Kind::Float);
                autograd::backward(&a, ctx, &[root], false).await?;
                let grads = autograd::get_gradients(&a, ctx)?;
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
                let r = autograd::context(&a, |ctx| async move {
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
