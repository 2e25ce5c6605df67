//! The rows of wasmrpc called from a Python program: the `wasmrpc` Python
//! package (`host/python`, its release build) in the set-up's interpreter,
//! measured by `bench/wasmrpc_python_bench.py` beside torch.distributed.rpc
//! from Python (the torch script's `rtt_aten_add` and `echo_64m`).

use std::path::Path;

use crate::progress::Progress;
use crate::rows::{Results, Side, wanted};
use crate::torch::{self, TorchRun};

/// This side's rows.
pub(crate) const ROWS: [&str; 2] = ["py_rtt_aten_add", "py_echo_64m"];

/// Copies the package's Python sources to `to` (without caches).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (path, name) = (entry.path(), entry.file_name());
        if name == "__pycache__" {
            continue;
        }
        if path.is_dir() {
            copy_tree(&path, &to.join(&name))?;
        } else {
            std::fs::copy(&path, to.join(&name))?;
        }
    }
    Ok(())
}

/// What the script needs besides the interpreter.
pub(crate) struct PythonProgram<'a> {
    pub(crate) root: &'a Path,
    pub(crate) python: &'a Path,
    pub(crate) quick: bool,
    pub(crate) only: &'a [String],
    pub(crate) log: &'a Path,
}

/// Measures the selected rows; each one that cannot be is `n/a` with why.
pub(crate) fn run(p: &PythonProgram<'_>, res: &mut Results, progress: &Progress) {
    let keys: Vec<&'static str> = ROWS.into_iter().filter(|r| wanted(p.only, r)).collect();
    if keys.is_empty() {
        return;
    }
    let not_measured = |res: &mut Results, why: String| {
        keys.iter()
            .for_each(|k| res.na(Side::Ours, k, format!("n/a ({why})")));
    };
    let module = p.root.join("target/release/lib_native.so");
    if !module.exists() {
        return not_measured(
            res,
            format!(
                "no release build of the Python package at {} (cargo build --release -p \
                 wasmrpc-python; `cargo xtask bench` makes it)",
                module.display()
            ),
        );
    }
    let site = match tempfile::tempdir() {
        Ok(site) => site,
        Err(e) => return not_measured(res, format!("no temporary folder: {e}")),
    };
    let package = site.path().join("wasmrpc");
    if let Err(e) = copy_tree(&p.root.join("host/python/python/wasmrpc"), &package)
        .and_then(|()| std::os::unix::fs::symlink(&module, package.join("_native.so")))
    {
        return not_measured(res, format!("assembling the package: {e}"));
    }
    torch::run(
        &TorchRun {
            side: Side::Ours,
            keys: keys.clone(),
            pythonpath: Some(site.path()),
            python: p.python,
            script: &p.root.join("bench/wasmrpc_python_bench.py"),
            quick: p.quick,
            only: p.only,
            memory_calls: 0,
            log: p.log,
        },
        res,
        progress,
    );
}
