//! Area J of `rpc_test.py`: `@rpc.functions.async_execution` functions, the
//! function tests (the class tests, `AsyncExecutionClass`, are in
//! `async_class`). Every test keeps the seed's name.
//!
//! The functions are the seed-fns plugin's `#[remote(async_execution)]`
//! functions (`seed_fns::async_add`, ...), run as wasm on the callee: each
//! returns a future (of a nested `rpc_async`, of a `then` chain, or one it
//! completes itself) and the call completes when that future does. The
//! tests follow the seed's `_test_async_function(fn, mode)`: the function
//! runs on `dst1 = rank + 1` and calls `dst2 = rank + 2`, in the three
//! modes of `_run_func_in_mode` (SYNC `rpc_sync`, ASYNC
//! `rpc_async().wait()`, REMOTE `remote().to_here()`).

use wasmrpc::prelude::*;
use wasmrpc::testing::Worker;
use wasmrpc::{Args, ErrorKind, Payload, args};
use wasmrpc_tests::{dist, expect_err, expect_tensor, ones};

/// The seed's `RPCExecMode`.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Sync,
    Async,
    Remote,
}

/// The seed's `_run_func_in_mode`.
async fn run_func_in_mode(
    w: &Worker,
    to: &str,
    function: &str,
    mode: Mode,
    args: Args,
) -> wasmrpc::Result<Payload> {
    match mode {
        Mode::Sync => w.agent.rpc_sync(to, function, args).await,
        Mode::Async => w.agent.rpc_async(to, function, args).wait().await,
        Mode::Remote => {
            let rref = w.agent.remote(to, function, args)?;
            rref.to_here(&w.agent, None).await
        }
    }
}

/// The seed's `_test_async_function_raise`: the function raises
/// `RuntimeError("Expected error")` before returning a future.
fn test_async_function_raise_in(mode: Mode) {
    dist(move |w| async move {
        let r = run_func_in_mode(&w, &w.dst(), "seed_fns::async_raise_func", mode, args![]).await;
        expect_err(r, ErrorKind::RuntimeError, "Expected error")?;
        Ok(())
    });
}

#[test]
fn test_async_function_raise() {
    test_async_function_raise_in(Mode::Sync);
}

#[test]
fn test_async_function_raise_async() {
    test_async_function_raise_in(Mode::Async);
}

#[test]
fn test_async_function_raise_remote() {
    test_async_function_raise_in(Mode::Remote);
}

/// The seed's regex, `Functions decorated with @rpc\.async_function must
/// return a torch\.futures\.Future object,`, as the text it matches.
const WRONG_RETURN_TYPE: &str =
    "Functions decorated with @rpc.async_function must return a torch.futures.Future object,";

/// The seed's `_test_async_function_wrong_return_type`: the function
/// returns a tensor instead of a future.
fn test_async_function_wrong_return_type_in(mode: Mode) {
    dist(move |w| async move {
        let r = run_func_in_mode(&w, &w.dst(), "seed_fns::async_wrong_type", mode, args![]).await;
        expect_err(r, ErrorKind::RuntimeError, WRONG_RETURN_TYPE)?;
        Ok(())
    });
}

#[test]
fn test_async_function_wrong_return_type() {
    test_async_function_wrong_return_type_in(Mode::Sync);
}

#[test]
fn test_async_function_wrong_return_type_async() {
    test_async_function_wrong_return_type_in(Mode::Async);
}

#[test]
fn test_async_function_wrong_return_type_remote() {
    test_async_function_wrong_return_type_in(Mode::Remote);
}

#[test]
fn test_async_function_simple() {
    dist(|w| async move {
        let (dst1, dst2) = (w.peer(1), w.peer(2));
        let r = w
            .agent
            .rpc_sync(
                &dst1,
                "seed_fns::async_add",
                args![dst2.as_str(), ones(&[2, 2]), 1],
            )
            .await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 1))
    });
}

/// The seed's `_test_async_function(fn, mode)`: `fn(dst2, ones(2, 2), 1, 2)`
/// on `dst1` is `ones(2, 2) + 3`.
fn test_async_function(function: &'static str, mode: Mode) {
    dist(move |w| async move {
        let (dst1, dst2) = (w.peer(1), w.peer(2));
        let call = args![dst2.as_str(), ones(&[2, 2]), 1, 2];
        let r = run_func_in_mode(&w, &dst1, function, mode, call).await?;
        expect_tensor(&r, &(ones(&[2, 2]) + 3))
    });
}

#[test]
fn test_async_function_with_future_ctor() {
    test_async_function("seed_fns::async_add_with_future_ctor", Mode::Sync);
}

#[test]
fn test_async_function_with_future_ctor_remote() {
    test_async_function("seed_fns::async_add_with_future_ctor", Mode::Remote);
}

#[test]
fn test_async_function_chained() {
    test_async_function("seed_fns::async_add_chained", Mode::Sync);
}

#[test]
fn test_async_function_chained_remote() {
    test_async_function("seed_fns::async_add_chained", Mode::Remote);
}

#[test]
fn test_async_function_nested() {
    test_async_function("seed_fns::async_add_nested", Mode::Sync);
}

#[test]
fn test_async_function_nested_remote() {
    test_async_function("seed_fns::async_add_nested", Mode::Remote);
}

/// The seed's `_test_async_function_multi(fn, mode)`: `fn(dst2, ones(2, 2),
/// num = 20, step = 3)` on `dst1` is `ones(2, 2) + num * step`.
fn test_async_function_multi(function: &'static str, mode: Mode) {
    const NUM: i64 = 20;
    const STEP: i64 = 3;
    dist(move |w| async move {
        let (dst1, dst2) = (w.peer(1), w.peer(2));
        let call = args![dst2.as_str(), ones(&[2, 2]), NUM, STEP];
        let r = run_func_in_mode(&w, &dst1, function, mode, call).await?;
        expect_tensor(&r, &(ones(&[2, 2]) + NUM * STEP))
    });
}

#[test]
fn test_async_function_multi_chained() {
    test_async_function_multi("seed_fns::async_add_chained_multi", Mode::Sync);
}

#[test]
fn test_async_function_multi_chained_async() {
    test_async_function_multi("seed_fns::async_add_chained_multi", Mode::Async);
}

#[test]
fn test_async_function_multi_chained_remote() {
    test_async_function_multi("seed_fns::async_add_chained_multi", Mode::Remote);
}

#[test]
fn test_async_function_multi_fanout() {
    test_async_function_multi("seed_fns::async_add_multi_fanout", Mode::Sync);
}

#[test]
fn test_async_function_multi_fanout_async() {
    test_async_function_multi("seed_fns::async_add_multi_fanout", Mode::Async);
}

#[test]
fn test_async_function_multi_fanout_remote() {
    test_async_function_multi("seed_fns::async_add_multi_fanout", Mode::Remote);
}
