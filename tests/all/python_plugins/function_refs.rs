//! Registered functions as RPC arguments, by reference, on the wasm path:
//! the Python kit sends a `@remote` function, a `@remote_class` method or a
//! torch op as a record `wasmrpc.FunctionRef { name }` (never a pickle),
//! and the receiving plugin calls what the name registers
//! (`plugins/python/seed-fns-py`: `call_function`, `my_function_ref`,
//! PyTorch's tutorial `_remote_method`).

use anyhow::ensure;
use wasmrpc::prelude::*;
use wasmrpc::testing::worker_name;
use wasmrpc::{Args, ErrorKind, Payload, RRef, Value, args};
use wasmrpc_tests::{expect_err, expect_tensor, ones, python_cluster, timed};

/// The record a function reference travels as.
fn reference(name: &str) -> Payload {
    Payload::from(Value::Record {
        name: "wasmrpc.FunctionRef".into(),
        fields: vec![("name".into(), Value::Str(name.into()))],
    })
}

/// The tutorial's `_remote_method(method, rref, arg)`, called on `to`.
async fn remote_method(
    agent: &wasmrpc::RpcAgent,
    to: &str,
    method: &str,
    rref: &RRef,
    arg: impl Into<Payload>,
) -> wasmrpc::Result<Payload> {
    agent
        .rpc_sync(
            to,
            "seed_fns_py::_remote_method",
            Args::new()
                .arg(reference(method))
                .arg(Payload::from(rref.clone()))
                .arg(arg),
        )
        .await
}

#[test]
fn function_references_call_what_their_names_register() {
    timed(async {
        let c = python_cluster(2).start().await?;
        let agent = c.agent(0);
        let w1 = worker_name(1);
        let call = |args: Args| agent.rpc_sync(w1.clone(), "seed_fns_py::call_function", args);

        let six = call(
            Args::new()
                .arg(reference("seed_fns_py::my_function"))
                .arg(1i64)
                .arg(2i64)
                .arg(3i64),
        )
        .await?;
        ensure!(six.as_int()? == 6, "{six:?}");
        let scaled = call(
            Args::new()
                .arg(reference("seed_fns_py::Accumulator.scale"))
                .arg(3i64)
                .arg(4i64),
        )
        .await?;
        ensure!(scaled.as_int()? == 12, "{scaled:?}");
        let added = call(
            Args::new()
                .arg(reference("aten::add"))
                .arg(ones(&[2, 2]))
                .arg(1i64),
        )
        .await?;
        expect_tensor(&added, &(ones(&[2, 2]) * 2))?;
        // Another plugin's function, called by name on the receiver.
        let six = call(
            Args::new()
                .arg(reference("seed_fns::my_function"))
                .arg(1i64)
                .arg(2i64)
                .arg(3i64),
        )
        .await?;
        ensure!(six.as_int()? == 6, "{six:?}");
        expect_err(
            call(Args::new().arg(reference("nope::f"))).await,
            ErrorKind::RuntimeError,
            "nope::f",
        )?;

        // A function a plugin returns arrives as its reference.
        let r = agent
            .rpc_sync(w1.clone(), "seed_fns_py::my_function_ref", args![])
            .await?;
        ensure!(
            format!("{:?}", r.value)
                == r#"Record { name: "wasmrpc.FunctionRef", fields: [("name", Str("seed_fns_py::my_function"))] }"#,
            "{:?}",
            r.value
        );

        // PyTorch's tutorial idiom on a tensor RRef, then on an object
        // RRef, whose method runs through the RRef's proxy.
        // The owner may get it before the `remote()` that creates its
        // value: RREF-3 keeps the entry that creation completes
        // (`rpc_test::rref::an_rref_forwarded_by_its_owner_...`).
        let rref: RRef = agent.remote(w1.clone(), "aten::add", args![ones(&[2]), 1i64])?;
        let out = remote_method(agent, &w1, "aten::add", &rref, ones(&[2])).await?;
        expect_tensor(&out, &(ones(&[2]) * 3))?;
        let obj: RRef = agent.remote(w1.clone(), "seed_fns_py::Accumulator", args![1i64])?;
        let out = agent
            .rpc_sync(
                w1.clone(),
                "seed_fns_py::_remote_method_proxy",
                Args::new()
                    .arg(reference("seed_fns_py::Accumulator.add"))
                    .arg(Payload::from(obj.clone()))
                    .arg(5i64),
            )
            .await?;
        ensure!(out.as_int()? == 6, "{out:?}");
        // The tutorial's own form on an object: the owner runs
        // `_call_method` beside the object, where `local_value()` is the
        // object itself (its total goes on from 6, no copy was made).
        for want in [13, 20] {
            let out = remote_method(agent, &w1, "seed_fns_py::Accumulator.add", &obj, 7i64).await?;
            ensure!(out.as_int()? == want, "{out:?} (want {want})");
        }
        // Each call runs beside the object its RRef names: a second object
        // keeps its own total.
        let other: RRef = agent.remote(w1.clone(), "seed_fns_py::Accumulator", args![100i64])?;
        let out = remote_method(agent, &w1, "seed_fns_py::Accumulator.add", &other, 1i64).await?;
        ensure!(out.as_int()? == 101, "{out:?}");
        drop(other);
        drop((rref, obj));
        c.shutdown().await?;
        Ok(())
    });
}

/// A call beside an object that waits for another call needing the same
/// object would wait for itself: the worker ends the second call's wait
/// after its RPC timeout with a `TimeoutError` that says why, the chain
/// unwinds, and the object serves on.
#[test]
fn a_call_beside_an_object_that_waits_for_itself_fails_instead_of_hanging() {
    timed(async {
        let c = python_cluster(2).start().await?;
        let agent = c.agent(0);
        let w1 = worker_name(1);
        c.agent(1)
            .set_rpc_timeout(std::time::Duration::from_secs(2));
        let obj: RRef = agent.remote(w1.clone(), "seed_fns_py::Accumulator", args![1i64])?;
        let err = agent
            .rpc_sync_with_timeout(
                w1.clone(),
                "seed_fns_py::_local_value_then_again",
                args![Payload::from(obj.clone())],
                std::time::Duration::from_secs(60),
            )
            .await
            .map(drop);
        expect_err(
            err,
            ErrorKind::TimeoutError,
            "`_local_value_then_again` of plugin `seed-fns-py` waited 2s to run beside its \
             `Accumulator` object, which stayed busy",
        )?;
        let out = remote_method(agent, &w1, "seed_fns_py::Accumulator.add", &obj, 2i64).await?;
        ensure!(out.as_int()? == 3, "the object no longer serves: {out:?}");
        drop(obj);
        c.shutdown().await?;
        Ok(())
    });
}
