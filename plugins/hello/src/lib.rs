//! A plugin written only against `wasmrpc-guest`, for deployment to a
//! running cluster: no test cluster loads it at start-up, so the deployment
//! tests (`tests/all/deploy_test.rs`, `host/tests/cli.rs`) ship it with
//! `deploy_plugin` / `wasmrpc plugin deploy` and then call it by name.

use wasmrpc_guest::{Result, Tensor, get_worker_info, remote, rpc_sync};

/// `greet(name)`: a greeting from the worker that runs it.
#[remote]
fn greet(name: String) -> Result<String> {
    Ok(format!("hello {name} from {}", get_worker_info()?.name))
}

/// `double_on(dst, n)`: `aten::mul(ones(n), 2)` run on worker `dst`, summed
/// here (a nested call made by a deployed plugin).
#[remote]
fn double_on(dst: String, n: i64) -> Result<Tensor> {
    let t: Tensor = rpc_sync(&dst, "aten::mul", (Tensor::ones(&[n])?, 2i64))?;
    t.sum()
}
