//! PyTorch's own RPC examples, ported as PyTorch wrote them: each port in
//! `plugins/python/` differs from its original (`tests/pytorch-examples/`)
//! only in import lines and in the launch section, and runs under
//! `wasmrpc launch`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::common::{text, wasmrpc};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the host crate is in the repository")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whether `line` is a top-level import (what a port may change).
fn is_import(line: &str) -> bool {
    line.starts_with("import ") || (line.starts_with("from ") && line.contains(" import "))
}

/// The lines of `source` that a port must keep as they are: every line
/// but top-level imports and the launch section, which starts at the first
/// line beginning with `launch_start` and runs to the end; blank lines are
/// dropped (a removed import leaves a different number of them).
fn kept_lines<'a>(source: &'a str, launch_start: &str) -> Vec<&'a str> {
    source
        .lines()
        .take_while(|l| !l.starts_with(launch_start))
        .filter(|l| !is_import(l) && !l.trim().is_empty())
        .collect()
}

/// What a port's launch section may hold when it only replaces PyTorch's
/// process launching: comments, blank lines, and the kit's
/// `wasmrpc.export_module(...)` calls.
fn launch_section_is_launch_only(port: &str) -> Result<(), String> {
    let Some(start) = port.find("\n# Launch.") else {
        return Err("the port has no `# Launch.` section".into());
    };
    for line in port[start..].lines() {
        let l = line.trim();
        if !(l.is_empty() || l.starts_with('#') || l.starts_with("wasmrpc.export_module(")) {
            return Err(format!(
                "the launch section holds code of its own: {line:?}"
            ));
        }
    }
    Ok(())
}

/// A port and its original.
struct Port {
    /// The original, under `tests/pytorch-examples/`.
    upstream: &'static str,
    /// The port, under `plugins/python/`.
    port: &'static str,
    /// The line where the original's launch section starts.
    upstream_launch: &'static str,
    /// Whether the port's launch section may hold code: where the
    /// original's launch also loads data (torchvision's MNIST), the port's
    /// loads the data it has instead.
    launch_loads_data: bool,
}

const PORTS: [Port; 3] = [
    Port {
        upstream: "rnn/rnn.py",
        port: "rnn-py/rnn.py",
        upstream_launch: "def run_worker(",
        launch_loads_data: false,
    },
    Port {
        upstream: "rnn/main.py",
        port: "rnn-py/app.py",
        upstream_launch: "def run_worker(",
        launch_loads_data: false,
    },
    Port {
        upstream: "parameter_server/rpc_parameter_server.py",
        port: "mnist-ps-py/app.py",
        upstream_launch: "# Main loop for trainers.",
        launch_loads_data: true,
    },
];

/// Checks `port` against `upstream`: the same lines but imports and launch.
fn port_matches(upstream: &str, port: &str, how: &Port) -> Result<(), String> {
    let want = kept_lines(upstream, how.upstream_launch);
    let got = kept_lines(port, "# Launch.");
    if want != got {
        let at = want.iter().zip(&got).position(|(a, b)| a != b);
        return Err(match at {
            Some(i) => format!(
                "line {i} differs: {:?} in PyTorch's, {:?} in the port",
                want[i], got[i]
            ),
            None => format!(
                "{} kept lines in PyTorch's, {} in the port",
                want.len(),
                got.len()
            ),
        });
    }
    if port.contains("\n# Launch.") && !how.launch_loads_data {
        launch_section_is_launch_only(port)?;
    }
    Ok(())
}

#[test]
fn pytorch_examples_ports_differ_from_their_sources_only_in_imports_and_launch() {
    let root = repo();
    for how in &PORTS {
        let port = how.port;
        let upstream = read(&root.join("tests/pytorch-examples").join(how.upstream));
        let port_text = read(&root.join("plugins/python").join(port));
        if let Err(e) = port_matches(&upstream, &port_text, how) {
            panic!("plugins/python/{port} is not PyTorch's code: {e}");
        }
        // The check itself: a changed line, an added statement and code in
        // the launch section are each caught.
        let changed = port_text.replacen("\ndef ", "\ndef z", 1);
        let added = port_text.replacen("\ndef ", "\nx = 1\ndef ", 1);
        let smuggled = format!("{port_text}\nrpc.rpc_sync('ps', 'os::system')\n");
        let mut mutations = vec![("a changed line", changed), ("an added line", added)];
        if !how.launch_loads_data {
            mutations.push(("launch code", smuggled));
        }
        for (what, bad) in mutations {
            assert_ne!(
                bad, port_text,
                "{port}: the {what} mutation changed nothing"
            );
            assert!(
                port_matches(&upstream, &bad, how).is_err(),
                "{port}: {what} went unnoticed"
            );
        }
    }
}

