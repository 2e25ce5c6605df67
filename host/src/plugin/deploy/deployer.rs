//! The deployer's side: sending a plugin (or a switch) to every worker
//! and gathering what each did into a report (the two phases of the
//! parent module's docs), rollback, and listing the versions workers hold.

use std::sync::Arc;

use super::store::publish;
use super::{
    DEPLOY_PLUGIN, DeployPlugin, DeployReport, PLUGIN_SWITCH, PLUGIN_VERSIONS, PluginSwitch,
    WorkerDeployment, decode_reply, hex, unhex,
};
use crate::abi::{Value, WorkerInfo};
use crate::agent::{RpcAgent, collect_all};
use crate::error::{Error, Result};
use crate::plugin::versions::SHORT;
use crate::plugin::{PluginHost, plugin_namespace};
use crate::transport::MessageKind;
use crate::value::Payload;

/// [`Deploy::deploy_plugin`](super::Deploy::deploy_plugin) to every worker of the group.
///
/// # Errors
/// As [`Deploy::deploy_plugin`](super::Deploy::deploy_plugin).
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

/// [`Deploy::deploy_plugin_to`](super::Deploy::deploy_plugin_to): stage everywhere, then commit or abort.
///
/// # Errors
/// As [`Deploy::deploy_plugin`](super::Deploy::deploy_plugin).
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

/// [`Deploy::rollback_plugin`](super::Deploy::rollback_plugin).
///
/// # Errors
/// As [`Deploy::rollback_plugin`](super::Deploy::rollback_plugin).
pub(crate) async fn rollback_plugin(
    agent: &RpcAgent,
    namespace: &str,
    workers: &[WorkerInfo],
) -> Result<DeployReport> {
    if !agent.is_running() {
        return Err(Error::not_initialized());
    }
    // Which version each worker would go back to.
    let mut previous: Option<crate::plugin::PluginVersion> = None;
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

/// [`Deploy::plugin_versions`](super::Deploy::plugin_versions).
///
/// # Errors
/// As a call of the worker; a reply of another shape.
pub(crate) async fn plugin_versions(
    agent: &RpcAgent,
    worker: &str,
) -> Result<Vec<crate::plugin::PluginVersion>> {
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
        .map(|v| crate::plugin::PluginVersion::from_value(v).ok_or_else(bad))
        .collect()
}
