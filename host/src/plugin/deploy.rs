//! Plugin deployment at run time: shipping a wasm plugin, or a new version
//! of one, to every worker of a running group, and switching the group to
//! it (or back) while it serves.
//!
//! **Versions.** A worker holds versions of a plugin side by side, each
//! content-addressed by its sha256 (`super::versions` keeps them): the
//! *current* one, which `hello::greet` calls; the *previous* one (what a
//! rollback goes back to); versions *staged* by a deployment in progress;
//! older ones *draining* until no call runs on them and no object of them
//! lives, or for at most
//! [`plugin_drain_timeout`](crate::RpcBackendOptions::plugin_drain_timeout).
//! `hello@<prefix>::greet` calls the version whose sha256 starts with
//! `<prefix>` (at least [`MIN_PREFIX`](super::MIN_PREFIX) hex digits,
//! matching exactly one version the worker holds, staged ones included,
//! else an error naming what it holds or the candidates). Each version has its
//! own globals, locks and named futures; an object (an RRef's) runs the
//! version that constructed it for its whole life; a call runs to its end
//! on the version it started on.
//!
//! **Deploying: two phases.** The deployer
//! ([`Deploy::deploy_plugin`](crate::Deploy::deploy_plugin), or `wasmrpc
//! plugin deploy`, which joins the group as a dynamic member to do it)
//! loads the bytes itself (bytes that are not a plugin are refused before
//! anything is sent), then:
//! 1. *stage*: one [`DEPLOY_PLUGIN`] to every worker at once, each under
//!    the call timeout. A worker refuses unless its options allow
//!    deployment ([`RpcBackendOptions::accept_plugin_deployment`], off by
//!    default; `wasmrpc worker --accept-plugin-deployment`: "worker X does
//!    not accept plugin deployment"), checks the bytes against the sha256
//!    the message carries, loads and compiles them (off the async threads)
//!    beside the versions it holds, and prepares the functions with a
//!    deployed plugin's rights ([`PluginTrust::Deployed`](super::PluginTrust));
//!    nothing changes for callers. A version it already holds is staged
//!    again without loading; the current one is a no-op ("already
//!    served"). A plugin loaded at start-up (`--plugins`) becomes its
//!    group's first version (with its operator rights). Functions of the
//!    namespace that another plugin serves are a refusal.
//! 2. *commit* if every worker staged it, else *abort*: one
//!    [`PLUGIN_SWITCH`] to every worker. A commit makes the version current
//!    (the version it replaces becomes previous; older ones drain); an
//!    abort drops the staged copy, so a refusal anywhere leaves the whole
//!    group on its current version.
//!
//! The deployer gathers one [`WorkerDeployment`] per worker into a
//! [`DeployReport`]. A deployer that dies between the phases leaves every
//! worker on its current version: a staged version is never current by
//! itself, and a worker drops it after
//! [`plugin_stage_timeout`](crate::RpcBackendOptions::plugin_stage_timeout)
//! (when it next handles a deployment or a listing); a later deployment
//! stages and commits as usual. **Rollback**
//! ([`Deploy::rollback_plugin`](crate::Deploy::rollback_plugin), `wasmrpc
//! plugin rollback NAME`) asks every worker for its previous version and,
//! if they all name the same one, commits it everywhere (the same switch).
//! `wasmrpc plugin list` ([`Deploy::plugin_versions`](crate::Deploy::plugin_versions))
//! prints what each worker holds.
//!
//! **What "atomic" means here.** On one worker, a commit is one
//! assignment under the lock of its version table: a call that starts
//! before it runs the old version, one that starts after runs the new one,
//! and no call runs both (it holds its version's code from its start). The
//! commit reaches the workers one message each, at once but not at one
//! instant: while it is under way, a call may find the new version on one
//! worker and the old one on another. Once the deployer's commit has
//! returned (every worker answered), every call that starts runs the new
//! version everywhere. A call chain is pinned: a deployed version names its
//! own functions (called by their short name, `rpc_sync(dst, "greet", ...)`)
//! as `namespace@<its sha256>::function`, so the nested calls of a call
//! started on version 1 run version 1 on every worker, before, during and
//! after the switch, as long as the workers hold it (staged, current and
//! previous versions always are; older ones while they drain). A chain that names functions
//! fully (`hello::greet`) is not pinned and sees the current version of
//! each worker when each nested call starts. If a commit fails on some
//! workers (a worker unreachable after it staged), the report says which;
//! the others switched, and a redeployment or a rollback brings them
//! together.
//!
//! Security: deployment messages only arrive over the agent's connections,
//! and every connection is authenticated by the HMAC handshake on the
//! cluster secret before any message is read (`transport::handshake`;
//! `rpc_test::extra::test_unauthenticated_peer_is_refused` shows a peer
//! without the secret cannot connect). The secret is the operator's
//! (options, `WASMRPC_CLUSTER_SECRET`, `--cluster-secret-file`), never the
//! store's. A worker without credentials (loopback or `--insecure`) is
//! unauthenticated: anyone who reaches it may deploy if it accepts
//! deployments, and its store entries are unsigned (see below). Plugins run
//! sandboxed, with only the host API every peer can already reach through
//! calls, narrowed further for deployed plugins (least privilege,
//! `super::grant`).
//!
//! Late joiners of a dynamic group: a deployment that at least one worker
//! committed is also published in the group's store (`rpc/plugins/count`,
//! `rpc/plugins/{i}` → sha256 and its HMAC-SHA256 under the cluster secret
//! (a MAC: it reveals nothing of the secret),
//! `rpc/plugins/sha256/{hex}` → bytes), and so is every switch
//! (`rpc/plugins/current/{namespace}` → the current version's sha256 and
//! its HMAC; static groups, which nobody joins later, publish nothing).
//! The HMAC keeps the store (unauthenticated, as PyTorch's TCPStore is)
//! from being a way around the handshake: a joiner installs only what a
//! holder of the cluster secret published. A group without a cluster
//! secret (TLS only, or unauthenticated) publishes the entries unsigned; a
//! joiner then installs only the entries whose sha256 a live member lists
//! as deployed when asked over its authenticated connection
//! (`wasmrpc::_deployed_plugins`), so the store is only a cache of bytes
//! checked against their sha256 (a switch entry is then trusted to name
//! one of those versions, not to be the latest). A worker that joins later
//! installs them with [`Deploy::install_deployed_plugins`](crate::Deploy::install_deployed_plugins)
//! (the `wasmrpc worker` binary does so right after joining when it
//! accepts deployment), each as a one-phase deployment (stage and commit),
//! in publication order, then switches each plugin to its published
//! current version. Until it has, it does not serve them: a peer calling
//! it in that window gets the unknown-function error.
//!
//! What this module leaves to others: loading and registering are
//! [`PluginHost`](super::PluginHost)'s, sending and timeouts the agent's.
//!
//! [`RpcBackendOptions::accept_plugin_deployment`]: crate::RpcBackendOptions::accept_plugin_deployment

