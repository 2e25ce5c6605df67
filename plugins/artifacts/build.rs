//! Builds every plugin under `plugins/` for `wasm32-unknown-unknown` with a
//! nested `cargo build`, then writes their paths and the `foreach_plugin!`
//! macro into `$OUT_DIR/plugins.rs` (Wasmtime's test-programs-artifacts
//! pattern). The Python plugins under `plugins/python/` are built into
//! components with `wasmrpc-pybuild` (componentize-py, installed by `cargo
//! xtask setup`), each only when its sources, the guest kit or the WIT world
//! changed since its last build.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-unknown-unknown";

/// Variables of the outer build that must not reach the nested one: they
/// carry flags, a target or a jobserver meant for the host build.
const SCRUB: &[&str] = &[
    "CARGO_ENCODED_RUSTFLAGS",
    "RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_BUILD_TARGET",
    "CARGO_MAKEFLAGS",
    "MAKEFLAGS",
    "MFLAGS",
    "RUSTC_WORKSPACE_WRAPPER",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_LLVM_COV",
    "CARGO_LLVM_COV_TARGET_DIR",
    "LLVM_PROFILE_FILE",
    "__CARGO_FIX_PLZ",
];

fn main() {
    let manifest_dir =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let plugins_dir = manifest_dir
        .parent()
        .expect("plugins/artifacts has a parent")
        .to_path_buf();
    let root = plugins_dir
        .parent()
        .expect("plugins/ has a parent")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    println!("cargo:rerun-if-changed={}", plugins_dir.display());
    println!(
        "cargo:rerun-if-changed={}",
        root.join("guest-sdk").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        root.join("Cargo.toml").display()
    );
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    check_target_installed();

    let target_dir = target_dir(&out_dir).join("wasm-plugins");
    let plugins = find_plugins(&plugins_dir);

    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--release")
        .arg("--target")
        .arg(TARGET)
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    for (package, _) in &plugins {
        cmd.arg("-p").arg(package);
    }
    for var in SCRUB {
        cmd.env_remove(var);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo for the plugins: {e}"));
    assert!(
        status.success(),
        "building the wasm plugins failed (see the cargo output above)"
    );

    let mut code = String::new();
    let mut names = Vec::new();
    for (package, short) in &plugins {
        let file = target_dir
            .join(TARGET)
            .join("release")
            .join(format!("{}.wasm", package.replace('-', "_")));
        assert!(file.exists(), "cargo did not produce {}", file.display());
        let konst = short.to_uppercase().replace('-', "_");
        let ident = short.replace('-', "_");
        code.push_str(&format!(
            "/// The `{package}` plugin, built for `{TARGET}`.\npub const {konst}: &str = {:?};\n",
            file.display().to_string()
        ));
        names.push((ident, konst, package.clone()));
    }
    code.push_str("/// Every plugin: `(package name, path of the .wasm file)`.\npub const PLUGINS: &[(&str, &str)] = &[\n");
    for (_, konst, package) in &names {
        code.push_str(&format!("    ({package:?}, {konst}),\n"));
    }
    code.push_str("];\n");
    code.push_str(
        "/// Calls `$mac!(name)` once per plugin, with the plugin's short name\n\
         /// (`seed_fns` for `plugins/seed-fns`). A test module that invokes it\n\
         /// with a macro requiring an item per plugin fails to compile when a\n\
         /// plugin has no test.\n\
         #[macro_export]\nmacro_rules! foreach_plugin {\n    ($mac:ident) => {\n",
    );
    for (ident, _, _) in &names {
        code.push_str(&format!("        $mac!({ident});\n"));
    }
    code.push_str("    };\n}\n");
    code.push_str(&python_plugins(
        &plugins_dir.join("python"),
        &target_dir.join("python"),
    ));
    fs::write(out_dir.join("plugins.rs"), code).expect("cannot write plugins.rs");
}

/// Builds every Python plugin (a folder of `plugins/python/` with an
/// `app.py`) into `out/<folder>.wasm` unless its stamp says the inputs did
/// not change, and returns the constants naming them.
fn python_plugins(python_dir: &Path, out: &Path) -> String {
    let mut dirs: Vec<PathBuf> = fs::read_dir(python_dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    dirs.retain(|d| d.join("app.py").exists());
    dirs.sort();
    let mut code = String::new();
    let mut all = Vec::new();
    if dirs.is_empty() {
        code.push_str("/// Every Python plugin: `(name, path of the .wasm component)`.\npub const PYTHON_PLUGINS: &[(&str, &str)] = &[];\n");
        return code;
    }
    println!(
        "cargo:rerun-if-changed={}",
        wasmrpc_pybuild::kit_dir().display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        wasmrpc_pybuild::wit_dir().display()
    );
    println!("cargo:rerun-if-env-changed=WASMRPC_COMPONENTIZE_PY_VENV");
    fs::create_dir_all(out).expect("cannot create the Python plugins' folder");
    let toolchain = wasmrpc_pybuild::Toolchain::find().unwrap_or_else(|e| panic!("{e}"));
    // The builder's own code and the manifest format it writes are inputs
    // too: a change to how a section is written rebuilds.
    let guest_sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-sdk");
    let mut stale = Vec::new();
    for dir in dirs {
        let plugin = wasmrpc_pybuild::Plugin::in_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
        let file = out.join(format!("{}.wasm", plugin.name));
        let stamp = file.with_extension("stamp");
        let inputs = format!(
            "{:016x}",
            inputs_hash(&[
                &dir,
                &wasmrpc_pybuild::kit_dir(),
                &wasmrpc_pybuild::wit_dir(),
                &guest_sdk.join("pybuild/src"),
                &guest_sdk.join("abi/src"),
            ])
        );
        let fresh = file.exists() && fs::read_to_string(&stamp).is_ok_and(|s| s == inputs);
        let konst = plugin.name.to_uppercase().replace('-', "_");
        code.push_str(&format!(
            "/// The Python plugin `plugins/python/{name}`, built into a component.\npub const {konst}: &str = {:?};\n",
            file.display().to_string(),
            name = plugin.name,
        ));
        all.push((plugin.name.clone(), konst));
        if !fresh {
            stale.push((plugin, file, stamp, inputs));
        }
    }
    build_in_parallel(&toolchain, &stale);
    code.push_str("/// Every Python plugin: `(name, path of the .wasm component)`.\npub const PYTHON_PLUGINS: &[(&str, &str)] = &[\n");
    for (name, konst) in &all {
        code.push_str(&format!("    ({name:?}, {konst}),\n"));
    }
    code.push_str("];\n");
    code
}

/// Builds the stale Python plugins, as many at once as Cargo gives this
/// script jobs (`NUM_JOBS`): each build is one componentize-py process that
/// keeps one core busy for 10-20 s, and the build script is the last step of
/// a fresh build, when the other cores have nothing left to compile. A
/// plugin's stamp is written only once its build succeeded.
fn build_in_parallel(
    toolchain: &wasmrpc_pybuild::Toolchain,
    stale: &[(wasmrpc_pybuild::Plugin, PathBuf, PathBuf, String)],
) {
    let jobs = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, stale.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                scope.spawn(|| {
                    let mut failures = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((plugin, file, stamp, inputs)) = stale.get(i) else {
                            return failures;
                        };
                        match wasmrpc_pybuild::build(toolchain, plugin, file) {
                            Ok(_) => fs::write(stamp, inputs)
                                .expect("cannot write a Python plugin's stamp"),
                            Err(e) => failures.push(e.to_string()),
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a Python plugin's build thread panicked"))
            .collect()
    });
    if !failures.is_empty() {
        panic!("{}", failures.join("\n"));
    }
}

/// A hash of every file's path and contents under `roots` (the inputs of a
/// Python plugin's build), and of the componentize-py version.
fn inputs_hash(roots: &[&Path]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut files = Vec::new();
    let mut stack: Vec<PathBuf> = roots.iter().map(|r| r.to_path_buf()).collect();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "__pycache__") {
                continue;
            }
            for e in fs::read_dir(&p).into_iter().flatten().flatten() {
                stack.push(e.path());
            }
        } else {
            files.push(p);
        }
    }
    files.sort();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    wasmrpc_pybuild::COMPONENTIZE_PY_VERSION.hash(&mut h);
    for f in files {
        f.hash(&mut h);
        fs::read(&f).unwrap_or_default().hash(&mut h);
    }
    h.finish()
}

