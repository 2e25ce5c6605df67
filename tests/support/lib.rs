//! Helpers shared by the integration tests in `tests/all`.
//!
//! - [`register_all`]: what every test worker serves besides its builtin
//!   ops (`aten::add`, which workers serve themselves under the default op
//!   policy): the seed-fns wasm plugin (`plugins/seed-fns`, the seeds'
//!   Python user functions as `seed_fns::<name>`, loaded once per process,
//!   [`seed_fns_plugin`]) and the native stand-ins of [`seed_fns`]
//!   (`seed::<name>`) for what a plugin cannot be (see that module).
//! - [`aten`]: builtin ops run locally by the tests (`aten::add`, ...),
//!   over the op shim (`wasmrpc-torch-sys`: libtorch's registry and schema
//!   matching).
//! - [`skips`]: the seed tests not ported, with their reasons.
//! - small assertion and tensor helpers.

pub mod aten;
pub mod gpu;
pub mod rref_fns;
pub mod seed_fns;
pub mod skips;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use wasmrpc::testing::{Cluster, ClusterBuilder, DEFAULT_TEST_TIMEOUT, Worker, dist_init, run};
use wasmrpc::wasm::Plugin;
use wasmrpc::{Error, ErrorKind, FunctionRegistry, Payload, PluginHost, Result};

/// The seeds' world size.
pub const WORLD_SIZE: u32 = 4;

/// `torch.ones(size)` as float32 on the CPU.
pub fn ones(size: &[i64]) -> Tensor {
    Tensor::ones(size, (Kind::Float, Device::Cpu))
}

/// `torch.rand(size)` as float32 on the CPU.
pub fn rand(size: &[i64]) -> Tensor {
    Tensor::rand(size, (Kind::Float, Device::Cpu))
}

/// The process's plugin host ([`PluginHost::shared`]) and the seed-fns
/// plugin loaded into it (`wasmrpc_plugins::SEED_FNS`, built from source by
/// `wasmrpc-plugins`), loaded on first use.
///
/// # Panics
/// If the plugin host cannot start or the plugin does not load: no seed
/// test can run then.
pub fn seed_fns_plugin() -> &'static (PluginHost, Arc<Plugin>) {
    static SEED_FNS: OnceLock<(PluginHost, Arc<Plugin>)> = OnceLock::new();
    SEED_FNS.get_or_init(|| {
        let host = PluginHost::shared().expect("the process's plugin host starts");
        let plugin = host
            .load_file(wasmrpc_plugins::SEED_FNS)
            .expect("the seed-fns plugin loads");
        (host, plugin)
    })
}

/// The process's plugin host and the Python seed plugin
/// (`plugins/python/seed-fns-py`, built into a component by
/// `wasmrpc-plugins` with componentize-py) loaded into it on first use;
/// its functions are served as `seed_fns_py::<name>`.
///
/// # Panics
/// If the plugin does not load.
pub fn python_seed_fns_plugin() -> &'static (PluginHost, Arc<Plugin>) {
    static SEED_FNS_PY: OnceLock<(PluginHost, Arc<Plugin>)> = OnceLock::new();
    SEED_FNS_PY.get_or_init(|| {
        let host = PluginHost::shared().expect("the process's plugin host starts");
        let plugin = host
            .load_file(wasmrpc_plugins::SEED_FNS_PY)
            .expect("the Python seed-fns plugin loads");
        (host, plugin)
    })
}

/// [`register_all`], plus the Python seed plugin (`seed_fns_py::<name>`).
pub fn register_with_python(r: &FunctionRegistry) {
    register_all(r);
    let (host, plugin) = python_seed_fns_plugin();
    host.register(plugin, r);
}

/// A cluster of the seeds' size serving the Python seed plugin besides
/// every other test function.
pub fn python_cluster(world_size: u32) -> ClusterBuilder {
    Cluster::builder(world_size).functions(register_with_python)
}

/// Registers every test function in a worker's registry: the seed-fns
/// plugin's functions (`seed_fns::<name>`) and the native stand-ins
/// (`seed::<name>`). Builtin ops (`aten::add`) are the workers' own, under
/// their op policy.
pub fn register_all(r: &FunctionRegistry) {
    let (host, plugin) = seed_fns_plugin();
    host.register(plugin, r);
    seed_fns::register(r);
}

/// A cluster of the seeds' size with every test function registered.
pub fn cluster(world_size: u32) -> ClusterBuilder {
    Cluster::builder(world_size).functions(register_all)
}

