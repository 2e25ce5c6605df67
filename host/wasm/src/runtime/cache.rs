//! The on-disk cache of compiled code: a plugin's compiled module or
//! component, named by the sha256 of its bytes and the engine's
//! compatibility hash, compiled once per machine under a lock file and
//! written atomically. Owns nothing else of the runtime.
//!
//! Invariant:
//! - CACHE-1: an entry is written whole under a temporary name and renamed
//!   into place, never changed in place, and entries are mapped, not read
//!   (the worker that compiled and wrote one runs from it too): only the
//!   code a worker runs is resident, workers of one host share it
//!   through the page cache, and a plugin running from an entry keeps
//!   running when the entry is replaced or removed. (An entry truncated in
//!   place by someone else would fault the workers mapping it: the folder
//!   is the operator's, as the binary is.)
//! - CACHE-2: the folder's entries stay within `Config::cache_max_bytes`:
//!   a load from an entry refreshes its modification time, and a process
//!   that writes an entry then removes the least recently used others
//!   until the entries fit. Only files named as entries are counted or
//!   removed; removing one is safe while workers run from it (CACHE-1).
//! - CACHE-3: with `Config::compile_helper`, code missing from the cache is
//!   compiled in a helper process that writes the entry (`helper`), under
//!   the entry's lock this process holds; this process then maps the entry
//!   as any other. A helper that fails, or whose entry does not load, costs
//!   a compile in this process, which writes the entry again; one that
//!   refuses the bytes gives the error a compile here would give. The
//!   helper is this process's own executable (`wasmrpc
//!   compile-plugin-entry`), trusted as the cache folder is: what it
//!   writes runs as compiled code.
//! - CACHE-4: compiled code is written to a file and mapped from it, with
//!   or without a cache. Where no cache folder is configured, or the one
//!   configured cannot be written, the code (from the helper, or from a
//!   compile in this process) goes to a scratch file in a folder of this
//!   process's own in the temporary folder (`$TMPDIR`, mode 0700), which
//!   is removed as soon as the code is mapped (and the folders of
//!   processes that died first are swept, `scratch`); the helper is never told
//!   to write where it cannot, which cost a second compile. A file that
//!   cannot be mapped executable (its file system is mounted `noexec`) is
//!   read into memory instead, not compiled again; only where no file can
//!   be written at all does the code run from the bytes compiled.

use super::helper::{CodeKind, Outcome};
use super::scratch::ScratchDir;
use super::{Runtime, engine};
use crate::plugin::LoadSource;
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use wasmtime::{Engine, Module};

impl Runtime {
    fn cache_path(&self, sha256: &[u8; 32]) -> Option<PathBuf> {
        let dir = self.inner.shared.config.cache_dir.as_ref()?;
        let compatibility = engine::compatibility(&self.inner.shared.engine);
        Some(dir.join(format!("{}-{compatibility:016x}.cwasm", hex(sha256))))
    }

    pub(super) fn compile(
        &self,
        bytes: &[u8],
        sha256: &[u8; 32],
        name: &str,
    ) -> Result<(Module, LoadSource)> {
        self.compile_cached(
            sha256,
            &format!("plugin `{name}`"),
            Loaders {
                wasm: bytes,
                kind: CodeKind::Module,
                // SAFETY: the file is named by the sha256 of the wasm bytes
                // and by this engine's compatibility hash, and only
                // `compile_cached` writes it (through `Module::serialize` and
                // an atomic rename), so it holds code wasmtime compiled from
                // these bytes for an engine like this one; wasmtime checks
                // the header and refuses others. It is mapped, not read: see
                // `compile_cached` for why that is safe.
                file: |engine: &Engine, compiled: &Path| unsafe {
                    Module::deserialize_file(engine, compiled)
                },
                // SAFETY: the bytes are `Module::serialize`'s, made by this
                // load from these wasm bytes (`compile_cached`).
                bytes: |engine: &Engine, compiled: &[u8]| unsafe {
                    Module::deserialize(engine, compiled)
                },
                compile: |engine: &Engine| Module::new(engine, bytes),
                serialize: Module::serialize,
            },
        )
    }