use std::collections::HashMap;
use std::future::Future;

use super::versions::Versions;
use crate::abi::{Value, WorkerInfo};

use crate::agent::{Extension, FunctionRegistry, Request, RpcAgent, Run};
use crate::error::{Error, Result};
use crate::transport::MessageKind;
use crate::value::Payload;

mod deployer;
mod message;
mod report;
mod store;
mod worker;

pub(crate) use deployer::{deploy_plugin, deploy_plugin_to, plugin_versions, rollback_plugin};
pub(crate) use store::install_deployed_plugins;
use worker::{handle_request, handle_switch};

pub use message::{DEPLOY_PLUGIN, DeployPlugin, PLUGIN_SWITCH, PluginSwitch};
pub use report::{DeployReport, WorkerDeployment};

/// What plugin deployment adds to an agent. In scope with
/// `use wasmrpc::prelude::*`.
pub trait Deploy {
    /// Deploys a plugin to every worker of the group, this one included
    /// (`deploy_plugin`), in two phases (see the module docs): validates
    /// `wasm` here; stages it on every worker at once, each under the call
    /// timeout; then, if every worker staged it, commits it everywhere (it
    /// becomes what `namespace::function` calls), else aborts (nobody
    /// switches, staged copies are dropped). A worker that serves another
    /// version of the plugin keeps it as *previous* (for
    /// [`rollback_plugin`](Deploy::rollback_plugin)). The same bytes
    /// deployed again are a no-op. Workers that refuse or fail are in the
    /// report ([`DeployReport::check`] turns them into an error).
    ///
    /// # Errors
    /// Before anything is sent: "RPC has not been initialized" if the agent
    /// stopped; a `RuntimeError` if `wasm` is not a plugin this host can
    /// load.
    fn deploy_plugin(&self, wasm: &[u8]) -> impl Future<Output = Result<DeployReport>> + Send;

