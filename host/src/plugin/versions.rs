//! The versions of each deployed plugin one worker holds, and which one
//! its name means: the worker's side of upgrades (see `deploy`'s module
//! docs for the protocol and what "atomic" means across workers).
//!
//! A *group* is every version of one plugin namespace (`hello`) this
//! worker holds, each content-addressed by its sha256. Its roles:
//! - *current*: what `hello::greet` runs. The registry holds a
//!   [`CurrentFunction`] under each name, which looks the current version
//!   up when a call starts: switching is one assignment under the group
//!   table's lock, the one point where this worker changes what a name
//!   means. A call that started keeps the version it started on (it holds
//!   that version's function, and with it its code).
//! - *previous*: the version the last commit replaced, kept loaded so
//!   that a rollback is a switch (no bytes to send).
//! - *staged*: loaded, compiled and checked by a deployment's first phase,
//!   never called by name until a commit makes it current; dropped by an
//!   abort or when it has been staged longer than
//!   [`RpcBackendOptions::plugin_stage_timeout`](crate::RpcBackendOptions::plugin_stage_timeout)
//!   (checked whenever this worker handles a deployment or lists its
//!   plugins: a staged version is never current by itself, so expiring it
//!   late changes nothing for callers).
//! - *draining*: any other version; it is unloaded (dropped from the
//!   group and the runtime, its globals cleared) as soon as no call runs
//!   on it and no object of it lives, or after
//!   [`RpcBackendOptions::plugin_drain_timeout`](crate::RpcBackendOptions::plugin_drain_timeout).
//!   Calls and objects still holding it after that keep running on it (they
//!   hold its code); new calls cannot reach it.
//!
//! `hello@<prefix>::greet` pins a version ([`PinnedNames`]): the prefix is
//! at least [`MIN_PREFIX`] hex digits of the version's sha256 and must
//! match exactly one version the worker holds. Staged versions answer
//! pinned names too: a call chain started on a worker that already
//! committed a version finds it on a worker that has not yet.
//!
//! Per-version state: a version's plugin globals, locks and named
//! futures are scoped by its *scope*: the namespace for the first version
//! a worker holds of a plugin (so a plugin loaded at start-up keeps its
//! globals when it is first upgraded), `namespace@<sha256 16 hex>` for
//! every later one. Objects keep the version that constructed them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use wasmrpc_wasm::Plugin;

use super::deploy::hex;
use crate::abi::Value;
use crate::agent::{CallContext, RpcAgent, RpcFunction};
use crate::error::{Error, Result};
use crate::value::{Args, Payload};

mod pinned;

pub(crate) use pinned::PinnedNames;

/// The fewest hex digits of a sha256 that pin a version.
pub const MIN_PREFIX: usize = 8;

/// How many hex digits of a sha256 name a version in scopes, pins made by
/// plugins and listings.
pub(crate) const SHORT: usize = 16;

/// Calls running on, and objects alive of, one version.
#[derive(Default, Debug)]
pub(crate) struct Usage {
    in_flight: AtomicUsize,
    objects: AtomicUsize,
}

/// One call or one object of a version, counted until dropped.
pub(crate) struct InUse {
    usage: Arc<Usage>,
    object: bool,
}

impl Usage {
    /// Counts a call until the guard is dropped.
    pub(crate) fn call(self: &Arc<Self>) -> InUse {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InUse {
            usage: self.clone(),
            object: false,
        }
    }

    /// Counts an object until the guard is dropped.
    pub(crate) fn object(self: &Arc<Self>) -> InUse {
        self.objects.fetch_add(1, Ordering::SeqCst);
        InUse {
            usage: self.clone(),
            object: true,
        }
    }

