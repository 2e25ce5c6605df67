//! Port of `rpc_test.py`'s `TensorPipeAgentCudaRpcTest`: device-map
//! configuration (area S) and device-mapped tensor transfer (area T).
//!
//! Most tests need CUDA devices and skip cleanly without them
//! (`wasmrpc_tests::require_gpus` prints `wasmrpc-skip: needs N GPUs`).
//! Those whose checks do not depend on a GPU run everywhere: the set-time
//! errors of `set_device_map` (`test_device_maps_one_to_many`,
//! `test_device_maps_invalid_min_device`), the init-time errors a machine
//! without GPUs reports with the seed's text (`test_device_maps_wrong_worker_name`,
//! `test_device_maps_invalid_max_local_device`, `test_device_maps_many_to_one`),
//! and the CPU→CPU map (`test_device_map_cpu`).
//!
//! The callees are native functions registered here as `cuda::<seed name>`
//! (the seeds' `_gpu_add_given_devices`, `_add_to_gpu`, ...): the wasm
//! guest SDK sees tensor elements, not devices. Groups are started with
//! per-rank options (each rank maps toward its own `dst`), 2 workers unless
//! a test needs more.
//!
//! Area U (CUDA streams): `test_tensor_view_as_return_value` (a view of a
//! CUDA tensor returned through the map) and, at the end of this file, the
//! stream and RRef synchronization tests (`test_custom_stream*`,
//! `test_rref_*_synchronization*`, `test_owner_rref_forward_synchronization*`,
//! `test_rref_with_unpickleable_attributes`). Their callees do what the
//! seeds' do, with the shim's streams, events and sleep kernel
//! (`wasmrpc_tests::gpu`): `_slow_add_on_user_stream` adds on a side stream
//! after a sleep and makes the current stream wait for it; the model's
//! `forward` sleeps on the current stream before it runs. A transfer that
//! did not wait for that work would carry the value before it is written.
//! For `TensorWrapper`, an object stays on its owner and is changed there.
//! Area V: device-aware futures (`Future::with_devices`), read on another
//! stream than the one that wrote them, after a second's sleep there. The
//! `_custom_class_` variants wrap the tensor in a named record
//! (`TensorWrapper { tensor }`), the value tree's custom class; the seed's
//! unpicklable fields (a lock, a CUDA event, a thread) have no counterpart
//! in a value. The `@async_execution` functions of
//! `test_async_execution_*_with_cuda_future` are native async functions
//! here (`cuda::async_cuda_sleep_and_set_to_one`, `cuda::async_cuda_nested_add`):
//! the call completes when the future they return does, without holding a
//! thread; the wasm guest SDK sees tensor elements, not devices.
//!
//! Area Q's `test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda`
//! is here too (it needs 2 GPUs): rank 0 joins a dynamic group with maps
//! toward workers that have not joined yet.

use std::time::Duration;
use wasmrpc::prelude::*;

use anyhow::{Context, ensure};
use tch::{Device, Kind, Tensor};
use wasmrpc::testing::{fresh_store, worker_name};
use wasmrpc::{
    Args, Error, ErrorKind, FunctionRegistry, Payload, RpcAgent, RpcBackendOptions, args, init_rpc,
};
use wasmrpc_tests::gpu::{
    Event, FIFTY_MIL_CYCLES, Stream, cuda_error, cuda_index, record_stream, sleep_cycles, sleep_ms,
};
use wasmrpc_tests::{expect_err, register_all, require_gpus, timed};

const MISSING_CONFIG: &str = "TensorPipe RPC backend only supports CPU tensors by default";
const SET_DEVICE_MAP_HINT: &str = "`set_device_map` on `TensorPipeRpcBackendOptions`";
const RESPONSE_MISSING: &str = "Response device mapping is not available";

fn dev(spec: &str) -> wasmrpc::Result<Device> {
    Ok(wasmrpc::device::parse_device(spec)?.to_tch())
}

/// The seeds' `_gpu_add_given_devices`, `_add_to_gpu`, `_gpu_add_multi_gpu`,
/// `_gpu_add_return_to_gpu` and the device-mismatch callee.
fn register(r: &FunctionRegistry) {
    register_all(r);
    register_streams(r);
    r.register_native(
        "cuda::add_one_through_first_then_sum_second",
        |_ctx, a: Args| async move {
            let (first, second) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
            // The whole storage from its start: libtorch refuses the view if
            // `first` has a storage of its own, half the size.
            let layout = format!(
                "first at {:#x} offset {}, second at {:#x} offset {}",
                first.data_ptr() as usize,
                first.storage_offset(),
                second.data_ptr() as usize,
                second.storage_offset()
            );
            let mut whole = first
                .f_as_strided([first.numel() as i64 * 2].as_slice(), [1i64].as_slice(), 0)
                .map_err(|e| Error::runtime(format!("{layout}: {e}")))?;
            let _ = whole.f_add_scalar_(1)?;
            Ok(Payload::from(second.f_sum(None::<Kind>)?))
        },
    );
    r.register_native("cuda::gpu_add_given_devices", |_ctx, a: Args| async move {
        let (x, y) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
        let (x_to, y_to, z_to) = (
            dev(a.get(2)?.as_str()?)?,
            dev(a.get(3)?.as_str()?)?,
            dev(a.get(4)?.as_str()?)?,
        );
        if x.device() == x_to && y.device() == y_to {
            Ok(Payload::from(
                x.f_to_device(z_to)?.f_add(&y.f_to_device(z_to)?)?,
            ))
        } else {
            Err(Error::value("Wrong device affinity"))
        }
    });
    r.register_native("cuda::add_to_gpu", |_ctx, a: Args| async move {
        let (x, y) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
        Ok(Payload::from(x.f_add(&y)?.f_to_device(Device::Cuda(0))?))
    });
    r.register_native("cuda::gpu_add_multi_gpu", |_ctx, a: Args| async move {
        let (x, y) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
        if x.device() == Device::Cuda(1) && y.device() == Device::Cuda(0) {
            Ok(Payload::tuple([
                Payload::from(x.f_to_device(Device::Cuda(0))?.f_add(&y)?),
                Payload::from(x.f_sub(&y.f_to_device(Device::Cuda(1))?)?),
            ]))
        } else {
            Err(Error::value("Wrong device affinity"))
        }
    });
    r.register_native("cuda::gpu_add_return_to_gpu", |_ctx, a: Args| async move {
        let (x, y) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
        if x.device() == Device::Cpu && y.device() == Device::Cpu {
            Ok(Payload::tuple([
                Payload::from(x.f_add(&y)?.f_to_device(Device::Cuda(0))?),
                Payload::from(x.f_sub(&y)?.f_to_device(Device::Cuda(1))?),
                Payload::from(x.f_mul(&y)?.f_to_device(Device::Cuda(2))?),
                Payload::from(x.f_div(&y)?.f_to_device(Device::Cuda(3))?),
            ]))
        } else {
            Err(Error::value("Wrong device affinity"))
        }
    });
    r.register_native("cuda::return_tensor_view", |_ctx, a: Args| async move {
        let i = a.get(0)?.as_int()?;
        let x = Tensor::f_ones([1000, 200], (Kind::Float, Device::Cuda(0)))?.f_mul_scalar(i)?;
        Ok(Payload::from(x.f_split(100, 0)?.swap_remove(0)))
    });
    // `@async_execution async_cuda_sleep_and_set_to_one(t)`: on a new
    // stream that waited for the current one, a second's sleep, then
    // `t.fill_(1)` and a device-aware future completed with `t`, which the
    // call returns. The reply must wait for that stream's work (through the
    // future's events): read before, `t` is still zeros.
    r.register_native(
        "cuda::async_cuda_sleep_and_set_to_one",
        |_ctx, a: Args| async move {
            let mut t = a.get(0)?.as_tensor()?;
            let device = cuda_index(&t)?;
            let original_stream = Stream::current(device).map_err(cuda_error)?;
            let new_stream = Stream::from_pool(device).map_err(cuda_error)?;
            new_stream
                .wait_stream(&original_stream)
                .map_err(cuda_error)?;
            let fut = {
                let _on_new_stream = new_stream.make_current().map_err(cuda_error)?;
                sleep_ms(device, 1000.0)?;
                let _ = t.f_fill_(1)?;
                let fut = wasmrpc::Future::with_devices([t.device()])?;
                fut.set_result(t)?;
                fut
            };
            fut.wait().await
        },
    );
    // `@async_execution async_cuda_nested_add(to, x, y, z)`:
    // `rpc_async(to, torch.add, (x, y)).then(lambda fut: fut.value() + z)`.
    r.register_native("cuda::async_cuda_nested_add", |ctx, a: Args| async move {
        let to = a.get(0)?.as_str()?.to_owned();
        let (x, y, z) = (
            a.get(1)?.as_tensor()?,
            a.get(2)?.as_tensor()?,
            a.get(3)?.as_tensor()?,
        );
        ctx.agent()
            .rpc_async(to.as_str(), "aten::add", args![x, y])
            .then(move |f| {
                // `cb`: a second's sleep, then `fut.value() + z`.
                sleep_ms(cuda_index(&z)?, 1000.0)?;
                let sum = f.try_value().expect("completed")?.as_tensor()?;
                Ok(Payload::from(sum.f_add(&z)?))
            })
            .wait()
            .await
    });
    r.register_native("cuda::gpu_device_mismatch", |_ctx, a: Args| async move {
        let (x, y) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
        Ok(Payload::from(
            x.f_to_device(Device::Cpu)?
                .f_add(&y.f_to_device(Device::Cuda(0))?)?,
        ))
    });
}

