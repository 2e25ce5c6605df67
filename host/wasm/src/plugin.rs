//! [`Plugin`]: a compiled, loaded plugin, its manifest, and its pool of
//! warm instances.

use crate::instance::Warm;
use crate::runtime::Shared;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use wasmrpc_abi::manifest::Manifest;
use wasmrpc_abi::protocol::ExportKind;
use wasmtime::InstancePre;

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
    pub(crate) export: String,
    pub(crate) kind: ExportKind,
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
    pre: InstancePre<crate::instance::StoreData>,
    entries: HashMap<String, Entry>,
    shared: Arc<Shared>,
    pool: Mutex<Vec<Warm>>,
}

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
        pre: InstancePre<crate::instance::StoreData>,
        entries: HashMap<String, Entry>,
        shared: Arc<Shared>,
    ) -> Plugin {
        Plugin {
            manifest,
            sha256,
            source,
            pre,
            entries,
            shared,
            pool: Mutex::new(Vec::new()),
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

    /// A warm instance from the pool, or a new one.
    pub(crate) async fn checkout(&self) -> Result<Warm> {
        let pooled = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        if let Some(warm) = pooled {
            return Ok(warm);
        }
        let config = &self.shared.config;
        Warm::new(
            &self.shared.engine,
            &self.pre,
            config.max_memory,
            config.time_limit,
        )
        .await
        .map_err(|e| Error::Engine(format!("cannot instantiate plugin `{}`: {e}", self.name())))
    }

    /// Returns a healthy instance to the pool (or drops it when the pool is
    /// full).
    pub(crate) fn checkin(&self, warm: Warm) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < self.shared.config.idle_instances {
            pool.push(warm);
        }
    }
}