/// Fails with the fix when the standard library for wasm32 is missing.
fn check_target_installed() {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let sysroot = Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let installed =
        sysroot.is_some_and(|s| Path::new(&s).join("lib/rustlib").join(TARGET).exists());
    if !installed {
        panic!(
            "the {TARGET} target is not installed, so the wasm plugins cannot be built: \
             run `rustup target add {TARGET}` (or `cargo xtask setup`)"
        );
    }
}

/// The outer build's target directory: `CARGO_TARGET_DIR`, or the first
/// ancestor of `OUT_DIR` that cargo tagged with `CACHEDIR.TAG`.
fn target_dir(out_dir: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("CARGO_TARGET_DIR") {
        let dir = PathBuf::from(dir);
        if dir.is_absolute() {
            return dir;
        }
    }
    out_dir
        .ancestors()
        .find(|a| a.join("CACHEDIR.TAG").exists())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| out_dir.join("target"))
}

/// `(package name, folder name)` of every plugin crate under `plugins/`.
fn find_plugins(plugins_dir: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let entries = fs::read_dir(plugins_dir).expect("cannot list plugins/");
    for entry in entries.flatten() {
        let dir = entry.path();
        let short = entry.file_name().to_string_lossy().into_owned();
        if short == "artifacts" || !dir.join("Cargo.toml").exists() {
            continue;
        }
        let manifest =
            fs::read_to_string(dir.join("Cargo.toml")).expect("cannot read a plugin's Cargo.toml");
        let package = manifest
            .lines()
            .find_map(|l| {
                let l = l.trim();
                let rest = l.strip_prefix("name")?.trim_start().strip_prefix('=')?;
                Some(rest.trim().trim_matches('"').to_owned())
            })
            .unwrap_or_else(|| panic!("{} has no package name", dir.display()));
        found.push((package, short));
    }
    found.sort();
    found
}