/// Starts a static group of `world_size` workers, each with the test
/// functions and the options `configure(rank, options)` makes (the seeds
/// build options per rank before `init_rpc`). On failure every started
/// worker is aborted and the first rank's error is returned, as every rank
/// of the seed reports the same error.
async fn start(
    world_size: u32,
    configure: impl Fn(u32, &mut RpcBackendOptions) -> wasmrpc::Result<()>,
) -> wasmrpc::Result<Vec<RpcAgent>> {
    let store = fresh_store();
    let mut tasks = Vec::new();
    for rank in 0..world_size {
        let registry = FunctionRegistry::new();
        register(&registry);
        let mut options = RpcBackendOptions {
            registry: std::sync::Arc::new(registry),
            ..RpcBackendOptions::default()
        };
        configure(rank, &mut options)?;
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            init_rpc(
                &worker_name(rank),
                Some(rank),
                Some(world_size),
                store,
                options,
            )
            .await
        }));
    }
    let mut agents = Vec::new();
    let mut first_err = None;
    for t in tasks {
        match t.await {
            Ok(Ok(a)) => agents.push(a),
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(e) => first_err = first_err.or(Some(Error::runtime(format!("init task: {e}")))),
        }
    }
    if let Some(e) = first_err {
        agents.iter().for_each(RpcAgent::abort);
        return Err(e);
    }
    Ok(agents)
}

async fn shutdown(agents: Vec<RpcAgent>) -> anyhow::Result<()> {
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|a| tokio::spawn(async move { a.shutdown(true, Duration::from_secs(30)).await }))
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// `_test_device_maps(options, errMsg)`: init with these options fails on
/// every rank with `ValueError` `text`.
fn expect_init_error(
    configure: impl Fn(u32, &mut RpcBackendOptions) -> wasmrpc::Result<()> + Send + 'static,
    text: &'static str,
) {
    timed(async move {
        expect_err(start(2, configure).await, ErrorKind::ValueError, text)?;
        Ok(())
    });
}

/// `got` is on `cuda:0` and every element equals `value`.
fn ensure_filled_on_cuda0(got: &Tensor, value: i64) -> anyhow::Result<()> {
    ensure!(
        got.device() == Device::Cuda(0),
        "result on {:?}",
        got.device()
    );
    ensure!(
        got.eq(value).all().int64_value(&[]) == 1,
        "not all {value}: {got:?}"
    );
    Ok(())
}

fn dst(rank: u32, world_size: u32) -> String {
    worker_name((rank + 1) % world_size)
}

// ---- Area S: device-map configuration ----------------------------------

#[test]
fn test_device_maps_wrong_worker_name() {
    // Target names are checked before any device index, so a machine
    // without GPUs reports the seed's error too.
    expect_init_error(
        |_, o| o.set_device_map("none_exist", [(0, 1)]),
        "Node worker0 has invalid target node names in its device maps",
    );
}

#[test]
fn test_device_maps_invalid_max_local_device() {
    let count = tch::Cuda::device_count();
    expect_init_error(
        move |rank, o| o.set_device_map(&dst(rank, 2), [(count, 0)]),
        "Node worker0 has source devices with invalid indices in its device map for worker1",
    );
}

#[test]
fn test_device_maps_invalid_max_remote_device() {
    if !require_gpus(1) {
        return;
    }
    let count = tch::Cuda::device_count();
    expect_init_error(
        move |rank, o| o.set_device_map(&dst(rank, 2), [(0, count)]),
        "Node worker0 has target devices with invalid indices in its device map for worker1",
    );
}

#[test]
fn test_device_maps_many_to_one() {
    // Duplicated targets are checked before device indices: the same error
    // with or without GPUs.
    expect_init_error(
        |rank, o| {
            o.set_device_map(&dst(rank, 2), [(1, 0)])?;
            o.set_device_map(&dst(rank, 2), [(0, 0)])
        },
        "Node worker0 has duplicated target devices in its device map for worker1",
    );
}

#[test]
fn test_device_maps_one_to_many() {
    let mut o = RpcBackendOptions::default();
    o.set_device_map("worker1", [(0, 1)]).unwrap();
    let e = expect_err(
        o.set_device_map("worker1", [(0, 0)]),
        ErrorKind::ValueError,
        "`set_device_map` only supports 1-to-1 mapping",
    )
    .unwrap();
    assert!(
        e.message()
            .contains("trying to map cuda:0 to cuda:0 and cuda:1")
    );
    // The failed call changed nothing.
    assert_eq!(
        o.device_maps["worker1"].values().collect::<Vec<_>>(),
        [&wasmrpc::device::Device::Cuda(1)]
    );
}

#[test]
fn test_device_maps_invalid_min_device() {
    let mut o = RpcBackendOptions::default();
    for (k, v) in [(-1, 0), (0, -1)] {
        expect_err(
            o.set_device_map("worker1", [(k, v)]),
            ErrorKind::RuntimeError,
            "Device index must not be negative",
        )
        .unwrap();
    }
    assert!(o.device_maps.is_empty());
}

#[test]
fn test_devices_option_mismatch() {
    if !require_gpus(2) {
        return;
    }
    expect_init_error(
        |rank, o| {
            o.set_device_map(&dst(rank, 2), [(0, 0)])?;
            o.set_devices([1])
        },
        "Node worker0 has unexpected source devices in its device map for worker1",
    );
}

#[test]
fn test_devices_option_mismatch_reverse() {
    if !require_gpus(2) {
        return;
    }
    expect_init_error(
        |rank, o| {
            o.set_device_map(&dst(rank, 2), [(0, 1)])?;
            o.set_devices([0])
        },
        "Node worker0 has unexpected target devices in its device map for worker1",
    );
}

/// Beyond the seeds: a map naming `cuda:0` on a machine without GPUs (or any
/// index past the device count) fails at init with PyTorch's text, before
/// any tensor moves.
#[test]
fn test_device_map_beyond_device_count_fails_at_init() {
    let count = tch::Cuda::device_count();
    expect_init_error(
        move |rank, o| {
            o.set_device_map(
                &dst(rank, 2),
                [(format!("cuda:{count}"), "cpu".to_string())],
            )
        },
        "Node worker0 has source devices with invalid indices in its device map for worker1",
    );
    expect_init_error(
        move |rank, o| {
            o.set_device_map(
                &dst(rank, 2),
                [("cpu".to_string(), format!("cuda:{count}"))],
            )
        },
        "Node worker0 has target devices with invalid indices in its device map for worker1",
    );
}

/// Beyond the seeds: validation is global (the maps are all-gathered at
/// init), so rank 0, whose own options are valid, reports rank 1's bad map
/// with rank 1's name, as every PyTorch rank does.
#[test]
fn test_device_maps_validated_on_every_rank() {
    let count = tch::Cuda::device_count();
    timed(async move {
        let agents = start(2, move |rank, o| {
            if rank == 1 {
                o.set_device_map("worker0", [(count, 0)])?;
            }
            Ok(())
        })
        .await;
        expect_err(
            agents,
            ErrorKind::ValueError,
            "Node worker1 has source devices with invalid indices in its device map for worker0",
        )?;
        Ok(())
    });
}

// ---- Area T: device-mapped transfer --------------------------------------

/// `_test_device_maps_gpu(x_from, y_from, z_to, device_map, dst)`: every
/// rank sends `zeros(2)` on `x_from` and `ones(2)` on `y_from` to `dst`
/// (the next rank, or itself for the `_self` variants); the callee checks
/// they arrived on `map[x_from]`, `map[y_from]` and returns their sum on
/// `z_to`, which must come back on `reverse_map[z_to]`.
fn device_maps_gpu(
    gpus: usize,
    x_from: &str,
    y_from: &str,
    z_to: &str,
    map: &[(&str, &str)],
    to_self: bool,
) {
    if !require_gpus(gpus) {
        return;
    }
    let map: Vec<(String, String)> = map
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let (x_from, y_from, z_to) = (x_from.to_string(), y_from.to_string(), z_to.to_string());
    timed(async move {
        let target = move |rank: u32| {
            if to_self {
                worker_name(rank)
            } else {
                dst(rank, 2)
            }
        };
        let m = map.clone();
        let agents = start(2, move |rank, o| o.set_device_map(&target(rank), m.clone())).await?;
        let parsed = wasmrpc::device::to_device_map(map.clone())?;
        let mapped = |d: &str| -> anyhow::Result<String> {
            let d = wasmrpc::device::parse_device(d)?;
            Ok(parsed.get(&d).copied().unwrap_or(d).to_string())
        };
        let back = |d: &str| -> anyhow::Result<Device> {
            let d = wasmrpc::device::parse_device(d)?;
            let r = parsed
                .iter()
                .find(|(_, v)| **v == d)
                .map(|(k, _)| *k)
                .unwrap_or(d);
            Ok(r.to_tch())
        };
        for (rank, a) in agents.iter().enumerate() {
            let x = Tensor::zeros([2], (Kind::Float, dev(&x_from)?));
            let y = Tensor::ones([2], (Kind::Float, dev(&y_from)?));
            let to = target(rank as u32);
            let ret = a
                .rpc_sync(
                    to.as_str(),
                    "cuda::gpu_add_given_devices",
                    args![x, y, mapped(&x_from)?, mapped(&y_from)?, z_to.clone()],
                )
                .await
                .with_context(|| format!("worker{rank} calling {to}"))?
                .as_tensor()?;
            ensure!(ret.device() == back(&z_to)?, "result on {:?}", ret.device());
            let want = Tensor::ones([2], (Kind::Float, ret.device()));
            ensure!(ret.equal(&want), "wrong value {ret:?}");
        }
        shutdown(agents).await
    });
}

