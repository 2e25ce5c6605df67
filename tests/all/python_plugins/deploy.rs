//! A Python plugin deployed to a running group (`deploy_plugin`), as a Rust
//! plugin is in `deploy_test`: every worker loads the component and serves
//! its functions by name, under a deployed plugin's least privilege.

use anyhow::ensure;
use wasmrpc::prelude::*;
use wasmrpc::testing::{fresh_store, worker_name};
use wasmrpc::{RpcAgent, RpcBackendOptions, args, init_rpc};
use wasmrpc_tests::{expect_tensor, ones, timed};

const WORLD: u32 = 3;

async fn start() -> anyhow::Result<Vec<RpcAgent>> {
    let store = fresh_store();
    let tasks: Vec<_> = (0..WORLD)
        .map(|rank| {
            let options = RpcBackendOptions {
                accept_plugin_deployment: true,
                ..RpcBackendOptions::default()
            };
            let store = store.clone();
            tokio::spawn(async move {
                init_rpc(&worker_name(rank), Some(rank), Some(WORLD), store, options).await
            })
        })
        .collect();
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await??);
    }
    Ok(agents)
}

#[test]
fn a_deployed_python_plugin_is_served_by_every_worker() {
    timed(async {
        let agents = start().await?;
        let wasm = std::fs::read(wasmrpc_plugins::SEED_FNS_PY)?;
        let report = agents[1].deploy_plugin(&wasm).await?;
        report.check()?;
        ensure!(report.plugin == "seed-fns-py", "{report:?}");
        ensure!(report.namespace == "seed_fns_py", "{report:?}");
        for w in &report.workers {
            let names = w.result.as_ref().map_err(Clone::clone)?;
            ensure!(
                names.contains(&"seed_fns_py::my_function".to_string()),
                "{w:?}"
            );
        }
        for from in &agents {
            for to in 0..WORLD {
                let six = from
                    .rpc_sync(worker_name(to), "seed_fns_py::my_function", args![1, 2, 3])
                    .await?;
                ensure!(six.as_int()? == 6);
            }
        }
        // A nested builtin op: within a deployed plugin's rights.
        let t = agents[0]
            .rpc_sync("worker2", "seed_fns_py::nested_rpc", args!["worker1"])
            .await?;
        expect_tensor(&t, &(ones(&[2, 2]) + 1))?;
        // Deploying the same bytes again is a no-op.
        let again = agents[2].deploy_plugin(&wasm).await?;
        again.check()?;
        ensure!(again.workers.iter().all(|w| w.already_served), "{again:?}");
        // A graceful shutdown waits for every worker: all at once.
        let stops: Vec<_> = agents
            .into_iter()
            .map(|a| tokio::spawn(async move { a.shutdown(true, std::time::Duration::ZERO).await }))
            .collect();
        for s in stops {
            s.await??;
        }
        Ok(())
    });
}