#[test]
fn pytorch_rnn_example_trains_from_its_sources() {
    // PyTorch's `run_worker` names the workers ps and trainer and runs
    // `_run_trainer` on the trainer: so does the launch (ps, the first,
    // calls it there and reports its result).
    let out = wasmrpc(
        &[
            "launch",
            "--names",
            "ps,trainer",
            "--plugins",
            wasmrpc_plugins::RNN_PY,
            "--entry",
            "rnn_py::_run_trainer",
            "--entry-on",
            "trainer",
        ],
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    for epoch in 0..10 {
        let line = format!("Training epoch {epoch}");
        assert!(
            stderr
                .lines()
                .any(|l| l.contains("[trainer]") && l.contains(&line)),
            "the trainer did not log {line:?}:\n{stderr}"
        );
    }
    assert!(
        stdout.contains("[ps] rnn_py::_run_trainer returned None"),
        "unexpected result:\n{stdout}\n{stderr}"
    );
}

/// Runs `plugins/python/<port>/reference.py` under PyTorch, in the
/// set-up's torch venv, with `args` and then a free port for its
/// rendezvous; its standard output.
fn run_reference(port: &str, args: &[std::ffi::OsString]) -> String {
    let root = repo();
    let python = std::env::var_os("WASMRPC_ENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".wasmrpc-env"))
        .join("venv/bin/python");
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let reference = std::process::Command::new(python)
        .arg("reference.py")
        .args(args)
        .arg(free.to_string())
        .current_dir(root.join("plugins/python").join(port))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("running reference.py");
    let (out, err) = text(&reference);
    assert!(
        reference.status.success(),
        "{port}/reference.py failed:\n{out}\n{err}"
    );
    out
}

/// The trainer's reported losses (`Rank 1 training batch I loss L`, every
/// fifth batch) and its accuracy (`Accuracy A`), from the lines of `log`.
fn curve(log: &str) -> (Vec<(u32, f64)>, Option<f64>) {
    let mut losses = Vec::new();
    let mut accuracy = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Rank 1 training batch ").nth(1) {
            let mut words = rest.split_whitespace();
            let batch = words.next().and_then(|b| b.parse().ok());
            let loss = words.nth(1).and_then(|l| l.parse().ok());
            if let (Some(b), Some(l)) = (batch, loss) {
                losses.push((b, l));
            }
        }
        if let Some(rest) = line.split("Accuracy ").nth(1) {
            accuracy = rest.split_whitespace().next().and_then(|a| a.parse().ok());
        }
    }
    (losses, accuracy)
}