#[test]
fn test_device_maps_gpu() {
    if !require_gpus(2) {
        return;
    }
    // `_gpu_add`: args on cuda:0 and cuda:0 arrive on cuda:1, the result
    // computed on cuda:0 comes back on cuda:1.
    device_maps_gpu(
        2,
        "cuda:0",
        "cuda:0",
        "cuda:0",
        &[("0", "1"), ("1", "0")],
        false,
    );
}

#[test]
fn test_device_map_cpu() {
    // `{"cpu": "cpu"}` needs no GPU: it runs everywhere.
    device_maps_gpu(0, "cpu", "cpu", "cpu", &[("cpu", "cpu")], false);
}

macro_rules! device_map_tests {
    ($($name:ident: $gpus:expr, $x:expr, $y:expr, $z:expr, [$(($k:expr, $v:expr)),*], $self_:expr;)*) => {
        $(
            #[test]
            fn $name() {
                device_maps_gpu($gpus, $x, $y, $z, &[$(($k, $v)),*], $self_);
            }
        )*
    };
}

device_map_tests! {
    test_device_map_cpu_to_gpu_default: 1, "cpu", "cpu", "cuda:0", [("cpu", "cuda:0")], false;
    test_device_map_cpu_to_gpu_non_default: 2, "cpu", "cpu", "cuda:1", [("cpu", "cuda:1")], false;
    test_device_map_gpu_to_cpu_default: 1, "cuda:0", "cuda:0", "cpu", [("cuda:0", "cpu")], false;
    test_device_map_gpu_to_cpu_non_default: 2, "cuda:1", "cuda:1", "cpu", [("cuda:1", "cpu")], false;
    test_device_map_gpu_default: 2, "cuda:0", "cuda:0", "cuda:0", [("cuda:0", "cuda:0")], false;
    test_device_map_gpu_non_default: 2, "cuda:1", "cuda:1", "cuda:1", [("cuda:1", "cuda:1")], false;
    test_device_map_gpu_default_to_non_default: 2, "cuda:0", "cuda:0", "cuda:1", [("cuda:0", "cuda:1")], false;
    test_device_map_gpu_non_default_to_default: 2, "cuda:1", "cuda:1", "cuda:0", [("cuda:1", "cuda:0")], false;
    test_device_map_gpu_mixed_1: 2, "cuda:0", "cuda:1", "cuda:0", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], false;
    test_device_map_gpu_mixed_2: 2, "cuda:0", "cuda:1", "cuda:1", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], false;
    test_device_map_gpu_mixed_3: 2, "cuda:1", "cuda:0", "cuda:0", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], false;
    test_device_map_gpu_mixed_4: 2, "cuda:1", "cuda:0", "cuda:1", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], false;
    test_device_map_gpu_mixed_5: 2, "cuda:0", "cuda:1", "cuda:0", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], false;
    test_device_map_gpu_mixed_6: 2, "cuda:0", "cuda:1", "cuda:1", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], false;
    test_device_map_gpu_mixed_7: 2, "cuda:1", "cuda:0", "cuda:0", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], false;
    test_device_map_gpu_mixed_8: 2, "cuda:1", "cuda:0", "cuda:1", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], false;
    test_device_map_gpu_mixed_self_1: 2, "cuda:0", "cuda:1", "cuda:0", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], true;
    test_device_map_gpu_mixed_self_2: 2, "cuda:0", "cuda:1", "cuda:1", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], true;
    test_device_map_gpu_mixed_self_3: 2, "cuda:1", "cuda:0", "cuda:0", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], true;
    test_device_map_gpu_mixed_self_4: 2, "cuda:1", "cuda:0", "cuda:1", [("cuda:0", "cuda:0"), ("cuda:1", "cuda:1")], true;
    test_device_map_gpu_mixed_self_5: 2, "cuda:0", "cuda:1", "cuda:0", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], true;
    test_device_map_gpu_mixed_self_6: 2, "cuda:0", "cuda:1", "cuda:1", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], true;
    test_device_map_gpu_mixed_self_7: 2, "cuda:1", "cuda:0", "cuda:0", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], true;
    test_device_map_gpu_mixed_self_8: 2, "cuda:1", "cuda:0", "cuda:1", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")], true;
}

/// `test_device_maps_multi_gpu` and friends: a merged map `{0:1, 1:0}`, set
/// by `configure`; `rets[0]` returns on cuda:1, `rets[1]` on cuda:0.
fn device_maps_multi_gpu(to_self: bool, in_constructor: bool) {
    if !require_gpus(2) {
        return;
    }
    timed(async move {
        let target = move |rank: u32| {
            if to_self {
                worker_name(rank)
            } else {
                dst(rank, 2)
            }
        };
        let agents = start(2, move |rank, o| {
            if in_constructor {
                o.device_maps.insert(
                    target(rank),
                    wasmrpc::device::to_device_map([(0, 1), (1, 0)])?,
                );
                Ok(())
            } else {
                o.set_device_map(&target(rank), [(0, 1)])?;
                o.set_device_map(&target(rank), [(1, 0)])
            }
        })
        .await?;
        for (rank, a) in agents.iter().enumerate() {
            let x = Tensor::zeros([2], (Kind::Float, Device::Cuda(0)));
            let y = Tensor::ones([2], (Kind::Float, Device::Cuda(1)));
            let rets = a
                .rpc_sync(
                    target(rank as u32).as_str(),
                    "cuda::gpu_add_multi_gpu",
                    args![x.shallow_clone(), y.shallow_clone()],
                )
                .await?
                .items()?;
            let (r0, r1) = (rets[0].as_tensor()?, rets[1].as_tensor()?);
            ensure!(r0.device() == Device::Cuda(1) && r1.device() == Device::Cuda(0));
            ensure!(r0.equal(&(x.to_device(Device::Cuda(1)) + y.to_device(Device::Cuda(1)))));
            ensure!(r1.equal(&(x.to_device(Device::Cuda(0)) - y.to_device(Device::Cuda(0)))));
        }
        shutdown(agents).await
    });
}

#[test]
fn test_device_maps_multi_gpu() {
    device_maps_multi_gpu(false, false);
}

#[test]
fn test_device_maps_multi_gpu_self() {
    device_maps_multi_gpu(true, false);
}

#[test]
fn test_device_maps_in_options() {
    device_maps_multi_gpu(false, true);
}

fn device_maps_return_to_gpu(to_self: bool) {
    if !require_gpus(4) {
        return;
    }
    timed(async move {
        let target = move |rank: u32| {
            if to_self {
                worker_name(rank)
            } else {
                dst(rank, 2)
            }
        };
        let agents = start(2, move |rank, o| {
            o.set_device_map(&target(rank), [(0, 1), (1, 2), (2, 3), (3, 0)])
        })
        .await?;
        for (rank, a) in agents.iter().enumerate() {
            let (x, y) = (
                Tensor::zeros([2], (Kind::Float, Device::Cpu)),
                wasmrpc_tests::ones(&[2]),
            );
            let rets = a
                .rpc_sync(
                    target(rank as u32).as_str(),
                    "cuda::gpu_add_return_to_gpu",
                    args![x.shallow_clone(), y.shallow_clone()],
                )
                .await?
                .items()?;
            let want = [&x + &y, &x - &y, &x * &y, &x / &y];
            for (i, (r, w)) in rets.iter().zip(want).enumerate() {
                let r = r.as_tensor()?;
                ensure!(
                    r.device() == Device::Cuda((3 + i) % 4),
                    "ret {i} on {:?}",
                    r.device()
                );
                ensure!(r.to_device(Device::Cpu).equal(&w), "ret {i} value");
            }
        }
        shutdown(agents).await
    });
}

#[test]
fn test_device_maps_return_to_gpu() {
    device_maps_return_to_gpu(false);
}

#[test]
fn test_device_maps_return_to_gpu_self() {
    device_maps_return_to_gpu(true);
}