    pub(crate) fn counts(&self) -> (usize, usize) {
        (
            self.in_flight.load(Ordering::SeqCst),
            self.objects.load(Ordering::SeqCst),
        )
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let counter = if self.object {
            &self.usage.objects
        } else {
            &self.usage.in_flight
        };
        counter.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One version of a plugin on this worker.
pub(crate) struct Version {
    pub(crate) plugin: Arc<Plugin>,
    /// Where its globals, locks and named futures live.
    pub(crate) scope: String,
    /// Its functions and classes by registered name (`hello::greet`).
    pub(crate) functions: HashMap<String, Arc<dyn RpcFunction>>,
    pub(crate) usage: Arc<Usage>,
    /// The worker that deployed it, or "operator" for one loaded at
    /// start-up.
    pub(crate) deployed_by: String,
    pub(crate) deployed_at: SystemTime,
    /// Since when it is staged, if it is.
    pub(crate) staged: Option<Instant>,
    /// Since when it drains, if it does.
    pub(crate) draining: Option<Instant>,
}

impl Version {
    fn sha256(&self) -> [u8; 32] {
        self.plugin.sha256()
    }
}

/// Every version of one namespace.
#[derive(Default)]
pub(crate) struct Group {
    pub(crate) versions: Vec<Version>,
    pub(crate) current: Option<[u8; 32]>,
    pub(crate) previous: Option<[u8; 32]>,
}

impl Group {
    pub(crate) fn get(&self, sha256: &[u8; 32]) -> Option<&Version> {
        self.versions.iter().find(|v| &v.sha256() == sha256)
    }

    fn get_mut(&mut self, sha256: &[u8; 32]) -> Option<&mut Version> {
        self.versions.iter_mut().find(|v| &v.sha256() == sha256)
    }

    fn role(&self, v: &Version) -> &'static str {
        let sha = v.sha256();
        if self.current == Some(sha) {
            "current"
        } else if v.staged.is_some() {
            "staged"
        } else if self.previous == Some(sha) {
            "previous"
        } else {
            "draining"
        }
    }

    fn describe_held(&self) -> String {
        let held: Vec<String> = self
            .versions
            .iter()
            .map(|v| format!("{} ({})", &hex(&v.sha256())[..SHORT], self.role(v)))
            .collect();
        if held.is_empty() {
            "none".into()
        } else {
            held.join(", ")
        }
    }
}

/// One worker's plugin versions, by namespace (in
/// [`RpcAgent::state`]).
#[derive(Default)]
pub(crate) struct Versions {
    groups: Mutex<HashMap<String, Group>>,
}

/// What a worker says of one version it holds ([`crate::Deploy::plugin_versions`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PluginVersion {
    /// The namespace its functions are served under (`hello`).
    pub namespace: String,
    /// Its manifest name.
    pub plugin: String,
    /// Its manifest version.
    pub version: String,
    /// Its sha256, in hex.
    pub sha256: String,
    /// `current`, `previous`, `staged` or `draining`.
    pub role: String,
    /// Calls running on it now.
    pub in_flight: u64,
    /// Its objects alive now (held by RRefs).
    pub objects: u64,
    /// The worker that deployed it, or `operator` (loaded at start-up).
    pub deployed_by: String,
    /// When it was deployed to (or loaded on) this worker, in seconds since
    /// the Unix epoch.
    pub deployed_at: f64,
}

impl PluginVersion {
    pub(crate) fn to_value(&self) -> Value {
        Value::Tuple(vec![
            Value::Str(self.namespace.clone()),
            Value::Str(self.plugin.clone()),
            Value::Str(self.version.clone()),
            Value::Str(self.sha256.clone()),
            Value::Str(self.role.clone()),
            Value::Int(i64::try_from(self.in_flight).unwrap_or(i64::MAX)),
            Value::Int(i64::try_from(self.objects).unwrap_or(i64::MAX)),
            Value::Str(self.deployed_by.clone()),
            Value::Float(self.deployed_at),
        ])
    }

    pub(crate) fn from_value(v: &Value) -> Option<PluginVersion> {
        let Value::Tuple(items) = v else { return None };
        let s = |i: usize| match items.get(i) {
            Some(Value::Str(s)) => Some(s.clone()),
            _ => None,
        };
        let n = |i: usize| match items.get(i) {
            Some(Value::Int(n)) => u64::try_from(*n).ok(),
            _ => None,
        };
        let deployed_at = match items.get(8) {
            Some(Value::Float(f)) => *f,
            _ => return None,
        };
        Some(PluginVersion {
            namespace: s(0)?,
            plugin: s(1)?,
            version: s(2)?,
            sha256: s(3)?,
            role: s(4)?,
            in_flight: n(5)?,
            objects: n(6)?,
            deployed_by: s(7)?,
            deployed_at,
        })
    }
}

