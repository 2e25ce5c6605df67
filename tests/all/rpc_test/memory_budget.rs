//! The tensor memory budget as an attacker meets it (not seed tests): a
//! peer, a plugin or a frame asking a worker for more tensor memory than
//! its budget gets an error naming the worker, the budget and what asked,
//! and the worker serves every other call on.

use std::time::{Duration, Instant};
use wasmrpc::prelude::*;

use anyhow::ensure;
use tch::{Device, Kind, Tensor};
use wasmrpc::{ErrorKind, Payload, RpcAgent, TensorMemoryBudget, args};
use wasmrpc_tests::{cluster, expect_err, expect_tensor, ones, timed};

const MIB: u64 = 1 << 20;

/// A 2-worker cluster where worker1 has `worker1` as its budget and worker0
/// a large one.
async fn cluster_with(worker1: TensorMemoryBudget) -> anyhow::Result<wasmrpc::testing::Cluster> {
    Ok(cluster(2)
        .configure(move |rank, o| {
            if rank == 1 {
                o.tensor_memory = worker1;
            } else {
                o.tensor_memory = TensorMemoryBudget {
                    per_worker: 1 << 34,
                    per_call: 1 << 34,
                };
            }
        })
        .start()
        .await?)
}

/// A list of ints, as `torch.zeros` takes its size.
fn sizes(dims: &[i64]) -> Payload {
    Payload::from(dims.iter().map(|d| Payload::from(*d)).collect::<Vec<_>>())
}

/// worker1 still answers an ordinary call.
async fn still_serves(a0: &RpcAgent) -> anyhow::Result<()> {
    let r = a0
        .rpc_sync("worker1", "aten::add", args![ones(&[2]), 1])
        .await;
    expect_tensor(&r?, &(ones(&[2]) + 1))
}

/// Waits until `agent`'s budget holds `bytes` (tensors are freed when the
/// last handle goes, which for RRefs and replies is a message later).
async fn wait_in_use(agent: &RpcAgent, bytes: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (used, _) = agent.tensor_memory_in_use();
        if used == bytes {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{} holds {used} bytes of tensors, expected {bytes}",
            agent.name()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn test_peer_allocation_over_the_call_budget_is_refused() {
    timed(async {
        let c = cluster_with(TensorMemoryBudget {
            per_worker: 256 * MIB,
            per_call: 32 * MIB,
        })
        .await?;
        let a0 = c.agent(0).clone();
        // 14.4 GB: without a budget this is the OOM killer's business.
        let r = a0
            .rpc_sync("worker1", "aten::zeros", args![sizes(&[60000, 60000])])
            .await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "worker1: per-call tensor memory budget of 33554432 bytes exceeded by aten::zeros \
             (asked 14400000000 bytes)",
        )?;
        still_serves(&a0).await?;
        wait_in_use(c.agent(1), 0).await?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_tensors_peers_keep_count_until_freed() {
    timed(async {
        let c = cluster_with(TensorMemoryBudget {
            per_worker: 64 * MIB,
            per_call: 48 * MIB,
        })
        .await?;
        let a0 = c.agent(0).clone();
        // 24 MB each, kept on worker1 in RRefs: two fit, a third does not.
        let make = || a0.remote("worker1", "aten::zeros", args![sizes(&[6_000_000])]);
        let first = make()?;
        let second = make()?;
        first.to_here(&a0, None).await?;
        second.to_here(&a0, None).await?;
        let third = make()?;
        expect_err(
            third.to_here(&a0, None).await,
            ErrorKind::RuntimeError,
            "worker1: tensor memory budget of 67108864 bytes exceeded by aten::zeros \
             (asked 24000000 bytes)",
        )?;
        still_serves(&a0).await?;
        // Freeing one makes room again.
        drop(first);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let again = make()?;
            match again.to_here(&a0, None).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    ensure!(e.message().contains("tensor memory budget"), "{e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => anyhow::bail!("no room after freeing an RRef: {e}"),
            }
        }
        drop((second, third));
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_plugin_allocations_are_bounded_per_call() {
    timed(async {
        let c = cluster_with(TensorMemoryBudget {
            per_worker: 256 * MIB,
            per_call: 64 * MIB,
        })
        .await?;
        let a0 = c.agent(0).clone();
        // 100 tensors of 4 MB, all held by one plugin call.
        let r = a0
            .rpc_sync(
                "worker1",
                "seed_fns::allocate_tensors",
                args![100, 1_000_000],
            )
            .await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "worker1: per-call tensor memory budget of 67108864 bytes exceeded by aten::zeros \
             (asked 4000000 bytes)",
        )?;
        // Within the budget the same function works, and what the failed
        // call held was released with it.
        let r = a0
            .rpc_sync(
                "worker1",
                "seed_fns::allocate_tensors",
                args![10, 1_000_000],
            )
            .await?;
        ensure!(r.as_int()? == 10_000_000, "{r:?}");
        wait_in_use(c.agent(1), 0).await?;
        // Tensors from the plugin's own bytes count too.
        let r = a0
            .rpc_sync("worker1", "seed_fns::tensor_from_bytes", args![20_000_000])
            .await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "worker1: per-call tensor memory budget of 67108864 bytes exceeded by a new tensor of \
             plugin seed_fns (asked 80000000 bytes)",
        )?;
        still_serves(&a0).await?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_frames_over_the_budget_are_refused_without_closing_the_connection() {
    timed(async {
        let c = cluster_with(TensorMemoryBudget {
            per_worker: 32 * MIB,
            per_call: 16 * MIB,
        })
        .await?;
        let a0 = c.agent(0).clone();
        // A 64 MiB argument: worker1 reads it off the wire without keeping it.
        let big = Tensor::zeros([16 << 20], (Kind::Float, Device::Cpu));
        let r = a0.rpc_sync("worker1", "aten::add", args![&big, 1]).await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "worker1: tensor memory budget of 33554432 bytes exceeded by a call of aten::add from \
             worker worker0 (asked 67108864 bytes)",
        )?;
        // The same connection carries the next call.
        still_serves(&a0).await?;
        wait_in_use(c.agent(1), 0).await?;

        // A reply too large for the caller's budget fails the caller's call:
        // worker1 asks worker0 (ample budget) for 64 MiB of zeros.
        let a1 = c.agent(1).clone();
        let r = a1
            .rpc_sync("worker0", "aten::zeros", args![sizes(&[16 << 20])])
            .await;
        expect_err(
            r,
            ErrorKind::RuntimeError,
            "worker1: tensor memory budget of 33554432 bytes exceeded by a Response message from \
             worker worker0 (asked 67108864 bytes)",
        )?;
        let r = a1
            .rpc_sync("worker0", "aten::add", args![ones(&[2]), 1])
            .await?;
        expect_tensor(&r, &(ones(&[2]) + 1))?;
        c.shutdown().await?;
        Ok(())
    });
}
