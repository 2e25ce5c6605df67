//! Compiling a plugin in a helper process (CACHE-3): a worker that finds no
//! cache entry for a plugin runs a short-lived child of its own executable,
//! which compiles the wasm bytes and writes the entry, and then maps the
//! entry as if another worker had written it.
//!
//! Why: a compile leaves the process that ran it larger for its whole life,
//! even after everything it allocated is freed. The compiler's code pages
//! stay resident (about 5 MiB of Cranelift), and so do allocator pages its
//! threads touched. A worker that compiled its plugins in process idled at
//! 156 MiB in the bench's `rss_idle_compiled` row, against 146 MiB for one
//! that mapped the same entries (2026-12-07). A helper's memory, its peak
//! of a few hundred MiB for a Python component included, goes back to the
//! system when the helper exits. What the helper costs is its start, about
//! 0.2 s for an executable that links libtorch, once per plugin per machine.
//!
//! This module owns the helper's command line, running it, and its body
//! ([`compile_entry`]). The entries' names, the cache lock and eviction stay
//! the cache's (`cache`): the worker takes the lock before it runs the
//! helper, and the helper writes exactly the path it is given.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Config, engine};
use crate::{Error, Result};

/// The exit status of a helper that refused the wasm bytes as invalid; its
/// standard error holds the compiler's message, the error a compile in
/// process would have given (BSD's `EX_DATAERR`).
pub const INVALID_WASM_EXIT: u8 = 65;

/// How long a helper may take by default ([`CompileHelper::timeout`]):
/// a hundred times what a Python component takes to compile on a 2-core VM
/// (6-7 s), so that only a helper that hangs reaches it.
pub const DEFAULT_HELPER_TIMEOUT: Duration = Duration::from_secs(600);

/// What a cache entry holds: a core module or a component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeKind {
    /// A core wasm module (a plugin built with the Rust guest SDK).
    Module,
    /// A component (a Python plugin).
    Component,
}

impl CodeKind {
    /// The value of the helper's `--kind` flag.
    pub fn as_flag(self) -> &'static str {
        match self {
            CodeKind::Module => "module",
            CodeKind::Component => "component",
        }
    }

    /// The kind a `--kind` flag names.
    ///
    /// # Errors
    /// Anything but `module` or `component`.
    pub fn from_flag(flag: &str) -> Result<CodeKind> {
        match flag {
            "module" => Ok(CodeKind::Module),
            "component" => Ok(CodeKind::Component),
            other => Err(Error::Engine(format!(
                "unknown kind of compiled code {other:?}: expected module or component"
            ))),
        }
    }
}

/// How a runtime compiles in a helper process: `program` run with `args`,
/// then `--kind module|component --out PATH`, the wasm bytes on its
/// standard input. The program must run [`compile_entry`] for those flags
/// and exit 0 once the entry is written, [`INVALID_WASM_EXIT`] with the
/// compiler's message on standard error for bytes that do not compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileHelper {
    /// The executable: a worker's own (`std::env::current_exe`).
    pub program: PathBuf,
    /// Its arguments before the flags, e.g. a hidden subcommand's name.
    pub args: Vec<OsString>,
    /// How long it may run: a helper still running then is killed, and
    /// the worker compiles in process.
    pub timeout: Duration,
}

/// What running the helper came to.
pub(super) enum Outcome {
    /// The entry is written at the path given.
    Written,
    /// The bytes do not compile: the compiler's message.
    Invalid(String),
}

