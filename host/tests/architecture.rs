//! The workspace's house rules, checked from its own source.
//!
//! For every crate the workspace's `Cargo.toml` lists as a member:
//!
//! - no non-test source file (`*.rs`, and the C++ shims' `*.cpp` and `*.h`)
//!   is longer than [`MAX_LINES`];
//! - no non-test Rust file imports its parent's whole namespace with
//!   `use super::*;` (a child module imports what it uses by name; test
//!   modules may glob their parent).
//!
//! Test files are those under a `tests/` folder (integration tests and the
//! integration-test crates), files named `tests.rs`, and, for the glob rule,
//! `mod tests { ... }` and `#[cfg(test)] mod name { ... }` blocks.
//!
//! And for the host library: the RPC core (the agent, the transport, values,
//! builtin ops, devices, tensors, errors, worker names) names no feature.
//! Features (RRefs, distributed autograd, the profiler, plugins, the
//! optimizer, RemoteModule) plug into the agent as extensions
//! (`wasmrpc::Extension`) and may use the core and the features in layers
//! below them ([`FEATURES`] is their order); the crate root (`lib.rs`) and
//! the harness (`testing.rs`) put them together. The top-level modules are
//! read from `lib.rs`; only which of them are core, and the features'
//! order, are kept here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of the host library's core.
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
    // Starts an agent on a backend chosen by name: the core's entry point.
    "backend_registry",
];

/// Top-level modules of the host library's features: everything the core
/// must not name. In layers, the lowest first: a feature names the core and
/// the features before it, never one after it (what a lower feature needs
/// from a higher one goes through the agent: a call option, a hook of
/// `Extension`).
const FEATURES: &[&str] = &[
    // Carries trace contexts and records calls' spans; knows no other
    // feature.
    "trace",
    // Times calls and ops; knows no other feature.
    "profiler",
    // RRefs: `remote()`'s creation is profiled.
    "rref",
    // Contexts follow calls, RRefs' `backward` and `to_here`.
    "dist_autograd",
    // Steps with the gradients of a context, over parameter RRefs.
    "optim",
    "remote_module",
    // Plugins reach every feature through their host functions.
    "plugin",
    "metrics",
    // The test harness puts core and features together, like the root.
    "testing",
];

/// Files stay small enough to read in one sitting: a file that grows past
/// this is split along what it owns (its tests in a `tests.rs` beside it,
/// a part with its own concern in a submodule).
const MAX_LINES: usize = 600;

/// Files excused from the rules above (path from the workspace root, and
/// why). An entry a file no longer needs is an error: remove it.
const ALLOWED: &[(&str, &str)] = &[];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the host crate sits in the workspace")
        .to_path_buf()
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The `members` of the workspace's `Cargo.toml`, as folders relative to it.
fn members(manifest: &str) -> Vec<String> {
    let mut offset = 0;
    for line in manifest.split_inclusive('\n') {
        if line.trim_start().starts_with("members = [") {
            break;
        }
        offset += line.len();
    }
    let rest = &manifest[offset..];
    let start = rest
        .find("members = [")
        .expect("the workspace manifest lists its members");
    let list = &rest[start + "members = [".len()..];
    let list = &list[..list.find(']').expect("the members list ends")];
    list.lines()
        .map(|line| line.split('#').next().unwrap_or(""))
        .flat_map(|line| line.split(','))
        .map(|item| item.trim().trim_matches('"').to_string())
        .filter(|item| !item.is_empty())
        .collect()
}

/// Every file under `dir` whose name ends in one of `exts`, leaving out
/// build outputs and hidden folders.
fn files(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reads the source tree") {
        let path = entry.expect("reads a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                files(&path, exts, out);
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| exts.contains(&e))
        {
            out.push(path);
        }
    }
}

/// Every source file of every workspace member, relative to the workspace.
fn workspace_sources() -> BTreeSet<String> {
    let root = workspace();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("reads Cargo.toml");
    let members = members(&manifest);
    assert!(
        members.iter().any(|m| m == "host") && members.len() > 5,
        "the workspace members were not found: {members:?}"
    );
    let mut all = Vec::new();
    for member in &members {
        let dir = root.join(member);
        assert!(dir.is_dir(), "workspace member {member} is not a folder");
        files(&dir, &["rs", "cpp", "h"], &mut all);
    }
    all.iter()
        .map(|f| f.strip_prefix(&root).unwrap_or(f).display().to_string())
        .collect()
}

