//! Folder grants (`--grant-dir`, `RpcBackendOptions::plugin_folders`),
//! attacked as a hostile plugin would: the `probe` plugin
//! (`plugins/probe`) reads, writes, lists and loads whatever path it is
//! told, loaded by the operator and deployed at run time. Every refusal is
//! checked by its message, and the worker serves on after each.
//!
//! The layout every test starts from (a fresh temporary folder):
//!
//! ```text
//! root/secret.txt              outside every grant
//! root/data/                   granted read-only at /data
//!   hello.txt, nested/deep.txt
//!   abs -> /etc                an absolute symlink out
//!   up -> ../                  a relative symlink out
//!   inside -> hello.txt        a symlink that stays inside
//!   hard                       a hard link to root/secret.txt
//!   fifo                       a FIFO
//!   model.pt                   a pickle (torch.save's old format)
//!   liar.safetensors           a header whose offsets lie
//!   big.bin                    larger than the call's tensor budget
//! root/ckpt/                   granted read-write at /ckpt, 4 KiB quota
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, ensure};
use wasmrpc::prelude::*;
use wasmrpc::testing::{Cluster, worker_name};
use wasmrpc::wasm::{FolderGrant, FolderGrants};
use wasmrpc::{ErrorKind, Payload, PluginHost, RpcBackendOptions, TensorMemoryBudget, Value, args};
use wasmrpc_tests::{expect_err, timed};

/// The call's tensor memory budget in these tests: `big.bin` is larger.
const PER_CALL: u64 = 1 << 20;

struct Layout {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Layout {
    fn new() -> anyhow::Result<Layout> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().to_path_buf();
        let data = root.join("data");
        std::fs::create_dir_all(data.join("nested"))?;
        std::fs::create_dir_all(root.join("ckpt"))?;
        std::fs::write(root.join("secret.txt"), "the secret outside")?;
        std::fs::write(data.join("hello.txt"), "hello from /data")?;
        std::fs::write(data.join("nested/deep.txt"), "deep")?;
        std::os::unix::fs::symlink("/etc", data.join("abs"))?;
        std::os::unix::fs::symlink("../", data.join("up"))?;
        std::os::unix::fs::symlink("hello.txt", data.join("inside"))?;
        std::fs::hard_link(root.join("secret.txt"), data.join("hard"))?;
        let fifo = std::ffi::CString::new(data.join("fifo").as_os_str().as_encoded_bytes())?;
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a node.
        ensure!(
            unsafe { libc_mkfifo(fifo.as_ptr(), 0o600) } == 0,
            "mkfifo failed"
        );
        // An old-style torch.save pickle: protocol 2, an empty dict, STOP.
        std::fs::write(data.join("model.pt"), b"\x80\x02}q\x00.")?;
        // A safetensors header claiming 64 bytes of data the file lacks.
        let header = br#"{"w":{"dtype":"F32","shape":[16],"data_offsets":[0,64]}}"#;
        let mut liar = (header.len() as u64).to_le_bytes().to_vec();
        liar.extend_from_slice(header);
        liar.extend_from_slice(&[0; 8]);
        std::fs::write(data.join("liar.safetensors"), liar)?;
        std::fs::write(data.join("big.bin"), vec![7u8; PER_CALL as usize + 1])?;
        Ok(Layout { _dir: dir, root })
    }

    fn grants(&self, deployed: bool) -> anyhow::Result<Vec<FolderGrant>> {
        let d = if deployed { ",deployed" } else { "" };
        Ok(vec![
            FolderGrant::parse(&format!(
                "probe:/data={}:ro{d}",
                self.root.join("data").display()
            ))
            .map_err(|e| anyhow::anyhow!(e.message))?,
            FolderGrant::parse(&format!(
                "probe:/ckpt={}:rw,quota=4K{d}",
                self.root.join("ckpt").display()
            ))
            .map_err(|e| anyhow::anyhow!(e.message))?,
        ])
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }
}

unsafe extern "C" {
    #[link_name = "mkfifo"]
    fn libc_mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
}