/// PyTorch's MNIST parameter server example (`rpc_parameter_server.py`),
/// ported as PyTorch wrote it, trains under `wasmrpc launch` on the demo's
/// digits; the original, unmodified, trains under `torch.distributed.rpc`
/// on the same data (`plugins/python/mnist-ps-py/reference.py`). The two
/// start from different random weights, dropout masks and batch orders, so
/// the curves are compared within a stated tolerance: both report the same
/// batches, both start near chance (a loss within 0.2 of ln 10), both end
/// at least 1.0 lower (the mean of the last three reported losses), and the
/// accuracies on the 360 held-out digits are above 0.45 (chance is 0.1)
/// and within 0.3 of each other. Five runs under PyTorch: first losses
/// 2.28-2.33, last three 0.78-0.98 on average. After 40 batches the
/// accuracy varies widely from run to run: 0.561-0.786 in fourteen runs
/// under PyTorch (two below 0.6, the bound this test had until one of them
/// failed CI), 0.611-0.786 in ten here; the bounds leave a margin below the
/// lowest and beyond the widest gap seen.
#[test]
fn pytorch_parameter_server_example_trains_from_its_sources_as_under_pytorch() {
    let root = repo();
    let data = root.join("examples/data");
    let out = wasmrpc(
        &[
            "launch",
            "--names",
            "parameter_server,trainer_1",
            "--plugins",
            wasmrpc_plugins::MNIST_PS_PY,
            "--grant-dir",
            &format!("mnist_ps_py:/data={}:ro", data.display()),
            "--entry",
            "mnist_ps_py::train_on_digits",
            "--entry-on",
            "trainer_1",
            "--",
            "1",
        ],
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    let ours = curve(&stderr);

    let ref_out = run_reference(
        "mnist-ps-py",
        &[
            root.join("tests/pytorch-examples/parameter_server").into(),
            data.join("digits.csv.gz").into(),
        ],
    );
    let theirs = curve(&ref_out);

    let batches = |c: &(Vec<(u32, f64)>, Option<f64>)| c.0.iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(
        batches(&ours),
        (0..=40).step_by(5).collect::<Vec<_>>(),
        "{stderr}"
    );
    assert_eq!(batches(&ours), batches(&theirs), "{ref_out}");
    for (who, (losses, accuracy)) in [("wasmrpc", &ours), ("PyTorch", &theirs)] {
        let first = losses[0].1;
        let last = losses[losses.len() - 3..].iter().map(|p| p.1).sum::<f64>() / 3.0;
        assert!(
            (first - 10f64.ln()).abs() < 0.2,
            "{who} starts at loss {first}"
        );
        assert!(last < first - 1.0, "{who} went from loss {first} to {last}");
        let accuracy = accuracy.unwrap_or_else(|| panic!("{who} reported no accuracy"));
        assert!(accuracy > 0.45, "{who}'s accuracy is {accuracy}");
    }
    let (a, b) = (ours.1.unwrap(), theirs.1.unwrap());
    assert!((a - b).abs() <= 0.3, "accuracy {a} here, {b} under PyTorch");
}

/// Each trainer's losses, by name, from `run`'s result as JSON.
fn losses_by_trainer(json: &str) -> Vec<(String, Vec<f64>)> {
    let value: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    let by_name = value
        .as_object()
        .unwrap_or_else(|| panic!("not a dict of losses: {json}"));
    by_name
        .iter()
        .map(|(name, losses)| {
            let losses = losses
                .as_array()
                .and_then(|l| l.iter().map(serde_json::Value::as_f64).collect())
                .unwrap_or_else(|| panic!("{name}'s losses are not numbers: {json}"));
            (name.clone(), losses)
        })
        .collect()
}

/// The batching parameter server (`plugins/python/batch-ps-py`): PyTorch's
/// batch RPC pattern (an object made in place with `rpc.RRef(...)`, an
/// `async_execution` function whose future the round's last report
/// completes, a ResNet-18 returned by value, `run` waiting for the
/// trainers while their reports reach the object in its instance), run
/// under `wasmrpc launch` and, the same file with PyTorch's imports, under
/// `torch.distributed.rpc` (`reference.py`). Both learn: every trainer
/// takes 5 steps, and its last loss is below 0.8 times its first and below
/// 0.5. Eleven runs each (22 trainers): first losses 0.40-1.11 here and
/// 0.49-1.08 under PyTorch, last 0.13-0.27 and 0.14-0.23, last over first
/// at most 0.58 and 0.41.
#[test]
fn batching_parameter_server_learns_as_the_same_file_does_under_pytorch() {
    let result = tempfile::NamedTempFile::new().expect("a temporary file");
    let out = wasmrpc(
        &[
            "launch",
            "--names",
            "server,trainer1,trainer2",
            "--plugins",
            wasmrpc_plugins::BATCH_PS_PY,
            "--entry",
            "batch_ps_py::run",
            "--entry-on",
            "server",
            "--entry-json",
            r#"[["trainer1", "trainer2"]]"#,
            "--result",
            &result.path().display().to_string(),
        ],
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "launch failed:\n{stdout}\n{stderr}");
    let ours = losses_by_trainer(&read(result.path()));

    let ref_out = run_reference("batch-ps-py", &[]);
    let theirs = losses_by_trainer(ref_out.lines().last().unwrap_or_default());

    for (who, run) in [("wasmrpc", &ours), ("PyTorch", &theirs)] {
        let names: Vec<&str> = run.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["trainer1", "trainer2"], "{who}: {run:?}");
        for (name, losses) in run {
            assert_eq!(losses.len(), 5, "{who} {name}: {losses:?}");
            let (first, last) = (losses[0], losses[4]);
            assert!(
                last < 0.8 * first && last < 0.5,
                "{who} {name} did not learn: {losses:?}"
            );
        }
    }
}
