//! What the tests that run the demo's job share: its data folder, and
//! what its checkpoints and results say.

use std::path::{Path, PathBuf};

/// The folder the demo's data is granted from.
pub(crate) fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data")
}

/// The per-epoch held-out accuracy in a `--result` file.
pub(crate) fn accuracy(result: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(result).expect("the launcher wrote the result");
    let json: serde_json::Value = serde_json::from_str(&text).expect("the result is JSON");
    json["accuracy"]
        .as_array()
        .expect("a list of accuracies")
        .iter()
        .map(|v| v.as_f64().expect("a number"))
        .collect()
}

/// The step of the folder's checkpoint, if it has one yet.
pub(crate) fn checkpointed_step(checkpoints: &Path) -> Option<i64> {
    let text = std::fs::read_to_string(checkpoints.join("checkpoint.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["step"].as_i64()
}

/// The pids of `parent`'s children.
pub(crate) fn children(parent: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|children| {
            children
                .split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}
