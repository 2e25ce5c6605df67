//! Plugin deployment at run time: shipping a wasm plugin to every worker of
//! a running group, which loads it and serves its functions by name.
//!
//! The deployer ([`Deploy::deploy_plugin`](crate::Deploy::deploy_plugin), or `wasmrpc plugin deploy`,
//! which joins the group as a dynamic member to do it) first loads the bytes
//! itself, so bytes that are not a plugin are refused before anything is
//! sent; then it sends one [`DEPLOY_PLUGIN`] to every worker at
//! once, each under the agent's call timeout, and gathers one
//! [`WorkerDeployment`] per worker into a [`DeployReport`]. A failure on one
//! worker does not stop the others.
//!
//! A worker receiving a deployment ([`handle_request`], dispatched by the
//! agent like every reserved message kind):
//! 1. refuses it unless its options allow deployment
//!    ([`RpcBackendOptions::accept_plugin_deployment`], off by default;
//!    `wasmrpc worker --accept-plugin-deployment`):
//!    "worker X does not accept plugin deployment";
//! 2. checks the bytes against the sha256 the message carries;
//! 3. answers at once if it already serves that exact plugin (same sha256,
//!    deployed before or loaded at start-up with `--plugins`): redeploying
//!    is a no-op;
//! 4. loads it into the process's [`PluginHost::shared`] (compiling off the
//!    async threads) and registers its functions in the agent's registry as
//!    `namespace::function`, as `--plugins` does but with a deployed
//!    plugin's rights ([`PluginTrust::Deployed`](super::PluginTrust): the
//!    worker's op families, calls to its own functions and builtin ops,
//!    plus what its manifest declares); it replies with the registered
//!    names.
//!
//! Versions are **not replaced**: a plugin whose name is already loaded in
//! the process with other bytes, or whose functions would replace functions
//! this worker already serves from another plugin, is refused with an error
//! naming the worker and the plugin. Replacing would need the runtime to
//! hold two modules under one plugin name (its per-worker globals and
//! locks are scoped by that name) and would silently change what a name
//! means for callers in flight; deploy a new version under a new package
//! name (so a new namespace) or restart the group with it instead.
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
//! accepted is also published in the group's store (`rpc/plugins/count`,
//! `rpc/plugins/{i}` → sha256 and its HMAC-SHA256 under the cluster secret
//! (a MAC: it reveals nothing of the secret),
//! `rpc/plugins/sha256/{hex}` → bytes; static groups, which nobody joins
//! later, publish nothing). The HMAC keeps the store (unauthenticated, as
//! PyTorch's TCPStore is) from being a way around the handshake: a joiner
//! installs only what a holder of the cluster secret published. A group
//! without a cluster secret (TLS only, or unauthenticated) publishes the
//! entries unsigned; a joiner then installs only the entries whose sha256 a
//! live member lists as deployed when asked over its authenticated
//! connection (`wasmrpc::_deployed_plugins`), so the store is only a cache
//! of bytes checked against their sha256. A worker that joins
//! later installs them with [`Deploy::install_deployed_plugins`](crate::Deploy::install_deployed_plugins) (the
//! `wasmrpc worker` binary does so right after joining when it accepts
//! deployment), through the same steps as a deployment message. Until it
//! has, it does not serve them: a peer calling it in that window gets the
//! unknown-function error.
//!
//! What this module leaves to others: loading and registering are
//! [`PluginHost`]'s, sending and timeouts the agent's.
//!
//! [`RpcBackendOptions::accept_plugin_deployment`]: crate::RpcBackendOptions::accept_plugin_deployment

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::PluginHost;
use crate::abi::{Value, WorkerInfo};

use crate::agent::{Extension, FunctionRegistry, Request, RpcAgent, Run, collect_all};
use crate::error::{Error, Result};
use crate::transport::MessageKind;
use crate::value::Payload;

mod message;
mod report;

pub use message::{DEPLOY_PLUGIN, DeployPlugin};
pub use report::{DeployReport, WorkerDeployment};

