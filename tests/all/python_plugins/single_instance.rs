//! Single-instance plugins (`wasmrpc.single_instance()`,
//! `plugins/python/shared-state-py`): every call of the plugin on a worker
//! runs in one instance, so module-level state is shared, a tensor kept in
//! a global stays valid, and an object a function hands to `remote()` is
//! kept itself, as PyTorch's `rpc.remote("ps", get_parameter_server)`.

use anyhow::ensure;
use wasmrpc::testing::{Cluster, worker_name};
use wasmrpc::{Args, ErrorKind, Payload, PluginHost, RRef, Remote, Value, args};
use wasmrpc_tests::{expect_err, timed};

fn reference(name: &str) -> Payload {
    Payload::from(Value::Record {
        name: "wasmrpc.FunctionRef".into(),
        fields: vec![("name".into(), Value::Str(name.into()))],
    })
}

#[test]
fn a_single_instance_plugin_shares_its_module_state_and_keeps_the_objects_it_hands_out() {
    timed(async {
        let host = PluginHost::shared()?;
        let plugin = host.load_file(wasmrpc_plugins::SHARED_STATE_PY)?;
        let c = Cluster::builder(2)
            .functions(move |r| {
                host.register(&plugin, r);
            })
            .start()
            .await?;
        let a = c.agent(0);
        let w1 = worker_name(1);

        // Eight calls at once share one module global: each sees its own
        // count, none repeats (pooled instances would each count from 1).
        let futures: Vec<_> = (0..8)
            .map(|_| a.rpc_async(w1.clone(), "shared_state_py::count_call", args![]))
            .collect();
        let mut counts = Vec::new();
        for f in futures {
            counts.push(f.wait().await?.as_int()?);
        }
        counts.sort_unstable();
        ensure!(counts == (1..=8).collect::<Vec<_>>(), "{counts:?}");

        // A tensor kept in a global by one call is there for the next.
        a.rpc_sync(w1.clone(), "shared_state_py::keep_weights", args![])
            .await?;
        let sum = a
            .rpc_sync(w1.clone(), "shared_state_py::weights_sum", args![])
            .await?;
        ensure!(sum.as_float()? == 4.0, "{sum:?}");

        // remote() of a function returning one of its objects keeps the
        // object itself: two RRefs, one counter.
        let first: RRef = a.remote(w1.clone(), "shared_state_py::get_counter", args![10i64])?;
        // Made first, so the counter starts at 10 (the second finds it).
        first.get_type(a, None).await?;
        let second: RRef = a.remote(w1.clone(), "shared_state_py::get_counter", args![99i64])?;
        // Called at once, before its creation has run: the call waits for
        // the creation, which needs the instance, before it takes it (a
        // call that took it first waited for itself until its timeout).
        for (rref, k, want) in [(&second, 5i64, 15i64), (&first, 1, 16)] {
            let out = a
                .rpc_sync(
                    w1.clone(),
                    "shared_state_py::_call_method",
                    Args::new()
                        .arg(reference("shared_state_py::Counter.add"))
                        .arg(Payload::from(rref.clone()))
                        .arg(k),
                )
                .await?;
            ensure!(out.as_int()? == want, "{out:?} (want {want})");
        }
        let total = a
            .rpc_sync(w1.clone(), "shared_state_py::counter_total", args![])
            .await?;
        ensure!(total.as_int()? == 16, "{total:?}");
        ensure!(
            first.get_type(a, None).await? == "shared_state_py::Counter",
            "the RRef holds no Counter"
        );
        // rpc_sync of the same function cannot return the object: it is
        // never copied (no pickle), and the error says so.
        expect_err(
            a.rpc_sync(w1.clone(), "shared_state_py::get_counter", args![0i64])
                .await,
            ErrorKind::TypeError,
            "cannot send a value of type Counter over RPC",
        )?;
        // Its methods through the RRef's proxy run on the same object.
        let proxied = first.rpc_sync(a, None).call("add", args![4i64]).await?;
        ensure!(proxied.as_int()? == 20, "{proxied:?}");

        // A plugin offering a class it does not export is refused.
        expect_err(
            a.rpc_sync(
                w1.clone(),
                "shared_state_py::offer_a_class_it_does_not_export",
                args![],
            )
            .await,
            ErrorKind::TypeError,
            "offered an object of class `NotAClass` to keep, which it does not export",
        )?;
        drop((first, second));
        c.shutdown().await?;
        Ok(())
    });
}
