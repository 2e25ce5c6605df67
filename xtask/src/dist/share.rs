//! What a bundle carries besides the binary and its libraries, under
//! `share/wasmrpc/`: the example plugins, the demo's data, the deployment
//! recipes, and the plugin SDK (the Rust guest SDK's crates as a workspace
//! of their own, the Python kit, the WIT world).

use anyhow::{Context, Result};
use std::path::Path;

/// The plugins the bundle ships: the examples' (the demo's among them).
pub(super) const EXAMPLE_PLUGINS: &[&str] = &["param-server", "hello", "pipeline", "rl"];
/// The plugins, the demo's data, the deployment recipes and the SDK.
pub(super) fn copy_share(root: &Path, share: &Path) -> Result<()> {
    let plugins = share.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    for name in EXAMPLE_PLUGINS {
        let wasm = crate::demo::built_plugin(root, name)?;
        // Named by the plugin's namespace (`param_server.wasm`), as users
        // call its functions.
        let file = format!("{}.wasm", name.replace('-', "_"));
        std::fs::copy(&wasm, plugins.join(file))?;
    }
    copy_tree(&root.join("examples/data"), &share.join("examples/data"))?;
    let deploy = root.join("examples/deploy");
    if deploy.is_dir() {
        copy_tree(&deploy, &share.join("deploy"))?;
    }
    let sdk = share.join("sdk");
    copy_tree(&root.join("guest-sdk/python"), &sdk.join("python"))?;
    copy_tree(&root.join("guest-sdk/wit"), &sdk.join("wit"))?;
    for krate in ["guest-sdk", "guest-sdk/abi", "guest-sdk/macros"] {
        let to = sdk.join("rust").join(krate);
        for part in ["src", "README.md"] {
            let from = root.join(krate).join(part);
            if from.is_dir() {
                copy_tree(&from, &to.join(part))?;
            } else if from.is_file() {
                std::fs::create_dir_all(&to)?;
                std::fs::copy(&from, to.join(part))?;
            }
        }
        // The tests stay in the repository, and so do their dependencies
        // (crates of this repository the bundle does not ship).
        let manifest = std::fs::read_to_string(root.join(krate).join("Cargo.toml"))?;
        std::fs::write(
            to.join("Cargo.toml"),
            without_section(&manifest, "[dev-dependencies]"),
        )?;
    }
    std::fs::write(
        sdk.join("rust/Cargo.toml"),
        sdk_workspace_manifest(root, &["guest-sdk", "guest-sdk/abi", "guest-sdk/macros"])?,
    )?;
    Ok(())
}

/// A workspace manifest for the SDK's crates outside this repository: the
/// root manifest's `[workspace.package]`, `[workspace.lints]` and those
/// `[workspace.dependencies]` that are not other crates of this repository.
pub(super) fn sdk_workspace_manifest(root: &Path, members: &[&str]) -> Result<String> {
    let text = std::fs::read_to_string(root.join("Cargo.toml"))?;
    let mut out = String::from(
        "# The wasmrpc guest SDK's crates, as a workspace of their own: a plugin\n\
         # depends on them by path (`wasmrpc-guest = { path = \".../sdk/rust/guest-sdk\" }`).\n\
         [workspace]\nresolver = \"3\"\nmembers = [",
    );
    out.push_str(
        &members
            .iter()
            .map(|m| format!("\"{m}\""))
            .collect::<Vec<_>>()
            .join(", "),
    );
    out.push_str("]\n");
    let mut section = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') {
            section = trimmed.to_owned();
            if section.starts_with("[workspace.") {
                out.push('\n');
                out.push_str(line);
                out.push('\n');
            }
            continue;
        }
        if !section.starts_with("[workspace.") {
            continue;
        }
        if section == "[workspace.dependencies]"
            && let Some(path) = dependency_path(trimmed)
        {
            // Only the SDK's own crates: the host's are not in the bundle.
            if members.contains(&path) {
                out.push_str(line);
                out.push('\n');
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

/// `manifest` without the TOML table `header` (up to the next table).
pub(super) fn without_section(manifest: &str, header: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for line in manifest.lines() {
        if line.trim_start().starts_with('[') {
            skipping = line.trim() == header;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The `path = "..."` of a dependency line, if it has one.
pub(super) fn dependency_path(line: &str) -> Option<&str> {
    let rest = &line[line.find("path = \"")? + 8..];
    rest.split('"').next()
}

/// Copies the tree `from` into `to` (files and folders; no caches).
pub(super) fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("listing {}", from.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        if name == "__pycache__" || name == "target" {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            copy_tree(&path, &to.join(&name))?;
        } else {
            std::fs::copy(&path, to.join(&name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}