    pub(super) fn compile_component(
        &self,
        bytes: &[u8],
        sha256: &[u8; 32],
        name: &str,
    ) -> Result<(wasmtime::component::Component, LoadSource)> {
        use wasmtime::component::Component;
        self.compile_cached(
            sha256,
            &format!("component plugin `{name}`"),
            Loaders {
                wasm: bytes,
                kind: CodeKind::Component,
                // SAFETY: as for core modules in `compile`.
                file: |engine: &Engine, compiled: &Path| unsafe {
                    Component::deserialize_file(engine, compiled)
                },
                // SAFETY: as for core modules in `compile`.
                bytes: |engine: &Engine, compiled: &[u8]| unsafe {
                    Component::deserialize(engine, compiled)
                },
                compile: |engine: &Engine| Component::new(engine, bytes),
                serialize: Component::serialize,
            },
        )
    }

    /// Compiled code from the disk cache, or compiled once per machine:
    /// while one process compiles, it holds an exclusive lock on the cache
    /// entry's lock file, so workers of one machine that start together
    /// (a `launch` group: a Python component takes 10-30 s to compile)
    /// wait for that compile and read its result instead of each compiling
    /// the same code. Without a cache folder it can write, every load
    /// compiles, into a scratch file (CACHE-4). Code is compiled in a
    /// helper process where the config names one (CACHE-3, `helper`),
    /// else in an engine of its own (see `engine::compiling_engine`), and
    /// mapped from the file it was written to.
    fn compile_cached<T>(
        &self,
        sha256: &[u8; 32],
        what: &str,
        loaders: Loaders<
            '_,
            impl Fn(&Engine, &Path) -> wasmtime::Result<T>,
            impl Fn(&Engine, &[u8]) -> wasmtime::Result<T>,
            impl FnOnce(&Engine) -> wasmtime::Result<T> + Send,
            impl Fn(&T) -> wasmtime::Result<Vec<u8>> + Sync,
        >,
    ) -> Result<(T, LoadSource)> {
        let Loaders {
            wasm,
            kind,
            file: deserialize,
            bytes: deserialize_bytes,
            compile,
            serialize,
        } = loaders;
        let engine = &self.inner.shared.engine;
        let mapped = |path: &Path| from_file(path, engine, &deserialize, &deserialize_bytes, None);
        let landing = match self.cache_path(sha256) {
            Some(path) => {
                if let Some(code) = mapped(&path) {
                    mark_used(&path);
                    return Ok((code, LoadSource::DiskCache));
                }
                // Held until this function returns; a failure to lock only
                // costs a compile of our own.
                let lock = lock_file(&path.with_extension("lock"))
                    .inspect_err(|e| tracing::debug!("compiling without the cache lock: {e}"))
                    .ok();
                // Another process may have compiled it while this one
                // waited for the lock.
                if let Some(code) = mapped(&path) {
                    return Ok((code, LoadSource::DiskCache));
                }
                Landing::cache_entry(path, lock, what)
            }
            None => Landing::scratch(what),
        };
        let started = std::time::Instant::now();
        if let (Some(helper), Some(path)) =
            (&self.inner.shared.config.compile_helper, landing.path())
        {
            let helped = match helper.run(kind, wasm, path) {
                Ok(Outcome::Written) => mapped(path),
                Ok(Outcome::Invalid(message)) => return Err(Error::InvalidModule(message)),
                Err(e) => {
                    tracing::warn!("{e}; compiling {what} in this process");
                    None
                }
            };
            if let Some(code) = helped {
                tracing::info!(
                    "compiled {what} in a helper process in {:.1} s",
                    started.elapsed().as_secs_f64()
                );
                landing.done(self);
                return Ok((code, LoadSource::Compiled));
            }
        }
        let compiled = self.compile_apart(what, compile, serialize)?;
        tracing::info!(
            "compiled {what} in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        // Run from the file just written, as the next load from the cache
        // will (CACHE-1, CACHE-4): loaded from bytes, the code is anonymous
        // memory, resident whole for the worker's life (a Python
        // component's 36 MiB), where a mapping keeps only the pages run,
        // shared with the host's other workers.
        let code = match landing.path() {
            Some(path) => match write_atomically(&compiled, path) {
                // On a `noexec` file system, the bytes in hand, not read back.
                Ok(()) => from_file(
                    path,
                    engine,
                    &deserialize,
                    &deserialize_bytes,
                    Some(&compiled),
                ),
                Err(e) => {
                    tracing::warn!("cannot write the compiled code to {}: {e}", path.display());
                    None
                }
            },
            None => None,
        };
        landing.done(self);
        let code = match code {
            Some(code) => code,
            None => deserialize_bytes(engine, &compiled).map_err(|e| {
                Error::Engine(format!(
                    "cannot load the code just compiled for {what}: {e:#}"
                ))
            })?,
        };
        drop(compiled);
        release_freed_memory();
        Ok((code, LoadSource::Compiled))
    }

    /// Keeps the cache folder within its cap after `written` was written
    /// (CACHE-2).
    fn evict_for(&self, written: &Path) {
        if let Some(cap) = self.inner.shared.config.cache_max_bytes {
            evict_least_recently_used(written, cap);
        }
    }

    /// Compiles in an engine made for this compile alone and returns the
    /// code serialized; the engine, with what its compiler kept, is gone
    /// when this returns.
    fn compile_apart<T>(
        &self,
        what: &str,
        compile: impl FnOnce(&Engine) -> wasmtime::Result<T> + Send,
        serialize: impl Fn(&T) -> wasmtime::Result<Vec<u8>> + Sync,
    ) -> Result<Vec<u8>> {
        let shared = &self.inner.shared;
        let engine = engine::compiling_engine(&shared.config, &shared.engine)?;
        // Cranelift compiles a module's functions on rayon's threads: on
        // the global pool they would idle for the process's life with the
        // stacks and allocator caches a compile left them (about 9 MiB after
        // a Python component). A pool of this compile's own ends with it.
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("wasmrpc-compile-{i}"))
            .build()
            .map_err(|e| Error::Engine(format!("cannot start threads to compile {what}: {e}")))?;
        // The compiled code is dropped at the end of its arm, before the
        // engine it holds.
        let serialized = pool.install(|| match compile(&engine) {
            Err(e) => Err(Error::InvalidModule(format!("{e:#}"))),
            Ok(code) => serialize(&code).map_err(|e| {
                Error::Engine(format!(
                    "cannot serialize the code compiled for {what}: {e:#}"
                ))
            }),
        });
        drop((pool, engine));
        release_freed_memory();
        serialized
    }
}

