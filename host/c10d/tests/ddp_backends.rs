//! `ddp::Reducer` and its comm hooks run on whichever backend the group has:
//! libtorch's Gloo, this crate's tcp, and NCCL on CUDA parameters when a GPU
//! is present (skipped otherwise).

mod common;

use common::run_ranks;

use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use wasmrpc_c10d::ddp::{GradBucket, HookFuture, Reducer};
use wasmrpc_c10d::{ReduceOp, World};

/// Gradients `rank + 1` for every element of `a`, `10 * (rank + 1)` of `b`.
fn set_grads(a: &Tensor, b: &Tensor, rank: usize) {
    let r = rank as f64 + 1.;
    ((a * r).sum(Kind::Float) + (b * (10. * r)).sum(Kind::Float)).backward();
}

/// Two parameters per rank whose gradients are `rank + 1` and `10 * (rank +
/// 1)`; after the default hook every rank holds the means; after a hook
/// that takes the MAX, the largest.
async fn reduce_gradients(world: Arc<World>, rank: usize, n: usize, device: Device) {
    let opts = (Kind::Float, device);
    let a = Tensor::zeros([300], opts).set_requires_grad(true);
    let b = Tensor::zeros([5, 5], opts).set_requires_grad(true);
    let mut reducer = Reducer::new(
        Arc::clone(&world),
        vec![a.shallow_clone(), b.shallow_clone()],
        64,
        None,
    )
    .await
    .unwrap();
    assert!(reducer.buckets().len() > 1, "{:?}", reducer.buckets());
    set_grads(&a, &b, rank);
    reducer.sync_gradients().await.unwrap();
    let mean = (1..=n).sum::<usize>() as f64 / n as f64;
    let cpu = |t: Tensor| t.to_device(Device::Cpu);
    assert!(
        cpu(a.grad()).allclose(
            &Tensor::full([300], mean, (Kind::Float, Device::Cpu)),
            1e-5,
            1e-5,
            false
        ),
        "rank {rank}: {}",
        a.grad()
    );
    assert!(cpu(b.grad()).allclose(
        &Tensor::full([5, 5], 10. * mean, (Kind::Float, Device::Cpu)),
        1e-5,
        1e-5,
        false
    ));

    // A hook of our own, through the same group.
    let hook_world = Arc::clone(&world);
    reducer.register_comm_hook(Arc::new(move |bucket: GradBucket| -> HookFuture {
        let world = Arc::clone(&hook_world);
        Box::pin(async move {
            world
                .all_reduce(&bucket.buffer, ReduceOp::MAX, None)?
                .wait()
                .await?;
            Ok(bucket.buffer)
        })
    }));
    let _ = a.grad().zero_();
    let _ = b.grad().zero_();
    set_grads(&a, &b, rank);
    reducer.sync_gradients().await.unwrap();
    assert_eq!(cpu(a.grad()).max().double_value(&[]), n as f64);
    assert_eq!(cpu(b.grad()).min().double_value(&[]), 10. * n as f64);
}

async fn run(backend: &'static str, n: usize, gpu: bool) {
    run_ranks(n, move |rank, file| async move {
        let world =
            Arc::new(common::init(Some(backend), rank, n, &file, Duration::from_secs(20)).await);
        let device = if gpu { Device::Cuda(rank) } else { Device::Cpu };
        reduce_gradients(Arc::clone(&world), rank, n, device).await;
        world.barrier(None).unwrap().wait().await.unwrap();
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reducer_on_gloo() {
    run("gloo", 3, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reducer_on_tcp() {
    run("tcp", 3, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reducer_on_nccl() {
    let gpus = if wasmrpc_torch_sys::cuda::is_loaded() && tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    };
    if gpus == 0 || !wasmrpc_c10d::is_nccl_available() {
        println!("wasmrpc-skip: needs a GPU and a CUDA build (NCCL)");
        return;
    }
    run("nccl", gpus.min(2), true).await;
}
