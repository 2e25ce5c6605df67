//! The wasm runtime's tests: the seed-fns plugin, built from source by
//! `wasmrpc-plugins`, run against a fake worker ([`fake::FakeHost`]).

mod compile_helper;
mod fake;
mod functions;
mod loading;
mod objects;
mod python;

use fake::FakeHost;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use wasmrpc_wasm::{CallArgs, Config, Plugin, Runtime, Value};

/// Every plugin must have a test module here: `foreach_plugin!` names each.
macro_rules! assert_plugin_tested {
    ($name:ident) => {
        #[allow(unused_imports, reason = "only checks that a test module exists")]
        use functions::$name as _;
    };
}
wasmrpc_plugins::foreach_plugin!(assert_plugin_tested);

/// Fails the test instead of hanging it.
pub(crate) async fn timed<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("the test timed out")
}

pub(crate) fn config() -> Config {
    Config {
        max_instances: 64,
        ..Config::default()
    }
}

/// A runtime with seed-fns loaded, and a fake host that serves it.
pub(crate) fn setup_with(config: Config) -> (Runtime, Arc<Plugin>, Arc<FakeHost>) {
    let runtime = Runtime::new(config).expect("a runtime");
    let plugin = runtime
        .load_file(wasmrpc_plugins::SEED_FNS)
        .expect("seed-fns loads");
    let host = FakeHost::new();
    host.serve(runtime.clone(), plugin.clone());
    (runtime, plugin, host)
}

pub(crate) fn setup() -> (Runtime, Arc<Plugin>, Arc<FakeHost>) {
    setup_with(config())
}

pub(crate) fn args(args: Vec<Value>) -> CallArgs {
    CallArgs {
        args,
        kwargs: Vec::new(),
    }
}

pub(crate) fn kwargs(kwargs: &[(&str, Value)]) -> CallArgs {
    CallArgs {
        args: Vec::new(),
        kwargs: kwargs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
    }
}