/// Where `compile_cached` writes the code it compiles, to map it from
/// there (CACHE-1, CACHE-4).
enum Landing {
    /// The cache entry, under its lock (when the lock could be taken).
    Entry {
        path: PathBuf,
        _lock: Option<std::fs::File>,
    },
    /// A file in a folder of this process's own in the temporary folder,
    /// removed with the folder once the code is mapped.
    Scratch(ScratchDir),
    /// Nowhere: the code is loaded from memory.
    Memory,
}

impl Landing {
    /// The cache entry at `path` if its folder can be written (the lock
    /// file was made in it, or a file can be), else a scratch file: a
    /// helper told to write where it cannot would compile for nothing.
    fn cache_entry(path: PathBuf, lock: Option<std::fs::File>, what: &str) -> Landing {
        let folder = path.parent().unwrap_or(Path::new("."));
        let writable = lock.is_some()
            || std::fs::create_dir_all(folder)
                .and_then(|()| tempfile::NamedTempFile::new_in(folder))
                .is_ok();
        if writable {
            tracing::info!(
                "compiling {what} (its first load on this machine; cached in {} for the next)",
                path.display()
            );
            return Landing::Entry { path, _lock: lock };
        }
        tracing::warn!(
            "the module cache folder {} cannot be written: compiling {what} without caching it",
            folder.display()
        );
        Landing::scratch(what)
    }

    /// A scratch file in a new folder of the temporary folder
    /// (`$TMPDIR`, see `scratch`); `Memory` if none can be made.
    fn scratch(what: &str) -> Landing {
        match ScratchDir::new() {
            Ok(dir) => {
                tracing::info!(
                    "compiling {what} into {}, removed once mapped (no module cache to keep it in)",
                    dir.path().display()
                );
                Landing::Scratch(dir)
            }
            Err(e) => {
                tracing::info!(
                    "compiling {what} into memory (no module cache to keep it in, and no \
                     scratch folder in {}: {e})",
                    std::env::temp_dir().display()
                );
                Landing::Memory
            }
        }
    }