/// The missing-config tests: with no map, a request with a CUDA tensor
/// (`response == false`) or a response with one (`response == true`) fails
/// fast with PyTorch's text, `times` times, through `rpc_sync` or
/// `remote().to_here()`; CPU calls still work afterwards.
fn missing_config(response: bool, times: usize, via_remote: bool) {
    if !require_gpus(1) {
        return;
    }
    timed(async move {
        let agents = start(2, |_, _| Ok(())).await?;
        let a = &agents[0];
        let to = worker_name(1);
        for _ in 0..times {
            let args = if response {
                args![
                    Tensor::zeros([2], (Kind::Float, Device::Cpu)),
                    wasmrpc_tests::ones(&[2])
                ]
            } else {
                args![Tensor::zeros([2], (Kind::Float, Device::Cuda(0))), 1]
            };
            let function = if response {
                "cuda::add_to_gpu"
            } else {
                "aten::add"
            };
            let r = if via_remote {
                match a.remote(to.as_str(), function, args) {
                    Ok(rref) => rref.to_here(a, None).await,
                    Err(e) => Err(e),
                }
            } else {
                a.rpc_sync(to.as_str(), function, args).await
            };
            let e = expect_err(
                r,
                ErrorKind::RuntimeError,
                if response {
                    RESPONSE_MISSING
                } else {
                    MISSING_CONFIG
                },
            )?;
            if !response {
                ensure!(e.message().contains(SET_DEVICE_MAP_HINT), "{e}");
            }
        }
        let ok = a
            .rpc_sync(
                to.as_str(),
                "aten::add",
                args![wasmrpc_tests::ones(&[2]), 1],
            )
            .await?
            .as_tensor()?;
        ensure!(ok.equal(&(wasmrpc_tests::ones(&[2]) + 1)));
        shutdown(agents).await
    });
}

#[test]
fn test_device_maps_missing_config() {
    missing_config(false, 1, false);
}

#[test]
fn test_device_maps_missing_config_not_timeout() {
    // `timed` bounds the failure and the shutdown well under the default
    // RPC timeout (60 s), which is what the seed checks.
    missing_config(false, 1, false);
}

#[test]
fn test_device_maps_missing_config_loop() {
    missing_config(false, wasmrpc::DEFAULT_NUM_WORKER_THREADS + 5, false);
}

#[test]
fn test_device_maps_missing_config_response() {
    missing_config(true, 1, false);
}

#[test]
fn test_device_maps_missing_config_response_loop() {
    missing_config(true, wasmrpc::DEFAULT_NUM_WORKER_THREADS + 5, false);
}

#[test]
fn test_device_maps_missing_config_remote() {
    missing_config(false, 1, true);
}

#[test]
fn test_device_maps_missing_config_remote_response() {
    missing_config(true, 1, true);
}

#[test]
fn test_device_maps_remote() {
    if !require_gpus(2) {
        return;
    }
    timed(async {
        let agents = start(2, |rank, o| o.set_device_map(&dst(rank, 2), [(1, 0)])).await?;
        let rref = agents[0].remote(
            "worker1",
            "cuda::add_to_gpu",
            args![
                Tensor::zeros([2], (Kind::Float, Device::Cpu)),
                wasmrpc_tests::ones(&[2])
            ],
        )?;
        let t = rref.to_here(&agents[0], None).await?.as_tensor()?;
        ensure!(t.device() == Device::Cuda(1), "on {:?}", t.device());
        ensure!(t.equal(&Tensor::ones([2], (Kind::Float, Device::Cuda(1)))));
        drop(rref);
        shutdown(agents).await
    });
}

#[test]
fn test_device_mismatch() {
    if !require_gpus(1) {
        return;
    }
    timed(async {
        let agents = start(2, |rank, o| o.set_device_map(&dst(rank, 2), [(0, 0)])).await?;
        let x = Tensor::zeros([2], (Kind::Float, Device::Cuda(0)));
        let y = Tensor::ones([2], (Kind::Float, Device::Cuda(0)));
        let r = agents[0]
            .rpc_sync("worker1", "cuda::gpu_device_mismatch", args![x, y])
            .await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "Expected all tensors to be on the same device, but found at least two devices",
        )?;
        shutdown(agents).await
    });
}

#[test]
fn test_tensor_view_as_return_value() {
    if !require_gpus(1) {
        return;
    }
    timed(async {
        let agents = start(2, |rank, o| o.set_device_map(&dst(rank, 2), [(0, 0)])).await?;
        let futs: Vec<_> = (0..5)
            .map(|i| agents[0].rpc_async("worker1", "cuda::return_tensor_view", args![i]))
            .collect();
        for (i, f) in futs.into_iter().enumerate() {
            let t = f.wait().await?.as_tensor()?;
            let want = Tensor::ones([100, 200], (Kind::Float, Device::Cuda(0))) * (i as f64);
            ensure!(t.device() == Device::Cuda(0) && t.equal(&want), "view {i}");
        }
        shutdown(agents).await
    });
}

// ---- Area V: device-aware futures ----------------------------------------

#[test]
fn test_cuda_future_device_as_int() {
    if !require_gpus(1) {
        return;
    }
    let f = wasmrpc::Future::with_devices([0]).unwrap();
    assert_eq!(f.devices(), [wasmrpc::device::Device::Cuda(0)]);
}

#[test]
fn test_cuda_future_device_as_str() {
    if !require_gpus(1) {
        return;
    }
    let f = wasmrpc::Future::with_devices(["cuda:0"]).unwrap();
    assert_eq!(f.devices(), [wasmrpc::device::Device::Cuda(0)]);
}

#[test]
fn test_cuda_future_device_as_device() {
    if !require_gpus(1) {
        return;
    }
    let f = wasmrpc::Future::with_devices([Device::Cuda(0)]).unwrap();
    assert_eq!(f.devices(), [wasmrpc::device::Device::Cuda(0)]);
}

#[test]
fn test_cuda_future_device_not_cuda() {
    // Refused before any device is touched: runs without a GPU.
    expect_err(
        wasmrpc::Future::with_devices(["cpu"]),
        ErrorKind::ValueError,
        "Expected devices to have indices, got cpu",
    )
    .unwrap();
}

/// How `_test_cuda_future_extraction` wraps the tensor it sets: as is, in
/// a list, or in a custom class (`TensorWrapper`).
#[derive(Clone, Copy, PartialEq)]
enum Wrapper {
    Plain,
    List,
    CustomClass,
}

/// `build_sparse_tensor()`: indices `[[0, 1, 1], [2, 0, 2]]`, values
/// `[3, 4, 5]`, size `(2, 3)`, uncoalesced.
fn build_sparse_tensor() -> Tensor {
    let i = Tensor::from_slice2(&[[0i64, 1, 1], [2, 0, 2]]);
    let v = Tensor::from_slice(&[3i64, 4, 5]);
    Tensor::sparse_coo_tensor_indices_size(&i, &v, [2, 3], (Kind::Int64, Device::Cpu), false)
}

/// `wrapper(tensor)`.
fn wrap(wrapper: Wrapper, t: &Tensor) -> Payload {
    match wrapper {
        Wrapper::Plain => Payload::from(t),
        Wrapper::List => Payload::list([Payload::from(t)]),
        Wrapper::CustomClass => Payload {
            value: wasmrpc::Value::Record {
                name: "TensorWrapper".into(),
                fields: vec![("tensor".into(), wasmrpc::Value::Tensor(0))],
            },
            tensors: vec![t.shallow_clone()],
            rrefs: Vec::new(),
        },
    }
}

/// `unwrapper(value)`.
fn unwrap(wrapper: Wrapper, got: &Payload) -> anyhow::Result<Tensor> {
    Ok(match (wrapper, &got.value) {
        (Wrapper::Plain, _) => got.as_tensor()?,
        (Wrapper::List, _) => got.items()?[0].as_tensor()?,
        // `unwrapper=lambda v: v.tensor`.
        (Wrapper::CustomClass, wasmrpc::Value::Record { fields, .. }) => {
            let (_, v) = fields
                .iter()
                .find(|(k, _)| k == "tensor")
                .context("TensorWrapper without its tensor")?;
            got.sub(v.clone()).as_tensor()?
        }
        (Wrapper::CustomClass, other) => anyhow::bail!("not a TensorWrapper: {other:?}"),
    })
}

/// `torch.eq(a, b).all().item()`, read on the current stream.
fn all_equal(a: &Tensor, b: &Tensor) -> bool {
    a.eq_tensor(b).all().int64_value(&[]) == 1
}

/// `_test_cuda_future_extraction`: on one stream of `cuda:0`, a second's
/// sleep, then `tensor += add_tensor`, then `future.set_result(wrapper(tensor))`;
/// on another stream, what `future.wait()` gives equals the sum. The
/// future must make the reading stream wait for the writing one: without
/// that, the read sees the tensor before the delayed add.
///
/// CUDA loads a kernel the first time it is launched (lazy loading), and
/// loading can wait for all of the device's work: a first run would order
/// the read after the add whatever the future does. So the scenario runs
/// once without the sleep, to load its kernels, then as the seed has it.
fn cuda_future_extraction(sparse: bool, wrapper: Wrapper) {
    if !require_gpus(1) {
        return;
    }
    timed(async move {
        cuda_future_extraction_once(sparse, wrapper, 0.0)
            .await
            .context("loading the kernels")?;
        cuda_future_extraction_once(sparse, wrapper, 1000.0).await
    });
}

