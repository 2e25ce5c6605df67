//! [`Runtime`] and its [`Config`]: the wasmtime engine (async, epoch
//! interruption, pooling allocator), the linker with the host imports, the
//! on-disk module cache, the loaded plugins, and the call entry points.

use crate::instance::{CallCtx, Fault, StoreData};
use crate::object::Object;
use crate::plugin::{Code, Entry, Plugin, Target, Warm};
use crate::{Error, GuestHost, Result, manifest};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wasmrpc_abi::protocol::{CallArgs, ExportKind, HandleKind, Outcome};
use wasmrpc_abi::{ErrorKind, RemoteError, Value};
use wasmtime::{Engine, Linker};

mod cache;
mod engine;
mod helper;
mod scratch;

pub use cache::set_memory_release;
pub use engine::PERF_MAP_VAR;
pub use helper::{
    CodeKind, CompileHelper, DEFAULT_HELPER_TIMEOUT, INVALID_WASM_EXIT, compile_entry, helper_main,
};

/// How the runtime runs guests. `Config::default()` suits a worker.
#[derive(Debug, Clone)]
pub struct Config {
    /// Folder of compiled modules, keyed by the sha256 of the wasm bytes;
    /// `None` compiles every load, into a scratch file in the temporary
    /// folder that is mapped and removed (CACHE-4), as does a folder that
    /// cannot be written.
    pub cache_dir: Option<PathBuf>,
    /// The most bytes of compiled modules `cache_dir` keeps: after writing
    /// an entry, the runtime removes the least recently used others until
    /// the entries fit (the one just written stays, whatever its size).
    /// `None` keeps every entry. A Python plugin's entry is about 35 MiB,
    /// and every version of every plugin a machine ever loaded has one.
    pub cache_max_bytes: Option<u64>,
    /// The most linear memory one instance may have, in bytes.
    pub max_memory: usize,
    /// The most time one call may spend running guest code (waiting on the
    /// host does not count); `None` for no limit.
    pub time_limit: Option<Duration>,
    /// Warm instances kept per plugin between calls.
    pub idle_instances: usize,
    /// Use wasmtime's pooling allocator (fast instantiation, memory
    /// reserved up front) instead of allocating on demand.
    pub pooling: bool,
    /// With `pooling`, the most instances alive at once in this runtime.
    pub max_instances: u32,
    /// How often the epoch advances: the granularity of the time limit and
    /// of a busy guest yielding its thread.
    pub epoch_tick: Duration,
    /// How to compile a plugin that has no cache entry: in a helper
    /// process that writes the entry (CACHE-3), so that what a compile
    /// leaves resident stays out of this process; `None` compiles in this
    /// process. Without a `cache_dir` it writes a scratch file (CACHE-4).
    /// Executables that can be their own helper set it ([`CompileHelper`]).
    pub compile_helper: Option<CompileHelper>,
}

/// [`Config::cache_max_bytes`]'s default: 2 GiB, some 55 versions of Python
/// plugins or hundreds of Rust ones.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 2 << 30;

impl Default for Config {
    fn default() -> Self {
        Config {
            cache_dir: None,
            cache_max_bytes: Some(DEFAULT_CACHE_MAX_BYTES),
            max_memory: 256 << 20,
            time_limit: Some(Duration::from_secs(60)),
            idle_instances: 16,
            pooling: true,
            max_instances: 128,
            epoch_tick: Duration::from_millis(2),
            compile_helper: None,
        }
    }
}

/// What every plugin of a runtime shares: the engine and the config.
pub(crate) struct Shared {
    pub(crate) engine: Engine,
    pub(crate) config: Config,
    /// Live instances of every plugin of the runtime, busy or idle: what
    /// holds the pooling allocator's slots.
    pub(crate) live: Arc<std::sync::atomic::AtomicUsize>,
    /// Every plugin loaded, whose idle instances a checkout that finds the
    /// pool full may drop to free their slots.
    pub(crate) plugins: Mutex<Vec<std::sync::Weak<Plugin>>>,
}