/// What plugin deployment adds to an agent. In scope with
/// `use wasmrpc::prelude::*`.
pub trait Deploy {
    /// Deploys a plugin to every worker of the group, this one included
    /// (`deploy_plugin`): validates `wasm` here, then sends it to every
    /// worker at once, each under the call timeout. A worker registers the
    /// plugin's functions as `namespace::function` and serves them to every
    /// peer and plugin; it answers at once if it already serves these exact
    /// bytes (same sha256); it refuses if it was started without
    /// [`accept_plugin_deployment`](crate::RpcBackendOptions::accept_plugin_deployment),
    /// or if it has another version of the plugin or functions of the same
    /// names (versions are not replaced at run time). Workers that refuse
    /// or fail are in the report ([`DeployReport::check`] turns them into
    /// an error).
    ///
    /// # Errors
    /// Before anything is sent: "RPC has not been initialized" if the agent
    /// stopped; a `RuntimeError` if `wasm` is not a plugin this host can
    /// load (or another plugin of its name is loaded in this process).
    fn deploy_plugin(&self, wasm: &[u8]) -> impl Future<Output = Result<DeployReport>> + Send;

    /// [`deploy_plugin`](Deploy::deploy_plugin) to the given workers only
    /// (e.g. every worker but a deploying tool's own).
    fn deploy_plugin_to(
        &self,
        wasm: &[u8],
        workers: &[WorkerInfo],
    ) -> impl Future<Output = Result<DeployReport>> + Send;

    /// Installs every plugin deployed to this worker's dynamic group before
    /// it joined (see the module docs), in deployment order, as if each
    /// deployment had reached it; returns the names it now serves from
    /// them. Plugins it already serves are skipped.
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

    fn install_deployed_plugins(&self) -> impl Future<Output = Result<Vec<String>>> + Send {
        install_deployed_plugins(self)
    }
}

/// Deploys a plugin to every worker of the group, this one included
/// (`deploy_plugin`): validates `wasm` here, then sends it to every
/// worker at once, each under the call timeout. A worker registers the
/// plugin's functions as `namespace::function` and serves them to every
/// peer and plugin; it answers at once if it already serves these exact
/// bytes (same sha256); it refuses if it was started without
/// [`accept_plugin_deployment`](crate::RpcBackendOptions::accept_plugin_deployment),
/// or if it has another version of the plugin or functions of the same
/// names (versions are not replaced at run time). Workers that refuse
/// or fail are in the report ([`DeployReport::check`] turns them into
/// an error).
///
/// # Errors
/// Before anything is sent: "RPC has not been initialized" if the agent
/// stopped; a `RuntimeError` if `wasm` is not a plugin this host can
/// load (or another plugin of its name is loaded in this process).
pub(crate) async fn deploy_plugin(agent: &RpcAgent, wasm: &[u8]) -> Result<DeployReport> {
    let workers = agent.get_worker_infos();
    deploy_plugin_to(agent, wasm, &workers).await
}