async fn cuda_future_extraction_once(
    sparse: bool,
    wrapper: Wrapper,
    sleep_for_ms: f64,
) -> anyhow::Result<()> {
    let future = wasmrpc::Future::with_devices(["cuda:0"])?;
    let c0 = Device::Cuda(0);
    let stream = Stream::from_pool(0).map_err(cuda_error)?;
    let another_stream = Stream::from_pool(0).map_err(cuda_error)?;
    let mut expected_ready = Event::new().map_err(cuda_error)?;
    let expected = {
        let _on_stream = stream.make_current().map_err(cuda_error)?;
        let (mut tensor, add_tensor) = if sparse {
            (
                build_sparse_tensor().to_device(c0),
                build_sparse_tensor().to_device(c0),
            )
        } else {
            (
                Tensor::zeros([100], (Kind::Float, c0)),
                Tensor::ones([100], (Kind::Float, c0)),
            )
        };
        let expected = if sparse {
            (&tensor + &add_tensor).coalesce()
        } else {
            &tensor + &add_tensor
        };
        // The reading stream waits for `expected` on its own: reading it
        // unfinished next to an unfinished `tensor` (both fresh memory)
        // would compare equal and hide a future that did not wait.
        expected_ready.record(&stream).map_err(cuda_error)?;
        sleep_ms(0, sleep_for_ms)?;
        let _ = tensor.f_add_(&add_tensor)?;
        if sparse {
            tensor = tensor.coalesce();
        }
        future.set_result(wrap(wrapper, &tensor))?;
        expected
    };
    let _on_another_stream = another_stream.make_current().map_err(cuda_error)?;
    expected_ready.block(&another_stream).map_err(cuda_error)?;
    let tensor = unwrap(wrapper, &future.wait().await?)?;
    if sparse {
        ensure!(
            all_equal(&tensor.indices(), &expected.indices()),
            "indices {:?}",
            tensor.indices()
        );
        ensure!(
            all_equal(&tensor.values(), &expected.values()),
            "values {:?}",
            tensor.values()
        );
        ensure!(tensor.size() == expected.size());
    } else {
        ensure!(all_equal(&tensor, &expected), "read {tensor:?}");
    }
    Ok(())
}

#[test]
fn test_cuda_future_can_extract_cuda_tensor() {
    cuda_future_extraction(false, Wrapper::Plain);
}

#[test]
fn test_cuda_future_can_extract_list_with_cuda_tensor() {
    cuda_future_extraction(false, Wrapper::List);
}

#[test]
fn test_cuda_future_can_extract_custom_class_with_cuda_tensor() {
    cuda_future_extraction(false, Wrapper::CustomClass);
}

#[test]
fn test_cuda_future_can_extract_cuda_sparse_tensor() {
    cuda_future_extraction(true, Wrapper::Plain);
}

#[test]
fn test_cuda_future_can_extract_list_with_cuda_sparse_tensor() {
    cuda_future_extraction(true, Wrapper::List);
}

#[test]
fn test_cuda_future_can_extract_custom_class_with_cuda_sparse_tensor() {
    cuda_future_extraction(true, Wrapper::CustomClass);
}

/// Every rank maps `cuda:0` to its next rank's `cuda:0` (the seeds'
/// `options.set_device_map(dst, {"cuda:0": "cuda:0"})`).
fn cuda0_ring(world_size: u32) -> impl Fn(u32, &mut RpcBackendOptions) -> wasmrpc::Result<()> {
    move |rank, o| o.set_device_map(&dst(rank, world_size), [("cuda:0", "cuda:0")])
}

#[test]
fn test_async_execution_with_cuda_future() {
    if !require_gpus(1) {
        return;
    }
    timed(async {
        let agents = start(2, cuda0_ring(2)).await?;
        for (rank, agent) in (0u32..).zip(&agents) {
            let t = Tensor::zeros([100], (Kind::Float, Device::Cuda(0)));
            let got = agent
                .rpc_async(
                    dst(rank, 2).as_str(),
                    "cuda::async_cuda_sleep_and_set_to_one",
                    args![&t],
                )
                .wait()
                .await?
                .as_tensor()?;
            ensure_filled_on_cuda0(&got, 1)?;
        }
        shutdown(agents).await
    });
}

#[test]
fn test_async_execution_nested_with_cuda_future() {
    if !require_gpus(1) {
        return;
    }
    // Three workers, so that `dst` and `nested_dst` differ from the caller.
    timed(async {
        let agents = start(3, cuda0_ring(3)).await?;
        for (rank, agent) in (0u32..).zip(&agents) {
            let ones = || Tensor::ones([100], (Kind::Float, Device::Cuda(0)));
            let nested_dst = worker_name((rank + 2) % 3);
            let got = agent
                .rpc_async(
                    dst(rank, 3).as_str(),
                    "cuda::async_cuda_nested_add",
                    args![nested_dst, ones(), ones(), ones()],
                )
                .wait()
                .await?
                .as_tensor()?;
            ensure_filled_on_cuda0(&got, 3)?;
        }
        shutdown(agents).await
    });
}

#[test]
fn test_cuda_future_callback_changes_devices() {
    if !require_gpus(2) {
        return;
    }
    timed(async {
        let parent = wasmrpc::Future::with_devices(["cuda:0", "cuda:1"])?;
        let child = parent.then(|p| {
            let t = p.try_value().expect("completed")?.as_tensor()?;
            Ok(Payload::from(t.f_to_device(Device::Cuda(1))?))
        });
        parent.set_result(Tensor::ones([100], (Kind::Float, Device::Cuda(0))))?;
        let got = child.wait().await?.as_tensor()?;
        ensure!(got.device() == Device::Cuda(1));
        ensure!(got.equal(&Tensor::ones([100], (Kind::Float, Device::Cuda(1)))));
        Ok(())
    });
}

#[test]
fn test_cuda_future_value_on_bad_device() {
    if !require_gpus(2) {
        return;
    }
    timed(async {
        let parent = wasmrpc::Future::with_devices(["cuda:1"])?;
        // A callback that does not touch the parent's value still runs and
        // succeeds.
        let child = parent.then(|_| {
            Ok(Payload::from(Tensor::ones(
                [100],
                (Kind::Float, Device::Cuda(1)),
            )))
        });
        parent.set_result(Tensor::ones([100], (Kind::Float, Device::Cuda(0))))?;
        expect_err(
            parent.wait().await,
            ErrorKind::ValueError,
            "The result contained tensors residing on device(s) cuda:0 which are not among the expected device(s) cuda:1",
        )?;
        let got = child.wait().await?.as_tensor()?;
        ensure!(got.equal(&Tensor::ones([100], (Kind::Float, Device::Cuda(1)))));
        Ok(())
    });
}

#[test]
fn test_cuda_future_modify_tensor_inplace() {
    if !require_gpus(1) {
        return;
    }
    timed(async {
        let f = wasmrpc::Future::with_devices(["cuda:0"])?;
        let mut t = Tensor::zeros([100], (Kind::Float, Device::Cuda(0)));
        f.set_result(&t)?;
        // Undefined behaviour in the seed; it must not crash.
        let _ = t.fill_(1);
        f.wait().await?;
        Ok(())
    });
}

#[test]
fn test_cuda_future_replace_tensor() {
    if !require_gpus(1) {
        return;
    }
    timed(async {
        let f = wasmrpc::Future::with_devices(["cuda:0"])?;
        let t = Tensor::zeros([100], (Kind::Float, Device::Cuda(0)));
        f.set_result(Payload::list([Payload::from(&t)]))?;
        // The seed replaces list[0] so the original may be freed; our
        // payload owns its tensors, so dropping ours must not crash.
        drop(t);
        f.wait().await?;
        Ok(())
    });
}

// ---- Area Q: a dynamic group with device maps ---------------------------

/// Rank 0 joins first, with the map `{1: 0, 0: 1}` toward every other
/// worker (none of which has joined yet); the others join after it,
/// without maps. The seed's RPC part is commented out (it crashed
/// PyTorch's CUDA allocator); it is run here: a tensor rank 0 sends from
/// `cuda:0` or `cuda:1` is added on the joiner's mapped device and comes
/// back to where it started, through the inverse map the joiner learnt
/// from rank 0's published maps.
#[test]
fn test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda() {
    if !require_gpus(2) {
        return;
    }
    let world_size = 4u32;
    super::per_rank(world_size, move |rank, store| async move {
        let mut options = RpcBackendOptions::default();
        register(&options.registry);
        if rank == 0 {
            for i in 1..world_size {
                let dst = worker_name(i);
                options.set_device_map(&dst, [(1, 0)])?;
                options.set_device_map(&dst, [(0, 1)])?;
            }
        } else {
            wasmrpc::testing::store_barrier(&*store, "joined0", world_size).await?;
        }
        let agent = init_rpc(&worker_name(rank), Some(rank), None, store.clone(), options).await?;
        if rank == 0 {
            wasmrpc::testing::store_barrier(&*store, "joined0", world_size).await?;
        }
        wasmrpc::testing::store_barrier(&*store, "all_joined", world_size).await?;
        if rank == 0 {
            for i in 1..world_size {
                let x = Tensor::ones([2], (Kind::Float, Device::Cpu));
                for device in [Device::Cuda(0), Device::Cuda(1)] {
                    let got = agent
                        .rpc_sync(
                            worker_name(i).as_str(),
                            "aten::add",
                            args![x.to_device(device), 1],
                        )
                        .await?
                        .as_tensor()?;
                    ensure!(got.device() == device, "result on {:?}", got.device());
                    ensure!(got.to_device(Device::Cpu).equal(&(&x + 1)), "{got:?}");
                }
            }
        }
        wasmrpc::testing::store_barrier(&*store, "done", world_size).await?;
        agent.shutdown(true, Duration::ZERO).await?;
        Ok(())
    });
}

// ---- Area U: results across CUDA devices, streams and RRefs -------------
//
// The seeds run their user functions and modules on a side stream (or
// after a GPU sleep kernel on the current one) and check that what comes
// back equals what they computed: that the transfer waited for the work.
// The functions here do the same, with the shim's streams and sleep kernel
// (`wasmrpc_tests::gpu`): a transfer that did not wait would carry the
// value before the delayed write.