impl Shared {
    fn new(engine: Engine, config: Config) -> Shared {
        Shared {
            engine,
            config,
            live: Arc::default(),
            plugins: Mutex::new(Vec::new()),
        }
    }

    /// Drops the idle instances of every plugin but the instances of
    /// `asking` that its waiting checkout could use (`usable`): dropping
    /// those would only make it build a new one. Returns how many.
    pub(crate) fn drop_idle_instances(
        &self,
        asking: &Plugin,
        usable: &dyn Fn(&Warm) -> bool,
    ) -> usize {
        let plugins: Vec<Arc<Plugin>> = {
            let mut all = self.plugins.lock().unwrap_or_else(|p| p.into_inner());
            all.retain(|p| p.strong_count() > 0);
            all.iter().filter_map(std::sync::Weak::upgrade).collect()
        };
        plugins
            .iter()
            .map(|p| {
                if std::ptr::eq(Arc::as_ptr(p), asking) {
                    p.drop_idle_unless(usable)
                } else {
                    p.drop_idle_unless(&|_| false)
                }
            })
            .sum()
    }
}

struct Inner {
    shared: Arc<Shared>,
    linker: Linker<StoreData>,
    /// The linker of component plugins (WASI granting nothing, the
    /// world's host interface).
    component_linker: wasmtime::component::Linker<StoreData>,
    /// Loaded plugins by name: one version, unless versions were loaded
    /// side by side ([`Runtime::load_version`]), oldest first.
    plugins: Mutex<HashMap<String, Vec<Arc<Plugin>>>>,
    stop_ticker: Arc<AtomicBool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop_ticker.store(true, Ordering::Relaxed);
    }
}