impl Versions {
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<String, Group>> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The function the registered name `name` of `namespace` runs now.
    fn current_function(
        &self,
        worker: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Arc<dyn RpcFunction>> {
        let groups = self.lock();
        let group = groups.get(namespace);
        let version = group.and_then(|g| g.current.and_then(|c| g.get(&c)));
        let Some(version) = version else {
            return Err(Error::runtime(format!(
                "worker {worker} serves no current version of plugin {namespace} (calling {name})"
            )));
        };
        version.functions.get(name).cloned().ok_or_else(|| {
            Error::runtime(format!(
                "unknown function {name} on worker {worker}: the current version of plugin \
                 {namespace} ({} {}, sha256 {}) does not serve it",
                version.plugin.name(),
                version.plugin.manifest().version,
                &hex(&version.sha256())[..SHORT]
            ))
        })
    }

    /// The scope of the current version of `namespace`, if it has one.
    pub(crate) fn current_scope(&self, namespace: &str) -> Option<String> {
        let groups = self.lock();
        let g = groups.get(namespace)?;
        g.current.and_then(|c| g.get(&c)).map(|v| v.scope.clone())
    }

    /// Each version's plugin and use counts.
    pub(crate) fn usages(&self) -> Vec<(Arc<Plugin>, Arc<Usage>)> {
        let groups = self.lock();
        groups
            .values()
            .flat_map(|g| &g.versions)
            .map(|v| (v.plugin.clone(), v.usage.clone()))
            .collect()
    }

    /// Every version this worker holds.
    pub(crate) fn list(&self) -> Vec<PluginVersion> {
        let groups = self.lock();
        let mut out = Vec::new();
        let mut namespaces: Vec<&String> = groups.keys().collect();
        namespaces.sort();
        for ns in namespaces {
            let g = &groups[ns];
            for v in &g.versions {
                let (in_flight, objects) = v.usage.counts();
                out.push(PluginVersion {
                    namespace: ns.clone(),
                    plugin: v.plugin.name().to_owned(),
                    version: v.plugin.manifest().version.clone(),
                    sha256: hex(&v.sha256()),
                    role: g.role(v).to_owned(),
                    in_flight: in_flight as u64,
                    objects: objects as u64,
                    deployed_by: v.deployed_by.clone(),
                    deployed_at: v
                        .deployed_at
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                });
            }
        }
        out
    }

    /// Drops the versions staged for longer than `stage_timeout` on
    /// `agent` (unless they are also previous, which stay held).
    pub(crate) fn expire_staged(agent: &RpcAgent) {
        let dropped = agent
            .state::<Versions>()
            .drop_staged(agent.options().plugin_stage_timeout);
        for (plugin, scope) in dropped {
            tracing::info!(
                "{}: dropped version {} of plugin {}: staged and never committed",
                agent.name(),
                &hex(&plugin.sha256())[..SHORT],
                plugin.name()
            );
            forget(agent, &plugin, &scope);
        }
    }

    fn drop_staged(&self, stage_timeout: Duration) -> Vec<(Arc<Plugin>, String)> {
        let mut groups = self.lock();
        let mut dropped = Vec::new();
        for g in groups.values_mut() {
            let (current, previous) = (g.current, g.previous);
            for v in &mut g.versions {
                if Some(v.sha256()) == previous
                    && v.staged.is_some_and(|t| t.elapsed() >= stage_timeout)
                {
                    v.staged = None;
                }
            }
            g.versions.retain(|v| {
                let expired = Some(v.sha256()) != current
                    && v.staged.is_some_and(|t| t.elapsed() >= stage_timeout);
                if expired {
                    dropped.push((v.plugin.clone(), v.scope.clone()));
                }
                !expired
            });
        }
        dropped
    }
}

/// The function a registered name of a versioned plugin stands for: the
/// current version's, looked up when the call starts.
pub(crate) struct CurrentFunction {
    pub(crate) namespace: String,
    pub(crate) name: String,
}

#[async_trait::async_trait]
impl RpcFunction for CurrentFunction {
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        let agent = ctx.agent();
        let f = agent.state::<Versions>().current_function(
            agent.name(),
            &self.namespace,
            &self.name,
        )?;
        f.call(ctx, args).await
    }
}