/// `torch.nn.init`'s default for a layer with `fan_in` inputs:
/// `uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))`.
fn init_param(size: &[i64], fan_in: i64, device: Device) -> wasmrpc::Result<Payload> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let mut t = Tensor::f_empty(size, (Kind::Float, device))?;
    let _ = t.f_uniform_(-bound, bound)?;
    Ok(Payload::from(t))
}

/// `MyConvNetForMNIST(device)`'s parameters, in `self.net`'s order:
/// `Conv2d(1, 16, 3, 1)`, `Conv2d(16, 32, 3, 1)`, `Linear(4608, 128)`,
/// `Linear(128, 10)`, each `(weight, bias)`.
fn conv_net(device: Device) -> wasmrpc::Result<Payload> {
    Ok(Payload::tuple([
        init_param(&[16, 1, 3, 3], 9, device)?,
        init_param(&[16], 9, device)?,
        init_param(&[32, 16, 3, 3], 144, device)?,
        init_param(&[32], 144, device)?,
        init_param(&[128, 4608], 4608, device)?,
        init_param(&[128], 4608, device)?,
        init_param(&[10, 128], 128, device)?,
        init_param(&[10], 128, device)?,
    ]))
}

/// `MyConvNetForMNIST.forward(x)`: conv, relu, conv, relu, max-pool 2,
/// flatten, linear, relu, linear.
fn conv_net_forward(net: &Payload, x: &Tensor) -> wasmrpc::Result<Tensor> {
    let p = |i: usize| net.tensor(i);
    let no_pad: [i64; 2] = [0, 0];
    let x = x
        .f_conv2d(p(0)?, Some(p(1)?), [1, 1], no_pad, [1, 1], 1)?
        .f_relu()?
        .f_conv2d(p(2)?, Some(p(3)?), [1, 1], no_pad, [1, 1], 1)?
        .f_relu()?
        .f_max_pool2d([2, 2], [2, 2], no_pad, [1, 1], false)?
        .f_flatten(1, -1)?
        .f_linear(p(4)?, Some(p(5)?))?
        .f_relu()?;
    Ok(x.f_linear(p(6)?, Some(p(7)?))?)
}

/// `_slow_add_on_user_stream(x, y)`: `x + y` on a new stream `s1` of
/// `x`'s device, after `10 * FIFTY_MIL_CYCLES` of sleep there; then the
/// current stream `s0` waits for `s1`, so the sum is ready on `s0`, the
/// stream the agent takes the result from.
fn slow_add_on_user_stream(x: &Tensor, y: &Tensor) -> wasmrpc::Result<Tensor> {
    let device = cuda_index(x)?;
    let s0 = Stream::current(device).map_err(cuda_error)?;
    let s1 = Stream::from_pool(device).map_err(cuda_error)?;
    s1.wait_stream(&s0).map_err(cuda_error)?;
    record_stream(x, &s1).map_err(cuda_error)?;
    record_stream(y, &s1).map_err(cuda_error)?;
    let z = {
        let _on_s1 = s1.make_current().map_err(cuda_error)?;
        sleep_cycles(device, 10 * FIFTY_MIL_CYCLES)?;
        x.f_add(y)?
    };
    s0.wait_stream(&s1).map_err(cuda_error)?;
    record_stream(&z, &s0).map_err(cuda_error)?;
    Ok(z)
}

/// The seeds' area-U callees.
fn register_streams(r: &FunctionRegistry) {
    r.register_native(
        "cuda::slow_add_on_user_stream",
        |_ctx, a: Args| async move {
            let (x, y) = (a.get(0)?.as_tensor()?, a.get(1)?.as_tensor()?);
            Ok(Payload::from(slow_add_on_user_stream(&x, &y)?))
        },
    );
    // `_nested_slow_add_on_user_stream(dst, x, y, z)`: the slow add of `x`
    // and `y` on `dst`, then the slow add of that and `z` here.
    r.register_native(
        "cuda::nested_slow_add_on_user_stream",
        |ctx, a: Args| async move {
            let dst = a.get(0)?.as_str()?.to_owned();
            let (x, y, z) = (
                a.get(1)?.as_tensor()?,
                a.get(2)?.as_tensor()?,
                a.get(3)?.as_tensor()?,
            );
            let ret = ctx
                .agent()
                .rpc_sync(dst.as_str(), "cuda::slow_add_on_user_stream", args![x, y])
                .await?
                .as_tensor()?;
            Ok(Payload::from(slow_add_on_user_stream(&ret, &z)?))
        },
    );
    // `MyConvNetForMNIST(device)`: the parameters, held by the RRef that
    // `remote` makes, on the owner.
    r.register_native("cuda::conv_net", |_ctx, a: Args| async move {
        conv_net(dev(a.get(0)?.as_str()?)?)
    });
    // `MyConvNetForMNIST.forward(x, is_rref)`, given the model's RRef: `x`
    // is fetched with `to_here()` when it is an RRef; then, on the current
    // stream, `10 * FIFTY_MIL_CYCLES` of sleep (the seed's deliberate
    // delay) before the network runs.
    r.register_native("cuda::conv_net_forward", |ctx, a: Args| async move {
        let net = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        let x = if a.get(2)?.as_bool()? {
            a.get(1)?
                .as_rref()?
                .to_here(ctx.agent(), None)
                .await?
                .as_tensor()?
        } else {
            a.get(1)?.as_tensor()?
        };
        sleep_cycles(cuda_index(&x)?, 10 * FIFTY_MIL_CYCLES)?;
        Ok(Payload::from(conv_net_forward(&net, &x)?))
    });
    // `_rref_relay(rref)`: `rref.to_here()`.
    r.register_native("cuda::rref_relay", |ctx, a: Args| async move {
        a.get(0)?.as_rref()?.to_here(ctx.agent(), None).await
    });
    // `torch.nn.Linear(in, out)`, on the CPU as the seed makes it.
    r.register_native("cuda::linear", |_ctx, a: Args| async move {
        let (fan_in, out) = (a.get(0)?.as_int()?, a.get(1)?.as_int()?);
        Ok(Payload::tuple([
            init_param(&[out, fan_in], fan_in, Device::Cpu)?,
            init_param(&[out], fan_in, Device::Cpu)?,
        ]))
    });
    // `model.to(device)` through `rref.remote()`: the module's parameters
    // moved, in a new RRef on the owner.
    r.register_native("cuda::module_to", |ctx, a: Args| async move {
        let m = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        let device = dev(a.get(1)?.as_str()?)?;
        let moved = m
            .tensors
            .iter()
            .map(|t| Ok(Payload::from(t.f_to_device(device)?)))
            .collect::<wasmrpc::Result<Vec<_>>>()?;
        Ok(Payload::tuple(moved))
    });
    // `model.rpc_sync().forward(data)` for a `Linear`.
    r.register_native("cuda::linear_forward", |ctx, a: Args| async move {
        let m = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        let x = a.get(1)?.as_tensor()?;
        Ok(Payload::from(x.f_linear(m.tensor(0)?, Some(m.tensor(1)?))?))
    });
    // `TensorWrapper(t)`: a record holding `t`; it stays on its owner.
    r.register_native("cuda::tensor_wrapper", |_ctx, a: Args| async move {
        Ok(Payload {
            value: wasmrpc::Value::Record {
                name: "TensorWrapper".into(),
                fields: vec![("tensor".into(), wasmrpc::Value::Tensor(0))],
            },
            tensors: vec![a.get(0)?.as_tensor()?],
            rrefs: Vec::new(),
        })
    });
    // `rref.rpc_sync().increase(v)`: `self.tensor += v` on the owner, in
    // place (the record shares the owner's tensor).
    r.register_native("cuda::tensor_wrapper_increase", |ctx, a: Args| async move {
        let w = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        let mut t = w.tensor(0)?.shallow_clone();
        let _ = t.f_add_scalar_(a.get(1)?.as_int()?)?;
        Ok(Payload::none())
    });
    // `rref.rpc_sync().sum()`: `self.tensor.sum().item()`.
    r.register_native("cuda::tensor_wrapper_sum", |ctx, a: Args| async move {
        let w = a.get(0)?.as_rref()?.local_value(ctx.agent()).await?;
        Ok(Payload::from(
            w.tensor(0)?.f_sum(None)?.f_double_value(&[])?,
        ))
    });
}

/// `self.assertEqual(actual, expected)` for float tensors: the same shape
/// and values within torch's float32 tolerances, wherever they are.
fn ensure_same_values(actual: &Tensor, expected: &Tensor) -> anyhow::Result<()> {
    ensure!(
        actual.size() == expected.size(),
        "shapes {:?} and {:?}",
        actual.size(),
        expected.size()
    );
    let (a, e) = (
        actual.to_device(Device::Cpu),
        expected.to_device(Device::Cpu),
    );
    ensure!(
        a.allclose(&e, 1.3e-6, 1e-5, false),
        "values differ: max |a - e| = {}",
        (&a - &e).abs().max().double_value(&[])
    );
    Ok(())
}