/// Whether `rel` (a path from the workspace root) is a test file: under a
/// `tests/` folder or named `tests.rs`.
fn is_test_file(rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    parts[..parts.len() - 1].contains(&"tests") || parts.last() == Some(&"tests.rs")
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
        files(&dir, &["rs"], &mut out);
    }
    out
}

/// `source` without comments (line comments, doc comments and block
/// comments), so that docs may name features. String literals are kept
/// (a path in a string counts: better a false alarm than a miss).
fn code_of(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
        } else if let Some(len) = char_literal(rest) {
            out.push_str(&rest[..len]);
            rest = &rest[len..];
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

/// The length of the char literal `rest` starts with (`'"'`, `'\''`), if
/// it starts with one rather than a lifetime.
fn char_literal(rest: &str) -> Option<usize> {
    let after = rest.strip_prefix('\'')?;
    if let Some(escaped) = after.strip_prefix('\\') {
        return escaped.find('\'').map(|i| i + 3);
    }
    let c = after.chars().next()?;
    after[c.len_utf8()..]
        .starts_with('\'')
        .then_some(c.len_utf8() + 2)
}

/// The tokens of `code`: identifiers, `::`, and single other characters.
fn tokens(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(c) = rest.chars().next() {
        let len = if c.is_whitespace() {
            rest = &rest[c.len_utf8()..];
            continue;
        } else if c.is_alphanumeric() || c == '_' {
            rest.find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len())
        } else if rest.starts_with("::") {
            2
        } else {
            c.len_utf8()
        };
        out.push(&rest[..len]);
        rest = &rest[len..];
    }
    out
}

/// The names `code` reaches at the crate root, from a file `depth` modules
/// below it (`transport/shm.rs` is 2): `crate::x`, `crate::{x, y::z}` and
/// `super::...::x` with `depth` supers all name `x` (and `y`).
fn root_names(code: &str, depth: usize) -> BTreeSet<String> {
    let tokens = tokens(code);
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < tokens.len() {
        // A path's first segment: not after `::` or `$` (`$crate`).
        let starts = i == 0 || !matches!(tokens[i - 1], "::" | "$");
        let mut at = None;
        if starts && tokens[i] == "crate" {
            at = Some(i + 1);
        } else if starts && tokens[i] == "super" {
            let mut supers = 1;
            let mut j = i + 1;
            while tokens.get(j) == Some(&"::") && tokens.get(j + 1) == Some(&"super") {
                supers += 1;
                j += 2;
            }
            if supers >= depth {
                at = Some(j);
            }
        }
        if let Some(j) = at
            && tokens.get(j) == Some(&"::")
        {
            match tokens.get(j + 1) {
                Some(&"{") => {
                    // The first segment of each item of the group.
                    let mut level = 0;
                    let mut first = true;
                    for token in &tokens[j + 1..] {
                        match *token {
                            "{" => {
                                level += 1;
                                continue;
                            }
                            "}" => {
                                level -= 1;
                                if level == 0 {
                                    break;
                                }
                            }
                            "," if level == 1 => {
                                first = true;
                                continue;
                            }
                            name if level == 1 && first && is_ident(name) => {
                                out.insert(name.to_string());
                            }
                            _ => {}
                        }
                        first = false;
                    }
                }
                Some(name) if is_ident(name) => {
                    out.insert(name.to_string());
                }
                _ => {}
            }
        }
        i += 1;
    }
    out.remove("self");
    out
}

fn is_ident(token: &str) -> bool {
    token
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The top-level modules `lib.rs` declares from files (`mod x;`, with any
/// visibility and attributes; inline `mod x { ... }` blocks are not files).
fn declared_modules(lib: &str) -> Vec<String> {
    let tokens = tokens(lib);
    let mut out = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        if *token == "mod"
            && let (Some(name), Some(&";")) = (tokens.get(i + 1), tokens.get(i + 2))
        {
            out.push(name.to_string());
        }
    }
    out
}

/// The names the crate root re-exports from the features
/// (`pub use rref::{RRef, ...}` in `lib.rs`): a core file naming
/// `crate::RRef` names the feature as surely as `crate::rref::RRef`.
fn feature_reexports(lib: &str) -> BTreeMap<String, &'static str> {
    let mut names = BTreeMap::new();
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
                names.insert(name.to_string(), *feature);
            }
        }
    }
    names
}

