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

/// What a port's launch section may hold: comments, blank lines, and the
/// kit's `wasmrpc.export_module(...)` calls.
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

/// Checks `port` against `upstream`: the same lines but imports and launch.
fn port_matches(upstream: &str, port: &str) -> Result<(), String> {
    let want = kept_lines(upstream, "def run_worker(");
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
    if port.contains("\n# Launch.") {
        launch_section_is_launch_only(port)?;
    }
    Ok(())
}

const RNN_FILES: [(&str, &str); 2] = [
    ("rnn/rnn.py", "rnn-py/rnn.py"),
    ("rnn/main.py", "rnn-py/app.py"),
];

#[test]
fn pytorch_examples_ports_differ_from_their_sources_only_in_imports_and_launch() {
    let root = repo();
    for (upstream, port) in RNN_FILES {
        let upstream = read(&root.join("tests/pytorch-examples").join(upstream));
        let port_text = read(&root.join("plugins/python").join(port));
        if let Err(e) = port_matches(&upstream, &port_text) {
            panic!("plugins/python/{port} is not PyTorch's code: {e}");
        }
        // The check itself: a changed line, an added statement and code in
        // the launch section are each caught.
        let changed = port_text.replacen("\ndef _", "\ndef z_", 1);
        let added = port_text.replacen("\ndef ", "\nx = 1\ndef ", 1);
        let smuggled = format!("{port_text}\nrpc.rpc_sync('ps', 'os::system')\n");
        for (what, bad) in [
            ("a changed line", changed),
            ("an added line", added),
            ("launch code", smuggled),
        ] {
            assert_ne!(
                bad, port_text,
                "{port}: the {what} mutation changed nothing"
            );
            assert!(
                port_matches(&upstream, &bad).is_err(),
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
