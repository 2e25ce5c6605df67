//! The worker's side: a deployment request staged (loaded, compiled,
//! checked beside the versions held) and a switch committed or aborted.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use sha2::{Digest, Sha256};

use super::{DeployPlugin, Deployed, PluginSwitch, hex, reply};
use crate::abi::Value;
use crate::agent::RpcAgent;
use crate::error::{Error, Result};
use crate::plugin::versions::{self, SHORT, Version, Versions};
use crate::plugin::{PluginHost, PluginTrust, VersionScope, plugin_namespace};
use crate::value::Payload;

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

/// The worker's side of [`DEPLOY_PLUGIN`](super::DEPLOY_PLUGIN) from worker `from`: stages the
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

/// Stages a version on this worker (the caller holds [`Deployed`](super::Deployed)'s lock):
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

/// The worker's side of [`PLUGIN_SWITCH`](super::PLUGIN_SWITCH) from worker `from`: commits (the
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
