//! Attacks on a worker's op policy (issue 18), made as a hostile peer and a
//! hostile plugin would make them: reading a file through `aten::from_file`,
//! running ops of other namespaces (`prim::`, `profiler::`), setting a
//! tensor's storage (`aten::set_`), in every spelling the worker accepts
//! (`aten::x`, `torch.ops.aten.x`, an overload `aten::x.out`, a bare tensor
//! method name through an RRef proxy or a plugin), by `rpc_sync`,
//! `rpc_async` and `remote`. Each must be refused before it runs, with the
//! policy's error, and the worker must keep serving (`aten::add` right
//! after). A control run with the op allowed shows the file attack would
//! otherwise succeed.
//!
//! POLICY_TEST_NAMES_DENIED_OPS: the op names here are attacks, not ops
//! the seeds call (`every_op_the_seeds_call_is_allowed_by_default`).

use std::path::PathBuf;
use std::sync::Arc;
use wasmrpc::prelude::*;

use anyhow::ensure;
use wasmrpc::{
    Args, Error, ErrorKind, OpPolicy, Payload, RpcAgent, RpcBackendOptions, Value, args,
};
use wasmrpc_tests::{cluster, expect_tensor, ones, timed};

/// What the file attack tries to read.
const SECRET: &[u8] = b"wasmrpc-sandbox-secret-4711";

/// A file holding [`SECRET`], removed on drop.
struct SecretFile(PathBuf);

impl SecretFile {
    fn new() -> anyhow::Result<SecretFile> {
        let path = std::env::temp_dir().join(format!(
            "wasmrpc-sandbox-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos()
        ));
        std::fs::write(&path, SECRET)?;
        Ok(SecretFile(path))
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }

    /// `from_file(path, shared=False, size=len(SECRET), dtype=uint8)`: the
    /// file's bytes as a tensor.
    fn read_args(&self) -> Args {
        args![self.path(), false, SECRET.len() as i64].kwarg("dtype", 0)
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Checks that `r` is the policy's refusal of `op` on `worker`, and that
/// the secret did not come back in it.
fn refused<T: std::fmt::Debug>(
    r: wasmrpc::Result<T>,
    worker: &str,
    op: &str,
) -> anyhow::Result<Error> {
    let e = match r {
        Ok(v) => anyhow::bail!("{op} ran on {worker} and returned {v:?}"),
        Err(e) => e,
    };
    ensure!(e.kind() == ErrorKind::RuntimeError, "{op}: {e}");
    ensure!(
        e.message().contains(&format!("{worker} does not run {op}")),
        "{op} was not refused by the op policy: {e}"
    );
    leaks_nothing(&e)?;
    Ok(e)
}

fn leaks_nothing(e: &Error) -> anyhow::Result<()> {
    let secret = String::from_utf8_lossy(SECRET);
    ensure!(
        !e.to_string().contains(secret.as_ref()),
        "the secret leaked: {e}"
    );
    Ok(())
}

/// The worker still serves a plain call.
async fn still_serves(agent: &RpcAgent, worker: &str) -> anyhow::Result<()> {
    let r = agent
        .rpc_sync(worker, "aten::add", args![ones(&[2]), 1])
        .await?;
    expect_tensor(&r, &(ones(&[2]) + 1))
}

/// A list argument (for `seed_fns::run_op`).
fn list(items: Vec<Payload>) -> Payload {
    Payload::list(items)
}

#[test]
fn test_peer_cannot_read_a_file_through_from_file() {
    timed(async {
        let file = SecretFile::new()?;
        let c = cluster(2).start().await?;
        let a = c.agent(0).clone();
        for spelling in ["aten::from_file", "torch.ops.aten.from_file"] {
            refused(
                a.rpc_sync("worker1", spelling, file.read_args()).await,
                "worker1",
                "aten::from_file",
            )?;
            refused(
                a.rpc_async("worker1", spelling, file.read_args())
                    .wait()
                    .await,
                "worker1",
                "aten::from_file",
            )?;
            let r = a.remote("worker1", spelling, file.read_args())?;
            refused(r.to_here(&a, None).await, "worker1", "aten::from_file")?;
            still_serves(&a, "worker1").await?;
        }
        // An overload's name, or a bare name, is not a function a peer can
        // call at all.
        for spelling in ["aten::from_file.out", "from_file"] {
            let e = a
                .rpc_sync("worker1", spelling, file.read_args())
                .await
                .expect_err(spelling);
            leaks_nothing(&e)?;
        }
        // As a tensor method through an RRef proxy, on the owner.
        let t = a.remote("worker1", "aten::ones", args![list(vec![2i64.into()])])?;
        refused(
            t.rpc_sync(&a, None)
                .call("from_file", file.read_args())
                .await,
            "worker1",
            "aten::from_file",
        )?;
        still_serves(&a, "worker1").await?;
        drop(t);
        c.shutdown().await?;

        // Control: with the op allowed, the same call reads the file.
        let options = RpcBackendOptions {
            op_policy: Arc::new(OpPolicy::default().allow("aten::from_file")?),
            ..Default::default()
        };
        let c = cluster(2).options(options).start().await?;
        let r = c
            .agent(0)
            .rpc_sync("worker1", "aten::from_file", file.read_args())
            .await?;
        let bytes = Vec::<u8>::try_from(r.as_tensor()?)?;
        ensure!(bytes == SECRET, "read {bytes:?}");
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_peer_cannot_run_ops_of_other_namespaces() {
    timed(async {
        let c = cluster(2).start().await?;
        let a = c.agent(0).clone();
        let cases: [(&str, Args); 2] = [
            ("prim::dtype", args![ones(&[2])]),
            ("profiler::_record_function_enter", args!["attack"]),
        ];
        for (op, call) in cases {
            ensure!(
                wasmrpc_torch_sys::Operator::resolve(op).is_ok(),
                "{op} is not callable by name: pick another"
            );
            let e = refused(a.rpc_sync("worker1", op, call).await, "worker1", op)?;
            ensure!(e.message().contains("the op is in namespace"), "{e}");
            still_serves(&a, "worker1").await?;
        }
        // A bare method name falls back to `prim::` only through the policy.
        let t = a.remote("worker1", "aten::ones", args![list(vec![2i64.into()])])?;
        refused(
            t.rpc_sync(&a, None).call("dtype", args![]).await,
            "worker1",
            "prim::dtype",
        )?;
        still_serves(&a, "worker1").await?;
        drop(t);
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_peer_cannot_set_a_tensor_storage() {
    timed(async {
        let c = cluster(2).start().await?;
        let a = c.agent(0).clone();
        for op in ["aten::set_", "aten::set"] {
            refused(
                a.rpc_sync("worker1", op, args![ones(&[2]), ones(&[4])])
                    .await,
                "worker1",
                op,
            )?;
            still_serves(&a, "worker1").await?;
        }
        let t = a.remote("worker1", "aten::ones", args![list(vec![2i64.into()])])?;
        refused(
            t.rpc_sync(&a, None).call("set_", args![ones(&[4])]).await,
            "worker1",
            "aten::set_",
        )?;
        // The owner's tensor is untouched.
        expect_tensor(&t.to_here(&a, None).await?, &ones(&[2]))?;
        drop(t);
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_plugin_cannot_run_ops_the_policy_refuses() {
    timed(async {
        let file = SecretFile::new()?;
        let c = cluster(2).start().await?;
        let a = c.agent(0).clone();
        let read = || {
            list(vec![
                file.path().into(),
                false.into(),
                (SECRET.len() as i64).into(),
            ])
        };
        let cases: Vec<(&str, Payload, &str)> = vec![
            ("aten::from_file", read(), "aten::from_file"),
            ("torch.ops.aten.from_file", read(), "aten::from_file"),
            ("from_file", read(), "aten::from_file"),
            ("prim::dtype", list(vec![ones(&[2]).into()]), "prim::dtype"),
            ("dtype", list(vec![ones(&[2]).into()]), "prim::dtype"),
            (
                "profiler::_record_function_enter",
                list(vec!["attack".into()]),
                "profiler::_record_function_enter",
            ),
            (
                "aten::set_",
                list(vec![ones(&[2]).into(), ones(&[4]).into()]),
                "aten::set_",
            ),
            (
                "set_",
                list(vec![ones(&[2]).into(), ones(&[4]).into()]),
                "aten::set_",
            ),
        ];
        for (name, op_args, op) in cases {
            refused(
                a.rpc_sync("worker1", "seed_fns::run_op", args![name, op_args])
                    .await,
                "worker1",
                op,
            )?;
            still_serves(&a, "worker1").await?;
        }
        // The same plugin function runs an op the policy serves.
        let r = a
            .rpc_sync(
                "worker1",
                "seed_fns::run_op",
                args![
                    "aten::add",
                    list(vec![ones(&[2]).into(), ones(&[2]).into()])
                ],
            )
            .await?;
        expect_tensor(&r, &(ones(&[2]) * 2))?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn test_a_policy_narrowed_by_the_operator_refuses_what_it_denies() {
    timed(async {
        let options = RpcBackendOptions {
            op_policy: Arc::new(OpPolicy::default().deny("@random")?.deny("aten::mul")?),
            ..Default::default()
        };
        let c = cluster(2).options(options).start().await?;
        let a = c.agent(0).clone();
        let e = refused(
            a.rpc_sync("worker1", "aten::rand", args![list(vec![2i64.into()])])
                .await,
            "worker1",
            "aten::rand",
        )?;
        ensure!(e.message().contains("denied by rule `deny @random`"), "{e}");
        refused(
            a.rpc_sync("worker1", "aten::mul", args![ones(&[2]), 2])
                .await,
            "worker1",
            "aten::mul",
        )?;
        // From a plugin too: the guest SDK's `mul` is `aten::mul`.
        refused(
            a.rpc_sync(
                "worker1",
                "seed_fns::run_op",
                args!["aten::mul", list(vec![ones(&[2]).into(), 2i64.into()])],
            )
            .await,
            "worker1",
            "aten::mul",
        )?;
        still_serves(&a, "worker1").await?;
        let v = a
            .rpc_sync("worker1", "seed_fns::identity", args![Value::Int(3)])
            .await?;
        ensure!(v.as_int()? == 3);
        c.shutdown().await?;
        Ok(())
    });
}