    /// [`deploy_plugin`](Deploy::deploy_plugin) to the given workers only
    /// (e.g. every worker but a deploying tool's own).
    fn deploy_plugin_to(
        &self,
        wasm: &[u8],
        workers: &[WorkerInfo],
    ) -> impl Future<Output = Result<DeployReport>> + Send;

    /// Switches plugin `namespace` back to its previous version on the
    /// given workers: asks each which version is its previous, and commits
    /// that version everywhere when they all agree (else switches nobody).
    ///
    /// # Errors
    /// A `RuntimeError` naming the workers that hold no previous version
    /// or another one, or that cannot be asked.
    fn rollback_plugin(
        &self,
        namespace: &str,
        workers: &[WorkerInfo],
    ) -> impl Future<Output = Result<DeployReport>> + Send;

    /// The plugin versions worker `worker` holds, with their roles, calls
    /// in flight and live objects, and who deployed them when.
    ///
    /// # Errors
    /// As a call of the worker.
    fn plugin_versions(
        &self,
        worker: &str,
    ) -> impl Future<Output = Result<Vec<super::PluginVersion>>> + Send;

    /// Installs every plugin deployed to this worker's dynamic group before
    /// it joined (see the module docs), in deployment order, as if each
    /// deployment had reached it, then makes current the version the group
    /// last switched to; returns the names it now serves from them. Plugins
    /// it already serves are skipped.
    ///
    /// # Errors
    /// "worker X does not accept plugin deployment" if its options refuse
    /// deployments and a plugin was deployed; store errors; the first plugin
    /// it cannot install (as a deployment would fail).
    fn install_deployed_plugins(&self) -> impl Future<Output = Result<Vec<String>>> + Send;
}

impl Deploy for RpcAgent {
    fn deploy_plugin(&self, wasm: &[u8]) -> impl Future<Output = Result<DeployReport>> + Send {
        deploy_plugin(self, wasm)
    }

    fn deploy_plugin_to(
        &self,
        wasm: &[u8],
        workers: &[WorkerInfo],
    ) -> impl Future<Output = Result<DeployReport>> + Send {
        deploy_plugin_to(self, wasm, workers)
    }

    fn rollback_plugin(
        &self,
        namespace: &str,
        workers: &[WorkerInfo],
    ) -> impl Future<Output = Result<DeployReport>> + Send {
        rollback_plugin(self, namespace, workers)
    }

    fn plugin_versions(
        &self,
        worker: &str,
    ) -> impl Future<Output = Result<Vec<super::PluginVersion>>> + Send {
        plugin_versions(self, worker)
    }

    fn install_deployed_plugins(&self) -> impl Future<Output = Result<Vec<String>>> + Send {
        install_deployed_plugins(self)
    }
}

