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
//! [`PluginHost`]'s, sending and timeouts the agent's.
//!
//! [`RpcBackendOptions::accept_plugin_deployment`]: crate::RpcBackendOptions::accept_plugin_deployment

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use sha2::{Digest, Sha256};

use super::versions::{self, SHORT, Version, Versions};
use super::{PluginHost, PluginTrust, VersionScope, plugin_namespace};
use crate::abi::{Value, WorkerInfo};

use crate::agent::{Extension, FunctionRegistry, Request, RpcAgent, Run, collect_all};
use crate::error::{Error, Result};
use crate::transport::MessageKind;
use crate::value::Payload;

mod message;
mod report;

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

/// [`Deploy::deploy_plugin`] to every worker of the group.
///
/// # Errors
/// As [`Deploy::deploy_plugin`].
pub(crate) async fn deploy_plugin(agent: &RpcAgent, wasm: &[u8]) -> Result<DeployReport> {
    let workers = agent.get_worker_infos();
    deploy_plugin_to(agent, wasm, &workers).await
}

/// Sends one request to every worker at once; one result per worker.
async fn to_all(
    agent: &RpcAgent,
    workers: &[WorkerInfo],
    kind: MessageKind,
    body: &Result<Vec<u8>>,
) -> Vec<Result<Payload>> {
    let futures: Vec<_> = workers
        .iter()
        .map(|w| match body {
            Ok(body) => agent.request(w, kind, body.clone(), &[], None),
            Err(e) => crate::agent::Future::ready(Err(e.clone())),
        })
        .collect();
    collect_all(&futures).await
}

/// [`Deploy::deploy_plugin_to`]: stage everywhere, then commit or abort.
///
/// # Errors
/// As [`Deploy::deploy_plugin`].
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
        tokio::task::spawn_blocking(move || host.load_version(&bytes))
            .await
            .map_err(|e| Error::runtime(format!("the plugin loader stopped: {e}")))?
            .map_err(|e| e.context_line("validating a plugin before deploying it"))?
    };
    let name = plugin.name().to_string();
    let namespace = plugin_namespace(&name);
    let sha256 = plugin.sha256();
    let short = &hex(&sha256)[..SHORT];
    // Phase 1: every worker stages the version; nothing changes for callers.
    let stage = DeployPlugin {
        name: name.clone(),
        sha256,
        wasm: bytes.to_vec(),
        stage: true,
    }
    .encode();
    let staged: Vec<Result<(bool, Vec<String>)>> = to_all(agent, workers, DEPLOY_PLUGIN, &stage)
        .await
        .into_iter()
        .zip(workers)
        .map(|(r, w)| {
            r.and_then(|p| decode_reply(&p.value)).map_err(|e| {
                e.context_line(format!(
                    "staging plugin {name} (sha256 {short}) on worker {}",
                    w.name
                ))
            })
        })
        .collect();
    let all_staged = staged.iter().all(Result::is_ok);
    // Phase 2: commit everywhere, or abort everywhere.
    let switch = PluginSwitch {
        namespace: namespace.clone(),
        sha256,
        commit: all_staged,
    }
    .encode();
    let switched = if all_staged {
        to_all(agent, workers, PLUGIN_SWITCH, &switch).await
    } else {
        // Only those that staged it; their answers do not matter (a worker
        // that misses the abort drops the version when its stage expires).
        let staged_on: Vec<WorkerInfo> = workers
            .iter()
            .zip(&staged)
            .filter(|(_, r)| r.is_ok())
            .map(|(w, _)| w.clone())
            .collect();
        let _ = to_all(agent, &staged_on, PLUGIN_SWITCH, &switch).await;
        tracing::warn!(
            "plugin {name} (sha256 {short}) was refused by {} worker(s): aborted, nobody switched",
            staged.iter().filter(|r| r.is_err()).count()
        );
        workers.iter().map(|_| Ok(Payload::none())).collect()
    };
    let mut committed_anywhere = false;
    let workers: Vec<WorkerDeployment> = workers
        .iter()
        .zip(staged.into_iter().zip(switched))
        .map(|(w, (staged, switched))| {
            let (already_served, names) = match staged {
                Ok(s) => s,
                Err(e) => {
                    return WorkerDeployment {
                        worker: w.clone(),
                        result: Err(e),
                        already_served: false,
                        committed: false,
                    };
                }
            };
            if !all_staged {
                return WorkerDeployment {
                    worker: w.clone(),
                    result: Ok(names),
                    already_served,
                    committed: false,
                };
            }
            let result = switched.map(|_| names).map_err(|e| {
                e.context_line(format!(
                    "committing plugin {name} (sha256 {short}) on worker {}",
                    w.name
                ))
            });
            committed_anywhere |= result.is_ok();
            WorkerDeployment {
                worker: w.clone(),
                committed: result.is_ok(),
                result,
                already_served,
            }
        })
        .collect();
    if committed_anywhere && !agent.is_static_group() {
        publish(agent, &namespace, &sha256, Some(&bytes[..]))
            .await
            .map_err(|e| {
                e.context_line(format!(
                    "plugin {name} was deployed, but not published for workers that join later"
                ))
            })?;
    }
    Ok(DeployReport {
        namespace,
        version: plugin.manifest().version.clone(),
        sha256: hex(&sha256),
        plugin: name,
        committed: all_staged,
        workers,
    })
}

