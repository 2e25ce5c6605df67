//! [`Plugin`]: a compiled, loaded plugin, its manifest, and its pool of
//! warm instances.

use crate::component::ComponentWarm;
use crate::instance::{CallCtx, CoreWarm, Fault, StoreData, release_locks};
use crate::runtime::Shared;
use crate::{Error, Folders, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use wasmrpc_abi::manifest::Manifest;
use wasmrpc_abi::protocol::{CallArgs, ExportKind, Outcome};

/// Where a plugin's compiled code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSource {
    /// Compiled from the wasm bytes by this load.
    Compiled,
    /// Read from the on-disk module cache.
    DiskCache,
}

/// An export the runtime can call.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) kind: ExportKind,
}

/// What a call runs in an instance.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target<'a> {
    /// A function (plain or async) by name.
    Function(&'a str),
    /// The constructor of a class.
    Constructor(&'a str),
    /// A method of an object.
    Method {
        /// The object's id in its instance.
        object: u32,
        /// Its class.
        class: &'a str,
        /// The method's name.
        method: &'a str,
    },
    /// The destructor of an object.
    Drop {
        /// The object's id in its instance.
        object: u32,
        /// Its class.
        class: &'a str,
    },
}

/// A plugin's compiled code, ready to instantiate: a core module (Rust
/// plugins, the `wasmrpc_abi::protocol` ABI) or a component (the WIT world
/// `guest-sdk/wit`, e.g. Python plugins).
pub(crate) enum Code {
    /// A core module.
    Core(wasmtime::InstancePre<StoreData>),
    /// A component.
    Component(wasmtime::component::InstancePre<StoreData>),
}

/// A live instance of either kind of code.
pub(crate) struct Warm {
    kind: WarmKind,
    /// The folders its WASI context preopens (FG-1): it serves only calls
    /// with the same folders.
    folders: Option<Arc<Folders>>,
    /// Counts the instance in its runtime's live instances while it lives.
    _live: LiveInstance,
}

enum WarmKind {
    /// Of a core module.
    Core(CoreWarm),
    /// Of a component.
    Component(ComponentWarm),
}

/// One of a runtime's live instances ([`Shared::live`]), until dropped.
struct LiveInstance(Arc<std::sync::atomic::AtomicUsize>);

impl LiveInstance {
    fn new(live: &Arc<std::sync::atomic::AtomicUsize>) -> LiveInstance {
        live.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        LiveInstance(live.clone())
    }
}

impl Drop for LiveInstance {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Warm {
    /// The component instance, if this is one.
    pub(crate) fn component(&mut self) -> Option<&mut ComponentWarm> {
        match &mut self.kind {
            WarmKind::Component(c) => Some(c),
            WarmKind::Core(_) => None,
        }
    }

    /// Runs `target` with `args` and returns its outcome; locks the call
    /// still holds are released when it ends.
    pub(crate) async fn invoke(
        &mut self,
        ctx: Arc<CallCtx>,
        target: Target<'_>,
        args: &CallArgs,
    ) -> std::result::Result<Outcome, Fault> {
        let (result, ctx) = match &mut self.kind {
            WarmKind::Core(w) => (w.invoke(ctx, target, args).await, w.take_ctx()),
            WarmKind::Component(w) => (w.invoke(ctx, target, args).await, w.take_ctx()),
        };
        release_locks(ctx).await;
        result
    }
}

/// A loaded plugin: shared by every call of its functions (`Arc<Plugin>`).
///
/// It keeps a small pool of warm instances; a call takes one (or makes a
/// new one when all are busy, so any number of calls run at once) and gives
/// it back when guest code returns. An instance that trapped is discarded.
pub struct Plugin {
    manifest: Manifest,
    sha256: [u8; 32],
    source: LoadSource,
    code: Code,
    entries: HashMap<String, Entry>,
    shared: Arc<Shared>,
    pool: Mutex<Vec<Warm>>,
    /// Told when an instance comes back (to a checkout waiting for a slot).
    returned: tokio::sync::Notify,
    /// How many instances came back so far: a waiting checkout's sign that
    /// the pool is moving.
    returns: std::sync::atomic::AtomicU64,
}

/// How long a call waits for an instance slot when the runtime's pool is
/// full and none of the plugin's busy instances comes back, before
/// failing.
pub const POOL_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.manifest.name)
            .field("version", &self.manifest.version)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Plugin {
    pub(crate) fn new(
        manifest: Manifest,
        sha256: [u8; 32],
        source: LoadSource,
        code: Code,
        entries: HashMap<String, Entry>,
        shared: Arc<Shared>,
    ) -> Plugin {
        Plugin {
            manifest,
            sha256,
            source,
            code,
            entries,
            shared,
            pool: Mutex::new(Vec::new()),
            returned: tokio::sync::Notify::new(),
            returns: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The manifest: name, version, and every export with its parameters.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The plugin's name (from its manifest).
    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    /// The sha256 of the module's bytes: its identity.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }

    /// Whether the plugin is a component (built against the WIT world, e.g.
    /// a Python plugin) rather than a core module.
    pub fn is_component(&self) -> bool {
        matches!(self.code, Code::Component(_))
    }

    /// Whether this load compiled the module or read the disk cache.
    pub fn source(&self) -> LoadSource {
        self.source
    }

    /// How many warm instances wait in the pool now.
    pub fn idle_instances(&self) -> usize {
        self.pool.lock().map(|p| p.len()).unwrap_or(0)
    }

    pub(crate) fn entry(&self, key: &str) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// A warm instance from the pool, or a new one. When every instance
    /// slot of the runtime is taken (a Python instance takes 13 to 16),
    /// drops the idle instances of every plugin of the runtime (but those
    /// of its own it could use, which it takes), then waits
    /// for a busy instance to come back for as long as the pool moves: it
    /// fails when none of the plugin's instances came back for
    /// [`POOL_WAIT`] (the waiters take turns in no order, so under a flood
    /// of calls one may wait longer than that while the others progress),
    /// and at once if no instance is live anywhere (the pool is too small
    /// for one).
    ///
    /// The instance is one made for `folders` (the calling worker's grants
    /// to this plugin): a component's WASI context preopens them, and
    /// Python's libc keeps what it found there, so an instance never moves
    /// between sets of folders (FG-1).
    pub(crate) async fn checkout(&self, folders: Option<Arc<Folders>>) -> Result<Warm> {
        let mut deadline = std::time::Instant::now() + POOL_WAIT;
        let mut returns = self.returns.load(std::sync::atomic::Ordering::Relaxed);
        let same = |w: &Warm| match (&w.folders, &folders) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        loop {
            let pooled = {
                let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
                pool.iter().rposition(same).map(|i| pool.swap_remove(i))
            };
            if let Some(warm) = pooled {
                return Ok(warm);
            }
            let e = match self.instantiate(folders.clone()).await {
                Ok(warm) => return Ok(warm),
                Err(e) => e,
            };
            let full = e
                .downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
                .is_some();
            // The asking plugin's instances that this checkout could use
            // are kept: one came back while it tried, and is taken next.
            if full
                && (self.shared.drop_idle_instances(self, &same) > 0
                    || self
                        .pool
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .iter()
                        .any(same))
            {
                continue;
            }
            let live = self.shared.live.load(std::sync::atomic::Ordering::Relaxed);
            if full && live == 0 {
                return Err(Error::Engine(format!(
                    "cannot instantiate plugin `{}`: one instance needs more slots than the \
                     runtime's whole pool has ({} instances): raise `max_instances` \
                     ({e:#})",
                    self.name(),
                    self.shared.config.max_instances
                )));
            }
            if !full || std::time::Instant::now() >= deadline {
                return Err(Error::Engine(format!(
                    "cannot instantiate plugin `{}`{}: {e:#}",
                    self.name(),
                    if full {
                        format!(
                            " ({live} instances held the runtime's pool for {} s)",
                            POOL_WAIT.as_secs()
                        )
                    } else {
                        String::new()
                    }
                )));
            }
            // Slots free when busy instances come back here or are dropped
            // anywhere in the runtime: wake on the first, poll for the
            // second.
            let back = self.returned.notified();
            let _ = tokio::time::timeout(std::time::Duration::from_millis(20), back).await;
            let now = self.returns.load(std::sync::atomic::Ordering::Relaxed);
            if now != returns {
                // The pool moves: only a pool stuck for POOL_WAIT fails.
                returns = now;
                deadline = std::time::Instant::now() + POOL_WAIT;
            }
        }
    }

    /// Drops the idle instances in the pool but those `keep` accepts;
    /// returns how many it dropped.
    pub(crate) fn drop_idle_unless(&self, keep: &dyn Fn(&Warm) -> bool) -> usize {
        let dropped: Vec<Warm> = {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            let (kept, dropped) = std::mem::take(&mut *pool)
                .into_iter()
                .partition(|w| keep(w));
            *pool = kept;
            dropped
        };
        dropped.len()
    }

    async fn instantiate(&self, folders: Option<Arc<Folders>>) -> wasmtime::Result<Warm> {
        let config = &self.shared.config;
        let (engine, memory, time) = (&self.shared.engine, config.max_memory, config.time_limit);
        let kind = match &self.code {
            Code::Core(pre) => WarmKind::Core(CoreWarm::new(engine, pre, memory, time).await?),
            Code::Component(pre) => WarmKind::Component(
                ComponentWarm::new(engine, pre, memory, time, folders.as_deref()).await?,
            ),
        };
        Ok(Warm {
            kind,
            folders,
            _live: LiveInstance::new(&self.shared.live),
        })
    }

    /// Returns a healthy instance to the pool (or drops it when the pool is
    /// full).
    pub(crate) fn checkin(&self, warm: Warm) {
        {
            let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
            if pool.len() < self.shared.config.idle_instances {
                pool.push(warm);
            }
        }
        self.returns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.returned.notify_one();
    }
}