    /// The file to write the compiled code to.
    fn path(&self) -> Option<&Path> {
        match self {
            Landing::Entry { path, .. } => Some(path),
            Landing::Scratch(dir) => Some(dir.code()),
            Landing::Memory => None,
        }
    }

    /// The load is over: a cache entry's folder is kept within its cap
    /// (CACHE-2); a scratch folder is removed, a mapping of its file
    /// staying valid (CACHE-4).
    fn done(self, runtime: &Runtime) {
        match self {
            Landing::Entry { path, .. } => runtime.evict_for(&path),
            Landing::Scratch(dir) => dir.close(),
            Landing::Memory => {}
        }
    }
}

/// How `compile_cached` makes code of one kind (a core module or a
/// component): from a cache entry mapped into an engine, from serialized
/// bytes, by compiling the wasm bytes in an engine, and serialized.
struct Loaders<'a, File, Bytes, Compile, Serialize> {
    /// The wasm bytes, for a helper process (CACHE-3).
    wasm: &'a [u8],
    kind: CodeKind,
    file: File,
    bytes: Bytes,
    compile: Compile,
    serialize: Serialize,
}

/// Code from the compiled file at `path`, mapped, not read (CACHE-1): only
/// the pages a worker runs become resident, and workers of one host share
/// them through the page cache. Read into memory, a Python component's
/// code and metadata held 34 MiB of every idle worker. A mapping faults
/// the process if its file is truncated in place; nothing of ours ever
/// does that (files are written whole and renamed into place, and a
/// rename or a removal leaves a mapped file as it was), and the cache
/// folder is the operator's, like the binary.
///
/// On a file system that forbids executable mappings (mounted `noexec`)
/// the code is loaded from its bytes instead, rather than compiled again
/// at every load: `written`, when the caller holds what it just wrote
/// there, else the file's. Any other file that does not map is not
/// compiled code of ours: `None`, with a warning, and it is not read
/// whole, whatever its size.
fn from_file<T>(
    path: &Path,
    engine: &Engine,
    map: &impl Fn(&Engine, &Path) -> wasmtime::Result<T>,
    load: &impl Fn(&Engine, &[u8]) -> wasmtime::Result<T>,
    written: Option<&[u8]>,
) -> Option<T> {
    if !path.is_file() {
        return None;
    }
    let refused = match map(engine, path) {
        Ok(code) => return Some(code),
        Err(e) => e,
    };
    let loaded = if !on_noexec(path) {
        Err(refused)
    } else if let Some(bytes) = written {
        load(engine, bytes)
    } else {
        std::fs::read(path)
            .map_err(wasmtime::Error::from)
            .and_then(|bytes| load(engine, &bytes))
    };
    match loaded {
        Ok(code) => {
            tracing::warn!(
                "cannot map the compiled code {} executable (its file system is mounted \
                 noexec), so it is read into memory: each worker holds all of it (mount its \
                 folder without noexec to share it)",
                path.display()
            );
            Some(code)
        }
        Err(e) => {
            tracing::warn!("ignoring compiled code {}: {e:#}", path.display());
            None
        }
    }
}

/// Whether the file system holding `path` forbids executable mappings
/// (mounted `noexec`), where compiled code can be read but not mapped.
fn on_noexec(path: &Path) -> bool {
    rustix::fs::statvfs(path)
        .is_ok_and(|fs| fs.f_flag.contains(rustix::fs::StatVfsMountFlags::NOEXEC))
}

/// Marks the entry at `path` as just used, for eviction's order (CACHE-2).
/// Best effort: a folder this process may read but not change keeps its
/// order.
fn mark_used(path: &Path) {
    let touched =
        std::fs::File::open(path).and_then(|file| file.set_modified(std::time::SystemTime::now()));
    if let Err(e) = touched {
        tracing::debug!("cannot mark {} as used: {e}", path.display());
    }
}