/// [`deploy_plugin`](Deploy::deploy_plugin) to the given workers only
/// (e.g. every worker but a deploying tool's own).
///
/// # Errors
/// As [`deploy_plugin`](Deploy::deploy_plugin).
pub(crate) async fn deploy_plugin_to(
    agent: &RpcAgent,
    wasm: &[u8],
    workers: &[WorkerInfo],
) -> Result<DeployReport> {
    if !agent.is_running() {
        return Err(Error::not_initialized());
    }
    let host = PluginHost::shared()?;
    let bytes: Arc<[u8]> = Arc::from(wasm);
    let plugin = {
        let (host, bytes) = (host.clone(), bytes.clone());
        tokio::task::spawn_blocking(move || host.load(&bytes))
            .await
            .map_err(|e| Error::runtime(format!("the plugin loader stopped: {e}")))?
            .map_err(|e| e.context_line("validating a plugin before deploying it"))?
    };
    let name = plugin.name().to_string();
    let sha256 = plugin.sha256();
    let futures: Vec<_> = workers
        .iter()
        .map(|w| {
            let (name, bytes) = (name.clone(), bytes.clone());
            let message = DeployPlugin {
                name,
                sha256,
                wasm: bytes.to_vec(),
            };
            match message.encode() {
                Ok(body) => agent.request(w, DEPLOY_PLUGIN, body, &[], None),
                Err(e) => crate::agent::Future::ready(Err(e)),
            }
        })
        .collect();
    let results = collect_all(&futures).await;
    let accepted = results.iter().any(Result::is_ok);
    if accepted && !agent.is_static_group() {
        publish(agent, &sha256, &bytes).await.map_err(|e| {
            e.context_line(format!(
                "plugin {name} was deployed, but not published for workers that join later"
            ))
        })?;
    }
    let workers = workers
        .iter()
        .zip(results)
        .map(|(w, r)| {
            let r = r.and_then(|p| decode_reply(&p.value)).map_err(|e| {
                e.context_line(format!("deploying plugin {name} to worker {}", w.name))
            });
            let already_served = matches!(r, Ok((true, _)));
            WorkerDeployment {
                worker: w.clone(),
                result: r.map(|(_, names)| names),
                already_served,
            }
        })
        .collect();
    Ok(DeployReport {
        namespace: super::plugin_namespace(&name),
        version: plugin.manifest().version.clone(),
        sha256: hex(&sha256),
        plugin: name,
        workers,
    })
}

/// Installs every plugin deployed to this worker's dynamic group before
/// it joined (see the module docs), in deployment order, as if each
/// deployment had reached it; returns the names it now serves from
/// them. Plugins it already serves are skipped.
///
/// # Errors
/// "worker X does not accept plugin deployment" if its options refuse
/// deployments and a plugin was deployed; store errors; the first plugin
/// it cannot install (as a deployment would fail).
pub(crate) async fn install_deployed_plugins(agent: &RpcAgent) -> Result<Vec<String>> {
    let store = agent.store();
    let secret = agent.cluster_secret()?;
    let key = |k: &str| format!("{PUBLISHED}/{k}");
    let count = store
        .add(&key("count"), 0)
        .await
        .map_err(|e| Error::runtime(format!("reading the deployed plugins: {e}")))?;
    if count == 0 {
        return Ok(Vec::new());
    }
    // Without a cluster secret (TLS only), the store's entries prove
    // nothing: a member, over an authenticated connection, says which
    // sha256s were deployed.
    let attested = if secret.is_empty() {
        Some(attested_deployments(agent).await?)
    } else {
        None
    };
    let mut names = Vec::new();
    for i in 0..count {
        let read = async |k: String| {
            store
                .get(&k)
                .await
                .map_err(|e| Error::runtime(format!("reading deployed plugin {i} ({k}): {e}")))
        };
        let entry = String::from_utf8_lossy(&read(key(&i.to_string())).await?).into_owned();
        let (sha_hex, mac_hex) = entry.split_once(' ').unwrap_or((&entry, ""));
        let wasm = read(key(&format!("sha256/{sha_hex}"))).await?;
        let sha256: [u8; 32] = Sha256::digest(&wasm).into();
        let vouched = match &attested {
            Some((_, hashes)) => hashes.iter().any(|h| h == sha_hex),
            None => hex(&sign(&secret, &sha256)) == mac_hex,
        };
        if let Some((member, _)) = &attested
            && (hex(&sha256) != sha_hex || !vouched)
        {
            return Err(Error::runtime(format!(
                "worker {} did not install deployed plugin {i} (sha256 {sha_hex}): worker \
                 {member} does not serve it as a deployed plugin",
                agent.name()
            )));
        }
        if hex(&sha256) != sha_hex || !vouched {
            return Err(Error::runtime(format!(
                "worker {} did not install deployed plugin {i} (sha256 {sha_hex}): the \
                 store's entry is not signed with the cluster secret",
                agent.name()
            )));
        }
        let name = wasmrpc_wasm::manifest::read(&wasm)
            .map(|m| m.name)
            .unwrap_or_else(|_| format!("sha256 {sha_hex}"));
        let reply = handle_request(agent, DeployPlugin { name, sha256, wasm }).await?;
        let (already, registered) = decode_reply(&reply.value)?;
        if !already {
            names.extend(registered);
        }
    }
    Ok(names)
}

