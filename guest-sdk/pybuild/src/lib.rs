//! Builds Python plugins into wasmrpc component plugins.
//!
//! A Python plugin is a folder holding a module (`app.py` by default) whose
//! functions and classes carry the guest kit's decorators (`@remote`,
//! `@remote_class`, package `wasmrpc` in `guest-sdk/python`). [`build`]
//! turns it into one `.wasm` component that every worker loads like a Rust
//! plugin (`--plugins`, `deploy_plugin`):
//!
//! 1. it writes an entry module that names the plugin and imports the app,
//!    the kit's implementation of the world's exports, and every module the
//!    plugin's sources import anywhere (inside functions too: a component
//!    has no files at run time, so only modules imported while it was
//!    built can be imported later);
//! 2. it imports that entry on the toolchain's own Python to read the
//!    manifest (the kit defers everything that needs the component's
//!    bindings, so an ordinary Python can import a plugin);
//! 3. it runs `componentize-py` against the WIT world `guest-sdk/wit`
//!    (world `plugin`), with the kit and the plugin's folder on the path;
//! 4. it appends the manifest as the `wasmrpc-manifest` custom section that
//!    Rust plugins carry, so `wasmrpc plugin inspect` and the host read it
//!    without compiling; the host checks it against the component's own
//!    `describe` export when it loads it.
//!
//! The toolchain ([`Toolchain`]) is componentize-py
//! [`COMPONENTIZE_PY_VERSION`] in a virtual environment of the cache
//! folder (`~/.cache/wasmrpc/componentize-py-VERSION`), installed from PyPI
//! by [`Toolchain::install`] (which `cargo xtask setup` runs).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

mod snapshot;

use wasmrpc_abi::manifest::{Export, Manifest, Permissions, Record};
use wasmrpc_abi::protocol::{ABI_VERSION, ExportKind, MANIFEST_SECTION};

/// The componentize-py release plugins are built with.
pub const COMPONENTIZE_PY_VERSION: &str = "0.25.1";

/// The folder holding the guest kit (`python/`) and the WIT world
/// (`wit/`): `WASMRPC_SDK_DIR` if set; else the release bundle's
/// `share/wasmrpc/sdk`, beside the running binary's folder (`bin/` or
/// `libexec/`), when it has the kit; else this checkout's `guest-sdk`.
/// A binary copied out of the checkout thus builds plugins against the
/// kit that travels with it, not against a path of the machine that
/// built it.
pub fn sdk_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("WASMRPC_SDK_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let bundled = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("share/wasmrpc/sdk")));
    if let Some(dir) = bundled.filter(|d| d.join("python/wasmrpc").is_dir()) {
        return dir;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The guest kit's Python package folder (`guest-sdk/python`, or the
/// bundle's `share/wasmrpc/sdk/python`: see [`sdk_dir`]).
pub fn kit_dir() -> PathBuf {
    sdk_dir().join("python")
}

/// The WIT folder of the plugin world (`guest-sdk/wit`, or the bundle's
/// `share/wasmrpc/sdk/wit`: see [`sdk_dir`]).
pub fn wit_dir() -> PathBuf {
    sdk_dir().join("wit")
}

/// The WIT world Python plugins target.
pub const WORLD: &str = "plugin";

/// Why a build failed; the message names the step and the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The result of this crate's operations.
pub type Result<T> = std::result::Result<T, Error>;

fn err(message: impl Into<String>) -> Error {
    Error(message.into())
}

/// The cache folder: `${XDG_CACHE_HOME:-$HOME/.cache}/wasmrpc`.
///
/// # Errors
/// When neither variable is set.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("wasmrpc"));
    }
    let home =
        std::env::var_os("HOME").ok_or_else(|| err("neither XDG_CACHE_HOME nor HOME is set"))?;
    Ok(PathBuf::from(home).join(".cache").join("wasmrpc"))
}

/// componentize-py and the Python it runs on.
#[derive(Debug, Clone)]
pub struct Toolchain {
    /// The virtual environment holding componentize-py.
    pub venv: PathBuf,
}

