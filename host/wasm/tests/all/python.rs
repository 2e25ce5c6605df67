//! Component plugins: the Python seed functions (`plugins/python/seed-fns-py`,
//! built with componentize-py by `wasmrpc-plugins`) on the same runtime,
//! pool and limits as Rust plugins, against the fake worker.
//!
//! Compiling a Python component takes seconds, so every runtime here shares
//! one on-disk cache folder: the first test compiles it, the others load
//! the compiled code.

use crate::{args, fake::FakeHost, kwargs, timed};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmrpc_wasm::manifest::{self, ExportKind};
use wasmrpc_wasm::{Config, Error, ErrorKind, LoadSource, Plugin, Runtime, Value};

/// The cache folder of this test binary's compiled components.
fn cache_dir() -> PathBuf {
    PathBuf::from(wasmrpc_plugins::SEED_FNS_PY)
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("compiled"))
        .expect("the Python plugin lies in the plugins' target folder")
}

fn python(config: Config) -> (Runtime, Arc<Plugin>, Arc<FakeHost>) {
    let runtime = Runtime::new(Config {
        cache_dir: Some(cache_dir()),
        ..config
    })
    .expect("a runtime");
    let plugin = runtime
        .load_file(wasmrpc_plugins::SEED_FNS_PY)
        .expect("the Python plugin loads");
    let host = FakeHost::new();
    host.serve(runtime.clone(), plugin.clone());
    (runtime, plugin, host)
}

fn setup() -> (Runtime, Arc<Plugin>, Arc<FakeHost>) {
    python(crate::config())
}