/// The wasm runtime of one worker: loads plugins and runs their functions
/// and objects. Cheap to clone (an `Arc`); share it across tasks.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("config", &self.inner.shared.config)
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// A runtime with its own engine and epoch ticker thread.
    ///
    /// # Errors
    /// [`Error::Engine`] if wasmtime rejects the configuration (e.g. the
    /// pooling allocator cannot reserve its memory), or if [`PERF_MAP_VAR`]
    /// holds something other than `0` or `1`.
    pub fn new(config: Config) -> Result<Runtime> {
        let engine =
            Engine::new(&engine::config(&config)?).map_err(|e| Error::Engine(format!("{e:#}")))?;
        let mut linker = Linker::new(&engine);
        crate::imports::define(&mut linker).map_err(|e| Error::Engine(format!("{e:#}")))?;
        let component_linker =
            crate::component::linker(&engine).map_err(|e| Error::Engine(format!("{e:#}")))?;

        let stop_ticker = Arc::new(AtomicBool::new(false));
        let (stop, ticking, tick) = (stop_ticker.clone(), engine.clone(), config.epoch_tick);
        std::thread::Builder::new()
            .name("wasmrpc-epoch".to_owned())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    ticking.increment_epoch();
                }
            })
            .map_err(|e| Error::Engine(format!("cannot start the epoch thread: {e}")))?;

        Ok(Runtime {
            inner: Arc::new(Inner {
                shared: Arc::new(Shared::new(engine, config)),
                linker,
                component_linker,
                plugins: Mutex::new(HashMap::new()),
                stop_ticker,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.shared.config
    }

    fn plugins(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Arc<Plugin>>>> {
        self.inner.plugins.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Loads a plugin from its wasm bytes: reads the manifest, compiles the
    /// module (or takes it from the disk cache) and registers it under its
    /// manifest name. Loading the same bytes again returns the same plugin.
    ///
    /// Compiling takes tens of milliseconds: call it from a blocking
    /// context (`tokio::task::spawn_blocking`) on a busy worker.
    ///
    /// # Errors
    /// [`Error::InvalidModule`] for bytes that are not a plugin built with
    /// the guest SDK (bad wasm, no manifest, another protocol version,
    /// exports missing), [`Error::DuplicatePlugin`] if another module of the
    /// same name is loaded.
    pub fn load(&self, bytes: &[u8]) -> Result<Arc<Plugin>> {
        self.load_inner(bytes, false)
    }

    /// [`load`](Runtime::load), but another version of a plugin of the same
    /// name (other bytes) may already be loaded: the two are held side by
    /// side, each with its own code, pool and instances (what a worker
    /// upgrading a plugin while it serves needs). Loading the same bytes
    /// again returns the same plugin.
    ///
    /// # Errors
    /// As [`load`](Runtime::load), never [`Error::DuplicatePlugin`].
    pub fn load_version(&self, bytes: &[u8]) -> Result<Arc<Plugin>> {
        self.load_inner(bytes, true)
    }

    /// Forgets `plugin` (one version of its name): later loads of its bytes
    /// compile or read the disk cache again. Calls and objects that hold it
    /// keep it alive until they end. Returns whether it was loaded.
    pub fn unload(&self, plugin: &Arc<Plugin>) -> bool {
        let mut plugins = self.plugins();
        let Some(versions) = plugins.get_mut(plugin.name()) else {
            return false;
        };
        let before = versions.len();
        versions.retain(|p| !Arc::ptr_eq(p, plugin));
        let removed = versions.len() < before;
        if versions.is_empty() {
            plugins.remove(plugin.name());
        }
        removed
    }

    fn load_inner(&self, bytes: &[u8], side_by_side: bool) -> Result<Arc<Plugin>> {
        let manifest = manifest::read(bytes)?;
        if !manifest.abi_matches() {
            return Err(Error::InvalidModule(format!(
                "plugin `{}` uses protocol version {}, this host speaks {}",
                manifest.name,
                manifest.abi,
                wasmrpc_abi::protocol::ABI_VERSION
            )));
        }
        let sha256: [u8; 32] = Sha256::digest(bytes).into();
        if let Some(versions) = self.plugins().get(&manifest.name) {
            if let Some(same) = versions.iter().find(|p| p.sha256() == sha256) {
                return Ok(same.clone());
            }
            if !side_by_side && !versions.is_empty() {
                return Err(Error::DuplicatePlugin(manifest.name));
            }
        }
        let mut entries = HashMap::new();
        for e in &manifest.exports {
            let key = match e.kind {
                ExportKind::Function | ExportKind::AsyncFunction => e.name.clone(),
                ExportKind::Constructor => format!("new:{}", e.name),
                ExportKind::Method | ExportKind::AsyncMethod => {
                    format!("method:{}.{}", e.class.as_deref().unwrap_or(""), e.name)
                }
            };
            entries.insert(key, Entry { kind: e.kind });
        }
        let shared = self.inner.shared.clone();
        let plugin = if crate::component::is_component(bytes) {
            let (component, source) = self.compile_component(bytes, &sha256, &manifest.name)?;
            let pre = self
                .inner
                .component_linker
                .instantiate_pre(&component)
                .map_err(|e| Error::InvalidModule(format!("{e:#}")))?;
            let plugin = Arc::new(Plugin::new(
                manifest,
                sha256,
                source,
                Code::Component(pre),
                entries,
                shared,
            ));
            check_described(&plugin)?;
            plugin
        } else {
            let (module, source) = self.compile(bytes, &sha256, &manifest.name)?;
            for e in &plugin_exports(&manifest) {
                if module.get_export(e).is_none() {
                    return Err(Error::InvalidModule(format!(
                        "the manifest lists `{e}` but the module does not export it"
                    )));
                }
            }
            let pre = self
                .inner
                .linker
                .instantiate_pre(&module)
                .map_err(|e| Error::InvalidModule(format!("{e:#}")))?;
            Arc::new(Plugin::new(
                manifest,
                sha256,
                source,
                Code::Core(pre),
                entries,
                shared,
            ))
        };
        self.inner
            .shared
            .plugins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&plugin));
        let mut plugins = self.plugins();
        let versions = plugins.entry(plugin.name().to_owned()).or_default();
        // Two loads of the same bytes may have compiled at once: the first
        // registered wins.
        if let Some(same) = versions.iter().find(|p| p.sha256() == sha256) {
            return Ok(same.clone());
        }
        if !side_by_side && !versions.is_empty() {
            return Err(Error::DuplicatePlugin(plugin.name().to_owned()));
        }
        versions.push(plugin.clone());
        Ok(plugin)
    }

    /// Loads the plugin in a `.wasm` file.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read, else as [`Runtime::load`].
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<Arc<Plugin>> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })?;
        self.load(&bytes)
    }

    /// Loads every `*.wasm` file in `dir`, in name order.
    ///
    /// # Errors
    /// The first file that fails to read or load.
    pub fn load_dir(&self, dir: impl AsRef<Path>) -> Result<Vec<Arc<Plugin>>> {
        let dir = dir.as_ref();
        let io = |source| Error::Io {
            context: format!("listing {}", dir.display()),
            source,
        };
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "wasm") && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        files.iter().map(|f| self.load_file(f)).collect()
    }

    /// The loaded plugin named `name` (the first loaded of its versions).
    pub fn plugin(&self, name: &str) -> Option<Arc<Plugin>> {
        self.plugins().get(name).and_then(|v| v.first()).cloned()
    }

    /// Every loaded plugin, every version.
    pub fn loaded(&self) -> Vec<Arc<Plugin>> {
        self.plugins().values().flatten().cloned().collect()
    }

    /// Calls the plugin function `function` (plain or `async_execution`)
    /// and returns its result. The call runs on a warm pooled instance that
    /// it holds only while guest code runs; an async function's future is
    /// awaited after the instance went back to the pool.
    ///
    /// Handles in `args` become the guest's; handles in the result are the
    /// caller's (see [`GuestHost`]).
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown function; [`Error::Raised`] with
    /// the guest's own kind and message; [`Error::Trap`],
    /// [`Error::Timeout`], [`Error::MemoryLimit`] or [`Error::Abi`] when the
    /// guest misbehaves (the instance is then discarded).
    pub async fn call(
        &self,
        plugin: &Arc<Plugin>,
        function: &str,
        args: CallArgs,
        host: Arc<dyn GuestHost>,
    ) -> Result<Value> {
        let entry = plugin
            .entry(function)
            .filter(|e| matches!(e.kind, ExportKind::Function | ExportKind::AsyncFunction));
        let Some(entry) = entry else {
            return Err(Error::NotFound {
                plugin: plugin.name().to_owned(),
                what: "function",
                name: function.to_owned(),
            });
        };
        let kind = entry.kind;
        let mut warm = plugin.checkout(host.folders()).await?;
        let ctx = CallCtx::new(host.clone(), plugin.clone(), self.clone());
        let outcome = warm.invoke(ctx, Target::Function(function), &args).await;
        match outcome {
            Ok(outcome) => {
                plugin.checkin(warm);
                let is_async = kind == ExportKind::AsyncFunction;
                finish(plugin.name(), function, is_async, outcome, &host).await
            }
            Err(fault) => Err(fault.into_error(plugin.name(), function)),
        }
    }

    /// Constructs an object of `class`: runs its constructor on an instance
    /// that then belongs to the object alone.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown class; the constructor's errors as
    /// for [`Runtime::call`].
    pub async fn construct(
        &self,
        plugin: &Arc<Plugin>,
        class: &str,
        args: CallArgs,
        host: Arc<dyn GuestHost>,
    ) -> Result<Object> {
        if plugin.entry(&format!("new:{class}")).is_none() {
            return Err(Error::NotFound {
                plugin: plugin.name().to_owned(),
                what: "class",
                name: class.to_owned(),
            });
        };
        let mut warm = plugin.checkout(host.folders()).await?;
        let ctx = CallCtx::new(host.clone(), plugin.clone(), self.clone());
        match warm.invoke(ctx, Target::Constructor(class), &args).await {
            Ok(Outcome::Object(id)) => {
                Ok(Object::new(self.clone(), plugin.clone(), class, id, warm))
            }
            Ok(Outcome::Raise(error)) => {
                // The instance is sound: only the constructor raised.
                plugin.checkin(warm);
                Err(Error::Raised {
                    plugin: plugin.name().to_owned(),
                    function: class.to_owned(),
                    error,
                })
            }
            Ok(other) => Err(Error::Abi {
                plugin: plugin.name().to_owned(),
                function: class.to_owned(),
                message: format!("a constructor returned {other:?}"),
            }),
            Err(fault) => Err(fault.into_error(plugin.name(), class)),
        }
    }
}