/// Written into the venv once componentize-py is installed and runs.
const READY_STAMP: &str = ".wasmrpc-ready";

impl Toolchain {
    /// The toolchain's folder in the cache.
    ///
    /// # Errors
    /// When the cache folder is unknown.
    pub fn default_dir() -> Result<PathBuf> {
        Ok(cache_dir()?.join(format!("componentize-py-{COMPONENTIZE_PY_VERSION}")))
    }

    /// The installed toolchain: `WASMRPC_COMPONENTIZE_PY_VENV` or the cache's.
    ///
    /// # Errors
    /// When it is not installed, with the command that installs it.
    pub fn find() -> Result<Toolchain> {
        let venv = match std::env::var_os("WASMRPC_COMPONENTIZE_PY_VENV") {
            Some(v) if !v.is_empty() => PathBuf::from(v),
            _ => Toolchain::default_dir()?,
        };
        if !venv.join(READY_STAMP).exists() {
            return Err(err(format!(
                "componentize-py {COMPONENTIZE_PY_VERSION} is not installed in {}: run \
                 `cargo xtask setup` in a checkout, or `wasmrpc plugin build-py \
                 --install-toolchain`",
                venv.display()
            )));
        }
        Ok(Toolchain { venv })
    }

    /// The toolchain, installed first (a venv with `python3 -m venv`, then
    /// `pip install componentize-py==VERSION` from PyPI) if it is missing.
    ///
    /// # Errors
    /// When Python, venv or pip fail.
    pub fn install() -> Result<Toolchain> {
        if let Ok(found) = Toolchain::find() {
            return Ok(found);
        }
        let venv = Toolchain::default_dir()?;
        if venv.exists() {
            std::fs::remove_dir_all(&venv)
                .map_err(|e| err(format!("cannot remove the partial {}: {e}", venv.display())))?;
        }
        let python = std::env::var("WASMRPC_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        run(
            Command::new(&python).args(["-m", "venv"]).arg(&venv),
            "creating the venv",
        )?;
        let t = Toolchain { venv };
        run(
            Command::new(t.venv.join("bin/pip")).args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &format!("componentize-py=={COMPONENTIZE_PY_VERSION}"),
            ]),
            "installing componentize-py from PyPI",
        )?;
        run(
            Command::new(t.componentize_py()).arg("--version"),
            "checking componentize-py",
        )?;
        std::fs::write(
            t.venv.join(READY_STAMP),
            format!("componentize-py {COMPONENTIZE_PY_VERSION}\n"),
        )
        .map_err(|e| err(format!("cannot write {}: {e}", t.venv.display())))?;
        Ok(t)
    }

    /// The `componentize-py` program.
    pub fn componentize_py(&self) -> PathBuf {
        self.venv.join("bin/componentize-py")
    }

    /// The venv's Python.
    pub fn python(&self) -> PathBuf {
        self.venv.join("bin/python")
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .map_err(|e| err(format!("{what}: cannot run {:?}: {e}", cmd.get_program())))?;
    if !out.status.success() {
        return Err(err(format!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What to build.
#[derive(Debug, Clone)]
pub struct Plugin {
    /// The folder holding the plugin's module.
    pub dir: PathBuf,
    /// The module's name (`app` for `app.py`).
    pub module: String,
    /// The plugin's name; its functions are served as
    /// `NAME::function` (with `-` as `_`).
    pub name: String,
    /// Its version.
    pub version: String,
}

impl Plugin {
    /// The plugin in `dir`: module `app`, named after the folder, version
    /// 0.1.0.
    ///
    /// # Errors
    /// When the folder has no usable name.
    pub fn in_dir(dir: impl Into<PathBuf>) -> Result<Plugin> {
        let dir = dir.into();
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .ok_or_else(|| err(format!("{} is not a folder with a name", dir.display())))?;
        Ok(Plugin {
            dir,
            module: "app".to_owned(),
            name,
            version: "0.1.0".to_owned(),
        })
    }
}

/// The entry module componentize-py wraps: names the plugin, imports the
/// app (running its decorators) and the kit's `Guest`, then the modules the
/// plugin's sources import anywhere (`preload`): a component has no files
/// at run time, so a module it did not import while it was built cannot be
/// imported later, and an `import` inside a function would fail.
fn entry_module(p: &Plugin, preload: &[String]) -> String {
    let preload = preload
        .iter()
        .map(|m| format!("{m:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "# Generated by wasmrpc-pybuild: the component's entry.\n\
         from wasmrpc import _registry\n\
         _registry.configure({name:?}, {version:?})\n\
         import {module}  # noqa: E402,F401 (registers the plugin's exports)\n\
         from wasmrpc._guest import Guest  # noqa: E402,F401 (the world's exports)\n\
         import importlib as _importlib  # noqa: E402\n\
         # Imported now, so `import` inside the plugin's functions finds them.\n\
         for _name in [{preload}]:\n\
         \x20   try:\n\
         \x20       _importlib.import_module(_name)\n\
         \x20   except Exception:  # noqa: BLE001 (it fails at run time, with its own error)\n\
         \x20       pass\n",
        name = p.name,
        version = p.version,
        module = p.module,
    )
}

/// Lists, on the toolchain's Python, every module the `.py` files of the
/// plugin's folder import anywhere (inside functions too), that this
/// Python can find: `import a.b` gives `a.b`, `from a import b` gives `a`
/// and `a.b` when that is a module.
const LIST_IMPORTS: &str = r#"
import ast, importlib.util, json, pathlib, sys
found = set()
for path in pathlib.Path(sys.argv[1]).rglob("*.py"):
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (SyntaxError, UnicodeDecodeError):
        continue
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
def findable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
print(json.dumps(sorted(n for n in found if findable(n))))
"#;

/// The entry module's name.
const ENTRY: &str = "wasmrpc_entry";

/// Builds `plugin` into the component `out` and returns its manifest.
///
/// # Errors
/// A step that failed, with its output: the app does not import, the
/// manifest is invalid, componentize-py fails.
pub fn build(toolchain: &Toolchain, plugin: &Plugin, out: &Path) -> Result<Manifest> {
    if !plugin.dir.join(format!("{}.py", plugin.module)).exists() {
        return Err(err(format!(
            "{} has no {}.py",
            plugin.dir.display(),
            plugin.module
        )));
    }
    let work = BuildFolder(out.with_extension("build"));
    // What an interrupted build left is not reused.
    let _ = std::fs::remove_dir_all(&work.0);
    let entry_dir = work.0.join("entry");
    std::fs::create_dir_all(&entry_dir)
        .map_err(|e| err(format!("cannot create {}: {e}", entry_dir.display())))?;
    let paths = [entry_dir.clone(), kit_dir(), plugin.dir.clone()];
    let imports = run(
        Command::new(toolchain.python())
            .arg("-c")
            .arg(format!(
                "import sys\nsys.path[:0] = {paths}\n{LIST_IMPORTS}",
                paths = python_list(&paths)
            ))
            .arg(&plugin.dir)
            .env("PYTHONDONTWRITEBYTECODE", "1"),
        &format!("listing the imports of Python plugin {}", plugin.name),
    )?;
    let preload: Vec<String> = serde_json::from_str(imports.trim()).map_err(|e| {
        err(format!(
            "listing the imports of Python plugin {}: {e}",
            plugin.name
        ))
    })?;
    std::fs::write(
        entry_dir.join(format!("{ENTRY}.py")),
        entry_module(plugin, &preload),
    )
    .map_err(|e| err(format!("cannot write the entry module: {e}")))?;

    let described = run(
        Command::new(toolchain.python())
            .arg("-c")
            .arg(format!(
                "import sys, json\nsys.path[:0] = {paths}\nimport {ENTRY}\n\
                 from wasmrpc import _registry\nprint(json.dumps(_registry.describe()))",
                paths = python_list(&paths)
            ))
            .env("PYTHONDONTWRITEBYTECODE", "1"),
        &format!("reading the manifest of Python plugin {}", plugin.name),
    )?;
    let manifest = manifest_from_json(&described).map_err(|e| {
        err(format!(
            "the manifest of Python plugin {}: {e}",
            plugin.name
        ))
    })?;

    // componentize-py writes bytecode beside what it compiles: it gets
    // copies of the kit and the plugin's folder, not the sources.
    let kit_copy = work.0.join("kit");
    let app_copy = work.0.join("app");
    for (from, to) in [(kit_dir(), &kit_copy), (plugin.dir.clone(), &app_copy)] {
        snapshot::copy_sources(&from, to, &work.0).map_err(|e| {
            err(format!(
                "copying {} for componentize-py: {e}",
                from.display()
            ))
        })?;
    }
    let raw = out.with_extension("component.wasm");
    let mut cmd = Command::new(toolchain.componentize_py());
    cmd.arg("-d")
        .arg(wit_dir())
        .arg("-w")
        .arg(WORLD)
        .arg("componentize");
    for p in [&entry_dir, &kit_copy, &app_copy] {
        cmd.arg("-p").arg(p);
    }
    cmd.arg(ENTRY).arg("-o").arg(&raw);
    run(
        &mut cmd,
        &format!("componentize-py for Python plugin {}", plugin.name),
    )?;

    let mut bytes =
        std::fs::read(&raw).map_err(|e| err(format!("reading {}: {e}", raw.display())))?;
    append_manifest(&mut bytes, &manifest)?;
    let tmp = out.with_extension("wasm.tmp");
    std::fs::write(&tmp, &bytes)
        .and_then(|()| std::fs::rename(&tmp, out))
        .map_err(|e| err(format!("writing {}: {e}", out.display())))?;
    let _ = std::fs::remove_file(&raw);
    Ok(manifest)
}

/// The build's scratch folder (`OUT.build`: the entry module, the copies
/// componentize-py reads), removed however the build ends.
struct BuildFolder(PathBuf);

impl Drop for BuildFolder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn python_list(paths: &[PathBuf]) -> String {
    let items: Vec<String> = paths
        .iter()
        .map(|p| format!("{:?}", p.display().to_string()))
        .collect();
    format!("[{}]", items.join(", "))
}

/// The manifest the kit describes (`_registry.describe()` as JSON).
///
/// # Errors
/// When the JSON is not the kit's description.
pub fn manifest_from_json(json: &str) -> std::result::Result<Manifest, String> {
    let v: serde_json::Value = serde_json::from_str(json.trim()).map_err(|e| e.to_string())?;
    let text = |v: &serde_json::Value, key: &str| -> std::result::Result<String, String> {
        v.get(key)
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("no string `{key}`"))
    };
    let list = |v: &serde_json::Value, key: &str| -> std::result::Result<Vec<String>, String> {
        v.get(key)
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| format!("no list `{key}`"))?
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("`{key}` holds a non-string"))
            })
            .collect()
    };
    let mut records = vec![Record::Plugin {
        name: text(&v, "name")?,
        version: text(&v, "version")?,
        abi: ABI_VERSION,
    }];
    for e in v
        .get("exports")
        .and_then(serde_json::Value::as_array)
        .ok_or("no list `exports`")?
    {
        let kind = match text(e, "kind")?.as_str() {
            "function" => ExportKind::Function,
            "async-function" => ExportKind::AsyncFunction,
            "constructor" => ExportKind::Constructor,
            "method" => ExportKind::Method,
            "async-method" => ExportKind::AsyncMethod,
            other => return Err(format!("unknown export kind `{other}`")),
        };
        records.push(Record::Export(Export {
            name: text(e, "name")?,
            kind,
            class: e
                .get("class")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned),
            params: list(e, "params")?,
        }));
    }
    records.push(Record::Permissions(Permissions {
        ops: list(&v, "ops")?,
        calls: list(&v, "calls")?,
    }));
    // Absent from kits before it existed: nothing reaches objects there.
    if v.get("reaches_objects").is_some() {
        records.push(Record::ReachesObjects(list(&v, "reaches_objects")?));
    }
    match v.get("single_instance") {
        None | Some(serde_json::Value::Bool(false)) => {}
        Some(serde_json::Value::Bool(true)) => records.push(Record::SingleInstance),
        Some(other) => return Err(format!("`single_instance` is not a boolean: {other}")),
    }
    let mut section = Vec::new();
    for r in &records {
        section.extend(r.frame().map_err(|e| e.to_string())?);
    }
    Manifest::from_section(&section).map_err(|e| e.to_string())
}

