//! Stateless functions of seed-fns: arguments, errors, traps, limits,
//! concurrency, nested calls, async functions.

use crate::{args, config, kwargs, setup, setup_with, timed};
use std::time::{Duration, Instant};
use wasmrpc_wasm::{Config, Error, ErrorKind, Value};

/// The plugin `plugins/seed-fns` is tested here (see `foreach_plugin!`).
pub(crate) mod seed_fns {}

/// The plugin `plugins/autograd-fns`: its autograd requests reach the
/// host's `GuestHost::autograd`, which the fake host does not implement;
/// its runs across real workers are in `tests/all/dist_autograd_test`.
pub(crate) mod autograd_fns {
    use crate::{setup, timed};
    use wasmrpc_wasm::ErrorKind;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn autograd_requests_reach_the_host() {
        timed(async {
            let (rt, _, host) = setup();
            let plugin = rt
                .load_file(wasmrpc_plugins::AUTOGRAD_FNS)
                .expect("the autograd-fns plugin loads");
            let err = rt
                .call(&plugin, "nested_context", Default::default(), host.arc())
                .await
                .expect_err("the fake host has no autograd");
            assert_eq!(err.kind(), ErrorKind::RuntimeError, "{err}");
            assert!(
                err.to_string()
                    .contains("this host does not support autograd requests (ContextNew)"),
                "{err}"
            );
        })
        .await;
    }
}

/// The plugin `plugins/demo` (a first plugin): its argument checks here,
/// against the fake host; its whole run across real workers in
/// `tests/all/plugin_test.rs`.
pub(crate) mod demo {
    use crate::{args, setup, timed};
    use wasmrpc_wasm::{ErrorKind, Value};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_rejects_an_empty_world_with_a_value_error() {
        timed(async {
            let (rt, _, host) = setup();
            let demo = rt
                .load_file(wasmrpc_plugins::DEMO)
                .expect("the demo plugin loads");
            let err = rt
                .call(
                    &demo,
                    "run",
                    args(vec![Value::Int(0), Value::Int(10)]),
                    host.arc(),
                )
                .await
                .expect_err("world_size 0 is refused");
            assert_eq!(err.kind(), ErrorKind::ValueError, "{err}");
            assert!(err.to_string().contains("world_size >= 1"), "{err}");
        })
        .await;
    }
}

/// The plugin `plugins/rl` (the RL examples): its argument checks here,
/// against the fake host; its training runs across real workers in
/// `examples/tests/examples.rs`.
pub(crate) mod rl {
    use crate::{args, setup, timed};
    use wasmrpc_wasm::{ErrorKind, Value};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_rejects_zero_observers_with_a_value_error() {
        timed(async {
            let (rt, _, host) = setup();
            let rl = rt
                .load_file(wasmrpc_plugins::RL)
                .expect("the rl plugin loads");
            let err = rt
                .call(
                    &rl,
                    "run",
                    args(vec![
                        Value::Int(0),
                        Value::Int(1),
                        Value::Int(1),
                        Value::Float(0.01),
                        Value::Bool(true),
                    ]),
                    host.arc(),
                )
                .await
                .expect_err("zero observers are refused");
            assert_eq!(err.kind(), ErrorKind::ValueError, "{err}");
            assert!(err.to_string().contains("observers"), "{err}");
        })
        .await;
    }
}

/// The plugin `plugins/param-server` (the parameter server example): its
/// argument checks here, against the fake host; its data and model across
/// real workers in `examples/tests/examples.rs`.
pub(crate) mod param_server {
    use crate::{args, setup, timed};
    use wasmrpc_wasm::{ErrorKind, Value};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn init_rejects_an_empty_hidden_layer_with_a_value_error() {
        timed(async {
            let (rt, _, host) = setup();
            let ps = rt
                .load_file(wasmrpc_plugins::PARAM_SERVER)
                .expect("the param-server plugin loads");
            let err = rt
                .call(
                    &ps,
                    "init",
                    args(vec![Value::Int(0), Value::Int(1)]),
                    host.arc(),
                )
                .await
                .expect_err("hidden 0 is refused");
            assert_eq!(err.kind(), ErrorKind::ValueError, "{err}");
            assert!(err.to_string().contains("hidden >= 1"), "{err}");
        })
        .await;
    }
}