fn options(grants: Vec<FolderGrant>) -> anyhow::Result<RpcBackendOptions> {
    Ok(RpcBackendOptions {
        plugin_folders: Arc::new(
            FolderGrants::open(grants).map_err(|e| anyhow::anyhow!(e.message))?,
        ),
        tensor_memory: TensorMemoryBudget {
            per_worker: 4 * PER_CALL,
            per_call: PER_CALL,
        },
        ..RpcBackendOptions::default()
    })
}

/// A group of two workers serving the operator-loaded probe plugin.
async fn operator_cluster(layout: &Layout) -> anyhow::Result<Cluster> {
    let host = PluginHost::shared()?;
    let probe = host.load_file(wasmrpc_plugins::PROBE)?;
    Ok(Cluster::builder(2)
        .options(options(layout.grants(false)?)?)
        .functions(move |r| {
            host.register(&probe, r);
        })
        .start()
        .await?)
}

async fn call(cluster: &Cluster, function: &str, args: wasmrpc::Args) -> wasmrpc::Result<Payload> {
    cluster
        .agent(0)
        .rpc_sync(worker_name(1), function, args)
        .await
}

fn text(p: &Payload) -> anyhow::Result<String> {
    match &p.value {
        Value::Bytes(b) => Ok(String::from_utf8(b.clone())?),
        other => anyhow::bail!("expected bytes, got {other:?}"),
    }
}

/// Still serving: a plain read works after whatever came before.
async fn serves_on(cluster: &Cluster) -> anyhow::Result<()> {
    let hello = call(cluster, "probe::read_file", args!["/data/hello.txt"]).await?;
    ensure!(text(&hello)? == "hello from /data");
    Ok(())
}

#[test]
fn a_granted_folder_reads_writes_lists_and_round_trips_tensors() {
    timed(async {
        let layout = Layout::new()?;
        let cluster = operator_cluster(&layout).await?;
        serves_on(&cluster).await?;
        let deep = call(
            &cluster,
            "probe::read_file",
            args!["/data//nested/./deep.txt"],
        )
        .await?;
        ensure!(text(&deep)? == "deep");
        // A symlink that stays inside the folder is followed.
        let inside = call(&cluster, "probe::read_file", args!["/data/inside"]).await?;
        ensure!(text(&inside)? == "hello from /data");

        call(
            &cluster,
            "probe::write_file",
            args!["/ckpt/run/notes.txt", "epoch 1"],
        )
        .await?;
        ensure!(std::fs::read_to_string(layout.path("ckpt/run/notes.txt"))? == "epoch 1");
        let listed = call(&cluster, "probe::list_dir", args!["/ckpt"]).await?;
        ensure!(
            format!("{:?}", listed.value) == r#"List([Str("run/")])"#,
            "{listed:?}"
        );
        let listed = call(&cluster, "probe::list_dir", args!["/ckpt/run"]).await?;
        // No temporary file is left behind by the atomic write.
        ensure!(
            format!("{:?}", listed.value) == r#"List([Str("notes.txt")])"#,
            "{listed:?}"
        );

        let w = tch::Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0]).reshape([2, 2]);
        let step = tch::Tensor::from_slice(&[7i64]);
        let pairs = Payload::list(vec![
            Payload::tuple(vec![
                Payload::from("w".to_string()),
                Payload::from(w.shallow_clone()),
            ]),
            Payload::tuple(vec![
                Payload::from("step".to_string()),
                Payload::from(step.shallow_clone()),
            ]),
        ]);
        call(
            &cluster,
            "probe::save_tensors",
            wasmrpc::Args::new()
                .arg("/ckpt/model.safetensors".to_string())
                .arg(pairs),
        )
        .await?;
        let loaded = call(
            &cluster,
            "probe::load_tensors",
            args!["/ckpt/model.safetensors"],
        )
        .await?;
        let items = loaded.items()?;
        ensure!(items.len() == 2, "{loaded:?}");
        let mut names = Vec::new();
        for item in &items {
            let pair = item.items()?;
            let (name, t) = (pair[0].as_str()?.to_owned(), pair[1].as_tensor()?);
            let expected = match name.as_str() {
                "w" => &w,
                "step" => &step,
                other => anyhow::bail!("an unexpected tensor {other:?}"),
            };
            ensure!(t.equal(expected), "{name} came back different: {t}");
            names.push(name);
        }
        names.sort();
        ensure!(names == ["step", "w"], "{names:?}");

        call(&cluster, "probe::remove_file", args!["/ckpt/run/notes.txt"]).await?;
        ensure!(!layout.path("ckpt/run/notes.txt").exists());
        cluster.shutdown().await?;
        Ok(())
    });
}