/// Makes `sha256` the current version of `namespace` on `agent` (it must be
/// held: staged, previous or draining); the previous current becomes
/// *previous*, every other version not staged drains. Returns the replaced
/// current version's sha256. The registry's names of the new version stand
/// for the group's current version from then on.
///
/// # Errors
/// A `RuntimeError` naming the worker, the plugin and the version when the
/// worker does not hold it.
pub(crate) fn commit(
    agent: &RpcAgent,
    namespace: &str,
    sha256: &[u8; 32],
) -> Result<Option<[u8; 32]>> {
    let versions = agent.state::<Versions>();
    let registry = agent.registry();
    let replaced;
    let draining;
    {
        let mut groups = versions.lock();
        let group = groups.get_mut(namespace);
        let Some(group) = group.filter(|g| g.get(sha256).is_some()) else {
            return Err(Error::runtime(format!(
                "worker {} holds no version {} of plugin {namespace} to make current (it was \
                 never staged here, or its stage expired or was aborted)",
                agent.name(),
                hex(sha256)
            )));
        };
        replaced = group.current;
        if replaced == Some(*sha256) {
            if let Some(v) = group.get_mut(sha256) {
                v.staged = None;
            }
            return Ok(replaced);
        }
        // The names first (harmless: they look the current version up),
        // then the switch itself, in one assignment.
        if let Some(v) = group.get(sha256) {
            for name in v.functions.keys() {
                registry.register(
                    name.clone(),
                    Arc::new(CurrentFunction {
                        namespace: namespace.to_owned(),
                        name: name.clone(),
                    }),
                );
            }
        }
        group.current = Some(*sha256);
        group.previous = replaced;
        let now = Instant::now();
        for v in &mut group.versions {
            let sha = v.sha256();
            if sha == *sha256 || Some(sha) == replaced {
                v.staged = None;
                v.draining = None;
            } else if v.staged.is_none() && v.draining.is_none() {
                v.draining = Some(now);
            }
        }
        draining = group.versions.iter().any(|v| v.draining.is_some());
    }
    if draining {
        spawn_drain(agent);
    }
    Ok(replaced)
}

/// Drops a staged version that is not current; returns whether it did.
pub(crate) fn abort(agent: &RpcAgent, namespace: &str, sha256: &[u8; 32]) -> bool {
    let versions = agent.state::<Versions>();
    let dropped = {
        let mut groups = versions.lock();
        let Some(group) = groups.get_mut(namespace) else {
            return false;
        };
        if group.current == Some(*sha256) {
            return false;
        }
        let i = group
            .versions
            .iter()
            .position(|v| &v.sha256() == sha256 && v.staged.is_some());
        let Some(i) = i else { return false };
        if group.previous == Some(*sha256) {
            // Held for rollback before it was staged again: it stays held.
            group.versions[i].staged = None;
            return true;
        }
        group.versions.remove(i)
    };
    forget(agent, &dropped.plugin, &dropped.scope);
    true
}

/// Forgets an unloaded version: its globals, and the runtime's copy.
fn forget(agent: &RpcAgent, plugin: &Arc<Plugin>, scope: &str) {
    agent.state::<super::state::Globals>().clear_scope(scope);
    if let Ok(host) = super::PluginHost::shared() {
        host.runtime().unload(plugin);
    }
}

/// Unloads draining versions as they become unused, or when the drain
/// timeout passes, on a task of its own (one per worker at a time).
fn spawn_drain(agent: &RpcAgent) {
    #[derive(Default)]
    struct Draining(std::sync::atomic::AtomicBool);
    let flag = agent.state::<Draining>();
    if flag.0.swap(true, Ordering::SeqCst) {
        return;
    }
    let agent = agent.clone();
    let timeout = agent.options().plugin_drain_timeout;
    drop(agent.runtime_handle().spawn(async move {
        loop {
            let (unloaded, left) = {
                let versions = agent.state::<Versions>();
                let mut groups = versions.lock();
                let mut unloaded = Vec::new();
                let mut left = false;
                for (ns, g) in groups.iter_mut() {
                    g.versions.retain(|v| {
                        let Some(since) = v.draining else {
                            return true;
                        };
                        let (calls, objects) = v.usage.counts();
                        let done = (calls == 0 && objects == 0) || since.elapsed() >= timeout;
                        if done {
                            tracing::info!(
                                "{}: unloaded version {} of plugin {ns} ({calls} calls, {objects} \
                                 objects still on it)",
                                agent.name(),
                                &hex(&v.sha256())[..SHORT]
                            );
                            unloaded.push((v.plugin.clone(), v.scope.clone()));
                        } else {
                            left = true;
                        }
                        !done
                    });
                }
                if !left {
                    agent.state::<Draining>().0.store(false, Ordering::SeqCst);
                }
                (unloaded, left)
            };
            for (plugin, scope) in unloaded {
                forget(&agent, &plugin, &scope);
            }
            if !left || !agent.is_running() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }));
}
