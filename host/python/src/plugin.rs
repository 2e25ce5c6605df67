//! A plugin's exports as a Python program names them: read from the
//! plugin file's manifest section, without compiling or running it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use wasmrpc::wasm::manifest;

/// What a plugin exports: the namespace its functions are served under,
/// its functions' names (static methods as `Class.method`), and each
/// class with its methods.
type Exports = (String, Vec<String>, BTreeMap<String, Vec<String>>);

/// The [`Exports`] of the plugin file `path`.
#[pyfunction]
pub(crate) fn plugin_exports(path: PathBuf) -> PyResult<Exports> {
    let bytes = std::fs::read(&path)
        .map_err(|e| PyOSError::new_err(format!("cannot read {}: {e}", path.display())))?;
    let m = manifest::read(&bytes).map_err(|e| {
        PyValueError::new_err(format!("{} is not a wasmrpc plugin: {e}", path.display()))
    })?;
    let mut functions = Vec::new();
    let mut classes: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in &m.exports {
        match (&e.class, e.kind) {
            (_, manifest::ExportKind::Constructor) => {
                classes.entry(e.name.clone()).or_default();
            }
            (Some(class), _) => classes
                .entry(class.clone())
                .or_default()
                .push(e.name.clone()),
            (None, _) => functions.push(e.name.clone()),
        }
    }
    Ok((wasmrpc::plugin_namespace(&m.name), functions, classes))
}