/// Whether `name` is a cache entry's file name:
/// `<sha256 in hex>-<compatibility hash in hex>.cwasm`.
fn is_entry_name(name: &str) -> bool {
    let Some((sha, compat)) = name
        .strip_suffix(".cwasm")
        .and_then(|stem| stem.split_once('-'))
    else {
        return false;
    };
    let hex_of = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    hex_of(sha, 64) && hex_of(compat, 16)
}

/// Removes the least recently used entries of `kept`'s folder, never
/// `kept` itself, until the entries hold at most `cap` bytes (CACHE-2).
/// Entries of other engines count too: they hold the same disk. Each
/// removed entry's lock file goes with it. A removal that fails (another
/// process removed it first, or the folder is read-only) is skipped.
fn evict_least_recently_used(kept: &Path, cap: u64) {
    let Some(dir) = kept.parent() else { return };
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries = Vec::new();
    let mut total = 0u64;
    for entry in listing.flatten() {
        let path = entry.path();
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_entry_name);
        // `symlink_metadata`: a link named as an entry counts (and goes)
        // as the link, never as what it points to.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !named || meta.is_dir() {
            continue;
        }
        total += meta.len();
        if path != kept {
            let used = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
            entries.push((used, meta.len(), path));
        }
    }
    if total <= cap {
        return;
    }
    entries.sort();
    let (mut removed, mut freed) = (0usize, 0u64);
    for (_, len, path) in entries {
        if total <= cap {
            break;
        }
        if std::fs::remove_file(&path).is_ok() {
            // A process compiling this entry again holds its own open lock
            // file; removing the name costs at worst a second compile.
            let _ = std::fs::remove_file(path.with_extension("lock"));
            total -= len;
            removed += 1;
            freed += len;
        }
    }
    if removed > 0 {
        tracing::info!(
            "removed the {removed} least recently used compiled plugin(s) ({:.1} MiB) from {} to keep it within {:.1} MiB",
            freed as f64 / f64::from(1 << 20),
            dir.display(),
            cap as f64 / f64::from(1 << 20)
        );
    }
}

/// How this process hands freed heap memory back to the system, set by an
/// executable that installs an allocator of its own
/// ([`set_memory_release`]); unset, glibc's `malloc_trim`.
static MEMORY_RELEASE: std::sync::OnceLock<fn() -> std::io::Result<()>> =
    std::sync::OnceLock::new();

/// Tells the runtime how to hand the heap memory a compile freed back to
/// the system, for an executable whose `#[global_allocator]` also serves
/// C's `malloc` (`wasmrpc_alloc`). Set once, before the first plugin loads;
/// later calls change nothing. Without it the runtime calls glibc's
/// `malloc_trim`, which only reaches glibc's own heaps.
pub fn set_memory_release(release: fn() -> std::io::Result<()>) {
    let _ = MEMORY_RELEASE.set(release);
}

/// Hands the heap memory a compile freed back to the system. Compiling a
/// Python component allocates a few hundred MiB on Cranelift's threads;
/// the allocator keeps what they free, so a worker that compiled one
/// stayed about 280 MiB larger for its whole life than one that read the
/// same code from the cache (446.6 MiB against 168.6 MiB idle in the
/// bench's `rss_idle` row, 2026-11-29, glibc; 448 MiB against 143 MiB with
/// jemalloc, 2026-12-05; 244-248 MiB against 144-147 MiB until the
/// worker also dropped its compiled copy for the entry's mapping and
/// released the serialized one, 2026-12-06). Elsewhere there is nothing
/// to do.
fn release_freed_memory() {
    if let Some(release) = MEMORY_RELEASE.get() {
        if let Err(e) = release() {
            tracing::debug!("the allocator did not release freed memory after a compile: {e}");
        }
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free pages of glibc's own heaps
    // to the kernel; it takes no pointer and touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// An exclusive advisory lock on `path` (made if missing), held until the
/// file is dropped.
fn lock_file(path: &Path) -> std::io::Result<std::fs::File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    file.lock()?;
    Ok(file)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// reader never sees half a file.
pub(super) fn write_atomically(bytes: &[u8], path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