/// [`Deploy::rollback_plugin`].
///
/// # Errors
/// As [`Deploy::rollback_plugin`].
pub(crate) async fn rollback_plugin(
    agent: &RpcAgent,
    namespace: &str,
    workers: &[WorkerInfo],
) -> Result<DeployReport> {
    if !agent.is_running() {
        return Err(Error::not_initialized());
    }
    // Which version each worker would go back to.
    let mut previous: Option<super::PluginVersion> = None;
    let mut refusals = Vec::new();
    for w in workers {
        match plugin_versions(agent, &w.name).await {
            Ok(held) => {
                let prev = held
                    .into_iter()
                    .find(|v| v.namespace == namespace && v.role == "previous");
                let first = previous.as_ref().map(|p| p.sha256.clone());
                match (prev, first) {
                    (None, _) => refusals.push(format!(
                        "worker {} holds no previous version of plugin {namespace}",
                        w.name
                    )),
                    (Some(p), Some(first)) if p.sha256 != first => refusals.push(format!(
                        "worker {} would roll plugin {namespace} back to {}, others to {}",
                        w.name,
                        &p.sha256[..SHORT],
                        &first[..SHORT]
                    )),
                    (Some(p), None) => previous = Some(p),
                    (Some(_), Some(_)) => {}
                }
            }
            Err(e) => refusals.push(format!("worker {}: {}", w.name, e.message())),
        }
    }
    let Some(previous) = previous.filter(|_| refusals.is_empty()) else {
        return Err(Error::runtime(format!(
            "plugin {namespace} was not rolled back (no worker switched): {}",
            if refusals.is_empty() {
                "no workers".to_string()
            } else {
                refusals.join("; ")
            }
        )));
    };
    let sha256 = unhex(&previous.sha256)
        .ok_or_else(|| Error::runtime(format!("bad sha256 {}", previous.sha256)))?;
    let switch = PluginSwitch {
        namespace: namespace.to_owned(),
        sha256,
        commit: true,
    }
    .encode();
    let results = to_all(agent, workers, PLUGIN_SWITCH, &switch).await;
    let short = &previous.sha256[..SHORT];
    let workers: Vec<WorkerDeployment> = workers
        .iter()
        .zip(results)
        .map(|(w, r)| {
            let result = r.map(|_| Vec::new()).map_err(|e| {
                e.context_line(format!(
                    "rolling plugin {namespace} back to {short} on worker {}",
                    w.name
                ))
            });
            WorkerDeployment {
                worker: w.clone(),
                committed: result.is_ok(),
                result,
                already_served: false,
            }
        })
        .collect();
    if workers.iter().any(|w| w.committed) && !agent.is_static_group() {
        publish(agent, namespace, &sha256, None)
            .await
            .map_err(|e| {
                e.context_line(format!(
                    "plugin {namespace} was rolled back, but not published for workers that join \
                 later"
                ))
            })?;
    }
    Ok(DeployReport {
        plugin: previous.plugin,
        namespace: namespace.to_owned(),
        version: previous.version,
        sha256: previous.sha256,
        committed: true,
        workers,
    })
}

/// [`Deploy::plugin_versions`].
///
/// # Errors
/// As a call of the worker; a reply of another shape.
pub(crate) async fn plugin_versions(
    agent: &RpcAgent,
    worker: &str,
) -> Result<Vec<super::PluginVersion>> {
    let reply = agent
        .rpc_sync(worker, PLUGIN_VERSIONS, crate::Args::new())
        .await?;
    let bad = || {
        Error::runtime(format!(
            "unexpected reply from worker {worker} listing its plugin versions"
        ))
    };
    let Value::List(items) = &reply.value else {
        return Err(bad());
    };
    items
        .iter()
        .map(|v| super::PluginVersion::from_value(v).ok_or_else(bad))
        .collect()
}

