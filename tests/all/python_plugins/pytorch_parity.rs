//! Model code as PyTorch users write it, in a plugin and under PyTorch:
//! `plugins/python/digits-py/model.py` (the parameter server tutorial's
//! CNN and training loop, and an LSTM model) runs unchanged in the
//! `digits-py` plugin (`app.py`) and under the torch venv's PyTorch
//! (`reference.py`), the import of `torch` being the only difference. Both
//! start from the same weights (PyTorch writes them as safetensors, the
//! plugin loads them from its granted folder) and train on the same
//! batches in the same order; their per-epoch losses agree within 1e-3.

use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use wasmrpc::args;
use wasmrpc::testing::worker_name;
use wasmrpc_tests::{cluster_with_folders, timed, venv_python};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `reference.py` under PyTorch: writes the data and the initial
/// weights into `out`; returns its per-epoch losses and accuracy.
fn reference(out: &Path, model: &str, epochs: u32, lr: f64) -> anyhow::Result<(Vec<f64>, f64)> {
    let plugin = root().join("plugins/python/digits-py");
    let run = std::process::Command::new(venv_python())
        .arg("reference.py")
        .arg(root().join("examples/data/digits.csv.gz"))
        .arg(out)
        .args([model, &epochs.to_string(), &lr.to_string()])
        .current_dir(&plugin)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .context("running reference.py")?;
    ensure!(
        run.status.success(),
        "reference.py failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&run.stdout)?;
    let losses = json["losses"]
        .as_array()
        .context("no losses")?
        .iter()
        .map(|v| v.as_f64().context("a loss"))
        .collect::<anyhow::Result<Vec<f64>>>()?;
    Ok((losses, json["accuracy"].as_f64().context("no accuracy")?))
}

#[test]
fn the_tutorials_cnn_and_an_lstm_train_in_a_plugin_as_under_pytorch() {
    timed(async {
        let dir = tempfile::tempdir()?;
        let runs = [("cnn", 3u32, 0.1f64), ("lstm", 3, 0.5)];
        let mut expected = Vec::new();
        for (model, epochs, lr) in runs {
            expected.push(reference(dir.path(), model, epochs, lr)?);
        }
        let folder = dir.path().display();
        let c = cluster_with_folders(
            wasmrpc_plugins::DIGITS_PY,
            &[
                format!("digits_py:/data={folder}:ro"),
                format!("digits_py:/init={folder}:ro"),
            ],
        )
        .await?;
        for ((model, epochs, lr), (want, want_accuracy)) in runs.iter().zip(&expected) {
            let out = c
                .agent(0)
                .rpc_sync(
                    worker_name(1),
                    "digits_py::train",
                    args![model.to_string(), i64::from(*epochs), *lr],
                )
                .await
                .with_context(|| format!("training {model} in the plugin"))?;
            let parts = out.items()?;
            let got: Vec<f64> = parts[0]
                .items()?
                .iter()
                .map(|v| v.as_float().map_err(anyhow::Error::from))
                .collect::<anyhow::Result<_>>()?;
            let accuracy = parts[1].as_float()?;
            ensure!(got.len() == want.len(), "{model}: {got:?} against {want:?}");
            for (epoch, (g, w)) in got.iter().zip(want).enumerate() {
                ensure!(
                    (g - w).abs() < 1e-3,
                    "{model}, epoch {}: loss {g} in the plugin, {w} under PyTorch \
                     ({got:?} against {want:?})",
                    epoch + 1
                );
            }
            ensure!(
                (accuracy - want_accuracy).abs() < 0.01,
                "{model}: accuracy {accuracy} in the plugin, {want_accuracy} under PyTorch"
            );
            ensure!(
                got[got.len() - 1] < got[0],
                "{model} did not learn: {got:?}"
            );
        }
        c.shutdown().await?;
        Ok(())
    });
}
