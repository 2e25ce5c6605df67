//! Port of `rpc_test.py`'s `@async_execution` class tests (area J): static
//! and class methods of `AsyncExecutionClass` called by name, and all three
//! kinds of method through RRef proxies on an `AsyncExecutionClass` object.
//! The class is the seed-fns wasm plugin's: its static and class methods are
//! the functions `seed_fns::AsyncExecutionClass.static_async_add` and
//! `seed_fns::AsyncExecutionClass.class_async_add`.
//!
//! Modes as in the seed's `_test_async_function`: SYNC is `rpc_sync`,
//! REMOTE is `remote().to_here()` (the function runs on `dst1` and calls
//! `dst2`); the proxy tests use `rref.rpc_sync()`, `rref.rpc_async()
//! .wait()` and `rref.remote().to_here()`.

use anyhow::ensure;
use wasmrpc::prelude::*;
use wasmrpc::testing::Worker;
use wasmrpc::{Payload, RRefProxyMode, args};
use wasmrpc_tests::{dist_with, expect_tensor, ones};

use super::rref::plugin_cluster;

const STATIC_ASYNC_ADD: &str = "seed_fns::AsyncExecutionClass.static_async_add";
const CLASS_ASYNC_ADD: &str = "seed_fns::AsyncExecutionClass.class_async_add";

#[derive(Clone, Copy, Debug)]
enum Mode {
    Sync,
    Remote,
}

/// The seed's `_test_async_function(fn, mode)`: `fn(dst2, ones(2, 2), 1,
/// 2)` on `dst1` is `ones(2, 2) + 3`.
async fn async_function(w: Worker, function: &str, mode: Mode) -> anyhow::Result<()> {
    let (dst1, dst2) = (w.peer(1), w.peer(2));
    let call = args![dst2, ones(&[2, 2]), 1, 2];
    let p = match mode {
        Mode::Sync => w.agent.rpc_sync(dst1.as_str(), function, call).await?,
        Mode::Remote => {
            let r = w.agent.remote(dst1.as_str(), function, call)?;
            r.to_here(&w.agent, None).await?
        }
    };
    expect_tensor(&p, &(ones(&[2, 2]) + 3))
}

#[test]
fn test_async_static_method() {
    dist_with(plugin_cluster(4), |w| async move {
        async_function(w, STATIC_ASYNC_ADD, Mode::Sync).await
    });
}

#[test]
fn test_async_static_method_remote() {
    dist_with(plugin_cluster(4), |w| async move {
        async_function(w, STATIC_ASYNC_ADD, Mode::Remote).await
    });
}

#[test]
fn test_async_class_method() {
    dist_with(plugin_cluster(4), |w| async move {
        async_function(w, CLASS_ASYNC_ADD, Mode::Sync).await
    });
}

#[test]
fn test_async_class_method_remote() {
    dist_with(plugin_cluster(4), |w| async move {
        async_function(w, CLASS_ASYNC_ADD, Mode::Remote).await
    });
}

/// The seed's `_test_test_async_class_rref_proxy(mode)`: the three methods
/// through a proxy of `mode`, each `x + x + y`, sum `3 * 4 * x`.
async fn async_class_rref_proxy(w: Worker, mode: RRefProxyMode) -> anyhow::Result<()> {
    let (dst1, dst2) = (w.peer(1), w.peer(2));
    let rref = w
        .agent
        .remote(dst1.as_str(), "seed_fns::AsyncExecutionClass", args![])?;
    let x = ones(&[2, 2]);
    let y = ones(&[2, 2]) + 1;
    let mut ret = x.zeros_like();
    for method in ["static_async_add", "class_async_add", "bound_async_add"] {
        let call = args![dst2.clone(), &x, &x, &y];
        let p: Payload = match mode {
            RRefProxyMode::Sync => rref.rpc_sync(&w.agent, None).call(method, call).await?,
            RRefProxyMode::Async => {
                rref.rpc_async(&w.agent, None)
                    .call_async(method, call)
                    .wait()
                    .await?
            }
            RRefProxyMode::Remote => {
                let r = rref
                    .remote(&w.agent, None)
                    .call_remote(method, call)
                    .await?;
                r.to_here(&w.agent, None).await?
            }
        };
        ret += p.as_tensor()?;
    }
    let want = x * 12;
    ensure!(ret.equal(&want), "{mode:?}: got {ret} want {want}");
    Ok(())
}

#[test]
fn test_async_class_rref_proxy() {
    dist_with(plugin_cluster(4), |w| async move {
        async_class_rref_proxy(w, RRefProxyMode::Sync).await
    });
}

#[test]
fn test_async_class_rref_proxy_async() {
    dist_with(plugin_cluster(4), |w| async move {
        async_class_rref_proxy(w, RRefProxyMode::Async).await
    });
}

#[test]
fn test_async_class_rref_proxy_remote() {
    dist_with(plugin_cluster(4), |w| async move {
        async_class_rref_proxy(w, RRefProxyMode::Remote).await
    });
}
