//! Plugins on the agent: loading wasm plugins into a worker's
//! [`FunctionRegistry`], and the worker's side of every request their guests
//! make.
//!
//! What this module owns:
//! - [`PluginHost`]: a wasm [`Runtime`](crate::wasm::Runtime) (one per
//!   process is enough, [`PluginHost::shared`]; its agents share it) and
//!   the registration of each loaded plugin's exports
//!   ([`PluginHost::register`]): functions as `namespace::function`
//!   ([`plugin_namespace`]), so a peer calls `rpc_sync("worker1",
//!   "seed_fns::my_function", ...)`; static and class methods as
//!   `namespace::Class.method`; classes as `namespace::Class`;
//! - plugin classes (`class`): `remote(dst, "seed_fns::MyClass", args)`
//!   constructs an object on `dst`, which the owner's RRef holds as an
//!   [`RRefObject`](crate::rref) (objects are never copied: `to_here`,
//!   `local_value` and `rpc_sync` of a class answer `TypeError`); proxies
//!   (`rref.rpc_sync().method(...)`) run its methods there, one at a time,
//!   and static and class methods through it as functions; the object is
//!   disposed of (its guest destructor runs) when the owner forgets it;
//! - the host functions of a guest (`host_functions`: `GuestCall`, a
//!   [`GuestHost`](crate::wasm::GuestHost))
//!   of one function call, or of one object for its whole life: a handle
//!   table for its tensors, RRefs and futures, tensor ops through
//!   `wasmrpc-torch-sys` (off the async threads, as builtin RPCs run, see
//!   [`crate::ops`]), nested `rpc_sync`/`rpc_async`/`remote` through the
//!   agent, RRefs (`to_here`, `RRef(v)`, owner info, proxies), worker info,
//!   per-worker globals and locks (in
//!   [`RpcAgent::state`](crate::RpcAgent::state), scoped by plugin), sleep
//!   and log.
//!
//! What it leaves to others: compiling, pooling and running instances,
//! objects' instances and their one-at-a-time calls, time and memory
//! limits, `then` callbacks and async functions' futures are the runtime's
//! (`wasmrpc-wasm`); the network and futures are the agent's; RRefs, their
//! protocol and where an object is kept are the RRef module's
//! ([`crate::rref`]); ops and their schema matching are
//! `wasmrpc-torch-sys`'s.
//!
//! Each registered plugin carries a grant (`grant`): what it may do on the
//! worker beyond the sandbox. A plugin the operator loads may run every op
//! the worker's op policy serves and call any function; a deployed one is
//! held to the op families and its own functions and builtin ops, plus
//! what its manifest declares ([`PluginTrust`]).
//!
//! Invariants:
//! - PL-1: a guest never sees a handle it does not own: every tensor in a
//!   call's arguments and in every reply is a new handle, released when the
//!   call (and every `then` callback it chained) is over, unless the guest
//!   returned it; an object's handles are released when it is disposed of.
//! - PL-2: a plugin's error reaches the caller with the guest's kind and
//!   message unchanged; a trap, a time or memory limit is a `RuntimeError`
//!   (`TimeoutError` for time) naming the plugin and the function, and the
//!   worker keeps serving.
//! - PL-3: per-worker locks a call still holds when it ends (an object:
//!   when it is disposed of) are released.

mod class;
pub(crate) mod deploy;
mod function;
mod grant;
mod handles;
mod host_functions;
mod module;
mod state;
mod stats;
pub(crate) mod versions;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use wasmrpc_wasm::manifest::ExportKind;
use wasmrpc_wasm::{Config, Plugin, Runtime};

use crate::agent::FunctionRegistry;
use crate::error::{Error, Result};
use class::PluginClass;
pub use deploy::{
    DEPLOY_PLUGIN, Deploy, DeployPlugin, DeployReport, PLUGIN_SWITCH, PluginSwitch,
    WorkerDeployment,
};
use function::{PluginFunction, wasm_error};
use grant::PluginGrant;
pub use grant::PluginTrust;
pub use versions::{MIN_PREFIX, PluginVersion};

/// The environment variable that overrides where compiled plugins are
/// cached on disk ([`PluginHost::default_config`]).
pub const CACHE_DIR_ENV: &str = "WASMRPC_CACHE_DIR";

/// The environment variable that caps, in MiB, what the disk cache of
/// compiled plugins keeps (`unlimited` for no cap; default 2048): past it,
/// the least recently used entries are removed
/// ([`wasmrpc_wasm::Config::cache_max_bytes`]).
pub const CACHE_MAX_ENV: &str = "WASMRPC_CACHE_MAX_MIB";