/// Which plugins were deployed to the group, as a live member other
/// than this worker says over its authenticated connection: the
/// member's name and the sha256s (hex) it serves as deployments.
async fn attested_deployments(agent: &RpcAgent) -> Result<(String, Vec<String>)> {
    let member = agent
        .get_worker_infos()
        .into_iter()
        .find(|w| w.name != agent.name())
        .ok_or_else(|| {
            Error::runtime(format!(
                "worker {} cannot check the group's deployed plugins: no other member to \
                 ask (without a cluster secret the store's entries are not signed)",
                agent.name()
            ))
        })?;
    let reply = agent
        .rpc_sync(member.name.as_str(), DEPLOYED_PLUGINS, crate::Args::new())
        .await?;
    let bad = || {
        Error::runtime(format!(
            "unexpected reply from worker {} listing deployed plugins",
            member.name
        ))
    };
    let Value::List(items) = &reply.value else {
        return Err(bad());
    };
    let hashes = items
        .iter()
        .map(|v| match v {
            Value::Str(s) => Ok(s.clone()),
            _ => Err(bad()),
        })
        .collect::<Result<_>>()?;
    Ok((member.name, hashes))
}

/// The internal function that lists the sha256s (hex) a worker serves as
/// deployed plugins: what a late joiner of a group without a cluster secret
/// installs from the store.
pub(crate) const DEPLOYED_PLUGINS: &str = "wasmrpc::_deployed_plugins";

/// Registers [`DEPLOYED_PLUGINS`] among the agent's internal functions.
pub(crate) fn register(r: &FunctionRegistry) {
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
}

/// The store prefix deployments are published under for late joiners.
const PUBLISHED: &str = "rpc/plugins";

/// Publishes a deployment in the group's store: the bytes first, then the
/// next index, so a reader that sees the index finds the bytes.
async fn publish(agent: &RpcAgent, sha256: &[u8; 32], wasm: &[u8]) -> Result<()> {
    let store = agent.store();
    let sha_hex = hex(sha256);
    let bytes_key = format!("{PUBLISHED}/sha256/{sha_hex}");
    let err = |e: crate::store::Error| Error::runtime(format!("store: {e}"));
    if store.check(&[&bytes_key]).await.map_err(err)? {
        return Ok(());
    }
    store.set(&bytes_key, wasm).await.map_err(err)?;
    let i = store
        .add(&format!("{PUBLISHED}/count"), 1)
        .await
        .map_err(err)?
        - 1;
    let secret = agent.cluster_secret()?;
    // Without a secret there is nothing to sign with: joiners ask a member
    // instead (`attested_deployments`).
    let mac_hex = if secret.is_empty() {
        "unsigned".to_string()
    } else {
        hex(&sign(&secret, sha256))
    };
    store
        .set(
            &format!("{PUBLISHED}/{i}"),
            format!("{sha_hex} {mac_hex}").as_bytes(),
        )
        .await
        .map_err(err)
}

/// HMAC-SHA256 of a published plugin's sha256 under the cluster secret.
fn sign(secret: &[u8], sha256: &[u8; 32]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(mut m) => {
            m.update(b"wasmrpc published plugin v1\0");
            m.update(sha256);
            m.finalize().into_bytes().into()
        }
        // HMAC takes keys of any length; were it to refuse one, no entry
        // would verify, which fails closed.
        Err(_) => [0; 32],
    }
}

/// The plugins deployed to one agent, by sha256, with the names each
/// registered. The mutex also makes one worker's deployments run one at a
/// time, so two deployers of the same bytes load and register them once.
#[derive(Default)]
struct Deployed {
    by_sha256: tokio::sync::Mutex<HashMap<[u8; 32], Vec<String>>>,
}

/// Plugin deployment on the agent: its functions and its request.
pub(crate) struct Deployment;