/// The internal function that lists the sha256s (hex) a worker serves as
/// deployed plugins: what a late joiner of a group without a cluster secret
/// installs from the store.
pub(crate) const DEPLOYED_PLUGINS: &str = "wasmrpc::_deployed_plugins";

/// The internal function that lists the plugin versions a worker holds
/// ([`Deploy::plugin_versions`], `wasmrpc plugin list`).
pub(crate) const PLUGIN_VERSIONS: &str = "wasmrpc::_plugin_versions";

/// Registers [`DEPLOYED_PLUGINS`] and [`PLUGIN_VERSIONS`] among the agent's
/// internal functions.
pub(crate) fn register(r: &FunctionRegistry) {
    // Pinned names (`hello@<sha256 prefix>::greet`) are nobody's registered
    // name: the agent asks this resolver for them.
    r.add_resolver(std::sync::Arc::new(super::versions::PinnedNames));
    r.register_native(DEPLOYED_PLUGINS, |ctx, _args| async move {
        let deployed = ctx.agent().state::<Deployed>();
        let hashes = deployed
            .by_sha256
            .lock()
            .await
            .keys()
            .map(|k| Value::Str(hex(k)))
            .collect();
        Ok(Payload::from_value(Value::List(hashes)))
    });
    r.register_native(PLUGIN_VERSIONS, |ctx, _args| async move {
        let agent = ctx.agent();
        Versions::expire_staged(agent);
        let held = agent
            .state::<Versions>()
            .list()
            .iter()
            .map(super::PluginVersion::to_value)
            .collect();
        Ok(Payload::from_value(Value::List(held)))
    });
}

/// The plugins deployed to one agent (committed at least once), by
/// sha256, with the names each registered. The mutex also makes one
/// worker's deployments and switches run one at a time.
#[derive(Default)]
struct Deployed {
    by_sha256: tokio::sync::Mutex<HashMap<[u8; 32], Vec<String>>>,
}

/// Plugin deployment on the agent: its functions and its requests.
pub(crate) struct Deployment;

impl Extension for Deployment {
    fn name(&self) -> &'static str {
        "deploy"
    }

    fn register(&self, functions: &FunctionRegistry) {
        register(functions);
    }

    fn message_kinds(&self) -> &'static [MessageKind] {
        &[DEPLOY_PLUGIN, PLUGIN_SWITCH]
    }

    fn debug_info(&self, agent: &RpcAgent) -> std::collections::BTreeMap<String, String> {
        super::stats::debug_info(agent)
    }

    fn serve_request(&self, agent: &RpcAgent, request: Request) -> Run {
        let agent = agent.clone();
        Box::pin(async move {
            if request.kind == PLUGIN_SWITCH {
                let message: PluginSwitch = request.decode(|_: &PluginSwitch| PLUGIN_SWITCH)?;
                return handle_switch(&agent, &request.from.name, message).await;
            }
            let message: DeployPlugin = request.decode(|_: &DeployPlugin| DEPLOY_PLUGIN)?;
            handle_request(&agent, &request.from.name, message).await
        })
    }
}

fn reply(already_served: bool, names: &[String]) -> Payload {
    Payload::from_value(Value::Tuple(vec![
        Value::Bool(already_served),
        Value::List(names.iter().map(|n| Value::Str(n.clone())).collect()),
    ]))
}

fn decode_reply(value: &Value) -> Result<(bool, Vec<String>)> {
    let bad = || {
        Error::runtime(format!(
            "unexpected reply to a plugin deployment: {value:?}"
        ))
    };
    let Value::Tuple(items) = value else {
        return Err(bad());
    };
    let [Value::Bool(already), Value::List(names)] = items.as_slice() else {
        return Err(bad());
    };
    let names = names
        .iter()
        .map(|n| match n {
            Value::Str(s) => Ok(s.clone()),
            _ => Err(bad()),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((*already, names))
}

/// Lowercase hex, as `sha256sum` and `wasmrpc plugin inspect` print it.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A sha256 from its 64 hex digits.
pub(crate) fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests;