/// [`CACHE_MAX_ENV`]'s value as a cap in bytes (`None`: no cap).
fn parse_cache_max(value: &str) -> Result<Option<u64>> {
    let value = value.trim();
    if value == "unlimited" {
        return Ok(None);
    }
    match value.parse::<u64>() {
        Ok(mib) if mib > 0 => mib.checked_mul(1 << 20).map(Some).ok_or_else(|| {
            Error::value(format!(
                "{CACHE_MAX_ENV}={value}: more MiB than a disk holds"
            ))
        }),
        _ => Err(Error::value(format!(
            "{CACHE_MAX_ENV}={value:?}: expected a whole number of MiB above 0 (e.g. 4096), \
             or `unlimited`"
        ))),
    }
}

/// The hidden subcommand of an executable that can be its own compile
/// helper ([`serve_as_compile_helper`]): `wasmrpc compile-plugin-entry
/// --kind module|component --out PATH`, the wasm bytes on standard input.
pub const COMPILE_HELPER_SUBCOMMAND: &str = "compile-plugin-entry";

static COMPILE_HELPER: OnceLock<wasmrpc_wasm::CompileHelper> = OnceLock::new();

/// Makes this executable its own compile helper (CACHE-3): plugins that
/// [`PluginHost::default_config`]'s runtimes find missing from the module
/// cache are compiled by this executable run with
/// [`COMPILE_HELPER_SUBCOMMAND`], which must call
/// [`wasmrpc_wasm::helper_main`]. A worker that compiled its plugins then
/// holds no more memory than one that found them cached. Call it first
/// thing in `main`; a path to this executable that cannot be read leaves
/// compiles in process.
pub fn serve_as_compile_helper() {
    match std::env::current_exe() {
        Ok(program) => {
            let _ = COMPILE_HELPER.set(wasmrpc_wasm::CompileHelper {
                program,
                args: vec![COMPILE_HELPER_SUBCOMMAND.into()],
                timeout: wasmrpc_wasm::DEFAULT_HELPER_TIMEOUT,
            });
        }
        Err(e) => tracing::debug!("plugins compile in process: no path to this executable: {e}"),
    }
}

/// The prefix plugin packages conventionally carry, left out of their
/// namespace ([`plugin_namespace`]).
pub const PACKAGE_PREFIX: &str = "wasmrpc-plugin-";

/// The namespace a plugin's functions are registered under, from its
/// manifest name (its Cargo package name): without [`PACKAGE_PREFIX`], with
/// `-` turned into `_`. `wasmrpc-plugin-seed-fns` → `seed_fns`,
/// `my-plugin` → `my_plugin`.
pub fn plugin_namespace(manifest_name: &str) -> String {
    manifest_name
        .strip_prefix(PACKAGE_PREFIX)
        .unwrap_or(manifest_name)
        .replace('-', "_")
}

/// The per-worker global `key` that the plugin `namespace` set on `agent`
/// (`set_global` in the guest SDKs, a Python module-level variable in the
/// seeds), or `None` if unset: the current version's, when the worker holds
/// several versions of the plugin (each has its own globals). Tensors in it are the worker's own, by
/// reference: autograd and gradient maps see the same tensors the plugin's
/// calls use.
pub fn plugin_global(
    agent: &crate::RpcAgent,
    namespace: &str,
    key: &str,
) -> Option<crate::value::Payload> {
    let scope = agent
        .state::<versions::Versions>()
        .current_scope(namespace)
        .unwrap_or_else(|| namespace.to_owned());
    agent.state::<state::Globals>().get(&scope, key)
}

/// Where one registered version of a plugin keeps its state and counts its
/// use (`versions`).
#[derive(Clone, Debug)]
pub(crate) struct VersionScope {
    /// The scope of its globals, locks and named futures.
    pub(crate) state: String,
    /// What its calls name its own functions by (`hello@<sha>` for a
    /// deployed version: a call chain stays on the version it started on),
    /// else the namespace.
    pub(crate) calls: String,
    /// Its calls in flight and objects alive.
    pub(crate) usage: Arc<versions::Usage>,
}

impl VersionScope {
    /// A plugin registered outside the version table: its namespace.
    pub(crate) fn unversioned(namespace: &str) -> VersionScope {
        VersionScope {
            state: namespace.to_owned(),
            calls: namespace.to_owned(),
            usage: Arc::default(),
        }
    }
}

