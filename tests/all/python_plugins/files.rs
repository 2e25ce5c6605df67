//! Files from a Python plugin (`plugins/python/files-py`): `open()` inside
//! the folders the operator granted (WASI preopens), tensors saved with
//! `wasmrpc.save` and read back by Python's own `safetensors.torch`, and
//! what a grant must never give, tried from Python.

use std::path::PathBuf;

use anyhow::{Context, ensure};
use wasmrpc::testing::{Cluster, worker_name};
use wasmrpc::{ErrorKind, Payload, Value, args};
use wasmrpc_tests::{cluster_with_folders, expect_err, timed, venv_python};

struct Folders {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

fn folders() -> anyhow::Result<Folders> {
    let dir = tempfile::tempdir()?;
    let root = dir.path().to_path_buf();
    for sub in ["data", "out", "quota"] {
        std::fs::create_dir_all(root.join(sub))?;
    }
    std::fs::write(root.join("secret.txt"), "the secret outside")?;
    std::fs::write(root.join("data/table.csv"), "x,y\n1,2\n3,4.5\n-1,0.25\n")?;
    std::os::unix::fs::symlink("/etc", root.join("data/abs"))?;
    std::os::unix::fs::symlink("../", root.join("data/up"))?;
    std::fs::write(root.join("data/model.pt"), b"\x80\x02}q\x00.")?;
    Ok(Folders { _dir: dir, root })
}

async fn cluster(f: &Folders) -> anyhow::Result<Cluster> {
    let folder = |sub: &str| f.root.join(sub).display().to_string();
    cluster_with_folders(
        wasmrpc_plugins::FILES_PY,
        &[
            format!("files_py:/data={}:ro", folder("data")),
            format!("files_py:/out={}:rw", folder("out")),
            format!("files_py:/quota={}:rw,quota=1K", folder("quota")),
        ],
    )
    .await
}

async fn call(c: &Cluster, function: &str, args: wasmrpc::Args) -> wasmrpc::Result<Payload> {
    c.agent(0).rpc_sync(worker_name(1), function, args).await
}

#[test]
fn a_python_plugin_reads_a_csv_and_saves_safetensors_that_torch_reads_back_equal() {
    timed(async {
        let f = folders()?;
        let c = cluster(&f).await?;
        let rows = call(
            &c,
            "files_py::csv_to_safetensors",
            args!["/data/table.csv", "/out/table.safetensors"],
        )
        .await?;
        ensure!(rows.as_int()? == 3, "{rows:?}");
        let file = f.root.join("out/table.safetensors");
        let script = "import sys\n\
            from safetensors import safe_open\n\
            from safetensors.torch import load_file\n\
            t = load_file(sys.argv[1])\n\
            print(sorted(t), t['x'].dtype, t['x'].tolist(), t['y'].tolist())\n\
            with safe_open(sys.argv[1], 'pt') as f:\n\
            \x20   print(sorted(f.metadata().items()))\n";
        let out = std::process::Command::new(venv_python())
            .args(["-c", script])
            .arg(&file)
            .output()
            .with_context(|| format!("running {}", venv_python().display()))?;
        ensure!(
            out.status.success(),
            "safetensors.torch could not read the file: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8(out.stdout)?;
        ensure!(
            printed
                == "['x', 'y'] torch.float32 [1.0, 3.0, -1.0] [2.0, 4.5, 0.25]\n\
                    [('rows', '3'), ('source', '/data/table.csv')]\n",
            "{printed}"
        );
        // And the plugin loads it back.
        let loaded = call(
            &c,
            "files_py::load_tensors",
            args!["/out/table.safetensors"],
        )
        .await?;
        let parts = loaded.items()?;
        let x = parts[0].get("x")?.context("no x")?.as_tensor()?;
        ensure!(
            x.equal(&tch::Tensor::from_slice(&[1.0f32, 3.0, -1.0])),
            "{x}"
        );
        ensure!(parts[1].get("source")?.context("no metadata")?.as_str()? == "/data/table.csv");
        // Plain open() writes where the grant is read-write.
        call(
            &c,
            "files_py::write_text",
            args!["/out/notes.txt", "from python"],
        )
        .await?;
        ensure!(std::fs::read_to_string(f.root.join("out/notes.txt"))? == "from python");
        let listed = call(&c, "files_py::list_dir", args!["/out"]).await?;
        ensure!(
            format!("{:?}", listed.value)
                == r#"List([Str("notes.txt"), Str("table.safetensors")])"#,
            "{listed:?}"
        );
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn a_python_plugin_imports_inside_functions_and_reads_the_wall_clock() {
    timed(async {
        let f = folders()?;
        let c = cluster(&f).await?;
        // `datetime` and `json` are imported only inside the function: the
        // build preloads what the sources import anywhere.
        let out = call(&c, "files_py::imports_inside_and_the_time", args![]).await?;
        ensure!(
            format!("{:?}", out.value) == r#"Tuple([Bool(true), Str("json")])"#,
            "{out:?}"
        );
        c.shutdown().await?;
        Ok(())
    });
}

/// What Python's `open()` raised, as the caller sees it.
async fn refused(
    c: &Cluster,
    function: &str,
    args: wasmrpc::Args,
    kind: ErrorKind,
    needle: &str,
) -> anyhow::Result<()> {
    let e = expect_err(call(c, function, args).await, kind, needle)?;
    ensure!(!e.to_string().contains("the secret outside"), "leaked: {e}");
    Ok(())
}

#[test]
fn a_python_plugin_reaches_nothing_outside_its_grants() {
    timed(async {
        let f = folders()?;
        let c = cluster(&f).await?;
        // WASI resolves each path against the preopened folders through
        // cap-std: an escape is EPERM, a path no folder holds ENOENT.
        for (path, raised) in [
            (
                "/data/../secret.txt",
                "PermissionError: [Errno 63] Operation not permitted",
            ),
            (
                "/data/abs/passwd",
                "PermissionError: [Errno 63] Operation not permitted",
            ),
            (
                "/data/up/secret.txt",
                "PermissionError: [Errno 63] Operation not permitted",
            ),
            (
                "/etc/passwd",
                "FileNotFoundError: [Errno 44] No such file or directory",
            ),
            (
                "/proc/self/environ",
                "FileNotFoundError: [Errno 44] No such file or directory",
            ),
            (
                "secret.txt",
                "FileNotFoundError: [Errno 44] No such file or directory",
            ),
        ] {
            refused(
                &c,
                "files_py::read_text",
                args![path],
                ErrorKind::RuntimeError,
                &format!("Original exception on remote side was {raised}: '{path}'"),
            )
            .await
            .with_context(|| format!("reading {path}"))?;
        }
        // Read-only: open(.., "w") is refused, and so is the worker's write.
        refused(
            &c,
            "files_py::write_text",
            args!["/data/new.txt", "x"],
            ErrorKind::RuntimeError,
            "Original exception on remote side was",
        )
        .await?;
        refused(
            &c,
            "files_py::write_through_host",
            args!["/data/new.txt", "x"],
            ErrorKind::RuntimeError,
            "is granted read-only",
        )
        .await?;
        ensure!(!f.root.join("data/new.txt").exists());
        // A grant with a quota is read-only to open(); the worker's writes
        // count against it.
        refused(
            &c,
            "files_py::write_text",
            args!["/quota/a.txt", "x"],
            ErrorKind::RuntimeError,
            "Original exception on remote side was",
        )
        .await?;
        call(
            &c,
            "files_py::write_through_host",
            args!["/quota/a.txt", "a".repeat(800)],
        )
        .await?;
        refused(
            &c,
            "files_py::write_through_host",
            args!["/quota/b.txt", "b".repeat(800)],
            ErrorKind::RuntimeError,
            "over its quota of 1024",
        )
        .await?;
        // No pickle.
        refused(
            &c,
            "files_py::load_tensors",
            args!["/data/model.pt"],
            ErrorKind::ValueError,
            "/data/model.pt is a Python pickle",
        )
        .await?;
        // Still serving.
        let rows = call(&c, "files_py::save_ones", args!["/out/ones.safetensors", 3]).await?;
        ensure!(rows.as_int()? == 3);
        ensure!(matches!(rows.value, Value::Int(3)));
        c.shutdown().await?;
        Ok(())
    });
}