/// [`Deploy::install_deployed_plugins`].
///
/// # Errors
/// As [`Deploy::install_deployed_plugins`].
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
    let mut namespaces: Vec<String> = Vec::new();
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
        let namespace = plugin_namespace(&name);
        if !namespaces.contains(&namespace) {
            namespaces.push(namespace);
        }
        let message = DeployPlugin {
            name,
            sha256,
            wasm,
            stage: false,
        };
        let reply = handle_request(agent, "the group's store", message).await?;
        let (already, registered) = decode_reply(&reply.value)?;
        if !already {
            for n in registered {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
    }
    // The version each plugin was last switched to (by a deployment or a
    // rollback), when it is not the last one published.
    for namespace in namespaces {
        let pointer = key(&format!("current/{namespace}"));
        let err = |e: crate::store::Error| Error::runtime(format!("store: {e}"));
        if !store.check(&[&pointer]).await.map_err(err)? {
            continue;
        }
        let entry = String::from_utf8_lossy(&store.get(&pointer).await.map_err(err)?).into_owned();
        let (sha_hex, mac_hex) = entry.split_once(' ').unwrap_or((&entry, ""));
        let Some(sha256) = unhex(sha_hex) else {
            continue;
        };
        let vouched = match &attested {
            Some((_, hashes)) => hashes.iter().any(|h| h == sha_hex),
            None => hex(&sign_current(&secret, &namespace, &sha256)) == mac_hex,
        };
        if !vouched {
            return Err(Error::runtime(format!(
                "worker {} did not switch plugin {namespace} to version {sha_hex}: the store's \
                 entry is not signed with the cluster secret",
                agent.name()
            )));
        }
        let deployed = agent.state::<Deployed>();
        let _serial = deployed.by_sha256.lock().await;
        versions::commit(agent, &namespace, &sha256).map_err(|e| {
            e.context_line(format!(
                "worker {} switching plugin {namespace} to the group's current version",
                agent.name()
            ))
        })?;
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

/// The store prefix deployments are published under for late joiners.
const PUBLISHED: &str = "rpc/plugins";

/// Publishes a deployment in the group's store: the bytes first (when
/// given and not there yet), then the next index, so a reader that sees
/// the index finds the bytes; then the namespace's current version.
async fn publish(
    agent: &RpcAgent,
    namespace: &str,
    sha256: &[u8; 32],
    wasm: Option<&[u8]>,
) -> Result<()> {
    let store = agent.store();
    let sha_hex = hex(sha256);
    let bytes_key = format!("{PUBLISHED}/sha256/{sha_hex}");
    let err = |e: crate::store::Error| Error::runtime(format!("store: {e}"));
    let secret = agent.cluster_secret()?;
    // Without a secret there is nothing to sign with: joiners ask a member
    // instead (`attested_deployments`).
    let signed = |mac: [u8; 32]| {
        if secret.is_empty() {
            "unsigned".to_string()
        } else {
            hex(&mac)
        }
    };
    if let Some(wasm) = wasm
        && !store.check(&[&bytes_key]).await.map_err(err)?
    {
        store.set(&bytes_key, wasm).await.map_err(err)?;
        let i = store
            .add(&format!("{PUBLISHED}/count"), 1)
            .await
            .map_err(err)?
            - 1;
        store
            .set(
                &format!("{PUBLISHED}/{i}"),
                format!("{sha_hex} {}", signed(sign(&secret, sha256))).as_bytes(),
            )
            .await
            .map_err(err)?;
    }
    store
        .set(
            &format!("{PUBLISHED}/current/{namespace}"),
            format!(
                "{sha_hex} {}",
                signed(sign_current(&secret, namespace, sha256))
            )
            .as_bytes(),
        )
        .await
        .map_err(err)
}

/// HMAC-SHA256 of a published plugin's sha256 under the cluster secret.
fn sign(secret: &[u8], sha256: &[u8; 32]) -> [u8; 32] {
    mac(secret, &[b"wasmrpc published plugin v1\0", sha256])
}

/// HMAC-SHA256 of a namespace's current version under the cluster secret.
fn sign_current(secret: &[u8], namespace: &str, sha256: &[u8; 32]) -> [u8; 32] {
    mac(
        secret,
        &[
            b"wasmrpc current plugin v1\0",
            namespace.as_bytes(),
            b"\0",
            sha256,
        ],
    )
}

fn mac(secret: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(mut m) => {
            for p in parts {
                m.update(p);
            }
            m.finalize().into_bytes().into()
        }
        // HMAC takes keys of any length; were it to refuse one, no entry
        // would verify, which fails closed.
        Err(_) => [0; 32],
    }
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

fn refuse_unless_accepting(agent: &RpcAgent, plugin: &str) -> Result<()> {
    if agent.options().accept_plugin_deployment {
        return Ok(());
    }
    Err(Error::runtime(format!(
        "worker {} does not accept plugin deployment (plugin {plugin}); start it with \
         --accept-plugin-deployment (RpcBackendOptions::accept_plugin_deployment)",
        agent.name()
    )))
}

/// The worker's side of [`DEPLOY_PLUGIN`] from worker `from`: stages the
/// version (steps of the module docs), and with `stage` false commits it
/// at once. The reply is `(already_served: bool, names: [str])`.
pub(crate) async fn handle_request(
    agent: &RpcAgent,
    from: &str,
    message: DeployPlugin,
) -> Result<Payload> {
    let DeployPlugin {
        name,
        sha256,
        wasm,
        stage,
    } = message;
    let me = agent.name().to_string();
    refuse_unless_accepting(agent, &name)?;
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
    Versions::expire_staged(agent);
    let (already, namespace, names) = stage_version(agent, from, &name, sha256, wasm).await?;
    if !stage {
        versions::commit(agent, &namespace, &sha256)?;
        by_sha256.insert(sha256, names.clone());
    }
    Ok(reply(already, &names))
}

/// Stages a version on this worker (the caller holds [`Deployed`]'s lock):
/// `(already current, namespace, names)`.
async fn stage_version(
    agent: &RpcAgent,
    from: &str,
    name: &str,
    sha256: [u8; 32],
    wasm: Vec<u8>,
) -> Result<(bool, String, Vec<String>)> {
    let me = agent.name().to_string();
    let short = &hex(&sha256)[..SHORT];
    let versions = agent.state::<Versions>();
    // Held already: current (a no-op), or staged again.
    {
        let mut groups = versions.lock();
        for (ns, g) in groups.iter_mut() {
            let current = g.current == Some(sha256);
            if let Some(v) = g.versions.iter_mut().find(|v| v.plugin.sha256() == sha256) {
                let mut names: Vec<String> = v.functions.keys().cloned().collect();
                names.sort();
                if !current {
                    v.staged = Some(Instant::now());
                    v.draining = None;
                }
                return Ok((current, ns.clone(), names));
            }
        }
    }
    let host = PluginHost::shared()?;
    let plugin = {
        let host = host.clone();
        tokio::task::spawn_blocking(move || host.load_version(&wasm))
            .await
            .map_err(|e| Error::runtime(format!("the plugin loader stopped: {e}")))?
            .map_err(|e| {
                Error::new(
                    e.kind(),
                    format!(
                        "worker {me} cannot load plugin {name} (sha256 {short}): {}",
                        e.message()
                    ),
                )
            })?
    };
    let name = plugin.name().to_owned();
    let namespace = plugin_namespace(&name);
    let registry = agent.registry();
    let has_group = versions.lock().contains_key(&namespace);
    if !has_group {
        // Names of this namespace served from outside the version table:
        // a plugin loaded at start-up (`--plugins`), which becomes the
        // group's first, current version, or another plugin's.
        let prefix = format!("{namespace}::");
        let served: Vec<String> = registry
            .names()
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .collect();
        if let Some(clash) = served.first() {
            let operator = host
                .runtime()
                .loaded()
                .into_iter()
                .filter(|p| p.name() == name)
                .find(|p| {
                    p.manifest()
                        .exports
                        .iter()
                        .any(|e| format!("{namespace}::{}", e.name) == *clash)
                });
            let Some(operator) = operator else {
                return Err(Error::runtime(format!(
                    "worker {me} already serves {clash}, which plugin {name} would replace; it \
                     is another plugin's: deploy this one under a new name"
                )));
            };
            adopt(agent, &host, &namespace, operator)?;
        }
    }
    let mut groups = versions.lock();
    let first = match groups.get(&namespace) {
        None => true,
        Some(group) => {
            if let Some(other) = group.versions.iter().find(|v| v.plugin.name() != name) {
                return Err(Error::runtime(format!(
                    "worker {me} serves namespace {namespace} from plugin {}, which plugin \
                     {name} would replace: deploy it under a new name",
                    other.plugin.name()
                )));
            }
            if let Some(v) = group.get(&sha256) {
                // Loaded at start-up with these very bytes.
                let mut names: Vec<String> = v.functions.keys().cloned().collect();
                names.sort();
                return Ok((group.current == Some(sha256), namespace, names));
            }
            group.versions.is_empty()
        }
    };
    let scope = VersionScope {
        state: if first {
            namespace.clone()
        } else {
            format!("{namespace}@{short}")
        },
        calls: format!("{namespace}@{short}"),
        usage: Arc::default(),
    };
    let functions = host
        .register_version(&plugin, PluginTrust::Deployed, &scope)
        .map_err(|e| {
            Error::new(
                e.kind(),
                format!(
                    "worker {me} cannot serve plugin {name} (sha256 {short}): {}",
                    e.message()
                ),
            )
        })?;
    let mut names: Vec<String> = functions.keys().cloned().collect();
    names.sort();
    tracing::info!(
        "{me}: staged plugin {name} {} (sha256 {short}) from {from}: {}",
        plugin.manifest().version,
        names.join(", ")
    );
    groups
        .entry(namespace.clone())
        .or_default()
        .versions
        .push(Version {
            plugin,
            scope: scope.state,
            functions,
            usage: scope.usage,
            deployed_by: from.to_owned(),
            deployed_at: SystemTime::now(),
            staged: Some(Instant::now()),
            draining: None,
        });
    Ok((false, namespace, names))
}

/// Makes a plugin loaded at start-up the first, current version of its
/// group: its names then stand for the group's current version.
fn adopt(
    agent: &RpcAgent,
    host: &PluginHost,
    namespace: &str,
    plugin: Arc<wasmrpc_wasm::Plugin>,
) -> Result<()> {
    let scope = VersionScope::unversioned(namespace);
    let functions = host.register_version(&plugin, PluginTrust::Operator, &scope)?;
    let sha256 = plugin.sha256();
    agent.state::<Versions>().lock().insert(
        namespace.to_owned(),
        versions::Group {
            versions: vec![Version {
                plugin,
                scope: scope.state,
                functions,
                usage: scope.usage,
                deployed_by: "operator".into(),
                deployed_at: SystemTime::now(),
                staged: Some(Instant::now()),
                draining: None,
            }],
            current: None,
            previous: None,
        },
    );
    versions::commit(agent, namespace, &sha256).map(|_| ())
}

/// The worker's side of [`PLUGIN_SWITCH`] from worker `from`: commits (the
/// reply is the replaced version's sha256 in hex, or `None`) or aborts
/// (the reply says whether a staged version was dropped).
pub(crate) async fn handle_switch(
    agent: &RpcAgent,
    from: &str,
    message: PluginSwitch,
) -> Result<Payload> {
    let PluginSwitch {
        namespace,
        sha256,
        commit,
    } = message;
    refuse_unless_accepting(agent, &namespace)?;
    let deployed = agent.state::<Deployed>();
    let mut by_sha256 = deployed.by_sha256.lock().await;
    let short = &hex(&sha256)[..SHORT];
    if !commit {
        let dropped = versions::abort(agent, &namespace, &sha256);
        tracing::info!(
            "{}: {from} aborted version {short} of plugin {namespace} (dropped: {dropped})",
            agent.name()
        );
        return Ok(Payload::from_value(Value::Bool(dropped)));
    }
    Versions::expire_staged(agent);
    let replaced = versions::commit(agent, &namespace, &sha256)?;
    let names = {
        let groups = agent.state::<Versions>();
        let groups = groups.lock();
        let mut names: Vec<String> = groups
            .get(&namespace)
            .and_then(|g| g.get(&sha256))
            .map(|v| v.functions.keys().cloned().collect())
            .unwrap_or_default();
        names.sort();
        names
    };
    by_sha256.entry(sha256).or_insert(names);
    tracing::info!(
        "{}: {from} made version {short} of plugin {namespace} current (was {})",
        agent.name(),
        replaced.map_or("none".into(), |r| hex(&r)[..SHORT].to_owned())
    );
    Ok(Payload::from_value(
        replaced.map_or(Value::None, |r| Value::Str(hex(&r))),
    ))
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