/// How many modules below the crate root the file at `rel` (from `src/`)
/// is: `value.rs` is 1, `transport/shm/link.rs` is 3, `x/mod.rs` is 1.
fn depth_of(rel: &Path) -> usize {
    let parts = rel.components().count();
    if rel.file_name().is_some_and(|n| n == "mod.rs") {
        parts - 1
    } else {
        parts
    }
}

#[test]
fn every_top_level_module_is_core_or_a_feature() {
    let lib = code_of(&std::fs::read_to_string(src().join("lib.rs")).expect("reads lib.rs"));
    let modules = declared_modules(&lib);
    assert!(
        modules.iter().any(|m| m == "agent"),
        "lib.rs's modules were not found: {modules:?}"
    );
    let unclassified: Vec<&String> = modules
        .iter()
        .filter(|m| !CORE.contains(&m.as_str()) && !FEATURES.contains(&m.as_str()))
        .collect();
    assert!(
        unclassified.is_empty(),
        "say whether these modules are core or features (CORE or FEATURES): {unclassified:?}"
    );
    let stale: Vec<&&str> = CORE
        .iter()
        .chain(FEATURES)
        .filter(|m| !modules.iter().any(|d| d == *m))
        .collect();
    assert!(
        stale.is_empty(),
        "lib.rs declares no such modules: {stale:?}"
    );
}

