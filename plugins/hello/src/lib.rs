//! A plugin written only against `wasmrpc-guest`, for deployment to a
//! running cluster: no test cluster loads it at start-up, so the deployment
//! tests (`tests/all/deploy_test.rs`, `host/tests/cli.rs`) ship it with
//! `deploy_plugin` / `wasmrpc plugin deploy` and then call it by name.
//!
//! The upgrade tests (`tests/all/upgrade_test.rs`) make a second version of
//! it by replacing the bytes of [`VERSION`] in the module (same length, so
//! the module stays valid): other bytes, same plugin, other behaviour.

use wasmrpc_guest::{
    Result, Tensor, get_worker_info, global, lock, remote, remote_class, rpc_sync, set_global,
    sleep,
};

/// This build's version marker, 32 bytes, the only place it is written.
pub const VERSION: &str = "hello-version-AAAAAAAAAAAAAAAAAA";

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

/// `version()`: the version marker of the code that runs.
#[remote]
fn version() -> Result<String> {
    Ok(VERSION.to_string())
}

/// `version_chain(on, seconds)`: the marker here, then, after sleeping
/// `seconds`, the marker of `version` called by its short name on worker
/// `on` (a nested call, which stays on this version), and counts the call
/// in this version's global `calls`: `"<here> <there>"`.
#[remote]
fn version_chain(on: String, seconds: f64) -> Result<String> {
    let here = VERSION.to_string();
    {
        let _counting = lock("calls")?;
        let calls = global::<i64>("calls")?.unwrap_or(0);
        set_global("calls", calls + 1)?;
    }
    sleep(seconds)?;
    let there: String = rpc_sync(&on, "version", ())?;
    Ok(format!("{here} {there}"))
}

/// `calls()`: how many `version_chain` calls this version served on this
/// worker (its own global).
#[remote]
fn calls() -> Result<i64> {
    Ok(global::<i64>("calls")?.unwrap_or(0))
}

/// `Versioned()`: an object that answers the marker of the version that
/// made it.
pub struct Versioned;

#[remote_class]
impl Versioned {
    /// `Versioned()`.
    #[constructor]
    fn new() -> Result<Versioned> {
        Ok(Versioned)
    }

    /// The marker of this object's code.
    fn version(&self) -> Result<String> {
        Ok(VERSION.to_string())
    }
}
