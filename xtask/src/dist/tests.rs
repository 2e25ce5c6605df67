//! The bundle's naming and its SDK manifest.

use super::share::{dependency_path, sdk_workspace_manifest, without_section};
use super::{base_version, cuda_tag};
use std::path::PathBuf;

#[test]
fn names_and_versions() {
    assert_eq!(cuda_tag(Some("13.0")), "cu130");
    assert_eq!(base_version("2.13.0+cu130"), "2.13.0");
    assert_eq!(base_version("2.11.0"), "2.11.0");
}

#[test]
fn a_section_is_left_out_up_to_the_next_table() {
    let manifest =
        "[package]\nname = \"a\"\n[dev-dependencies]\nx = \"1\"\n[lints]\nworkspace = true\n";
    assert_eq!(
        without_section(manifest, "[dev-dependencies]"),
        "[package]\nname = \"a\"\n[lints]\nworkspace = true\n"
    );
}

#[test]
fn dependency_paths() {
    assert_eq!(
        dependency_path(r#"wasmrpc-abi = { path = "guest-sdk/abi", version = "0.1" }"#),
        Some("guest-sdk/abi")
    );
    assert_eq!(dependency_path(r#"serde = { version = "1" }"#), None);
}

#[test]
fn the_sdk_workspace_keeps_only_its_own_path_dependencies() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifest =
        sdk_workspace_manifest(&root, &["guest-sdk", "guest-sdk/abi", "guest-sdk/macros"]).unwrap();
    assert!(manifest.contains("[workspace.dependencies]"), "{manifest}");
    assert!(manifest.contains("[workspace.package]"), "{manifest}");
    for line in manifest
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("path = \""))
    {
        let path = dependency_path(line).unwrap();
        assert!(
            path.starts_with("guest-sdk"),
            "a dependency outside the SDK kept: {line}"
        );
    }
    assert!(
        !manifest.contains("wasmrpc-store = {"),
        "a host crate kept: {manifest}"
    );
}
