//! `nccl` is libtorch's `c10d::ProcessGroupNCCL`, compiled into the shim
//! when libtorch is a CUDA build. Without a GPU the tests that need one
//! print the skip line the coverage tool counts (`wasmrpc-skip: ...`) and
//! return; the availability checks run everywhere.

mod common;

use common::run_ranks;

use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use wasmrpc_c10d::{InitOptions, ReduceOp, World, is_backend_available, is_nccl_available};
use wasmrpc_store::HashStore;

/// Whether build.rs found a CUDA libtorch (`libtorch_cuda.so`).
const CUDA_BUILD: bool = matches!(env!("WASMRPC_C10D_CUDA_BUILD").as_bytes(), b"1");

/// The GPUs the multi-rank tests may use: one rank per GPU, as NCCL wants.
fn gpus() -> usize {
    // CUDA is loaded at run time, where a device is present: before
    // libtorch's first device query.
    if wasmrpc_torch_sys::cuda::is_loaded() && tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

#[test]
fn nccl_is_available_exactly_in_a_cuda_build() {
    assert_eq!(is_nccl_available(), CUDA_BUILD);
    assert_eq!(is_backend_available("nccl"), CUDA_BUILD);
    assert_eq!(wasmrpc_c10d::engine::nccl_compiled(), CUDA_BUILD);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_gpu_nccl_refuses_with_pytorchs_text() {
    if !is_nccl_available() || gpus() > 0 {
        println!("wasmrpc-skip: needs a CUDA build without a GPU");
        return;
    }
    let world = World::new();
    let err = world
        .init_process_group(InitOptions {
            backend: Some("nccl".into()),
            store: Some(Arc::new(HashStore::new())),
            rank: Some(0),
            world_size: Some(1),
            ..Default::default()
        })
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
            && text.contains("rank 0 of group 0"),
        "{text}"
    );
    // Refused before anything of CUDA's was loaded, unless the process was
    // told to load CUDA (then libtorch's own constructor refuses).
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    if forced_cuda() {
        assert!(
            maps.contains(wasmrpc_c10d::engine::nccl::LIBRARY) && maps.contains("/libnccl"),
            "{maps}"
        );
    } else {
        assert!(text.contains("this process did not load CUDA: "), "{text}");
        for lib in [
            "/libtorch_cuda.so",
            "/libnccl",
            wasmrpc_c10d::engine::nccl::LIBRARY,
        ] {
            assert!(!maps.contains(lib), "{lib} is mapped:\n{maps}");
        }
    }
    assert!(!world.is_initialized());
    // Without a GPU the default backend string keeps CUDA on gloo.
    assert_eq!(
        wasmrpc_c10d::BackendConfig::new("undefined")
            .unwrap()
            .to_string(),
        "cpu:gloo,cuda:gloo"
    );
}

/// Whether this process was told to load CUDA (`WASMRPC_LOAD_CUDA=1`).
fn forced_cuda() -> bool {
    std::env::var(wasmrpc_torch_sys::cuda::LOAD_ENV).is_ok_and(|v| v == "1")
}

/// NCCL's library is a shared object of its own that only an NCCL group
/// loads, after CUDA: with CUDA forced on a machine without a GPU, it
/// loads (its libraries resolve, its factory is found) and libtorch's own
/// constructor refuses; run in a child process, since CUDA is loaded once
/// per process.
#[test]
fn with_cuda_forced_the_nccl_library_loads_and_libtorch_refuses_without_a_gpu() {
    if !is_nccl_available() || forced_cuda() {
        println!("wasmrpc-skip: needs a CUDA build (NCCL)");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "without_a_gpu_nccl_refuses_with_pytorchs_text",
            "--exact",
            "--nocapture",
        ])
        .env(wasmrpc_torch_sys::cuda::LOAD_ENV, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    if !text.contains("wasmrpc-skip") {
        assert!(text.contains("1 passed"), "{text}");
    }
}

async fn init(backend: &str, rank: usize, n: usize, file: &std::path::Path) -> World {
    common::init(Some(backend), rank, n, file, Duration::from_secs(30)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_on_cuda_tensors() {
    let n = gpus().min(4);
    if n == 0 || !is_nccl_available() {
        println!("wasmrpc-skip: needs a GPU and a CUDA build (NCCL)");
        return;
    }
    run_ranks(n, move |rank, file| async move {
        let world = init("nccl", rank, n, &file).await;
        let dev = (Kind::Float, Device::Cuda(rank));
        let r = rank as f64;
        let nf = n as f64;
        let t = Tensor::full([3], r + 1., dev);
        world
            .all_reduce(&t, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let want = nf * (nf + 1.) / 2.;
        assert!(t.to_device(Device::Cpu).equal(&Tensor::full(
            [3],
            want,
            (Kind::Float, Device::Cpu)
        )));

        let t = Tensor::full([3], r + 1., dev);
        world
            .all_reduce(&t, ReduceOp::AVG, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let want = (nf + 1.) / 2.;
        assert!(t.to_device(Device::Cpu).allclose(
            &Tensor::full([3], want, (Kind::Float, Device::Cpu)),
            1e-6,
            1e-6,
            false
        ));

        let t = Tensor::full([2], r, dev);
        world.broadcast(&t, 0, None).unwrap().wait().await.unwrap();
        assert_eq!(t.sum(Kind::Float).double_value(&[]), 0.);

        let outs: Vec<Tensor> = (0..n).map(|_| Tensor::zeros([2], dev)).collect();
        world
            .all_gather(&outs, &Tensor::full([2], r, dev), None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        for (s, o) in outs.iter().enumerate() {
            assert_eq!(o.sum(Kind::Float).double_value(&[]), 2. * s as f64);
        }

        let ins: Vec<Tensor> = (0..n).map(|d| Tensor::full([1], d as f64, dev)).collect();
        let out = Tensor::zeros([1], dev);
        world
            .reduce_scatter(&out, &ins, ReduceOp::SUM, None)
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!(out.double_value(&[0]), nf * r);

        world.barrier(None).unwrap().wait().await.unwrap();
        world.destroy_process_group(None).unwrap();
    })
    .await;
}

/// `"cpu:gloo,cuda:nccl"` as in PyTorch: CPU tensors go to Gloo, CUDA
/// tensors to NCCL, in one group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_gloo_cuda_nccl_dispatch_by_device() {
    let n = gpus().min(2);
    if n == 0 || !is_nccl_available() {
        println!("wasmrpc-skip: needs a GPU and a CUDA build (NCCL)");
        return;
    }
    run_ranks(n, move |rank, file| async move {
        let world = init("cpu:gloo,cuda:nccl", rank, n, &file).await;
        let pg = world.default_group().unwrap();
        assert_eq!(pg.backend_for(Device::Cpu).unwrap().name(), "gloo");
        assert_eq!(pg.backend_for(Device::Cuda(rank)).unwrap().name(), "nccl");
        let cpu = Tensor::full([2], 1., (Kind::Float, Device::Cpu));
        let gpu = Tensor::full([2], 1., (Kind::Float, Device::Cuda(rank)));
        let a = world.all_reduce(&cpu, ReduceOp::SUM, None).unwrap();
        let b = world.all_reduce(&gpu, ReduceOp::SUM, None).unwrap();
        a.wait().await.unwrap();
        b.wait().await.unwrap();
        assert_eq!(cpu.double_value(&[0]), n as f64);
        assert_eq!(gpu.double_value(&[0]), n as f64);
        world.destroy_process_group(None).unwrap();
    })
    .await;
}
