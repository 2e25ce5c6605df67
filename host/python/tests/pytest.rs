//! Runs the `wasmrpc` Python package's pytest suite (`tests/*.py`) against
//! the extension module this very build made, in the project's torch venv.
//!
//! The package is assembled as `pip install` would lay it out (the Python
//! sources with `_native.so` beside them) in a temporary folder on
//! `PYTHONPATH`, so the suite needs no install step and never sees a stale
//! module. The suite's processes find the `wasmrpc` binary and the plugins
//! through `WASMRPC_BIN` and `WASMRPC_TEST_PLUGIN_*`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The extension module cargo built for this test (`lib_native.so`, in the
/// folder of this test's executable or the one above it).
fn native_module() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let deps = exe.parent().expect("the test's folder");
    [deps.to_path_buf(), deps.join("..")]
        .into_iter()
        .map(|d| d.join("lib_native.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no lib_native.so near {}", exe.display()))
}

/// The `wasmrpc` binary of the same build.
fn wasmrpc_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = profile.join("wasmrpc");
    assert!(
        bin.exists(),
        "{} is missing: build it (cargo build -p wasmrpc)",
        bin.display()
    );
    bin
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the package folder");
    for entry in std::fs::read_dir(from).expect("read the package sources") {
        let entry = entry.expect("a package entry");
        let path = entry.path();
        let name = entry.file_name();
        if name == "__pycache__" {
            continue;
        }
        if path.is_dir() {
            copy_tree(&path, &to.join(&name));
        } else {
            std::fs::copy(&path, to.join(&name)).expect("copy a package file");
        }
    }
}

#[test]
fn the_python_package_passes_its_pytest_suite() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = Path::new(env!("WASMRPC_ENV")).join("venv");
    let python = venv.join("bin/python");
    let site = tempfile::tempdir().expect("a temporary folder");
    let package = site.path().join("wasmrpc");
    copy_tree(&crate_dir.join("python/wasmrpc"), &package);
    std::os::unix::fs::symlink(native_module(), package.join("_native.so"))
        .expect("link the extension module");

    let mut cmd = Command::new(&python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(crate_dir.join("tests"))
        .env("PYTHONPATH", site.path())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("WASMRPC_BIN", wasmrpc_binary())
        .env("WASMRPC_TEST_PLUGIN_SEED_FNS", wasmrpc_plugins::SEED_FNS)
        .env(
            "WASMRPC_TEST_PLUGIN_SEED_FNS_PY",
            wasmrpc_plugins::SEED_FNS_PY,
        )
        .env(
            "WASMRPC_TEST_PLUGIN_MLP_LOSS_PY",
            wasmrpc_plugins::MLP_LOSS_PY,
        )
        // PyTorch's test files, beside the repository.
        .env("WASMRPC_SEEDS", crate_dir.join("../../../shared/seeds"))
        .current_dir(crate_dir);
    // A filter for one run: `WASMRPC_PYTEST_ARGS='-k remote'`.
    if let Ok(extra) = std::env::var("WASMRPC_PYTEST_ARGS") {
        cmd.args(extra.split_whitespace());
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(status.success(), "the pytest suite failed ({status})");
}
