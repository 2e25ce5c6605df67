//! Builds every plugin under `plugins/` for `wasm32-unknown-unknown` with a
//! nested `cargo build`, then writes their paths and the `foreach_plugin!`
//! macro into `$OUT_DIR/plugins.rs` (Wasmtime's test-programs-artifacts
//! pattern).

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
    fs::write(out_dir.join("plugins.rs"), code).expect("cannot write plugins.rs");
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