/// The plugin `plugins/pipeline` (the pipeline parallel example): its
/// argument checks here, against the fake host; its training across real
/// workers in `examples/tests/examples.rs`.
pub(crate) mod pipeline {
    use crate::{args, setup, timed};
    use wasmrpc_wasm::{ErrorKind, Value};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_rejects_zero_micro_batches_with_a_value_error() {
        timed(async {
            let (rt, _, host) = setup();
            let pipeline = rt
                .load_file(wasmrpc_plugins::PIPELINE)
                .expect("the pipeline plugin loads");
            let err = rt
                .call(
                    &pipeline,
                    "run",
                    args(vec![
                        Value::Int(0),
                        Value::Int(8),
                        Value::Int(1),
                        Value::Float(0.1),
                        Value::Int(16),
                        Value::Bool(true),
                    ]),
                    host.arc(),
                )
                .await
                .expect_err("zero micro-batches are refused");
            assert_eq!(err.kind(), ErrorKind::ValueError, "{err}");
            assert!(err.to_string().contains("micro_batches"), "{err}");
        })
        .await;
    }
}

/// The plugin `plugins/hello` (deployed at run time by the deployment
/// tests): `greet` against the fake host here; its deployment to real
/// workers in `tests/all/deploy_test.rs`.
pub(crate) mod hello {
    use crate::{args, setup, timed};
    use wasmrpc_wasm::Value;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn greet_names_the_worker_it_runs_on() {
        timed(async {
            let (rt, _, host) = setup();
            let hello = rt
                .load_file(wasmrpc_plugins::HELLO)
                .expect("the hello plugin loads");
            let r = rt
                .call(
                    &hello,
                    "greet",
                    args(vec![Value::Str("you".into())]),
                    host.arc(),
                )
                .await
                .expect("greet answers");
            assert_eq!(r, Value::Str("hello you from worker0".into()));
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn my_function_with_kwargs_and_positional_tensors() {
    timed(async {
        let (rt, plugin, host) = setup();
        let n = 5;
        let r = rt
            .call(
                &plugin,
                "my_function",
                kwargs(&[
                    ("a", Value::Int(n)),
                    ("b", Value::Int(n + 1)),
                    ("c", Value::Int(n + 2)),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(r, Value::Int(3 * n + 3));

        // Mixed: positional a, keyword c and b in another order.
        let mut mixed = args(vec![Value::Int(1)]);
        mixed.kwargs = vec![("c".into(), Value::Float(0.5)), ("b".into(), Value::Int(2))];
        assert_eq!(
            rt.call(&plugin, "my_function", mixed, host.arc())
                .await
                .unwrap(),
            Value::Float(3.5)
        );

        // Tensors: my_function(ones(2, 2), 1, 3).
        let x = host.ones(&[2, 2]);
        let r = rt
            .call(
                &plugin,
                "my_function",
                args(vec![x, Value::Int(1), Value::Int(3)]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![5.0; 4]));
        assert_eq!(
            host.live_tensors(),
            0,
            "the guest released every handle it owned"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn argument_errors_are_python_type_errors() {
    timed(async {
        let (rt, plugin, host) = setup();
        let call = |a| rt.call(&plugin, "my_function", a, host.arc());
        let e = call(args(vec![Value::Int(1), Value::Int(2)]))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TypeError);
        assert_eq!(
            e.to_remote().message,
            "my_function() missing 1 required positional argument: 'c'"
        );
        let e = call(args(vec![Value::Int(1); 4])).await.unwrap_err();
        assert_eq!(
            e.to_remote().message,
            "my_function() takes 3 positional arguments but 4 were given"
        );
        let e = call(kwargs(&[("a", Value::Int(1)), ("d", Value::Int(1))]))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_remote().message,
            "my_function() got an unexpected keyword argument 'd'"
        );
        let mut twice = args(vec![Value::Int(1)]);
        twice.kwargs.push(("a".into(), Value::Int(2)));
        let e = call(twice).await.unwrap_err();
        assert_eq!(
            e.to_remote().message,
            "my_function() got multiple values for argument 'a'"
        );
        let e = call(args(vec![
            Value::Str("x".into()),
            Value::Int(1),
            Value::Int(1),
        ]))
        .await
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TypeError);
        assert!(e.to_remote().message.contains("argument 'a'"), "{e}");
        let e = rt
            .call(&plugin, "no_such_function", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raise_func_keeps_its_kind_and_text() {
    timed(async {
        let (rt, plugin, host) = setup();
        let e = rt
            .call(&plugin, "raise_func", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Raised { function, .. } if function == "raise_func"),
            "{e:?}"
        );
        assert_eq!(e.kind(), ErrorKind::ValueError);
        assert_eq!(e.to_remote().message, "Expected error");
        assert_eq!(e.to_string(), "ValueError: Expected error");

        // raise_or_inc: raises for two elements, else adds one.
        let e = rt
            .call(
                &plugin,
                "raise_or_inc",
                args(vec![host.ones(&[2])]),
                host.arc(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueError);
        assert_eq!(e.to_remote().message, "Expected error");
        let r = rt
            .call(
                &plugin,
                "raise_or_inc",
                args(vec![host.ones(&[3])]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![3], vec![2.0; 3]));
        assert_eq!(host.live_tensors(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_result_returns_none_and_prints() {
    timed(async {
        let (rt, plugin, host) = setup();
        assert_eq!(
            rt.call(&plugin, "no_result", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::None
        );
        assert_eq!(*host.logs.lock().unwrap(), vec!["do nothing".to_owned()]);
        assert_eq!(
            rt.call(&plugin, "light_rpc", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(0)
        );
        assert_eq!(
            rt.call(&plugin, "return_callee_id", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(0)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_rpc_runs_in_place_ops() {
    timed(async {
        let (rt, plugin, host) = setup();
        let t = host.ones(&[100, 100]);
        let Value::Tensor(h) = t else { unreachable!() };
        // Keep a second handle to read the tensor after the guest dropped its own.
        let mine = wasmrpc_wasm::GuestHost::dup(&*host, wasmrpc_wasm::HandleKind::Tensor, h)
            .await
            .unwrap();
        let r = rt
            .call(&plugin, "heavy_rpc", args(vec![t]), host.arc())
            .await
            .unwrap();
        assert_eq!(r, Value::Int(0));
        let (_, values) = host.take_tensor(&Value::Tensor(mine));
        assert!(
            values.iter().all(|v| (*v - 0.01).abs() < 1e-4),
            "{}",
            values[0]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trapping_guest_is_an_error_and_the_runtime_keeps_working() {
    timed(async {
        let (rt, plugin, host) = setup();
        rt.call(&plugin, "light_rpc", args(vec![]), host.arc())
            .await
            .unwrap();
        let idle = plugin.idle_instances();
        let e = rt
            .call(
                &plugin,
                "panic_func",
                args(vec![Value::Str("boom".into())]),
                host.arc(),
            )
            .await
            .unwrap_err();
        match &e {
            Error::Trap {
                plugin: p,
                function,
                message,
            } => {
                assert_eq!(p, "wasmrpc-plugin-seed-fns");
                assert_eq!(function, "panic_func");
                assert!(message.contains("boom"), "{message}");
            }
            other => panic!("expected a trap, got {other:?}"),
        }
        assert_eq!(e.kind(), ErrorKind::RuntimeError);
        // The trapped instance was discarded, not pooled.
        assert_eq!(plugin.idle_instances(), idle - 1);
        for n in 0..3 {
            let r = rt
                .call(
                    &plugin,
                    "my_function",
                    args(vec![Value::Int(n), Value::Int(1), Value::Int(1)]),
                    host.arc(),
                )
                .await
                .unwrap();
            assert_eq!(r, Value::Int(n + 2));
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_guest_hits_the_time_limit_but_waiting_does_not_count() {
    timed(async {
        let (rt, plugin, host) = setup_with(Config {
            time_limit: Some(Duration::from_millis(300)),
            ..config()
        });
        let start = Instant::now();
        let e = rt
            .call(&plugin, "spin_forever", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { limit_ms: 300, .. }), "{e:?}");
        assert_eq!(e.kind(), ErrorKind::TimeoutError);
        assert!(start.elapsed() < Duration::from_secs(10));
        // Sleeping on the host for longer than the limit is fine.
        let r = rt
            .call(
                &plugin,
                "my_sleep_func",
                kwargs(&[("seconds", Value::Float(0.6))]),
                host.arc(),
            )
            .await;
        assert_eq!(r.unwrap(), Value::None);
        assert_eq!(
            rt.call(&plugin, "light_rpc", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(0)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_past_its_memory_limit_gets_a_clear_error() {
    timed(async {
        let (rt, plugin, host) = setup_with(Config {
            max_memory: 16 << 20,
            ..config()
        });
        assert_eq!(
            rt.call(&plugin, "allocate", args(vec![Value::Int(1)]), host.arc())
                .await
                .unwrap(),
            Value::Int(1 << 20)
        );
        let e = rt
            .call(&plugin, "allocate", args(vec![Value::Int(64)]), host.arc())
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::MemoryLimit { limit, .. } if limit == 16 << 20),
            "{e:?}"
        );
        assert!(e.to_string().contains("exceeded the memory limit"), "{e}");
        assert_eq!(
            rt.call(&plugin, "allocate", args(vec![Value::Int(2)]), host.arc())
                .await
                .unwrap(),
            Value::Int(2 << 20)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_calls_run_at_once_on_the_pool() {
    timed(async {
        let (rt, plugin, host) = setup_with(Config {
            idle_instances: 4,
            ..config()
        });
        // 40 calls that each sleep 0.3 s on the host: serial would take 12 s.
        let start = Instant::now();
        let calls = (0..40).map(|_| {
            let (rt, plugin, host) = (rt.clone(), plugin.clone(), host.clone());
            tokio::spawn(async move {
                rt.call(
                    &plugin,
                    "my_sleep_func",
                    args(vec![Value::Float(0.3)]),
                    host.arc(),
                )
                .await
            })
        });
        for c in futures_join(calls).await {
            assert_eq!(c.unwrap(), Value::None);
        }
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "took {:?}",
            start.elapsed()
        );
        assert!(plugin.idle_instances() <= 4);
        // And 200 quick ones, each with its own answer.
        let calls = (0..200i64).map(|n| {
            let (rt, plugin, host) = (rt.clone(), plugin.clone(), host.clone());
            tokio::spawn(async move {
                let r = rt
                    .call(
                        &plugin,
                        "my_function",
                        args(vec![Value::Int(n), Value::Int(n), Value::Int(n)]),
                        host.arc(),
                    )
                    .await;
                (n, r)
            })
        });
        for (n, r) in futures_join(calls).await {
            assert_eq!(r.unwrap(), Value::Int(3 * n));
        }
    })
    .await;
}

async fn futures_join<T: Send + 'static>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    let mut out = Vec::new();
    for h in handles.collect::<Vec<_>>() {
        out.push(h.await.expect("the task did not panic"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_calls_into_the_same_runtime_do_not_deadlock() {
    timed(async {
        // One idle instance at most: every nested call needs a second one.
        let (rt, plugin, host) = setup_with(Config {
            idle_instances: 1,
            ..config()
        });
        let r = rt
            .call(
                &plugin,
                "nested_udf",
                args(vec![Value::Str("worker0".into()), Value::Int(5)]),
                host.arc(),
            )
            .await;
        assert_eq!(r.unwrap(), Value::Int(8));
        let calls = (0..20i64).map(|n| {
            let (rt, plugin, host) = (rt.clone(), plugin.clone(), host.clone());
            tokio::spawn(async move {
                rt.call(
                    &plugin,
                    "nested_udf",
                    args(vec![Value::Str("worker1".into()), Value::Int(n)]),
                    host.arc(),
                )
                .await
                .map(|v| (n, v))
            })
        });
        for r in futures_join(calls).await {
            let (n, v) = r.unwrap();
            assert_eq!(v, Value::Int(n + 3));
        }
        // nested_rpc: the guest calls aten::add back on its caller.
        let r = rt
            .call(
                &plugin,
                "nested_rpc",
                args(vec![Value::Str("worker0".into())]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![2.0; 4]));
        // An unknown worker is the host's error, passed through.
        let e = rt
            .call(
                &plugin,
                "nested_rpc",
                args(vec![Value::Str("nobody".into())]),
                host.arc(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.to_remote().message, "Unknown destination worker nobody");
        assert_eq!(host.live_tensors(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_functions_complete_when_their_future_does() {
    timed(async {
        let (rt, plugin, host) = setup();
        let to = Value::Str("worker1".into());
        let r = rt
            .call(
                &plugin,
                "async_add",
                args(vec![to.clone(), host.ones(&[2, 2]), host.ones(&[2, 2])]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![2.0; 4]));

        // then(): the callback runs on a pooled instance after the call returned.
        let r = rt
            .call(
                &plugin,
                "async_add_chained",
                args(vec![
                    to.clone(),
                    host.ones(&[2, 2]),
                    host.ones(&[2, 2]),
                    Value::Int(3),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![5.0; 4]));

        // A `Future()` the function made, completed by a `then` callback
        // that got it by its handle.
        let r = rt
            .call(
                &plugin,
                "async_add_with_future_ctor",
                args(vec![
                    to.clone(),
                    host.ones(&[2]),
                    host.ones(&[2]),
                    Value::Int(1),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2], vec![3.0; 2]));

        let e = rt
            .call(&plugin, "async_raise_func", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RuntimeError);
        assert_eq!(e.to_remote().message, "Expected error");

        // The nested call's failure reaches the caller through the future.
        let e = rt
            .call(
                &plugin,
                "async_add",
                args(vec![to, host.ones(&[2]), host.ones(&[3])]),
                host.arc(),
            )
            .await
            .unwrap_err();
        assert!(e.to_remote().message.contains("must match the size"), "{e}");

        assert_eq!(host.settled_tensors(0).await, 0);
        // The `then` tasks release their own handles just after completing.
        let deadline = Instant::now() + Duration::from_secs(10);
        while host.live_futures() != 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(host.live_futures(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_function_returning_a_value_is_refused_with_pytorchs_text() {
    // `async_wrong_type` returns a tensor from an `async_execution` function
    // (the seed's `async_wrong_type`): a RuntimeError with PyTorch's text,
    // naming what came back, and the tensor is released.
    timed(async {
        let (rt, plugin, host) = setup();
        let e = rt
            .call(&plugin, "async_wrong_type", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RuntimeError, "{e}");
        let message = e.to_remote().message;
        assert!(
            message.starts_with(wasmrpc_wasm::ASYNC_WRONG_TYPE),
            "{message}"
        );
        assert!(message.ends_with("but got Tensor"), "{message}");
        assert_eq!(host.live_tensors(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn globals_and_locks_are_per_worker() {
    timed(async {
        let (rt, plugin, host) = setup();
        rt.call(&plugin, "set_value", args(vec![Value::Int(41)]), host.arc())
            .await
            .unwrap();
        assert_eq!(
            rt.call(&plugin, "get_value", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(41)
        );
        let t = host.ones(&[3]);
        rt.call(&plugin, "set_value", args(vec![t]), host.arc())
            .await
            .unwrap();
        assert_eq!(
            host.live_tensors(),
            0,
            "the global keeps the tensor, not the guest's handle"
        );
        let r = rt
            .call(&plugin, "get_value", args(vec![]), host.arc())
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![3], vec![1.0; 3]));

        // 30 concurrent read-sleep-write increments under a worker-wide lock.
        rt.call(&plugin, "_reset_count", args(vec![]), host.arc())
            .await
            .unwrap();
        let calls = (0..30).map(|_| {
            let (rt, plugin, host) = (rt.clone(), plugin.clone(), host.clone());
            tokio::spawn(async move {
                rt.call(&plugin, "_increment_count", args(vec![]), host.arc())
                    .await
            })
        });
        let mut seen: Vec<i64> = futures_join(calls)
            .await
            .into_iter()
            .map(|r| match r.unwrap() {
                Value::Int(i) => i,
                other => panic!("{other:?}"),
            })
            .collect();
        seen.sort();
        assert_eq!(seen, (1..=30).collect::<Vec<_>>());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_a_trapped_call_held_are_released() {
    timed(async {
        let (rt, plugin, host) = setup();
        let e = rt
            .call(
                &plugin,
                "lock_then_panic",
                args(vec![Value::Str("count".into())]),
                host.arc(),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Trap { message, .. } if message.contains("holding lock count")),
            "{e:?}"
        );
        // `_increment_count` takes the same lock: it would wait forever.
        let r = rt
            .call(&plugin, "_increment_count", args(vec![]), host.arc())
            .await
            .unwrap();
        assert_eq!(r, Value::Int(1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_remotes_and_returned_rrefs() {
    timed(async {
        let (rt, plugin, host) = setup();
        let dst = || Value::Str("worker1".into());
        let r = rt
            .call(&plugin, "nested_remote", args(vec![dst()]), host.arc())
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![4.0; 4]));

        // An RRef comes back; passing two of them in gives their sum.
        let a = rt
            .call(&plugin, "rpc_return_rref", args(vec![dst()]), host.arc())
            .await
            .unwrap();
        let Value::Tuple(pair) = rt
            .call(&plugin, "nested_rref", args(vec![dst()]), host.arc())
            .await
            .unwrap()
        else {
            panic!("nested_rref returns a tuple");
        };
        assert!(
            matches!(a, Value::RRef(_)) && matches!(pair[..], [Value::RRef(_), Value::RRef(_)])
        );
        let r = rt
            .call(&plugin, "my_rref_function", args(pair), host.arc())
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![5.0; 4]));
        let Value::RRef(a) = a else { unreachable!() };
        let r = wasmrpc_wasm::GuestHost::rref_to_here(&*host, a)
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![2.0; 4]));

        let list = Value::List(vec![host.ones(&[3]), host.ones(&[3]), host.ones(&[3])]);
        let r = rt
            .call(&plugin, "my_container_sum", args(vec![list]), host.arc())
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![3], vec![3.0; 3]));

        // 20 chained `then(+3)` callbacks: ones + 60.
        let r = rt
            .call(
                &plugin,
                "async_add_chained_multi",
                args(vec![
                    dst(),
                    host.ones(&[2, 2]),
                    Value::Int(20),
                    Value::Int(3),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2, 2], vec![61.0; 4]));
        // The `then` tasks release their own handles just after completing.
        assert_eq!(host.settled_tensors(0).await, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rref_arguments_are_fetched_through_the_host() {
    timed(async {
        let (rt, plugin, host) = setup();
        let rref = wasmrpc_wasm::GuestHost::rref_new(&*host, Value::Int(40))
            .await
            .unwrap();
        let r = rt
            .call(
                &plugin,
                "add_rref_to_value",
                args(vec![Value::RRef(rref), Value::Int(50)]),
                host.arc(),
            )
            .await;
        assert_eq!(r.unwrap(), Value::Int(90));
    })
    .await;
}

/// The plugin `plugins/probe` (deployed by the least-privilege tests in
/// `tests/all/deploy_test.rs`): what its `permissions!` declaration writes
/// into its manifest.
pub(crate) mod probe {
    use crate::{args, setup, timed};
    use wasmrpc_wasm::Value;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn its_manifest_declares_one_op_and_one_call() {
        timed(async {
            let (rt, _, host) = setup();
            let probe = rt
                .load_file(wasmrpc_plugins::PROBE)
                .expect("the probe plugin loads");
            let declared = &probe.manifest().permissions;
            assert_eq!(declared.ops, ["aten::from_file"]);
            assert_eq!(declared.calls, ["seed_fns::identity"]);
            assert!(probe.manifest().function("relay").is_some());
            let text = wasmrpc_wasm::manifest::describe(probe.manifest());
            assert!(
                text.ends_with(
                    "  asks to run ops: aten::from_file\n  asks to call: seed_fns::identity\n"
                ),
                "{text}"
            );
            // A plugin without a declaration asks for nothing.
            let hello = rt
                .load_file(wasmrpc_plugins::HELLO)
                .expect("the hello plugin loads");
            assert!(hello.manifest().permissions.is_empty());
            // Its op requests reach the host by the name given.
            let r = rt
                .call(
                    &probe,
                    "run_op",
                    args(vec![
                        Value::Str("aten::add".into()),
                        Value::List(vec![Value::Int(2), Value::Int(3)]),
                    ]),
                    host.arc(),
                )
                .await
                .expect("the fake host adds");
            assert_eq!(r, Value::Int(5));
        })
        .await;
    }
}