impl CompileHelper {
    /// Runs the helper for `wasm` and waits for it.
    ///
    /// # Errors
    /// The helper could not start, or it failed other than by refusing
    /// the bytes (the text says how, with what it wrote on standard error).
    pub(super) fn run(&self, kind: CodeKind, wasm: &[u8], out: &Path) -> Result<Outcome> {
        let failed = |why: String| {
            Error::Engine(format!(
                "the compile helper {} {why}",
                self.program.display()
            ))
        };
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .arg("--kind")
            .arg(kind.as_flag())
            .arg("--out")
            .arg(out)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| failed(format!("did not start: {e}")))?;
        // The helper reads all its input before it writes anything, so
        // writing it whole first cannot block on a full stderr pipe.
        let fed = child
            .stdin
            .take()
            .map(|mut stdin| stdin.write_all(wasm))
            .transpose();
        let mut stderr_pipe = child.stderr.take();
        let reader = std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(pipe) = stderr_pipe.as_mut() {
                let _ = pipe.read_to_end(&mut text);
            }
            text
        });
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if started.elapsed() > self.timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(failed(format!(
                        "did not finish within {:?} and was killed",
                        self.timeout
                    )));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(failed(format!("could not be waited for: {e}"))),
            }
        };
        let stderr = reader.join().unwrap_or_default();
        let stderr = String::from_utf8_lossy(&stderr).trim().to_string();
        match status.code() {
            Some(0) if fed.is_ok() => Ok(Outcome::Written),
            Some(code) if code == i32::from(INVALID_WASM_EXIT) => Ok(Outcome::Invalid(stderr)),
            _ => Err(failed(format!(
                "failed ({}{}){}",
                status,
                fed.err()
                    .map(|e| format!(", reading its input: {e}"))
                    .unwrap_or_default(),
                if stderr.is_empty() {
                    String::new()
                } else {
                    format!(": {stderr}")
                }
            ))),
        }
    }
}

/// The helper's body: compiles the wasm bytes read from `input` as `kind`
/// and writes the serialized code to `out` (through a temporary file and a
/// rename, CACHE-1), for an engine configured as a runtime's default config
/// (the settings that decide compatibility are the same for every config;
/// should they ever differ, the worker's wasmtime refuses the entry and the
/// worker compiles in process).
///
/// # Errors
/// `Error::InvalidModule` for bytes that do not compile (exit with
/// [`INVALID_WASM_EXIT`] and its message); anything else for an input that
/// cannot be read or an entry that cannot be written.
pub fn compile_entry(kind: CodeKind, mut input: impl Read, out: &Path) -> Result<()> {
    let mut wasm = Vec::new();
    input
        .read_to_end(&mut wasm)
        .map_err(|e| Error::Engine(format!("cannot read the wasm bytes to compile: {e}")))?;
    let engine = engine::engine_without_pool(&Config::default())?;
    let invalid = |e: wasmtime::Error| Error::InvalidModule(format!("{e:#}"));
    let unserializable =
        |e: wasmtime::Error| Error::Engine(format!("cannot serialize the compiled code: {e:#}"));
    let serialized = match kind {
        CodeKind::Module => wasmtime::Module::new(&engine, &wasm)
            .map_err(invalid)?
            .serialize()
            .map_err(unserializable)?,
        CodeKind::Component => wasmtime::component::Component::new(&engine, &wasm)
            .map_err(invalid)?
            .serialize()
            .map_err(unserializable)?,
    };
    super::cache::write_atomically(&serialized, out).map_err(|e| {
        Error::Engine(format!(
            "cannot write the compiled code to {}: {e}",
            out.display()
        ))
    })
}

/// A helper executable's whole subcommand: [`compile_entry`] of standard
/// input for the `--kind` and `--out` flags given, its error on standard
/// error; returns the exit status the worker reads (0, [`INVALID_WASM_EXIT`]
/// with the compiler's message alone, or 1).
pub fn helper_main(kind: &str, out: &Path) -> std::process::ExitCode {
    let done = CodeKind::from_flag(kind)
        .and_then(|kind| compile_entry(kind, std::io::stdin().lock(), out));
    let status = match done {
        Ok(()) => 0,
        Err(Error::InvalidModule(message)) => {
            eprintln!("{message}");
            INVALID_WASM_EXIT
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    };
    std::process::ExitCode::from(status)
}