/// Loads wasm plugins and registers their functions in agents' registries.
///
/// Cheap to clone (a [`Runtime`] is an `Arc`). One per process is enough:
/// a plugin loaded once serves every agent it is registered in, each call
/// with its own handles and each agent with its own globals.
///
/// ```no_run
/// use wasmrpc::{FunctionRegistry, PluginHost};
///
/// # fn main() -> wasmrpc::Result<()> {
/// let plugins = PluginHost::shared()?;
/// let registry = FunctionRegistry::new();
/// let names = plugins.install("plugins/", &registry)?;
/// assert!(names.iter().any(|n| n == "seed_fns::my_function"));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PluginHost {
    runtime: Runtime,
}

fn io_error(path: &Path, e: &std::io::Error) -> Error {
    Error::runtime(format!("cannot read {}: {e}", path.display()))
}

impl PluginHost {
    /// A host with its own wasm runtime.
    ///
    /// # Errors
    /// `RuntimeError` if wasmtime rejects `config` (e.g. the pooling
    /// allocator cannot reserve its memory).
    pub fn new(config: Config) -> Result<PluginHost> {
        let runtime = Runtime::new(config)
            .map_err(|e| wasm_error(&e).context_line("starting the wasm runtime"))?;
        Ok(PluginHost { runtime })
    }

    /// The process-wide host, made with [`default_config`](Self::default_config)
    /// on first use.
    ///
    /// # Errors
    /// As [`new`](Self::new), on every call if the first failed.
    pub fn shared() -> Result<PluginHost> {
        static SHARED: OnceLock<std::result::Result<PluginHost, Error>> = OnceLock::new();
        SHARED
            .get_or_init(|| PluginHost::new(Self::default_config()?))
            .clone()
    }

