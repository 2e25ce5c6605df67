//! Port of `rpc_test.py`'s backend-registry seeds (area R): backends by
//! name with their options type (`wasmrpc::backend_registry`), and the
//! backend inferred from the options when none is named.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::ensure;
use wasmrpc::backend_registry::{
    self, BackendOptions, ConstructOptionsHandler, InitArgs, InitBackendHandler, TENSORPIPE,
};
use wasmrpc::testing::{fresh_store, worker_name};
use wasmrpc::{ErrorKind, RpcBackendOptions, args};
use wasmrpc_tests::{expect_err, timed};

/// The seeds' `FooBackendOptions(init_method)`: options of no registered
/// backend.
#[derive(Debug)]
struct FooBackendOptions {
    #[expect(dead_code, reason = "shown in the error text, as the seed's repr")]
    init_method: String,
}

impl BackendOptions for FooBackendOptions {
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// The stub backend's options (`_stub_construct_rpc_backend_options_handler`
/// returns a mock).
#[derive(Debug)]
struct StubOptions;

impl BackendOptions for StubOptions {
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

const WORLD_SIZE: u32 = 4;

#[test]
fn test_register_rpc_backend_and_set_and_start_rpc_backend() {
    timed(async {
        let backend_name = "stub_backend";
        // `_stub_init_rpc_backend_handler` returns `StubRpcAgent(world_size)`:
        // here an agent of its own (alone in its own store), recording what
        // the handler was given.
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let construct: ConstructOptionsHandler = Arc::new(|_, _| Ok(Box::new(StubOptions)));
        let init: InitBackendHandler = Arc::new(|args: InitArgs| {
            Box::pin(async move {
                STARTED.fetch_add(1, Ordering::SeqCst);
                ensure_stub_args(&args)?;
                wasmrpc::init_rpc(
                    &args.name,
                    Some(0),
                    Some(1),
                    fresh_store(),
                    RpcBackendOptions::default(),
                )
                .await
            })
        });
        let backend = backend_registry::register_backend::<StubOptions>(
            backend_name,
            construct.clone(),
            init.clone(),
        )?;
        let e = backend_registry::register_backend::<StubOptions>(backend_name, construct, init)
            .unwrap_err();
        ensure!(e.kind() == ErrorKind::RuntimeError, "{e}");
        ensure!(
            e.message() == "RPC backend stub_backend: already registered",
            "{e}"
        );
        ensure!(backend_registry::backend_registered(backend_name));

        let agent = backend_registry::init_rpc_backend(
            "worker1",
            Some(&backend),
            Some(0),
            Some(WORLD_SIZE),
            fresh_store(),
            Some(Box::new(StubOptions)),
        )
        .await?;
        ensure!(STARTED.load(Ordering::SeqCst) == 1);
        ensure!(agent.name() == "worker1");
        agent.shutdown(true, std::time::Duration::ZERO).await?;
        Ok(())
    });
}

/// What the stub's init handler checks it was handed.
fn ensure_stub_args(args: &InitArgs) -> wasmrpc::Result<()> {
    let ok = args.name == "worker1"
        && args.rank == Some(0)
        && args.world_size == Some(WORLD_SIZE)
        && format!("{:?}", args.options) == "StubOptions";
    if ok {
        Ok(())
    } else {
        Err(wasmrpc::Error::runtime(format!(
            "the stub backend was handed {} rank {:?} of {:?} with {:?}",
            args.name, args.rank, args.world_size, args.options
        )))
    }
}

/// Every rank's `init_rpc` with `FooBackendOptions` on `backend` fails with
/// a `TypeError` containing `text`.
async fn every_rank_refuses_foo_options(
    backend: Option<&backend_registry::BackendType>,
    text: &str,
) -> anyhow::Result<()> {
    let store = fresh_store();
    for rank in 0..WORLD_SIZE {
        let e = backend_registry::init_rpc_backend(
            &worker_name(rank),
            backend,
            Some(rank),
            Some(WORLD_SIZE),
            store.clone(),
            Some(Box::new(FooBackendOptions {
                init_method: "env://".into(),
            })),
        )
        .await;
        expect_err(e, ErrorKind::TypeError, text)?;
    }
    Ok(())
}

#[test]
fn test_cannot_infer_backend_from_options() {
    timed(every_rank_refuses_foo_options(
        None,
        "Could not infer backend for options",
    ));
}

#[test]
fn test_mismatched_type_for_options() {
    timed(async {
        let tensorpipe = backend_registry::backend(TENSORPIPE)
            .ok_or_else(|| anyhow::anyhow!("{TENSORPIPE} is not registered"))?;
        every_rank_refuses_foo_options(
            Some(&tensorpipe),
            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`",
        )
        .await
    });
}

#[test]
fn test_infer_backend_from_options() {
    timed(async {
        let store = fresh_store();
        let starts = (0..WORLD_SIZE).map(|rank| {
            let store = store.clone();
            tokio::spawn(async move {
                // No backend named: the options' type says TENSORPIPE.
                backend_registry::init_rpc_backend(
                    &worker_name(rank),
                    None,
                    Some(rank),
                    Some(WORLD_SIZE),
                    store,
                    Some(Box::new(RpcBackendOptions::default())),
                )
                .await
            })
        });
        let mut agents = Vec::new();
        for start in starts.collect::<Vec<_>>() {
            agents.push(start.await??);
        }
        // The seed's `assertIsInstance(_get_current_rpc_agent(),
        // TensorPipeAgent)`: the agent is this crate's, and serves.
        let answer = agents[0]
            .rpc_sync(worker_name(1), "aten::add", args![1i64, 2i64])
            .await?;
        ensure!(answer.value == wasmrpc::Value::Int(3), "{:?}", answer.value);
        // Graceful shutdown is collective: every worker at once.
        let stops: Vec<_> = agents
            .into_iter()
            .map(|agent| {
                tokio::spawn(async move { agent.shutdown(true, std::time::Duration::ZERO).await })
            })
            .collect();
        for stop in stops {
            stop.await??;
        }
        Ok(())
    });
}
