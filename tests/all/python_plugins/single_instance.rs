//! Single-instance plugins (`wasmrpc.single_instance()`,
//! `plugins/python/shared-state-py`): every call of the plugin on a worker
//! runs in one instance, so module-level state is shared, a tensor kept in
//! a global stays valid, and an object a function hands to `remote()` is
//! kept itself, as PyTorch's `rpc.remote("ps", get_parameter_server)`,
//! and so is an object it wraps in `RRef(obj)` in place (OBJ-6), as
//! PyTorch's `rpc.RRef(ParameterServer())`.

use anyhow::ensure;
use wasmrpc::testing::{Cluster, worker_name};
use wasmrpc::{Args, ErrorKind, Payload, PluginHost, RRef, Remote, Value, args};
use wasmrpc_tests::{expect_err, timed};

/// A cluster of `workers` that all serve `plugins/python/shared-state-py`.
async fn shared_state_cluster(workers: u32) -> anyhow::Result<Cluster> {
    let host = PluginHost::shared()?;
    let plugin = host.load_file(wasmrpc_plugins::SHARED_STATE_PY)?;
    Ok(Cluster::builder(workers)
        .functions(move |r| {
            host.register(&plugin, r);
        })
        .start()
        .await?)
}

fn reference(name: &str) -> Payload {
    Payload::from(Value::Record {
        name: "wasmrpc.FunctionRef".into(),
        fields: vec![("name".into(), Value::Str(name.into()))],
    })
}