    /// The runtime's defaults, compiling in this executable as a helper
    /// process where it serves as one ([`serve_as_compile_helper`]), with
    /// compiled modules cached on disk in
    /// `$WASMRPC_CACHE_DIR`, else `$XDG_CACHE_HOME/wasmrpc/modules`, else
    /// `~/.cache/wasmrpc/modules` (an empty variable counts as unset;
    /// with none set, or a folder that cannot be written, plugins compile
    /// into scratch files removed once mapped, CACHE-4), kept within
    /// `$WASMRPC_CACHE_MAX_MIB` MiB ([`CACHE_MAX_ENV`]), and room for 512
    /// live instances (the
    /// runtime's pool is shared by every agent of the process, and a call
    /// waiting on a nested RPC keeps its instance).
    ///
    /// # Errors
    /// `ValueError` naming [`CACHE_MAX_ENV`] if it is set to anything but
    /// a whole number of MiB or `unlimited`.
    pub fn default_config() -> Result<Config> {
        // An empty variable is an unset one, not the current folder.
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let cache_dir = var(CACHE_DIR_ENV)
            .map(PathBuf::from)
            .or_else(|| {
                var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("wasmrpc").join("modules"))
            })
            .or_else(|| {
                var("HOME").map(|h| {
                    PathBuf::from(h)
                        .join(".cache")
                        .join("wasmrpc")
                        .join("modules")
                })
            });
        let cache_max_bytes = match std::env::var_os(CACHE_MAX_ENV) {
            None => Some(wasmrpc_wasm::DEFAULT_CACHE_MAX_BYTES),
            Some(value) => parse_cache_max(&value.to_string_lossy())?,
        };
        Ok(Config {
            cache_dir,
            cache_max_bytes,
            max_instances: 512,
            compile_helper: COMPILE_HELPER.get().cloned(),
            ..Config::default()
        })
    }

    /// The wasm runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Loads a plugin from its wasm bytes (or returns the same bytes'
    /// plugin, already loaded). Compiles unless the disk cache has it: call
    /// it from a blocking context on a busy worker.
    ///
    /// # Errors
    /// `RuntimeError` for bytes that are not a plugin built with the guest
    /// SDK, or a different plugin of the same name already loaded.
    pub fn load(&self, bytes: &[u8]) -> Result<Arc<Plugin>> {
        self.runtime
            .load(bytes)
            .map_err(|e| wasm_error(&e).context_line("loading a plugin"))
    }

    /// [`load`](Self::load), but another version of the plugin (other
    /// bytes, same name) may be loaded already: the two are held side by
    /// side (what deploying an upgrade needs).
    ///
    /// # Errors
    /// As [`load`](Self::load), never for another version.
    pub fn load_version(&self, bytes: &[u8]) -> Result<Arc<Plugin>> {
        self.runtime
            .load_version(bytes)
            .map_err(|e| wasm_error(&e).context_line("loading a plugin"))
    }

    /// Loads the plugin in a `.wasm` file.
    ///
    /// # Errors
    /// As [`load`](Self::load), or if the file cannot be read.
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<Arc<Plugin>> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| io_error(path, &e))?;
        self.runtime
            .load(&bytes)
            .map_err(|e| wasm_error(&e).context_line(format!("loading {}", path.display())))
    }

    /// Loads a `.wasm` file, or every `*.wasm` file of a folder (in name
    /// order).
    ///
    /// # Errors
    /// The first file that cannot be read or loaded; a folder without
    /// plugins.
    pub fn load_path(&self, path: impl AsRef<Path>) -> Result<Vec<Arc<Plugin>>> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| io_error(path, &e))?;
        if !meta.is_dir() {
            return Ok(vec![self.load_file(path)?]);
        }
        let mut files = Vec::new();
        for entry in std::fs::read_dir(path).map_err(|e| io_error(path, &e))? {
            let file = entry.map_err(|e| io_error(path, &e))?.path();
            if file.extension().is_some_and(|x| x == "wasm") && file.is_file() {
                files.push(file);
            }
        }
        if files.is_empty() {
            return Err(Error::value(format!(
                "no plugins (*.wasm files) in {}",
                path.display()
            )));
        }
        files.sort();
        files.iter().map(|f| self.load_file(f)).collect()
    }

    /// Loads every plugin under `path` (a `*.wasm` file or a folder of
    /// them, as [`load_path`](Self::load_path)) off the async threads, since
    /// compiling takes seconds, and registers each as
    /// [`register`](Self::register) does: what `wasmrpc worker --plugins`
    /// and a Python program's `plugins=` option do. Returns each plugin
    /// with the names it registered.
    ///
    /// # Errors
    /// As [`load_path`](Self::load_path).
    pub async fn load_and_register(
        &self,
        path: &Path,
        registry: &FunctionRegistry,
    ) -> Result<Vec<(Arc<Plugin>, Vec<String>)>> {
        let (host, owned) = (self.clone(), path.to_path_buf());
        let plugins = tokio::task::spawn_blocking(move || host.load_path(&owned))
            .await
            .map_err(|e| Error::runtime(format!("the plugin loader stopped: {e}")))??;
        Ok(plugins
            .into_iter()
            .map(|plugin| {
                let names = self.register(&plugin, registry);
                (plugin, names)
            })
            .collect())
    }

    /// Registers every function and class of `plugin` in `registry`,
    /// replacing entries of the same names, and returns the names:
    ///
    /// - functions (plain and `async_execution`) as `namespace::function`
    ///   ([`plugin_namespace`]);
    /// - static and class methods (exported as functions `Class.method`) as
    ///   `namespace::Class.method`, e.g.
    ///   `seed_fns::AsyncExecutionClass.static_async_add`;
    /// - classes as `namespace::Class`: `remote(dst, "seed_fns::MyClass",
    ///   args)` constructs an object on `dst` held by the RRef, whose
    ///   methods the RRef's proxies call (`rpc_sync`/`rpc_async` of a class
    ///   answer `TypeError`: objects stay on their owner).
    ///
    /// The plugin gets the rights of one its operator loaded
    /// ([`PluginTrust::Operator`]); see [`register_with`](Self::register_with).
    pub fn register(&self, plugin: &Arc<Plugin>, registry: &FunctionRegistry) -> Vec<String> {
        let namespace = plugin_namespace(plugin.name());
        self.register_granted(
            plugin,
            registry,
            PluginGrant::operator(&namespace),
            &VersionScope::unversioned(&namespace),
        )
    }

    /// [`register`](Self::register) with the rights `trust` gives
    /// (`grant`'s module docs): [`PluginTrust::Operator`], the worker's
    /// whole op policy and any function; [`PluginTrust::Deployed`] (what
    /// deployment uses), the op families and calls to its own functions
    /// and builtin ops, plus what its manifest declares
    /// (`wasmrpc_host_functions::permissions!`), never beyond the worker's op
    /// policy.
    ///
    /// # Errors
    /// `ValueError` if the manifest declares an op pattern that is not one
    /// (nothing is registered then).
    pub fn register_with(
        &self,
        plugin: &Arc<Plugin>,
        registry: &FunctionRegistry,
        trust: PluginTrust,
    ) -> Result<Vec<String>> {
        let namespace = plugin_namespace(plugin.name());
        let grant = match trust {
            PluginTrust::Operator => PluginGrant::operator(&namespace),
            PluginTrust::Deployed => PluginGrant::deployed(&namespace, plugin.manifest())?,
        };
        Ok(self.register_granted(
            plugin,
            registry,
            grant,
            &VersionScope::unversioned(&namespace),
        ))
    }

    /// A version of `plugin` for a worker's version table: its functions
    /// (in a registry of their own, not the agent's) with `trust`'s rights,
    /// its state in `scope`, counted in `usage`.
    pub(crate) fn register_version(
        &self,
        plugin: &Arc<Plugin>,
        trust: PluginTrust,
        scope: &VersionScope,
    ) -> Result<std::collections::HashMap<String, Arc<dyn crate::agent::RpcFunction>>> {
        let namespace = plugin_namespace(plugin.name());
        let grant = match trust {
            PluginTrust::Operator => PluginGrant::operator(&namespace),
            PluginTrust::Deployed => PluginGrant::deployed(&namespace, plugin.manifest())?,
        };
        let scratch = FunctionRegistry::without_builtins();
        let names = self.register_granted(plugin, &scratch, grant, scope);
        Ok(names
            .into_iter()
            .filter_map(|n| scratch.get(&n).map(|f| (n, f)))
            .collect())
    }

    fn register_granted(
        &self,
        plugin: &Arc<Plugin>,
        registry: &FunctionRegistry,
        grant: PluginGrant,
        scope: &VersionScope,
    ) -> Vec<String> {
        let namespace = plugin_namespace(plugin.name());
        let grant = Arc::new(grant);
        // A single-instance plugin's calls on this worker share one instance.
        let module = plugin.manifest().single_instance.then(|| {
            module::ModuleInstance::new(
                self.runtime.clone(),
                plugin.clone(),
                namespace.clone(),
                grant.clone(),
                scope.clone(),
            )
        });
        let mut names = Vec::new();
        for export in &plugin.manifest().exports {
            let function: Arc<dyn crate::agent::RpcFunction> = match (export.kind, &export.class) {
                (ExportKind::Function | ExportKind::AsyncFunction, None) => {
                    Arc::new(PluginFunction::new(
                        self.runtime.clone(),
                        plugin.clone(),
                        namespace.clone(),
                        export.name.clone(),
                        grant.clone(),
                        scope.clone(),
                        module.clone(),
                    ))
                }
                (ExportKind::Constructor, Some(class)) => Arc::new(PluginClass::new(
                    self.runtime.clone(),
                    plugin.clone(),
                    namespace.clone(),
                    class.clone(),
                    grant.clone(),
                    scope.clone(),
                    module.clone(),
                )),
                // Methods are served through their objects.
                _ => continue,
            };
            let name = format!("{namespace}::{}", export.name);
            registry.register(name.clone(), function);
            names.push(name);
        }
        names
    }

    /// Loads `path` ([`load_path`](Self::load_path)) and registers every
    /// plugin it holds in `registry`; returns the registered names.
    ///
    /// # Errors
    /// As [`load_path`](Self::load_path).
    pub fn install(
        &self,
        path: impl AsRef<Path>,
        registry: &FunctionRegistry,
    ) -> Result<Vec<String>> {
        let plugins = self.load_path(path)?;
        Ok(plugins
            .iter()
            .flat_map(|p| self.register(p, registry))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_drop_the_package_prefix() {
        assert_eq!(plugin_namespace("wasmrpc-plugin-seed-fns"), "seed_fns");
        assert_eq!(plugin_namespace("my-plugin"), "my_plugin");
        assert_eq!(plugin_namespace("plain"), "plain");
    }

    #[test]
    fn the_cache_cap_is_whole_mib_or_unlimited_and_anything_else_is_named() {
        assert_eq!(parse_cache_max("4096").unwrap(), Some(4096 << 20));
        assert_eq!(parse_cache_max(" 1 ").unwrap(), Some(1 << 20));
        assert_eq!(parse_cache_max("unlimited").unwrap(), None);
        for bad in [
            "0",
            "-5",
            "2GiB",
            "1.5",
            "",
            "Unlimited",
            "18446744073709551615",
        ] {
            let e = parse_cache_max(bad).expect_err(bad).to_string();
            assert!(e.contains("WASMRPC_CACHE_MAX_MIB="), "{bad}: {e}");
        }
        let e = parse_cache_max("2GiB").unwrap_err().to_string();
        assert!(e.contains("expected a whole number of MiB"), "{e}");
    }
}