#[test]
fn the_python_manifest_is_read_without_compiling() {
    let bytes = std::fs::read(wasmrpc_plugins::SEED_FNS_PY).unwrap();
    let m = manifest::read(&bytes).unwrap();
    assert_eq!(m.name, "seed-fns-py");
    assert!(m.abi_matches());
    assert_eq!(m.function("my_function").unwrap().params, ["a", "b", "c"]);
    assert_eq!(m.constructor("MyClass").unwrap().params, ["a", "delay"]);
    assert_eq!(
        m.method("MyClass", "increment_value").unwrap().kind,
        ExportKind::Method
    );
    assert_eq!(
        m.function("MyClass.my_static_method").unwrap().params,
        ["f"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_functions_run_by_name_with_kwargs_and_tensors() {
    timed(async {
        let (rt, plugin, host) = setup();
        assert!(plugin.is_component());
        let six = rt
            .call(
                &plugin,
                "my_function",
                kwargs(&[
                    ("a", Value::Int(1)),
                    ("b", Value::Int(2)),
                    ("c", Value::Int(3)),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(six, Value::Int(6));
        let s = rt
            .call(
                &plugin,
                "my_function",
                args(vec![
                    Value::Str("a".into()),
                    Value::Str("b".into()),
                    Value::Str("c".into()),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(s, Value::Str("abc".into()));
        // Tensors: `t1 + t2` runs in the host.
        let (a, b) = (
            host.tensor(&[2], vec![1.0, 2.0]),
            host.tensor(&[2], vec![10.0, 20.0]),
        );
        let sum = rt
            .call(&plugin, "my_py_add", args(vec![a, b]), host.arc())
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&sum), (vec![2], vec![11.0, 22.0]));
        // A warm instance went back to the pool, and serves the next call.
        assert!(plugin.idle_instances() >= 1);
        let start = Instant::now();
        for _ in 0..100 {
            rt.call(&plugin, "light_rpc", args(vec![]), host.arc())
                .await
                .unwrap();
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_errors_keep_their_class() {
    timed(async {
        let (rt, plugin, host) = setup();
        let e = rt
            .call(&plugin, "raise_func", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(
            (e.kind(), e.to_remote().message.as_str()),
            (ErrorKind::ValueError, "Expected error")
        );
        let e = rt
            .call(&plugin, "raise_func_escape", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(
            e.to_remote().message,
            "\nFirst line of error \n next line of error \n last line of error"
        );
        let e = rt
            .call(&plugin, "custom_raise_func", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RuntimeError);
        assert!(
            e.to_remote()
                .message
                .ends_with("Original exception on remote side was CustomException: foo"),
            "{e}"
        );
        // A host error inside Python arrives in Python as its class, and
        // back out unchanged: an unknown worker.
        let e = rt
            .call(
                &plugin,
                "nested_rpc",
                args(vec![Value::Str("nobody".into())]),
                host.arc(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RuntimeError, "{e}");
        assert!(e.to_remote().message.contains("nobody"), "{e}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_python_function_hits_the_time_limit() {
    timed(async {
        let (rt, plugin, host) = python(Config {
            time_limit: Some(Duration::from_millis(300)),
            ..crate::config()
        });
        let start = Instant::now();
        let e = rt
            .call(&plugin, "spin_forever", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { limit_ms: 300, .. }), "{e:?}");
        assert!(start.elapsed() < Duration::from_secs(10));
        // Waiting on the host does not count; the plugin keeps serving.
        let r = rt
            .call(
                &plugin,
                "delayed_add",
                args(vec![Value::Int(1), Value::Int(2), Value::Float(0.5)]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(r, Value::Int(3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_function_past_its_memory_limit_gets_a_clear_error() {
    timed(async {
        let (rt, plugin, host) = python(Config {
            max_memory: 128 << 20,
            ..crate::config()
        });
        assert_eq!(
            rt.call(&plugin, "allocate", args(vec![Value::Int(4)]), host.arc())
                .await
                .unwrap(),
            Value::Int(4)
        );
        let e = rt
            .call(&plugin, "allocate", args(vec![Value::Int(256)]), host.arc())
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::MemoryLimit { limit, .. } if limit == 128 << 20),
            "{e:?}"
        );
        assert_eq!(
            rt.call(&plugin, "allocate", args(vec![Value::Int(2)]), host.arc())
                .await
                .unwrap(),
            Value::Int(2)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_objects_keep_their_state_between_method_calls() {
    timed(async {
        let (rt, plugin, host) = setup();
        let obj = rt
            .construct(&plugin, "MyClass", args(vec![Value::Int(2)]), host.arc())
            .await
            .unwrap();
        obj.call_method("increment_value", args(vec![Value::Int(3)]), host.arc())
            .await
            .unwrap();
        let v = obj
            .call_method("get_value", args(vec![]), host.arc())
            .await
            .unwrap();
        assert_eq!(v, Value::Int(5));
        let e = obj
            .call_method("nope", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
        obj.dispose(host.arc()).await.unwrap();
        let t = rt
            .call(
                &plugin,
                "MyClass.my_static_method",
                args(vec![Value::Int(11)]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(t, Value::Bool(true));
    })
    .await;
}

#[test]
fn a_second_load_reads_the_compiled_component_from_the_cache() {
    drop(setup());
    let (_, plugin, _) = setup();
    assert_eq!(plugin.source(), LoadSource::DiskCache);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_beyond_the_pools_slots_wait_for_an_instance() {
    timed(async {
        // A Python instance takes 13 to 16 of the runtime's core-instance
        // slots (CPython, its libraries and the WASI adapter): a pool of 96
        // holds 6 at once, and 24 calls at once must queue for them rather
        // than fail.
        let (rt, plugin, host) = python(Config {
            max_instances: 96,
            ..crate::config()
        });
        let calls = (0..24).map(|i| {
            let (rt, plugin, host) = (rt.clone(), plugin.clone(), host.clone());
            tokio::spawn(async move {
                let a = args(vec![Value::Int(i), Value::Int(1), Value::Float(0.05)]);
                rt.call(&plugin, "delayed_add", a, host.arc()).await
            })
        });
        let results: Vec<_> = futures_join(calls).await;
        for (i, r) in results.into_iter().enumerate() {
            assert_eq!(r.unwrap(), Value::Int(i as i64 + 1));
        }
    })
    .await;
}

#[test]
fn a_pool_too_small_for_one_python_instance_fails_at_once() {
    // 8 slots cannot hold one Python instance (13 to 16): with no instance
    // live anywhere to wait for, the load's first instance fails at once.
    // The compiled component is in the disk cache first, so the time
    // measured is the checkout's, not the compiler's.
    drop(setup());
    let runtime = Runtime::new(Config {
        cache_dir: Some(cache_dir()),
        max_instances: 8,
        ..crate::config()
    })
    .expect("a runtime");
    let started = Instant::now();
    let err = runtime
        .load_file(wasmrpc_plugins::SEED_FNS_PY)
        .expect_err("8 slots hold no Python instance")
        .to_string();
    assert!(
        err.contains("needs more slots than the runtime's whole pool has (8 instances)"),
        "{err}"
    );
    assert!(
        started.elapsed() < wasmrpc_wasm::POOL_WAIT / 2,
        "failed only after {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_instances_of_other_plugins_give_their_slots_to_a_python_call() {
    timed(async {
        // 24 slots, all held by idle instances of the Rust plugin after 20
        // calls at once: loading the Python plugin (whose first instance
        // takes 13 to 16) must take their slots rather than wait for
        // instances nobody returns.
        let rt = Runtime::new(Config {
            cache_dir: Some(cache_dir()),
            max_instances: 24,
            ..crate::config()
        })
        .expect("a runtime");
        let rust = rt
            .load_file(wasmrpc_plugins::SEED_FNS)
            .expect("the Rust seed plugin loads");
        let host = FakeHost::new();
        host.serve(rt.clone(), rust.clone());
        let calls = (0..20).map(|_| {
            let (rt, rust, host) = (rt.clone(), rust.clone(), host.clone());
            tokio::spawn(async move {
                let a = args(vec![Value::Float(0.2)]);
                rt.call(&rust, "my_sleep_func", a, host.arc()).await
            })
        });
        for r in futures_join(calls).await {
            r.expect("a Rust call");
        }
        assert!(
            rust.idle_instances() >= 12,
            "{} idle",
            rust.idle_instances()
        );
        let started = Instant::now();
        let rt2 = rt.clone();
        let python =
            tokio::task::spawn_blocking(move || rt2.load_file(wasmrpc_plugins::SEED_FNS_PY))
                .await
                .expect("the load's task")
                .expect("the Python plugin loads");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "waited {:?}",
            started.elapsed()
        );
        assert!(python.idle_instances() >= 1);
        assert!(rust.idle_instances() < 12, "{} idle", rust.idle_instances());
    })
    .await;
}

async fn futures_join<T>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<wasmrpc_wasm::Result<T>>>,
) -> Vec<wasmrpc_wasm::Result<T>> {
    let mut out = Vec::new();
    for h in handles.collect::<Vec<_>>() {
        out.push(h.await.expect("the call's task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sees_no_files_no_environment_and_no_time_of_day() {
    timed(async {
        let (rt, plugin, host) = setup();
        let probe = rt
            .call(&plugin, "sandbox_probe", args(vec![]), host.arc())
            .await
            .unwrap();
        let Value::Dict(entries) = probe else {
            panic!("sandbox_probe returned {probe:?}");
        };
        let get = |key: &str| {
            entries
                .iter()
                .find(|(k, _)| *k == Value::Str(key.into()))
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no {key} in {entries:?}"))
        };
        for path in ["/etc/passwd", "/proc/self/environ", "app.py"] {
            match get(path) {
                Value::Str(s) => assert!(!s.starts_with("read"), "{path}: {s}"),
                other => panic!("{path}: {other:?}"),
            }
        }
        assert!(
            matches!(get("listdir"), Value::Str(_) | Value::Int(0)),
            "{:?}",
            get("listdir")
        );
        assert_eq!(get("environ"), Value::Int(0));
        let Value::Float(t) = get("time") else {
            panic!("time: {:?}", get("time"))
        };
        // The wall clock is the host's (no secret: logs and deadlines need
        // it).
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            (t - now).abs() < 60.0,
            "the plugin's clock reads {t}, the host's {now}"
        );
        assert_eq!(get("monotonic_advances"), Value::Bool(true));
    })
    .await;
}
