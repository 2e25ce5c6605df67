//! The demo's build against the tests' build, unit by unit: which of the
//! crates `cargo xtask demo` compiles the test build of `cargo xtask test`
//! would compile again, with other features or other dependencies.
//!
//! The two builds share every dependency only while `wasmrpc` depends on
//! some crates with the features the workspace's dev-dependencies turn on
//! (the workspace manifest lists them, and the guide's "CI's time" says
//! what a difference costs). A new dependency can break that silently, so a
//! test compares the unit graphs of both commands. Cargo prints a unit
//! graph only with `-Z unstable-options`, which `RUSTC_BOOTSTRAP=1` allows
//! on a stable toolchain; nothing is built.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// One compiled unit of a build: its package, target, mode and, folded
/// into `identity`, everything that makes Cargo compile it anew (features,
/// profile settings but the profile's name, platform, and the identities
/// of its dependencies).
#[derive(Debug)]
pub(crate) struct Unit {
    pub(crate) package: String,
    pub(crate) target: String,
    pub(crate) mode: String,
    pub(crate) identity: u64,
}

/// The units `cargo <args> --unit-graph` would compile, run in `root`.
pub(crate) fn units(root: &Path, args: &[&str]) -> Result<Vec<Unit>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(args)
        .args([
            "--unit-graph",
            "-Z",
            "unstable-options",
            "--locked",
            "--offline",
        ])
        .env("RUSTC_BOOTSTRAP", "1")
        .current_dir(root)
        .output()
        .with_context(|| format!("cannot run {cargo}"))?;
    if !out.status.success() {
        bail!(
            "cargo {} --unit-graph failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let graph: Value = serde_json::from_slice(&out.stdout).context("the unit graph")?;
    let Some(raw) = graph["units"].as_array() else {
        bail!("the unit graph has no units");
    };
    let mut identities: HashMap<usize, u64> = HashMap::new();
    (0..raw.len())
        .map(|i| {
            let u = &raw[i];
            Ok(Unit {
                package: u["pkg_id"].as_str().unwrap_or_default().to_owned(),
                target: u["target"]["name"].as_str().unwrap_or_default().to_owned(),
                mode: u["mode"].as_str().unwrap_or_default().to_owned(),
                identity: identity(raw, i, &mut identities, 0)?,
            })
        })
        .collect()
}

fn identity(raw: &[Value], i: usize, memo: &mut HashMap<usize, u64>, depth: usize) -> Result<u64> {
    if let Some(&h) = memo.get(&i) {
        return Ok(h);
    }
    if depth > raw.len() {
        bail!("the unit graph has a cycle");
    }
    let u = &raw[i];
    let mut profile = u["profile"].clone();
    if let Some(p) = profile.as_object_mut() {
        // `dev` for the demo, `test` for the tests: the same settings.
        p.remove("name");
    }
    let mut deps = Vec::new();
    for d in u["dependencies"].as_array().into_iter().flatten() {
        let j = d["index"].as_u64().context("a dependency without index")? as usize;
        deps.push(identity(raw, j, memo, depth + 1)?);
    }
    deps.sort_unstable();
    let mut features: Vec<String> = u["features"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect();
    features.sort();
    let mut h = DefaultHasher::new();
    (
        u["pkg_id"].to_string(),
        u["target"]["name"].to_string(),
        u["target"]["kind"].to_string(),
        u["mode"].to_string(),
        features,
        profile.to_string(),
        u["platform"].to_string(),
        deps,
    )
        .hash(&mut h);
    let h = h.finish();
    memo.insert(i, h);
    Ok(h)
}

/// The units of `first` that `second` does not have as they are: what
/// `second` compiles again after `first`.
pub(crate) fn compiled_again<'a>(first: &'a [Unit], second: &[Unit]) -> Vec<&'a Unit> {
    let twins: BTreeSet<u64> = second.iter().map(|u| u.identity).collect();
    first
        .iter()
        .filter(|u| !twins.contains(&u.identity))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo's build (`cargo build -p wasmrpc --bin wasmrpc`, as
    /// `cargo xtask demo` runs it) and the tests' (`cargo nextest run`
    /// builds what `cargo test --no-run` does) differ only in `wasmrpc`,
    /// which the tests build with its `testing` feature.
    #[test]
    fn the_tests_build_compiles_again_only_what_the_demo_built_for_other_features() {
        let root = crate::workspace_root();
        let demo = units(&root, &["build", "-p", "wasmrpc", "--bin", "wasmrpc"]).expect("demo");
        let tests = units(&root, &["test", "--no-run"]).expect("tests");
        assert!(
            demo.iter().any(|u| u.target == "wasmtime"),
            "the demo's graph has no wasmtime: {} units",
            demo.len()
        );
        let again: Vec<String> = compiled_again(&demo, &tests)
            .into_iter()
            .filter(|u| !u.package.contains("#wasmrpc@"))
            .map(|u| format!("{} ({}, {})", u.package, u.target, u.mode))
            .collect();
        assert!(
            again.is_empty(),
            "the tests' build would compile these again, with other features or other \
             dependencies than the demo's: pin the feature at the bottom in wasmrpc's \
             manifest (see the workspace manifest's note):\n{}",
            again.join("\n")
        );
    }

    #[test]
    fn a_unit_with_other_features_or_dependencies_is_compiled_again() {
        let unit = |package: &str, identity| Unit {
            package: package.into(),
            target: "lib".into(),
            mode: "build".into(),
            identity,
        };
        let first = [unit("a", 1), unit("b", 2)];
        let second = [unit("a", 1), unit("b", 3)];
        let again: Vec<&str> = compiled_again(&first, &second)
            .iter()
            .map(|u| u.package.as_str())
            .collect();
        assert_eq!(again, ["b"]);
    }
}
