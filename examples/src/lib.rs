//! Runnable programs mirroring PyTorch's RPC tutorials, written as wasm
//! plugins.
//!
//! # Layout
//!
//! Each example is a plugin crate under `plugins/` (built to wasm32 by
//! `plugins/artifacts`, like every plugin) plus a module here that runs it:
//!
//! | example | plugin | module |
//! |---|---|---|
//! | RL actor-learner, unbatched and batched (async execution) | `plugins/rl` | [`rl`] |
//! | parameter server on scikit-learn's digits | `plugins/param-server` | [`param_server`] |
//! | pipeline parallelism over two stage workers | `plugins/pipeline` | [`pipeline`] |
//!
//! A module starts a cluster of workers in this process ([`Cluster`]: one
//! [`RpcAgent`](wasmrpc::RpcAgent) per worker on a loopback port, every one
//! serving the example's plugin), calls the plugin's driver on worker0 and
//! decodes what it returns. The binary (`cargo run --release -p
//! wasmrpc-examples -- <example>`) prints it; the tests in `tests/` run each
//! example small and check its outcome. The same plugin runs on separate
//! processes with `wasmrpc launch --plugins <dir> --entry <plugin>::run`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use wasmrpc::store::HashStore;
use wasmrpc::wasm::{FolderGrant, FolderGrants};
use wasmrpc::{Args, FunctionRegistry, Payload, PluginHost, RpcAgent, RpcBackendOptions, init_rpc};

pub mod param_server;
pub mod pipeline;
pub mod rl;

/// A local cluster of `worker0 .. worker<N-1>` in this process, each
/// serving the given plugins.
pub struct Cluster {
    agents: Vec<RpcAgent>,
}

impl Cluster {
    /// Starts `world_size` workers serving the plugins at `plugins` (paths
    /// of `.wasm` files), with calls timing out after `timeout`.
    ///
    /// # Errors
    /// A plugin that does not load, or a worker that does not join.
    pub async fn start(world_size: u32, plugins: &[&str], timeout: Duration) -> Result<Cluster> {
        Self::start_with_folders(world_size, plugins, timeout, Vec::new()).await
    }

    /// [`start`](Self::start), with every worker granting the plugins the
    /// folders `grants` name (as `wasmrpc worker --grant-dir` does).
    ///
    /// # Errors
    /// As [`start`](Self::start), or a granted folder that cannot be opened.
    pub async fn start_with_folders(
        world_size: u32,
        plugins: &[&str],
        timeout: Duration,
        grants: Vec<FolderGrant>,
    ) -> Result<Cluster> {
        let plugin_folders =
            Arc::new(FolderGrants::open(grants).map_err(|e| anyhow::anyhow!(e.message))?);
        let host = PluginHost::shared().context("cannot start the wasm runtime")?;
        let mut loaded = Vec::new();
        for path in plugins {
            let (h, p) = (host.clone(), path.to_string());
            loaded.push(
                tokio::task::spawn_blocking(move || h.load_file(&p))
                    .await
                    .context("the plugin loader stopped")?
                    .with_context(|| format!("cannot load the plugin {path}"))?,
            );
        }
        let store: Arc<dyn wasmrpc::store::Store> = Arc::new(HashStore::new());
        let mut joins = Vec::new();
        for rank in 0..world_size {
            let registry = FunctionRegistry::new();
            for plugin in &loaded {
                host.register(plugin, &registry);
            }
            let options = RpcBackendOptions {
                registry: Arc::new(registry),
                rpc_timeout: timeout,
                plugin_folders: plugin_folders.clone(),
                ..RpcBackendOptions::default()
            };
            let store = store.clone();
            joins.push(tokio::spawn(async move {
                init_rpc(
                    &format!("worker{rank}"),
                    Some(rank),
                    Some(world_size),
                    store,
                    options,
                )
                .await
            }));
        }
        let mut agents = Vec::new();
        for (rank, join) in joins.into_iter().enumerate() {
            agents.push(
                join.await
                    .context("a worker's start-up task failed")?
                    .with_context(|| format!("worker{rank} did not join"))?,
            );
        }
        Ok(Cluster { agents })
    }

    /// Calls `function` on worker0, from worker0.
    ///
    /// # Errors
    /// The call's error, with the function's name.
    pub async fn run(&self, function: &str, args: Args) -> Result<Payload> {
        self.call_on("worker0", function, args).await
    }

    /// Calls `function` on worker `on`, from worker0.
    ///
    /// # Errors
    /// The call's error, with the function's name and the worker.
    pub async fn call_on(&self, on: &str, function: &str, args: Args) -> Result<Payload> {
        let agent = self.agents.first().context("the cluster has no workers")?;
        agent
            .rpc_sync(on, function, args)
            .await
            .with_context(|| format!("{function} on {on} failed"))
    }

    /// Shuts every worker down gracefully.
    ///
    /// # Errors
    /// The first worker whose shutdown fails.
    pub async fn shutdown(self) -> Result<()> {
        let mut stops = Vec::new();
        for agent in self.agents {
            stops.push(tokio::spawn(async move {
                let name = agent.name().to_owned();
                agent
                    .shutdown(true, Duration::ZERO)
                    .await
                    .with_context(|| format!("graceful shutdown of {name} failed"))
            }));
        }
        for stop in stops {
            stop.await.context("a shutdown task failed")??;
        }
        Ok(())
    }
}

/// Starts a cluster, runs `function` on worker0, and shuts the cluster
/// down, whatever the call returned.
///
/// # Errors
/// As [`Cluster::start`], [`Cluster::run`] and [`Cluster::shutdown`].
pub async fn run_on_cluster(
    world_size: u32,
    plugins: &[&str],
    grants: Vec<FolderGrant>,
    function: &str,
    args: Args,
) -> Result<Payload> {
    let cluster =
        Cluster::start_with_folders(world_size, plugins, Duration::from_secs(120), grants).await?;
    let result = cluster.run(function, args).await;
    let stopped = cluster.shutdown().await;
    let result = result?;
    stopped?;
    Ok(result)
}

/// The floats of a list payload.
///
/// # Errors
/// A payload that is not a list of floats.
pub fn floats(p: &Payload) -> Result<Vec<f64>> {
    p.items()?
        .iter()
        .map(|x| x.as_float().map_err(anyhow::Error::from))
        .collect()
}