/// Appends `manifest` to a component as a top-level custom section named
/// [`MANIFEST_SECTION`].
///
/// # Errors
/// When the bytes are not a component, or the manifest does not encode.
pub fn append_manifest(component: &mut Vec<u8>, manifest: &Manifest) -> Result<()> {
    if component.get(..8) != Some(b"\0asm\x0d\0\x01\0".as_slice()) {
        return Err(err("componentize-py did not write a component"));
    }
    let records = manifest.records();
    let mut payload = Vec::new();
    leb(&mut payload, MANIFEST_SECTION.len());
    payload.extend_from_slice(MANIFEST_SECTION.as_bytes());
    for r in &records {
        payload.extend(
            r.frame()
                .map_err(|e| err(format!("encoding the manifest: {e}")))?,
        );
    }
    component.push(0);
    leb(component, payload.len());
    component.extend(payload);
    Ok(())
}

fn leb(out: &mut Vec<u8>, mut n: usize) {
    loop {
        // The low seven bits, then a continuation flag.
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESCRIBED: &str = r#"{"name": "seed-fns-py", "version": "0.1.0",
        "exports": [
            {"name": "my_py_add", "kind": "function", "class": null, "params": ["a", "b"]},
            {"name": "MyClass", "kind": "constructor", "class": "MyClass", "params": ["a"]},
            {"name": "get_value", "kind": "method", "class": "MyClass", "params": []}
        ],
        "ops": [], "calls": ["seed_fns::*"]}"#;

    #[test]
    fn the_kits_description_becomes_a_manifest() {
        let m = manifest_from_json(DESCRIBED).unwrap();
        assert_eq!((m.name.as_str(), m.abi), ("seed-fns-py", ABI_VERSION));
        assert_eq!(m.function("my_py_add").unwrap().params, ["a", "b"]);
        assert_eq!(m.constructor("MyClass").unwrap().params, ["a"]);
        assert!(m.method("MyClass", "get_value").is_some());
        assert_eq!(m.permissions.calls, ["seed_fns::*"]);
        assert!(manifest_from_json(r#"{"name": "x"}"#).is_err());
    }

    #[test]
    fn the_manifest_section_is_appended_to_a_component() {
        let m = manifest_from_json(DESCRIBED).unwrap();
        let mut component = b"\0asm\x0d\0\x01\0".to_vec();
        append_manifest(&mut component, &m).unwrap();
        // The section: id 0, a size, the name, then the framed records.
        assert_eq!(component[8], 0);
        let name = MANIFEST_SECTION.as_bytes();
        let at = component
            .windows(name.len())
            .position(|w| w == name)
            .unwrap();
        let back = Manifest::from_section(&component[at + name.len()..]).unwrap();
        assert_eq!(back, m);
        assert!(append_manifest(&mut b"\0asm\x01\0\0\0".to_vec(), &m).is_err());
    }

    #[test]
    fn the_entry_names_the_plugin_and_imports_the_app() {
        let p = Plugin {
            dir: "x".into(),
            module: "app".into(),
            name: "seed-fns-py".into(),
            version: "0.2.0".into(),
        };
        let e = entry_module(&p, &["datetime".to_owned()]);
        assert!(e.contains("_registry.configure(\"seed-fns-py\", \"0.2.0\")"));
        assert!(e.contains("import app"));
        assert!(e.contains("from wasmrpc._guest import Guest"));
        assert!(e.contains("for _name in [\"datetime\"]:"), "{e}");
    }
}