/// `_test_custom_stream(fn, device_map)`: every rank of the seed's four
/// maps `device_map` toward the next rank, then runs `body(rank, agent)`.
async fn custom_stream<F, Fut>(
    device_map: &'static [(&'static str, &'static str)],
    body: F,
) -> anyhow::Result<()>
where
    F: Fn(u32, RpcAgent) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let ws = 4;
    let agents = start(ws, move |rank, o| {
        o.set_device_map(&dst(rank, ws), device_map.iter().copied())
    })
    .await?;
    for (rank, a) in (0u32..).zip(&agents) {
        body(rank, a.clone())
            .await
            .with_context(|| format!("on worker{rank}"))?;
    }
    shutdown(agents).await
}

#[test]
fn test_custom_stream() {
    if !require_gpus(2) {
        return;
    }
    timed(custom_stream(
        &[("cuda:0", "cuda:1")],
        |rank, a| async move {
            // `_test_stream_sync`.
            let x = Tensor::ones([2, 2], (Kind::Float, Device::Cuda(0)));
            let ret = a
                .rpc_sync(
                    dst(rank, 4).as_str(),
                    "cuda::slow_add_on_user_stream",
                    args![&x, &x],
                )
                .await?
                .as_tensor()?;
            ensure_same_values(&ret, &(&x * 2))
        },
    ));
}

#[test]
fn test_custom_stream_multi() {
    if !require_gpus(2) {
        return;
    }
    timed(custom_stream(
        &[("cuda:0", "cuda:1")],
        |rank, a| async move {
            // `_test_stream_multi_async`: 20 calls in flight.
            let futs: Vec<_> = (0..20i64)
                .map(|i| {
                    let x = Tensor::ones([2, 2], (Kind::Float, Device::Cuda(0))) * i;
                    a.rpc_async(
                        dst(rank, 4).as_str(),
                        "cuda::slow_add_on_user_stream",
                        args![&x, &x],
                    )
                })
                .collect();
            for (i, f) in (0i64..).zip(futs) {
                let got = f.wait().await?.as_tensor()?;
                let want = Tensor::ones([2, 2], (Kind::Float, Device::Cuda(0))) * 2 * i;
                ensure_same_values(&got, &want).with_context(|| format!("call {i}"))?;
            }
            Ok(())
        },
    ));
}

#[test]
fn test_custom_stream_nested() {
    if !require_gpus(2) {
        return;
    }
    timed(custom_stream(
        &[("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")],
        |rank, a| async move {
            // `_test_stream_nested_sync`.
            let c0 = (Kind::Float, Device::Cuda(0));
            let x = Tensor::ones([2, 2], c0);
            let y = Tensor::ones([2, 2], c0) * 2;
            let z = Tensor::ones([2, 2], c0) * 3;
            let nested_dst = worker_name((rank + 2) % 4);
            let ret = a
                .rpc_sync(
                    dst(rank, 4).as_str(),
                    "cuda::nested_slow_add_on_user_stream",
                    args![nested_dst, &x, y, z],
                )
                .await?
                .as_tensor()?;
            ensure_same_values(&ret, &(&x * 6))
        },
    ));
}

#[test]
fn test_custom_stream_nested_multi() {
    if !require_gpus(2) {
        return;
    }
    timed(custom_stream(
        &[("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")],
        |rank, a| async move {
            // `_test_stream_nested_multi_async`: rank 0 only, 5 calls.
            if rank != 0 {
                return Ok(());
            }
            let c0 = (Kind::Float, Device::Cuda(0));
            let nested_dst = worker_name((rank + 2) % 4);
            let mut calls = Vec::new();
            for i in 0..5i64 {
                let x = Tensor::ones([2, 2], c0) * (i - 1);
                let y = Tensor::ones([2, 2], c0) * i;
                let z = Tensor::ones([2, 2], c0) * (i + 1);
                let want = &x + &y + &z;
                let f = a.rpc_async(
                    dst(rank, 4).as_str(),
                    "cuda::nested_slow_add_on_user_stream",
                    args![nested_dst.as_str(), x, y, z],
                );
                calls.push((f, want));
            }
            for (i, (f, want)) in calls.into_iter().enumerate() {
                let got = f.wait().await?.as_tensor()?;
                ensure_same_values(&got, &want).with_context(|| format!("call {i}"))?;
            }
            Ok(())
        },
    ));
}

/// `_test_rref_synchronization(local_device, remote_device)`: worker1
/// holds an RRef to a `MyConvNetForMNIST` on the next worker's
/// `remote_device`; ten times, `rref.remote().forward(x).to_here()` equals
/// `rref.rpc_sync().forward(x)` for a `(200, 1, 28, 28)` batch on
/// `local_device`.
fn rref_synchronization(gpus: usize, local: &'static str, remote: &'static str) {
    if !require_gpus(gpus) {
        return;
    }
    timed(async move {
        let ws = 4;
        let agents = start(ws, move |rank, o| {
            o.set_device_map(&dst(rank, ws), [(local, remote)])
        })
        .await?;
        let a = &agents[1];
        let to = dst(1, ws);
        let model = a.remote(to.as_str(), "cuda::conv_net", args![remote])?;
        for i in 0..10 {
            let x = Tensor::f_randn([200, 1, 28, 28], (Kind::Float, dev(local)?))?;
            let actual = a
                .remote(
                    to.as_str(),
                    "cuda::conv_net_forward",
                    args![&model, &x, false],
                )?
                .to_here(a, None)
                .await?
                .as_tensor()?;
            let expected = a
                .rpc_sync(
                    to.as_str(),
                    "cuda::conv_net_forward",
                    args![&model, &x, false],
                )
                .await?
                .as_tensor()?;
            ensure_same_values(&actual, &expected).with_context(|| format!("batch {i}"))?;
        }
        drop(model);
        shutdown(agents).await
    });
}

#[test]
fn test_rref_to_here_synchronization1() {
    rref_synchronization(1, "cuda:0", "cuda:0");
}

#[test]
fn test_rref_to_here_synchronization2() {
    rref_synchronization(2, "cuda:1", "cuda:0");
}

#[test]
fn test_rref_to_here_synchronization3() {
    rref_synchronization(2, "cuda:1", "cuda:1");
}

#[test]
fn test_rref_to_here_synchronization4() {
    rref_synchronization(2, "cuda:0", "cuda:1");
}

/// `_test_rref_as_arg_synchronization(local, remote, devicesOptions)`: as
/// [`rref_synchronization`], with the batch passed as an RRef that worker1
/// owns (`forward(rref_x, True)` fetches it with `to_here()`, through the
/// map `{remote: local}` each rank sets toward the previous one).
fn rref_as_arg_synchronization(
    gpus: usize,
    local: &'static str,
    remote: &'static str,
    devices: Option<&'static str>,
) {
    if !require_gpus(gpus) {
        return;
    }
    timed(async move {
        let ws = 4;
        let agents = start(ws, move |rank, o| {
            o.set_device_map(&dst(rank, ws), [(local, remote)])?;
            o.set_device_map(&worker_name((rank + ws - 1) % ws), [(remote, local)])?;
            if let Some(d) = devices {
                o.set_devices([d])?;
            }
            Ok(())
        })
        .await?;
        let a = &agents[1];
        let to = dst(1, ws);
        let model = a.remote(to.as_str(), "cuda::conv_net", args![remote])?;
        for i in 0..10 {
            let x = Tensor::f_randn([200, 1, 28, 28], (Kind::Float, dev(local)?))?;
            let rref_x = wasmrpc::RRef::new(a, x);
            let actual = a
                .remote(
                    to.as_str(),
                    "cuda::conv_net_forward",
                    args![&model, &rref_x, true],
                )?
                .to_here(a, None)
                .await?
                .as_tensor()?;
            let expected = a
                .rpc_sync(
                    to.as_str(),
                    "cuda::conv_net_forward",
                    args![&model, &rref_x, true],
                )
                .await?
                .as_tensor()?;
            ensure_same_values(&actual, &expected).with_context(|| format!("batch {i}"))?;
        }
        drop(model);
        shutdown(agents).await
    });
}

#[test]
fn test_rref_as_arg_synchronization1() {
    rref_as_arg_synchronization(1, "cuda:0", "cuda:0", None);
}

#[test]
fn test_rref_as_arg_synchronization2() {
    rref_as_arg_synchronization(2, "cuda:1", "cuda:0", None);
}

#[test]
fn test_rref_as_arg_synchronization3() {
    rref_as_arg_synchronization(2, "cuda:1", "cuda:1", None);
}

#[test]
fn test_rref_as_arg_synchronization4() {
    rref_as_arg_synchronization(2, "cuda:0", "cuda:1", None);
}

#[test]
fn test_rref_as_arg_synchronization5() {
    // `devicesOptions`: every rank sets `devices=["cuda:0"]`.
    rref_as_arg_synchronization(1, "cuda:0", "cuda:0", Some("cuda:0"));
}