#[test]
fn the_core_names_no_feature() {
    let lib = code_of(&std::fs::read_to_string(src().join("lib.rs")).expect("reads lib.rs"));
    let reexports = feature_reexports(&lib);
    assert!(
        reexports.contains_key("RRef"),
        "the root's feature re-exports were not found: {reexports:?}"
    );
    let mut violations = Vec::new();
    for core in declared_modules(&lib)
        .iter()
        .filter(|m| CORE.contains(&m.as_str()))
    {
        let module = module_files(core);
        assert!(!module.is_empty(), "core module {core} has no files");
        for file in module {
            let code = code_of(&std::fs::read_to_string(&file).expect("reads a source file"));
            let rel = file.strip_prefix(src()).unwrap_or(&file);
            let named = root_names(&code, depth_of(rel));
            for name in &named {
                if FEATURES.contains(&name.as_str()) {
                    violations.push(format!("{} names feature {name}", rel.display()));
                } else if reexports.contains_key(name) {
                    violations.push(format!("{} names {name} (a feature's)", rel.display()));
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
fn a_feature_names_only_the_features_below_it() {
    let lib = code_of(&std::fs::read_to_string(src().join("lib.rs")).expect("reads lib.rs"));
    let reexports = feature_reexports(&lib);
    let mut violations = Vec::new();
    for (layer, feature) in FEATURES.iter().enumerate() {
        let above = &FEATURES[layer + 1..];
        let module = module_files(feature);
        assert!(!module.is_empty(), "feature {feature} has no files");
        for file in module {
            let rel = file.strip_prefix(src()).unwrap_or(&file);
            if is_test_file(&rel.display().to_string()) {
                continue;
            }
            let text = std::fs::read_to_string(&file).expect("reads a source file");
            let code = without_test_modules(&code_of(&text));
            for name in root_names(&code, depth_of(rel)) {
                let named = reexports.get(&name).copied().unwrap_or(name.as_str());
                if above.contains(&named) {
                    violations.push(format!(
                        "{} ({feature}) names {name}, of {named}, a layer above",
                        rel.display()
                    ));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "a feature must not name a feature above it in FEATURES (go through the agent: a \
         call option, an Extension hook):\n{}",
        violations.join("\n")
    );
}

/// The `(path, lines)` of each file in `files` (path, text) over
/// [`MAX_LINES`], but for those `allowed`.
fn too_long<'a>(files: &'a [(String, String)], allowed: &[&str]) -> Vec<(&'a str, usize)> {
    files
        .iter()
        .filter(|(rel, _)| !is_test_file(rel) && !allowed.contains(&rel.as_str()))
        .map(|(rel, text)| (rel.as_str(), text.lines().count()))
        .filter(|(_, lines)| *lines > MAX_LINES)
        .collect()
}

/// `code` without its test modules: `mod tests { ... }` blocks and any
/// `#[cfg(test)] mod name { ... }`.
fn without_test_modules(code: &str) -> String {
    let tokens = tokens(code);
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let cfg_test = i >= 5 && tokens[i - 5..i] == ["cfg", "(", "test", ")", "]"];
        if tokens[i] == "mod"
            && (tokens.get(i + 1) == Some(&"tests") || cfg_test)
            && tokens.get(i + 2) == Some(&"{")
        {
            let mut level = 0;
            i += 2;
            while i < tokens.len() {
                match tokens[i] {
                    "{" => level += 1,
                    "}" => level -= 1,
                    _ => {}
                }
                i += 1;
                if level == 0 {
                    break;
                }
            }
            continue;
        }
        out.push(tokens[i]);
        i += 1;
    }
    out.join(" ")
}

/// Whether `code` (outside its test modules) globs its parent's namespace:
/// `use super::*;`, `pub(crate) use super::super::*;`.
fn globs_super(code: &str) -> bool {
    let code = without_test_modules(code);
    let tokens = tokens(&code);
    tokens.iter().enumerate().any(|(i, token)| {
        if *token != "use" {
            return false;
        }
        let mut j = i + 1;
        let mut supers = 0;
        while tokens.get(j) == Some(&"super") && tokens.get(j + 1) == Some(&"::") {
            supers += 1;
            j += 2;
        }
        supers > 0 && tokens.get(j) == Some(&"*")
    })
}

#[test]
fn the_workspace_keeps_the_house_rules() {
    let root = workspace();
    let sources: Vec<(String, String)> = workspace_sources()
        .into_iter()
        .map(|rel| {
            let text = std::fs::read_to_string(root.join(&rel)).expect("reads a source file");
            (rel, text)
        })
        .collect();
    assert!(
        sources
            .iter()
            .any(|(rel, _)| rel == "host/torch-sys/shim/ops.h"),
        "the C++ shims were not found"
    );
    let allowed: Vec<&str> = ALLOWED.iter().map(|(path, _)| *path).collect();
    let mut problems: Vec<String> = too_long(&sources, &allowed)
        .into_iter()
        .map(|(rel, lines)| format!("{rel}: {lines} lines (split it; at most {MAX_LINES})"))
        .collect();
    for (rel, text) in &sources {
        if rel.ends_with(".rs")
            && !is_test_file(rel)
            && !allowed.contains(&rel.as_str())
            && globs_super(&code_of(text))
        {
            problems.push(format!(
                "{rel}: `use super::*` (import what it uses by name)"
            ));
        }
    }
    for (path, why) in ALLOWED {
        let text = sources.iter().find(|(rel, _)| rel == path).map(|(_, t)| t);
        let needed = text
            .is_some_and(|text| text.lines().count() > MAX_LINES || globs_super(&code_of(text)));
        if !needed {
            problems.push(format!(
                "{path} is allowed ({why}) but keeps the rules now: take it off ALLOWED"
            ));
        }
    }
    assert!(problems.is_empty(), "house rules:\n{}", problems.join("\n"));
}

#[test]
fn a_feature_name_in_a_comment_or_string_is_not_a_use() {
    let code =
        code_of("// crate::rref\nlet s = \"crate::rref\"; /* crate::optim */ crate::value::X");
    let named = root_names(&code, 1);
    assert!(!named.contains("optim"));
    assert!(named.contains("value"));
    assert!(named.contains("rref"), "strings are kept: {code}");
    assert!(!root_names("crate::rrefs", 1).contains("rref"));
    // A char literal holding a quote does not open a string.
    let code = code_of("let q = '\"'; // crate::optim\nlet l: &'a str;");
    assert!(!root_names(&code, 1).contains("optim"), "{code}");
}

#[test]
fn a_grouped_import_names_each_of_its_modules() {
    let named = root_names("use crate::{rref, value};", 1);
    assert!(
        named.contains("rref") && named.contains("value"),
        "{named:?}"
    );
    let named = root_names("use crate::{rref::RRef};", 1);
    assert!(named.contains("rref"), "{named:?}");
    let named = root_names(
        "use crate::{\n    value::{self, Value},\n    optim::Sgd,\n};",
        2,
    );
    assert!(
        named.contains("value") && named.contains("optim"),
        "{named:?}"
    );
    assert!(
        !named.contains("Value") && !named.contains("Sgd"),
        "{named:?}"
    );
    let named = root_names("use crate :: { RRef as R };", 1);
    assert!(
        named.contains("RRef"),
        "a re-exported name counts too: {named:?}"
    );
}

#[test]
fn a_super_path_that_reaches_the_root_names_a_module() {
    // From `transport/shm.rs` (two below the root), `super::super` is it.
    let named = root_names("use super::super::rref::RRef;", 2);
    assert!(named.contains("rref"), "{named:?}");
    let named = root_names("let x = super::super::{optim, value};", 2);
    assert!(
        named.contains("optim") && named.contains("value"),
        "{named:?}"
    );
    // From `value.rs`, one `super` is the root.
    assert!(root_names("super::rref::x()", 1).contains("rref"));
    // From `transport/shm/link.rs`, `super::super::rref` is `transport::rref`.
    assert!(root_names("use super::super::rref::RRef;", 3).is_empty());
    // Not the start of a path.
    assert!(root_names("$crate::rref", 1).is_empty());
}

#[test]
fn lib_rs_modules_are_read_from_its_declarations() {
    let lib = "mod agent;\npub mod rref;\n#[cfg(feature = \"testing\")]\npub(crate) mod testing;\npub mod prelude {\n    pub use crate::agent::X;\n}";
    assert_eq!(declared_modules(lib), ["agent", "rref", "testing"]);
    assert_eq!(depth_of(Path::new("transport/shm/link.rs")), 3);
    assert_eq!(depth_of(Path::new("transport/mod.rs")), 1);
}

#[test]
fn a_file_over_the_limit_is_reported() {
    let long = "x\n".repeat(MAX_LINES + 1);
    let short = "x\n".repeat(MAX_LINES);
    let files = vec![
        ("a/src/long.rs".to_string(), long.clone()),
        ("a/src/short.rs".to_string(), short),
        ("a/shim/long.cpp".to_string(), long.clone()),
        ("a/tests/long.rs".to_string(), long.clone()),
        ("a/src/x/tests.rs".to_string(), long.clone()),
        ("a/src/allowed.rs".to_string(), long),
    ];
    assert_eq!(
        too_long(&files, &["a/src/allowed.rs"]),
        [
            ("a/src/long.rs", MAX_LINES + 1),
            ("a/shim/long.cpp", MAX_LINES + 1)
        ]
    );
}

#[test]
fn a_glob_of_the_parent_is_caught_outside_test_modules() {
    assert!(globs_super("use super::*;"));
    assert!(globs_super("pub(crate) use super :: super :: *;"));
    assert!(!globs_super(
        "use super::{Link, lock};\nuse super::cuda::*;"
    ));
    assert!(!globs_super(
        "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    fn g() { if x { } }\n}\n"
    ));
    assert!(!globs_super(
        "#[cfg(test)]\nmod properties {\n    use super::*;\n}\n"
    ));
    assert!(globs_super(
        "#[cfg(test)]\nmod tests {\n    use super::*;\n}\nmod other {\n    use super::*;\n}\n"
    ));
    assert!(globs_super(&code_of("// use super::*;\nuse super::*;")));
    assert!(!globs_super(&code_of("// use super::*;\n")));
}

#[test]
fn the_members_are_read_from_the_manifest() {
    let manifest = "[workspace]\nmembers = [\n    \"host\",\n    \"host/store\", # the store\n    \"tests\",\n]\ndefault-members = [\"host\"]\n";
    assert_eq!(members(manifest), ["host", "host/store", "tests"]);
    assert!(is_test_file("tests/all/rpc_test.rs"));
    assert!(is_test_file("host/c10d/src/mesh/tests.rs"));
    assert!(!is_test_file("host/c10d/src/mesh.rs"));
}
