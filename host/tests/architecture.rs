//! The host library's layering, checked from its own source: the RPC core
//! (the agent, the transport, values, builtin ops, devices, tensors, errors,
//! worker names) names no feature. Features (RRefs, distributed autograd,
//! the profiler, plugins, the optimizer, RemoteModule) plug into the agent
//! as extensions (`wasmrpc::Extension`) and may use the core and each
//! other; the crate root (`lib.rs`) and the harness (`testing.rs`) put
//! them together.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Top-level modules of the core.
const CORE: &[&str] = &[
    "agent",
    "transport",
    "value",
    "ops",
    "device",
    "tensor",
    "error",
    "worker",
    "progress",
];

/// Top-level modules of the features.
const FEATURES: &[&str] = &[
    "rref",
    "dist_autograd",
    "profiler",
    "plugin",
    "optim",
    "remote_module",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reads the source tree") {
        let path = entry.expect("reads a directory entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The files of top-level module `name`: `name.rs` and `name/**`.
fn module_files(name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let file = src().join(format!("{name}.rs"));
    if file.exists() {
        out.push(file);
    }
    let dir = src().join(name);
    if dir.is_dir() {
        files(&dir, &mut out);
    }
    out
}

/// `source` without comments (line comments, doc comments and block
/// comments), so that docs may name features.
fn code_of(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
        } else if rest.starts_with('"') {
            // Strings may hold `//` (URLs); keep them, skipping escapes.
            let bytes = rest.as_bytes();
            let mut i = 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            let end = (i + 1).min(rest.len());
            out.push_str(&rest[..end]);
            rest = &rest[end..];
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The names the crate root re-exports from the features
/// (`pub use rref::{RRef, ...}` in `lib.rs`): a core file naming
/// `crate::RRef` names the feature as surely as `crate::rref::RRef`.
fn feature_reexports() -> BTreeSet<String> {
    let lib = code_of(&std::fs::read_to_string(src().join("lib.rs")).expect("reads lib.rs"));
    let mut names = BTreeSet::new();
    for statement in lib.split(';') {
        let statement = statement.trim();
        let Some(path) = statement.strip_prefix("pub use ") else {
            continue;
        };
        let Some(feature) = FEATURES
            .iter()
            .find(|f| path.starts_with(&format!("{f}::")))
        else {
            continue;
        };
        let items = &path[feature.len() + 2..];
        let items = items.trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.split(" as ").last().unwrap_or(item).trim();
            let name = name.rsplit("::").next().unwrap_or(name).trim();
            if !name.is_empty() && name != "self" {
                names.insert(name.to_string());
            }
        }
    }
    names
}

/// Whether `code` contains `word` as a whole path segment after `prefix`.
fn names(code: &str, prefix: &str, word: &str) -> bool {
    let needle = format!("{prefix}{word}");
    code.match_indices(&needle).any(|(i, _)| {
        let after = code[i + needle.len()..].chars().next();
        !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn the_core_names_no_feature() {
    let reexports = feature_reexports();
    assert!(
        reexports.contains("RRef"),
        "the root's feature re-exports were not found: {reexports:?}"
    );
    let mut violations = Vec::new();
    for core in CORE {
        let module = module_files(core);
        assert!(!module.is_empty(), "core module {core} has no files");
        for file in module {
            let code = code_of(&std::fs::read_to_string(&file).expect("reads a source file"));
            let rel = file
                .strip_prefix(src())
                .unwrap_or(&file)
                .display()
                .to_string();
            for feature in FEATURES {
                if names(&code, "crate::", feature) {
                    violations.push(format!("{rel} names crate::{feature}"));
                }
            }
            for name in &reexports {
                if names(&code, "crate::", name) {
                    violations.push(format!("{rel} names crate::{name} (a feature's)"));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "the core must not name a feature (plug it in as an Extension instead):\n{}",
        violations.join("\n")
    );
}

#[test]
fn a_feature_name_in_a_comment_or_string_is_not_a_use() {
    let code =
        code_of("// crate::rref\nlet s = \"crate::rref\"; /* crate::optim */ crate::value::X");
    assert!(!names(&code, "crate::", "optim"));
    assert!(names(&code, "crate::", "value"));
    assert!(names(&code, "crate::", "rref"), "strings are kept: {code}");
    assert!(!names("crate::rrefs", "crate::", "rref"));
}

/// Files stay small enough to read in one sitting: a file that grows past
/// this is split along what it owns (its tests in a `tests.rs` beside it,
/// a part with its own concern in a submodule).
const MAX_LINES: usize = 600;

#[test]
fn no_source_file_is_longer_than_600_lines() {
    let mut all = Vec::new();
    files(&src(), &mut all);
    let long: Vec<String> = all
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).ok()?.lines().count();
            let rel = f.strip_prefix(src()).unwrap_or(f).display().to_string();
            (lines > MAX_LINES).then(|| format!("{rel}: {lines} lines"))
        })
        .collect();
    assert!(long.is_empty(), "split these files:\n{}", long.join("\n"));
}