/// `_test_rref_forward_synchronization(local, remote)`: worker0 feeds an
/// RRef'd batch to the model on worker1 (`rref.remote().forward(rref_input,
/// True)`), worker2 relays the output RRef back (`_rref_relay`), and what
/// comes back equals `rref.rpc_sync().forward(rref_input, True)`.
fn rref_forward_synchronization(gpus: usize, local: &'static str, remote: &'static str) {
    if !require_gpus(gpus) {
        return;
    }
    timed(async move {
        let (input_src, model_dst, out_relay) = (worker_name(0), worker_name(1), worker_name(2));
        let agents = start(4, move |rank, o| match rank {
            0 => {
                o.set_device_map(&model_dst, [(local, remote)])?;
                o.set_device_map(&out_relay, [(local, local)])
            }
            1 => o.set_device_map(&input_src, [(remote, local)]),
            2 => o.set_device_map(&model_dst, [(local, remote)]),
            _ => Ok(()),
        })
        .await?;
        let a = &agents[0];
        let (model_dst, out_relay) = (worker_name(1), worker_name(2));
        let model = a.remote(model_dst.as_str(), "cuda::conv_net", args![remote])?;
        for i in 0..10 {
            let x = Tensor::f_randn([200, 1, 28, 28], (Kind::Float, dev(local)?))?;
            let rref_input = wasmrpc::RRef::new(a, x);
            let rref_out = a.remote(
                model_dst.as_str(),
                "cuda::conv_net_forward",
                args![&model, &rref_input, true],
            )?;
            let out = a
                .remote(out_relay.as_str(), "cuda::rref_relay", args![&rref_out])?
                .to_here(a, None)
                .await?
                .as_tensor()?;
            let expected = a
                .rpc_sync(
                    model_dst.as_str(),
                    "cuda::conv_net_forward",
                    args![&model, &rref_input, true],
                )
                .await?
                .as_tensor()?;
            ensure_same_values(&out, &expected).with_context(|| format!("batch {i}"))?;
        }
        drop(model);
        shutdown(agents).await
    });
}

#[test]
fn test_rref_forward_synchronization1() {
    rref_forward_synchronization(1, "cuda:0", "cuda:0");
}

#[test]
fn test_rref_forward_synchronization2() {
    rref_forward_synchronization(2, "cuda:0", "cuda:1");
}

#[test]
fn test_rref_forward_synchronization3() {
    rref_forward_synchronization(2, "cuda:1", "cuda:0");
}

#[test]
fn test_rref_forward_synchronization4() {
    rref_forward_synchronization(2, "cuda:1", "cuda:1");
}

/// `_test_owner_rref_forward_synchronization(local, remote)`: a group of
/// one maps itself `{local: remote}`; a `Linear(2048, 20000)` made by a
/// `remote()` to itself and moved to `remote` (`.remote().to(remote)`)
/// runs a `(2048, 2048)` batch on `local` thirty times, and the sum of the
/// output through an owner RRef's proxy (`RRef(output).remote().sum()`)
/// equals `output.sum()`.
fn owner_rref_forward_synchronization(gpus: usize, local: &'static str, remote: &'static str) {
    if !require_gpus(gpus) {
        return;
    }
    timed(async move {
        let agents = start(1, move |_, o| {
            o.set_device_map(&worker_name(0), [(local, remote)])
        })
        .await?;
        let a = &agents[0];
        let me = worker_name(0);
        let cpu_model = a.remote(me.as_str(), "cuda::linear", args![2048, 20000])?;
        let model = a.remote(me.as_str(), "cuda::module_to", args![&cpu_model, remote])?;
        for i in 0..30 {
            let data = Tensor::f_rand([2048, 2048], (Kind::Float, dev(local)?))?;
            let output = a
                .rpc_sync(me.as_str(), "cuda::linear_forward", args![&model, data])
                .await?
                .as_tensor()?;
            let v0 = wasmrpc::RRef::new(a, output.shallow_clone())
                .remote(a, None)
                .call_remote("sum", wasmrpc::Args::new())
                .await?
                .to_here(a, None)
                .await?
                .as_tensor()?
                .f_double_value(&[])?;
            let v1 = output.f_sum(None)?.f_double_value(&[])?;
            // `assertEqual` on two floats: within float32's tolerances.
            ensure!(
                (v0 - v1).abs() <= 1e-5 + 1.3e-6 * v1.abs(),
                "iteration {i}: {v0} != {v1}"
            );
        }
        drop((cpu_model, model));
        shutdown(agents).await
    });
}

#[test]
fn test_owner_rref_forward_synchronization1() {
    owner_rref_forward_synchronization(1, "cuda:0", "cuda:0");
}

#[test]
fn test_owner_rref_forward_synchronization2() {
    owner_rref_forward_synchronization(2, "cuda:0", "cuda:1");
}

#[test]
fn test_owner_rref_forward_synchronization3() {
    owner_rref_forward_synchronization(2, "cuda:1", "cuda:0");
}

#[test]
fn test_owner_rref_forward_synchronization4() {
    owner_rref_forward_synchronization(2, "cuda:1", "cuda:1");
}

/// The seed's `TensorWrapper` holds a lock, a CUDA event and a thread,
/// none of which can be pickled: the object never leaves its owner, which
/// runs `increase(1)` on the tensor it holds in place, then `sum()`.
#[test]
fn test_rref_with_unpickleable_attributes() {
    if !require_gpus(1) {
        return;
    }
    timed(async {
        let ws = 4;
        let agents = start(ws, cuda0_ring(ws)).await?;
        for (rank, a) in (0u32..).zip(&agents) {
            let to = dst(rank, ws);
            let zeros = Tensor::zeros([42], (Kind::Float, Device::Cuda(0)));
            let rref = a.remote(to.as_str(), "cuda::tensor_wrapper", args![zeros])?;
            a.rpc_sync(
                to.as_str(),
                "cuda::tensor_wrapper_increase",
                args![&rref, 1],
            )
            .await?;
            let ret = a
                .rpc_sync(to.as_str(), "cuda::tensor_wrapper_sum", args![&rref])
                .await?
                .as_float()?;
            ensure!(ret == 42.0, "worker{rank}: sum {ret}");
            drop(rref);
        }
        shutdown(agents).await
    });
}

/// Not a seed port: CUDA storages between two workers on one host cross in
/// CUDA segments of their shared-memory link (SHM-6; in this in-process
/// harness by the segment's address, between processes by its IPC handle),
/// and through host memory when shared memory is off, with the same values
/// and devices either way; views of one CUDA storage arrive as views of one
/// storage.
#[test]
fn test_cuda_storages_cross_in_cuda_segments_between_workers_on_one_host() {
    if !require_gpus(1) {
        return;
    }
    // Why a storage went through host memory, if one did: the link warns.
    let logs = wasmrpc::testing::global_logs();
    timed(async {
        let fell_back = || {
            let text = logs.text();
            text.lines()
                .filter(|l| l.contains("CUDA storages to a worker on this host"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        for shared_memory in [true, false] {
            ensure!(fell_back().is_empty(), "{:?}", fell_back());
            let agents = start(2, |rank, o| {
                o.shared_memory = shared_memory;
                cuda0_ring(2)(rank, o)
            })
            .await?;
            let mut sent = 0u64;
            // 12 bytes, 1 MiB, 8 MiB, twice each (the second time in the
            // segments the first made).
            for floats in [3i64, 1 << 18, 2 << 20, 3, 1 << 18, 2 << 20] {
                let x = Tensor::rand([floats], (Kind::Float, Device::Cuda(0)));
                let got = agents[0]
                    .rpc_sync("worker1", "aten::add", args![x.shallow_clone(), 1])
                    .await?
                    .as_tensor()?;
                ensure!(
                    got.device() == Device::Cuda(0),
                    "result on {:?}",
                    got.device()
                );
                ensure!(got.equal(&(&x + 1)), "{floats} floats changed on the way");
                ensure!(
                    !shared_memory || fell_back().is_empty(),
                    "{:?}",
                    fell_back()
                );
                sent += floats as u64 * 4;
            }
            let info = |rank: u32, key: &str| -> anyhow::Result<u64> {
                let info = agents[rank as usize].get_debug_info();
                Ok(info
                    .get(key)
                    .with_context(|| format!("no {key} in {info:?}"))?
                    .parse()?)
            };
            let cuda_bytes = |rank| info(rank, "agent.shared_memory_cuda_bytes_sent");
            let links = info(0, "agent.shared_memory_links")?;
            if shared_memory {
                ensure!(
                    links == 1 && cuda_bytes(0)? == sent && cuda_bytes(1)? == sent,
                    "{links} links; sent {} and answered {} of {sent} bytes in CUDA segments",
                    cuda_bytes(0)?,
                    cuda_bytes(1)?
                );
            }
            // Two halves of one storage arrive as halves of one storage: the
            // callee adds 1 to the whole storage through the first half and
            // sums the second.
            let base = Tensor::ones([1 << 18], (Kind::Float, Device::Cuda(0)));
            let (first, second) = (base.narrow(0, 0, 1 << 17), base.narrow(0, 1 << 17, 1 << 17));
            let got = agents[0]
                .rpc_sync(
                    "worker1",
                    "cuda::add_one_through_first_then_sum_second",
                    args![first, second],
                )
                .await?
                .as_tensor()?;
            ensure!(
                got.double_value(&[]) == f64::from(2 << 17),
                "the halves did not share a storage: {got:?}"
            );
            sent += 1 << 20;
            let (requests, responses) = (cuda_bytes(0)?, cuda_bytes(1)?);
            if shared_memory {
                // The halves' sum comes back as one float.
                ensure!(
                    requests == sent && responses == sent - (1 << 20) + 4,
                    "sent {requests} and answered {responses} bytes in CUDA segments"
                );
            } else {
                ensure!(requests == 0 && responses == 0);
            }
            shutdown(agents).await?;
        }
        Ok(())
    });
}