impl Extension for Deployment {
    fn name(&self) -> &'static str {
        "deploy"
    }

    fn register(&self, functions: &FunctionRegistry) {
        register(functions);
    }

    fn message_kinds(&self) -> &'static [MessageKind] {
        &[DEPLOY_PLUGIN]
    }

    fn serve_request(&self, agent: &RpcAgent, request: Request) -> Run {
        let agent = agent.clone();
        Box::pin(async move {
            let message: DeployPlugin = request.decode(|_: &DeployPlugin| DEPLOY_PLUGIN)?;
            handle_request(&agent, message).await
        })
    }
}

/// The worker's side of [`DEPLOY_PLUGIN`] (steps 1-4 of the module docs).
/// The reply is `(already_served: bool, names: [str])`.
pub(crate) async fn handle_request(agent: &RpcAgent, message: DeployPlugin) -> Result<Payload> {
    let DeployPlugin { name, sha256, wasm } = message;
    let me = agent.name().to_string();
    if !agent.options().accept_plugin_deployment {
        return Err(Error::runtime(format!(
            "worker {me} does not accept plugin deployment (plugin {name}); start it with \
             --accept-plugin-deployment (RpcBackendOptions::accept_plugin_deployment)"
        )));
    }
    let actual: [u8; 32] = Sha256::digest(&wasm).into();
    if actual != sha256 {
        return Err(Error::value(format!(
            "worker {me} received plugin {name} with sha256 {} but its bytes hash to {}",
            hex(&sha256),
            hex(&actual)
        )));
    }
    let deployed = agent.state::<Deployed>();
    let mut by_sha256 = deployed.by_sha256.lock().await;
    if let Some(names) = by_sha256.get(&sha256) {
        return Ok(reply(true, names));
    }
    let host = PluginHost::shared()?;
    let loaded_before = host.runtime().loaded();
    if let Some(other) = loaded_before
        .iter()
        .find(|p| p.name() == name && p.sha256() != sha256)
    {
        return Err(Error::runtime(format!(
            "worker {me} already serves another version of plugin {name} (sha256 {}, deploying \
             {}); a running worker does not replace a plugin: deploy it under a new name or \
             restart the group with it",
            hex(&other.sha256()),
            hex(&sha256)
        )));
    }
    let was_loaded = loaded_before.iter().any(|p| p.sha256() == sha256);
    let plugin = {
        let host = host.clone();
        tokio::task::spawn_blocking(move || host.load(&wasm))
            .await
            .map_err(|e| Error::runtime(format!("the plugin loader stopped: {e}")))?
            .map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("worker {me} cannot load plugin {name}: {e}"),
                )
            })?
    };
    // The names the plugin would register, without touching the agent's
    // registry yet: a scratch registry gets them from the one place that
    // decides them (`PluginHost::register`).
    let names = host.register(&plugin, &FunctionRegistry::without_builtins());
    let registry = agent.registry();
    let served: Vec<&String> = names.iter().filter(|n| registry.get(n).is_some()).collect();
    if was_loaded && served.len() == names.len() {
        // Loaded at start-up (`--plugins`) with these very bytes.
        by_sha256.insert(sha256, names.clone());
        return Ok(reply(true, &names));
    }
    if let Some(clash) = served.first() {
        return Err(Error::runtime(format!(
            "worker {me} already serves {clash}, which plugin {name} would replace; a running \
             worker does not replace functions: deploy it under a new name"
        )));
    }
    let names = host
        .register_with(&plugin, registry, super::PluginTrust::Deployed)
        .map_err(|e| {
            Error::new(
                e.kind(),
                format!("worker {me} cannot serve plugin {name}: {}", e.message()),
            )
        })?;
    tracing::info!(
        "{me}: deployed plugin {name} {} (sha256 {}): serving {}",
        plugin.manifest().version,
        hex(&sha256),
        names.join(", ")
    );
    by_sha256.insert(sha256, names.clone());
    Ok(reply(false, &names))
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

#[cfg(test)]
mod tests;
