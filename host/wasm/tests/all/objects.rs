//! Classes of seed-fns: objects on their own instance, methods one at a
//! time, static functions, async methods, broken objects, disposal.

use crate::{args, kwargs, setup, timed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmrpc_wasm::{Error, ErrorKind, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn my_class_constructor_and_methods() {
    timed(async {
        let (rt, plugin, host) = setup();
        // MyClass(a=2): `delay` is optional.
        let obj = rt
            .construct(
                &plugin,
                "MyClass",
                kwargs(&[("a", Value::Int(2))]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(obj.class(), "MyClass");
        let r = obj
            .call_method("my_instance_method", args(vec![Value::Int(5)]), host.arc())
            .await
            .unwrap();
        assert_eq!(r, Value::Int(7));
        obj.call_method(
            "increment_value",
            kwargs(&[("increment", Value::Int(10))]),
            host.arc(),
        )
        .await
        .unwrap();
        assert_eq!(
            obj.call_method("get_value", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(12)
        );

        // Class and static methods are plain functions named `Class.name`.
        let r = rt
            .call(
                &plugin,
                "MyClass.my_class_method",
                args(vec![Value::Int(3), Value::Int(4)]),
                host.arc(),
            )
            .await;
        assert_eq!(r.unwrap(), Value::Int(7));
        let r = rt
            .call(
                &plugin,
                "MyClass.my_static_method",
                args(vec![Value::Int(13)]),
                host.arc(),
            )
            .await;
        assert_eq!(r.unwrap(), Value::Bool(true));

        let e = obj
            .call_method("no_such_method", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AttributeError);
        let e = rt
            .construct(&plugin, "NoSuchClass", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound { what: "class", .. }), "{e:?}");
        let e = rt
            .construct(&plugin, "MyClass", args(vec![]), host.arc())
            .await
            .unwrap_err();
        assert_eq!(
            e.to_remote().message,
            "MyClass() missing 1 required positional argument: 'a'"
        );

        // Two objects do not share state.
        let other = rt
            .construct(&plugin, "MyClass", args(vec![Value::Int(100)]), host.arc())
            .await
            .unwrap();
        assert_eq!(
            other
                .call_method("get_value", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(100)
        );
        assert_eq!(
            obj.call_method("get_value", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(12)
        );
        obj.dispose(host.arc()).await.unwrap();
        other.dispose(host.arc()).await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_calls_on_one_object_run_one_at_a_time() {
    timed(async {
        let (rt, plugin, host) = setup();
        let obj = Arc::new(
            rt.construct(&plugin, "MyClass", args(vec![Value::Int(0)]), host.arc())
                .await
                .unwrap(),
        );
        // Each call reads `a`, sleeps 30 ms on the host, then writes `a + 1`:
        // any overlap would lose an update.
        let start = Instant::now();
        let calls: Vec<_> = (0..10)
            .map(|_| {
                let (obj, host) = (obj.clone(), host.clone());
                tokio::spawn(async move {
                    obj.call_method(
                        "slow_increment",
                        args(vec![Value::Int(1), Value::Float(0.03)]),
                        host.arc(),
                    )
                    .await
                })
            })
            .collect();
        let mut results = Vec::new();
        for c in calls {
            match c.await.unwrap().unwrap() {
                Value::Int(i) => results.push(i),
                other => panic!("{other:?}"),
            }
        }
        results.sort();
        assert_eq!(results, (1..=10).collect::<Vec<_>>());
        assert!(
            start.elapsed() >= Duration::from_millis(300),
            "calls overlapped: {:?}",
            start.elapsed()
        );
        assert_eq!(
            obj.call_method("get_value", args(vec![]), host.arc())
                .await
                .unwrap(),
            Value::Int(10)
        );
        // Meanwhile stateless functions of the same plugin are not blocked.
        let r = rt
            .call(&plugin, "light_rpc", args(vec![]), host.arc())
            .await
            .unwrap();
        assert_eq!(r, Value::Int(0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_breaks_only_its_object() {
    timed(async {
        let (rt, plugin, host) = setup();
        let obj = rt.construct(&plugin, "MyClass", args(vec![Value::Int(9)]), host.arc()).await.unwrap();
        let e = obj.call_method("explode", args(vec![]), host.arc()).await.unwrap_err();
        assert!(matches!(&e, Error::Trap { message, function, .. } if message.contains("MyClass exploded with a = 9") && function == "explode"), "{e:?}");
        let e = obj.call_method("get_value", args(vec![]), host.arc()).await.unwrap_err();
        assert!(matches!(e, Error::ObjectBroken { .. }), "{e:?}");
        let fresh = rt.construct(&plugin, "MyClass", args(vec![Value::Int(1)]), host.arc()).await.unwrap();
        assert_eq!(fresh.call_method("get_value", args(vec![]), host.arc()).await.unwrap(), Value::Int(1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_methods_and_disposal_release_handles() {
    timed(async {
        let (rt, plugin, host) = setup();
        let obj = rt
            .construct(&plugin, "MyClass", args(vec![Value::Int(10)]), host.arc())
            .await
            .unwrap();
        let r = obj
            .call_method(
                "bound_async_add",
                args(vec![
                    Value::Str("worker1".into()),
                    host.ones(&[2]),
                    host.ones(&[2]),
                ]),
                host.arc(),
            )
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&r), (vec![2], vec![12.0; 2]));
        // The method's `then` task releases its handles just after the
        // result is in.
        assert_eq!(host.settled_tensors(0).await, 0);

        let wrapper = rt
            .construct(
                &plugin,
                "TensorWrapper",
                args(vec![host.ones(&[4])]),
                host.arc(),
            )
            .await
            .unwrap();
        wrapper
            .call_method("increase", args(vec![Value::Float(1.5)]), host.arc())
            .await
            .unwrap();
        let s = wrapper
            .call_method("sum", args(vec![]), host.arc())
            .await
            .unwrap();
        assert_eq!(host.take_tensor(&s), (vec![], vec![10.0]));
        assert_eq!(host.live_tensors(), 1, "the object holds its tensor");
        wrapper.dispose(host.arc()).await.unwrap();
        assert_eq!(host.live_tensors(), 0, "disposing released it");
        obj.dispose(host.arc()).await.unwrap();
    })
    .await;
}