#[test]
fn paths_outside_a_grant_are_refused_by_construction() {
    timed(async {
        let layout = Layout::new()?;
        let cluster = operator_cluster(&layout).await?;
        for (path, kind, needle) in [
            ("/data/../secret.txt", ErrorKind::ValueError, "holds '..'"),
            (
                "data/hello.txt",
                ErrorKind::ValueError,
                "is not an absolute path",
            ),
            (
                "/etc/passwd",
                ErrorKind::RuntimeError,
                "no granted folder holds it",
            ),
            (
                "/proc/self/environ",
                ErrorKind::RuntimeError,
                "no granted folder holds it",
            ),
            (
                "/dataextra/hello.txt",
                ErrorKind::RuntimeError,
                "no granted folder holds it",
            ),
            (
                "/data/abs/passwd",
                ErrorKind::RuntimeError,
                "outside the granted folder",
            ),
            (
                "/data/up/secret.txt",
                ErrorKind::RuntimeError,
                "outside the granted folder",
            ),
            ("/data/hard", ErrorKind::RuntimeError, "hard links"),
            ("/data/fifo", ErrorKind::RuntimeError, "not a regular file"),
            ("/data/nested", ErrorKind::RuntimeError, "it is a folder"),
            (
                "/data/missing.txt",
                ErrorKind::RuntimeError,
                "cannot open /data/missing.txt",
            ),
        ] {
            let e = expect_err(
                call(&cluster, "probe::read_file", args![path]).await,
                kind,
                needle,
            )
            .with_context(|| format!("reading {path}"))?;
            ensure!(
                !e.to_string().contains("the secret outside"),
                "{path}: the outside file leaked: {e}"
            );
            serves_on(&cluster).await?;
        }
        // Listing is held to the same rules.
        expect_err(
            call(&cluster, "probe::list_dir", args!["/data/up"]).await,
            ErrorKind::RuntimeError,
            "outside the granted folder",
        )?;
        expect_err(
            call(&cluster, "probe::list_dir", args!["/"]).await,
            ErrorKind::RuntimeError,
            "no granted folder holds it",
        )?;
        cluster.shutdown().await?;
        Ok(())
    });
}

#[test]
fn read_only_grants_quotas_and_planted_symlinks_hold_against_writes() {
    timed(async {
        let layout = Layout::new()?;
        let cluster = operator_cluster(&layout).await?;
        expect_err(
            call(&cluster, "probe::write_file", args!["/data/new.txt", "x"]).await,
            ErrorKind::RuntimeError,
            "cannot write /data/new.txt: the folder /data is granted read-only",
        )?;
        expect_err(
            call(&cluster, "probe::remove_file", args!["/data/hello.txt"]).await,
            ErrorKind::RuntimeError,
            "is granted read-only",
        )?;
        ensure!(layout.path("data/hello.txt").exists());

        // The quota (4 KiB) counts what the folder holds.
        let kb3 = "a".repeat(3000);
        call(
            &cluster,
            "probe::write_file",
            args!["/ckpt/a.txt", kb3.clone()],
        )
        .await?;
        expect_err(
            call(
                &cluster,
                "probe::write_file",
                args!["/ckpt/b.txt", "b".repeat(2000)],
            )
            .await,
            ErrorKind::RuntimeError,
            "over its quota of 4096",
        )?;
        ensure!(
            !layout.path("ckpt/b.txt").exists(),
            "a refused write left a file"
        );
        // Replacing a file counts only the difference.
        call(
            &cluster,
            "probe::write_file",
            args!["/ckpt/a.txt", "c".repeat(3500)],
        )
        .await?;
        call(&cluster, "probe::remove_file", args!["/ckpt/a.txt"]).await?;
        call(
            &cluster,
            "probe::write_file",
            args!["/ckpt/b.txt", "b".repeat(4000)],
        )
        .await?;

        // A symlink planted in a writable folder is not written through.
        std::os::unix::fs::symlink(layout.path("secret.txt"), layout.path("ckpt/planted"))?;
        expect_err(
            call(
                &cluster,
                "probe::write_file",
                args!["/ckpt/planted", "owned"],
            )
            .await,
            ErrorKind::RuntimeError,
            "cannot write /ckpt/planted",
        )?;
        std::os::unix::fs::symlink("../", layout.path("ckpt/upward"))?;
        expect_err(
            call(
                &cluster,
                "probe::write_file",
                args!["/ckpt/upward/secret.txt", "owned"],
            )
            .await,
            ErrorKind::RuntimeError,
            "outside the granted folder",
        )?;
        ensure!(std::fs::read_to_string(layout.path("secret.txt"))? == "the secret outside");
        serves_on(&cluster).await?;
        cluster.shutdown().await?;
        Ok(())
    });
}