#[test]
fn a_single_instance_plugin_shares_its_module_state_and_keeps_the_objects_it_hands_out() {
    timed(async {
        let c = shared_state_cluster(2).await?;
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

#[test]
fn an_rref_made_in_place_holds_the_object_itself_and_is_refused_where_it_cannot() {
    timed(async {
        let host = PluginHost::shared()?;
        let shared = host.load_file(wasmrpc_plugins::SHARED_STATE_PY)?;
        let pooled = host.load_file(wasmrpc_plugins::SEED_FNS_PY)?;
        let c = Cluster::builder(2)
            .functions(move |r| {
                host.register(&shared, r);
                host.register(&pooled, r);
            })
            .start()
            .await?;
        let a = c.agent(0);
        let w1 = worker_name(1);
        let objects = || async {
            a.rpc_sync(
                w1.clone(),
                "shared_state_py::objects_in_the_instance",
                args![],
            )
            .await?
            .as_int()
        };
        let before = objects().await?;

        // The function checks in place that `local_value()` is the object
        // and that a second RRef of it shares it (its `add(1)`: 5 -> 6).
        let rref = a
            .rpc_sync(
                w1.clone(),
                "shared_state_py::counter_rref_made_in_place",
                args![5i64],
            )
            .await?
            .as_rref()?;
        ensure!(rref.owner().name == w1, "owned by {:?}", rref.owner());
        ensure!(
            rref.get_type(a, None).await? == "shared_state_py::Counter",
            "the RRef holds no Counter"
        );
        // Its methods run on that very object, through the proxy and
        // through `_call_method` beside it on the owner.
        let proxied = rref.rpc_sync(a, None).call("add", args![3i64]).await?;
        ensure!(proxied.as_int()? == 9, "{proxied:?}");
        let beside = a
            .rpc_sync(
                w1.clone(),
                "shared_state_py::_call_method",
                Args::new()
                    .arg(reference("shared_state_py::Counter.add"))
                    .arg(Payload::from(rref.clone()))
                    .arg(2i64),
            )
            .await?;
        ensure!(beside.as_int()? == 11, "{beside:?}");
        // It is never copied: `to_here()` says where its methods run.
        expect_err(
            rref.to_here(a, None).await,
            ErrorKind::TypeError,
            "it holds an object of class shared_state_py::Counter on worker",
        )?;
        ensure!(
            objects().await? == before + 1,
            "the instance does not keep it"
        );

        // Once the last RRef goes, the owner forgets it and the instance
        // drops the object (the delete travels to the owner on its own).
        drop(rref);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while objects().await? != before {
            ensure!(
                std::time::Instant::now() < deadline,
                "the object outlived its RRefs"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }

        // Refused: a class the plugin does not export; an object made in a
        // pooled instance, which ends with the call.
        expect_err(
            a.rpc_sync(
                w1.clone(),
                "shared_state_py::rref_of_a_class_it_does_not_export",
                args![],
            )
            .await,
            ErrorKind::TypeError,
            "asked for an RRef to an object of class `NotAClass`, which it does not export",
        )?;
        expect_err(
            a.rpc_sync(
                w1.clone(),
                "seed_fns_py::rref_of_an_object_made_here",
                args![1i64],
            )
            .await,
            ErrorKind::TypeError,
            "runs each call in an instance of its own, so the object would not outlive the call",
        )?;
        // An id the instance never gave: its methods find no object, and
        // the worker is unharmed.
        let bogus = a
            .rpc_sync(
                w1.clone(),
                "shared_state_py::rref_of_an_object_it_never_made",
                args![],
            )
            .await?
            .as_rref()?;
        expect_err(
            bogus.rpc_sync(a, None).call("add", args![1i64]).await,
            ErrorKind::AttributeError,
            "'Counter' object has no attribute 'add'",
        )?;
        drop(bogus);
        let count = a
            .rpc_sync(w1.clone(), "shared_state_py::count_call", args![])
            .await?;
        ensure!(count.as_int()? >= 1, "{count:?}");
        c.shutdown().await?;
        Ok(())
    });
}

/// PyTorch's batching parameter server, in small: `run_ps` makes the
/// server in place (`rpc.RRef(Batcher(...))`), hands its RRef to two
/// trainers and waits for them, while their `async_execution` updates
/// run on the server in the very instance that waits (VIS-1..3). Before
/// visits, the updates queued behind the waiting call, which waited for
/// them: a deadlock until the RPC timeout.
#[test]
fn a_waiting_call_serves_the_calls_it_waits_for_in_its_instance() {
    timed(async {
        let c = shared_state_cluster(3).await?;
        let a = c.agent(0);
        let trainers = Value::List(vec![Value::Str(worker_name(0)), Value::Str(worker_name(2))]);
        let out = a
            .rpc_sync(
                worker_name(1),
                "shared_state_py::run_ps",
                Args::new().arg(Payload::from(trainers)).arg(3i64),
            )
            .await?;
        // Each round's updates wait for each other; the last of a round
        // completes both with the running total: 2, 4, 6.
        let Value::Tuple(parts) = &out.value else {
            anyhow::bail!("run_ps gave {out:?}");
        };
        let rounds = Value::List(vec![Value::Int(2), Value::Int(4), Value::Int(6)]);
        ensure!(
            parts.first() == Some(&Value::List(vec![rounds.clone(), rounds])),
            "the trainers saw {parts:?}"
        );
        ensure!(
            parts.get(1) == Some(&Value::Int(6)),
            "the server holds {parts:?}"
        );
        c.shutdown().await?;
        Ok(())
    });
}

/// While a call of the instance waits, other calls run in it as visits:
/// an object kept by a `remote()` (whose keeping is the visitor's, VIS-2),
/// its method, a constructor, the call that ends the wait. A guest that
/// abandons a visit fails that call instead of hanging it (VIS-4), and
/// the outcome of no visit is refused.
#[test]
fn visits_run_in_their_callers_context_and_a_hostile_guest_cannot_hang_them() {
    timed(async {
        let c = shared_state_cluster(2).await?;
        let a = c.agent(0);
        let w1 = worker_name(1);
        let until_waiting = || async {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                let waiting = a
                    .rpc_sync(w1.clone(), "shared_state_py::is_waiting", args![])
                    .await?;
                if waiting.as_bool()? {
                    return anyhow::Ok(());
                }
                ensure!(
                    std::time::Instant::now() < deadline,
                    "the call never waited"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        };

        let waiter = a.rpc_async(w1.clone(), "shared_state_py::wait_for_release", args!["k"]);
        until_waiting().await?;
        // From here each call is a visit: the instance is held by the wait.
        let kept: RRef = a.remote(w1.clone(), "shared_state_py::get_counter", args![7i64])?;
        ensure!(
            kept.get_type(a, None).await? == "shared_state_py::Counter",
            "the visit's remote() kept no Counter"
        );
        let added = kept.rpc_sync(a, None).call("add", args![1i64]).await?;
        ensure!(added.as_int()? == 8, "{added:?}");
        // A `to_here()` waits serving too: the remote() it fetches needs
        // this very instance.
        let fetched = a
            .rpc_sync(
                w1.clone(),
                "shared_state_py::remote_then_to_here",
                args![41i64],
            )
            .await?;
        ensure!(fetched.as_int()? == 42, "{fetched:?}");
        // A constructor runs as a visit too.
        let made: RRef = a.remote(w1.clone(), "shared_state_py::Counter", args![3i64])?;
        let added = made.rpc_sync(a, None).call("add", args![1i64]).await?;
        ensure!(added.as_int()? == 4, "{added:?}");
        ensure!(!waiter.done(), "the wait ended before its release");
        a.rpc_sync(w1.clone(), "shared_state_py::release", args!["k", 5i64])
            .await?;
        ensure!(
            waiter.wait().await?.as_int()? == 5,
            "the wait gave another value"
        );

        // The first call that reaches the abandoning guest's wait is
        // abandoned; one that runs before it starts sees it not waiting.
        let abandoning = a.rpc_async(
            w1.clone(),
            "shared_state_py::abandon_the_next_visit",
            args![],
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let abandoned = loop {
            match a
                .rpc_sync(w1.clone(), "shared_state_py::is_waiting", args![])
                .await
            {
                Ok(waiting) => ensure!(!waiting.as_bool()?, "a visit ran though abandoned"),
                Err(e) => break Err::<Payload, _>(e),
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "no call was abandoned"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        expect_err(
            abandoned,
            ErrorKind::RuntimeError,
            "the call of the instance that was running it ended before it finished",
        )?;
        let woken = abandoning.wait().await?;
        ensure!(woken.as_str()? == "Wake_Visit", "{woken:?}");
        expect_err(
            a.rpc_sync(
                w1.clone(),
                "shared_state_py::visit_done_without_a_visit",
                args![],
            )
            .await,
            ErrorKind::RuntimeError,
            "visit-done for visit 0, while 0 visits run",
        )?;
        let count = a
            .rpc_sync(w1.clone(), "shared_state_py::count_call", args![])
            .await?;
        ensure!(
            count.as_int()? >= 1,
            "the instance no longer serves: {count:?}"
        );
        drop((kept, made));
        c.shutdown().await?;
        Ok(())
    });
}