/// Runs `body` on every rank of a fresh 4-worker cluster, under the test
/// timeout, then shuts down gracefully and checks for leaks (`@dist_init`).
///
/// # Panics
/// When any rank fails, or on timeout.
pub fn dist<F, Fut>(body: F)
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    dist_with(cluster(WORLD_SIZE), body);
}

/// [`dist`] with a custom cluster.
///
/// # Panics
/// When any rank fails, or on timeout.
pub fn dist_with<F, Fut>(builder: ClusterBuilder, body: F)
where
    F: Fn(Worker) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let body = std::sync::Arc::new(body);
    let r = run(DEFAULT_TEST_TIMEOUT, async move {
        dist_init(builder, move |w| {
            let body = body.clone();
            async move { body(w).await.map_err(|e| format!("{e:#}")) }
        })
        .await
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// Runs a whole test future under the test timeout.
///
/// # Panics
/// When the future fails, or on timeout.
pub fn timed<Fut>(fut: Fut)
where
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    if let Err(e) = run(DEFAULT_TEST_TIMEOUT, fut) {
        panic!("{e:#}");
    }
}

/// Checks that `r` failed with `kind` and a message containing `needle`.
///
/// # Errors
/// When `r` succeeded or failed otherwise.
pub fn expect_err<T: std::fmt::Debug>(
    r: Result<T>,
    kind: ErrorKind,
    needle: &str,
) -> anyhow::Result<Error> {
    match r {
        Ok(v) => anyhow::bail!("expected {kind} containing {needle:?}, got Ok({v:?})"),
        Err(e) if e.kind() == kind && e.message().contains(needle) => Ok(e),
        Err(e) => anyhow::bail!("expected {kind} containing {needle:?}, got {e}"),
    }
}

/// Checks that `p` is a tensor equal to `want`.
///
/// # Errors
/// When it is not.
pub fn expect_tensor(p: &Payload, want: &Tensor) -> anyhow::Result<()> {
    let got = p.as_tensor()?;
    anyhow::ensure!(
        got.size() == want.size()
            && got.kind() == want.kind()
            && got.allclose(want, 1e-5, 1e-8, false),
        "tensor mismatch: got {got:?} want {want:?}"
    );
    Ok(())
}

/// Sleeps without blocking the runtime.
pub async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Whether this machine has at least `n` CUDA devices. When it has not,
/// prints the skip line the coverage tool counts (`wasmrpc-skip: needs N
/// GPUs (found K)`) and returns false; the test then returns.
///
/// Panics if a device is present but libtorch's CUDA side, which the
/// process loads at start where one is (`wasmrpc_torch_sys::cuda`), did
/// not load.
pub fn require_gpus(n: usize) -> bool {
    if let Err(e) = wasmrpc_torch_sys::cuda::load() {
        panic!("CUDA: {e}");
    }
    let found = usize::try_from(tch::Cuda::device_count()).unwrap_or(0);
    if found < n {
        println!("wasmrpc-skip: needs {n} GPUs (found {found})");
        return false;
    }
    true
}

/// The torch venv's Python that `cargo xtask setup` made (torch, numpy,
/// safetensors): `$WASMRPC_ENV/venv/bin/python`, else the checkout's
/// `.wasmrpc-env`.
pub fn venv_python() -> std::path::PathBuf {
    std::env::var_os("WASMRPC_ENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.wasmrpc-env"))
        .join("venv/bin/python")
}

/// Two workers serving the plugin in the `.wasm` file `wasm`, each granting
/// it the folders `specs` name (`--grant-dir` specs).
///
/// # Errors
/// A spec that is not one, a folder that cannot be opened, a plugin that
/// does not load, a worker that does not start.
pub async fn cluster_with_folders(wasm: &str, specs: &[String]) -> anyhow::Result<Cluster> {
    use wasmrpc::wasm::{FolderGrant, FolderGrants};
    let grants = specs
        .iter()
        .map(|spec| FolderGrant::parse(spec).map_err(|e| anyhow::anyhow!(e.message)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let folders = FolderGrants::open(grants).map_err(|e| anyhow::anyhow!(e.message))?;
    let host = PluginHost::shared()?;
    let plugin = host.load_file(wasm)?;
    Ok(Cluster::builder(2)
        .options(wasmrpc::RpcBackendOptions {
            plugin_folders: Arc::new(folders),
            ..wasmrpc::RpcBackendOptions::default()
        })
        .functions(move |r| {
            host.register(&plugin, r);
        })
        .start()
        .await?)
}