#[test]
fn pickles_lying_headers_and_files_over_the_budget_are_refused() {
    timed(async {
        let layout = Layout::new()?;
        let cluster = operator_cluster(&layout).await?;
        expect_err(
            call(&cluster, "probe::load_tensors", args!["/data/model.pt"]).await,
            ErrorKind::ValueError,
            "/data/model.pt is a Python pickle (as torch.save writes), and wasmrpc never loads \
             pickles",
        )?;
        let e = expect_err(
            call(
                &cluster,
                "probe::load_tensors",
                args!["/data/liar.safetensors"],
            )
            .await,
            ErrorKind::RuntimeError,
            "/data/liar.safetensors",
        )?;
        ensure!(!e.to_string().contains("panick"), "{e}");
        expect_err(
            call(&cluster, "probe::read_file", args!["/data/big.bin"]).await,
            ErrorKind::RuntimeError,
            &format!("more than the {PER_CALL} this read may take"),
        )?;
        expect_err(
            call(&cluster, "probe::load_tensors", args!["/data/big.bin"]).await,
            ErrorKind::RuntimeError,
            "the worker's tensor memory budget",
        )?;
        serves_on(&cluster).await?;
        cluster.shutdown().await?;
        Ok(())
    });
}

#[test]
fn a_deployed_plugin_gets_only_the_grants_marked_for_deployed_plugins() {
    for deployed in [false, true] {
        timed(async move {
            let layout = Layout::new()?;
            let cluster = Cluster::builder(2)
                .options(RpcBackendOptions {
                    accept_plugin_deployment: true,
                    ..options(layout.grants(deployed)?)?
                })
                .start()
                .await?;
            let wasm = std::fs::read(wasmrpc_plugins::PROBE)?;
            cluster.agent(0).deploy_plugin(&wasm).await?.check()?;
            let read = call(&cluster, "probe::read_file", args!["/data/hello.txt"]).await;
            if deployed {
                ensure!(text(&read?)? == "hello from /data");
            } else {
                expect_err(
                    read,
                    ErrorKind::RuntimeError,
                    "plugin probe has no folder granted on worker1",
                )?;
            }
            cluster.shutdown().await?;
            Ok(())
        });
    }
}

#[test]
fn grants_are_checked_when_a_worker_starts() {
    let missing = Path::new("/nonexistent/wasmrpc-grant");
    let e = FolderGrants::open(vec![
        FolderGrant::parse(&format!("probe:/data={}", missing.display())).expect("a valid spec"),
    ])
    .expect_err("a missing folder was granted");
    assert!(
        e.message
            .contains("cannot open the folder /nonexistent/wasmrpc-grant"),
        "{}",
        e.message
    );
    let dir = tempfile::tempdir().expect("a temporary folder");
    let twice = format!("probe:/data={}", dir.path().display());
    let e = FolderGrants::open(vec![
        FolderGrant::parse(&twice).expect("a valid spec"),
        FolderGrant::parse(&twice).expect("a valid spec"),
    ])
    .expect_err("two grants at one guest path");
    assert!(
        e.message.contains("already has a folder at /data"),
        "{}",
        e.message
    );
}