/// The core-module export names a manifest lists.
fn plugin_exports(manifest: &manifest::Manifest) -> Vec<String> {
    manifest
        .exports
        .iter()
        .map(|e| wasmrpc_abi::protocol::export_name(e.kind, e.class.as_deref(), &e.name))
        .collect()
}

/// The exports a component plugin describes itself with, from a new
/// instance that then joins the pool.
async fn describe(plugin: &Arc<Plugin>) -> Result<Vec<manifest::Export>> {
    let mut warm = plugin.checkout(None).await?;
    let Some(component) = warm.component() else {
        return Err(Error::Engine(
            "a component plugin made a core instance".into(),
        ));
    };
    let exports = component
        .describe()
        .await
        .map_err(|fault| fault.into_error(plugin.name(), "describe"))?;
    plugin.checkin(warm);
    Ok(exports)
}

/// Instantiates a component plugin once, checks that the manifest of its
/// section is what the component describes itself as (so a section cannot
/// promise exports the code lacks), and keeps the instance in the pool.
fn check_described(plugin: &Arc<Plugin>) -> Result<()> {
    // On a thread of its own with its own runtime: `load` is synchronous
    // and may be called from inside a tokio runtime.
    let described = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| {
                        Error::Engine(format!("cannot start a runtime to load a component: {e}"))
                    })?
                    .block_on(describe(plugin))
            })
            .join()
            .unwrap_or_else(|_| Err(Error::Engine("loading a component panicked".into())))
    })?;
    let mut listed = plugin.manifest().exports.clone();
    let mut described = described;
    let key = |e: &manifest::Export| (e.class.clone(), e.name.clone());
    listed.sort_by_key(key);
    described.sort_by_key(key);
    if listed != described {
        return Err(Error::InvalidModule(format!(
            "the manifest of component `{}` lists {} exports that differ from the {} it \
             describes itself with: rebuild it",
            plugin.name(),
            listed.len(),
            described.len()
        )));
    }
    Ok(())
}

/// Turns an outcome into the call's result, awaiting an async function's
/// future.
pub(crate) async fn finish(
    plugin: &str,
    function: &str,
    is_async: bool,
    outcome: Outcome,
    host: &Arc<dyn GuestHost>,
) -> Result<Value> {
    let raised = |error: RemoteError| Error::Raised {
        plugin: plugin.to_owned(),
        function: function.to_owned(),
        error,
    };
    match (outcome, is_async) {
        (Outcome::Return(v), false) => Ok(v),
        (Outcome::Raise(e), _) => Err(raised(e)),
        (Outcome::Future(f), true) => {
            let result = host.future_wait(f).await;
            let _ = host.drop_handle(HandleKind::Future, f).await;
            result.map_err(raised)
        }
        (Outcome::Return(v), true) => {
            crate::imports::release(host, &v).await;
            Err(raised(RemoteError::new(
                ErrorKind::RuntimeError,
                format!(
                    "{} but got {}",
                    crate::error::ASYNC_WRONG_TYPE,
                    v.type_name()
                ),
            )))
        }
        (other, _) => {
            Err(Fault::Abi(format!("unexpected outcome {other:?}")).into_error(plugin, function))
        }
    }
}
