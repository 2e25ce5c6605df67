//! The agent's failure detection (not a seed test: PyTorch has none): a
//! peer that proved itself and then went silent, as a stopped process or a
//! machine off the network looks, is declared failed after the failure
//! window, with the cause (FAIL-1 to FAIL-3 in `wasmrpc::agent`).

use std::time::{Duration, Instant};

use anyhow::ensure;
use wasmrpc::prelude::*;
use wasmrpc::testing::Cluster;
use wasmrpc::transport::probe;
use wasmrpc::{
    ErrorKind, FAILED_WORKERS, NEXT_FAILURE, Payload, RESTART_COUNT, RpcBackendOptions,
    WorkerFailure, args, dist_autograd,
};
use wasmrpc_tests::{expect_err, ones, register_all, timed};

/// A call that outlasts the test: pending when its callee fails.
const SLOW: &str = "failures::slow";

/// A connection to worker0 at `addr` that passes the handshake as worker1
/// and then carries nothing: what a stopped worker1 looks like from
/// worker0. Over TLS when the cluster runs TLS (`ca`, its CA).
async fn silent_worker1(
    ca: Option<&std::sync::Arc<wasmrpc::CertificateAuthority>>,
    addr: std::net::SocketAddr,
    secret: &[u8],
) -> anyhow::Result<Box<dyn std::any::Any + Send>> {
    Ok(match ca {
        None => Box::new(probe::connect(addr, secret, "worker1").await?),
        Some(ca) => {
            let tls = probe::TlsProbe {
                ca_pem: ca.cert_pem().to_string(),
                client: Some(ca.credentials_for("worker1")?),
                server: "worker0".to_string(),
            };
            Box::new(probe::connect_tls(addr, &tls, secret, "worker1").await?)
        }
    })
}

#[test]
fn a_silent_peer_is_declared_failed_and_calls_to_it_fail_at_once() {
    timed(async {
        let options = RpcBackendOptions {
            failure_timeout: Some(Duration::from_millis(500)),
            ..Default::default()
        };
        let builder = Cluster::builder(2).options(options).functions(|r| {
            register_all(r);
            r.register_native(SLOW, |_ctx, _args| async move {
                tokio::time::sleep(Duration::from_secs(120)).await;
                Ok(Payload::none())
            });
        });
        let secret = builder.secret().to_vec();
        let ca = builder.authority().cloned();
        let c = builder.start().await?;
        let agent = c.agent(0).clone();
        let mut watch = agent.watch_failures();
        // worker0's connection to the real worker1 first: calls go on it.
        agent.rpc_sync("worker1", wasmrpc::NOOP, args![]).await?;
        let pending = agent.rpc_async("worker1", SLOW, args![]);
        let addr = agent.local_addr().expect("worker0 listens");
        // What a stopped worker1 looks like from worker0: a connection that
        // passed the handshake as worker1 and then carries nothing.
        let _silent = silent_worker1(ca.as_ref(), addr, &secret).await?;
        let started = Instant::now();
        watch.changed().await?;
        let failure = WorkerFailure {
            worker: "worker1".into(),
            cause: "no heartbeat for 0.5 s".into(),
        };
        ensure!(*watch.borrow() == std::slice::from_ref(&failure));
        ensure!(started.elapsed() >= Duration::from_millis(500));
        ensure!(failure.to_string() == "worker1 failed: no heartbeat for 0.5 s");

        // FAIL-1: the pending call failed with the cause, and so does every
        // new call, before anything is sent.
        let text = "worker1 failed: no heartbeat for 0.5 s";
        expect_err(pending.wait().await, ErrorKind::RuntimeError, text)?;
        let call = agent.rpc_sync("worker1", "aten::add", args![1i64, 2i64]);
        expect_err(call.await, ErrorKind::RuntimeError, text)?;
        ensure!(agent.failed_workers() == std::slice::from_ref(&failure));
        ensure!(agent.next_failure(&[]).await == failure);

        // FAIL-2: what plugins ask the worker answers the same.
        let listed = agent.rpc_sync("worker0", FAILED_WORKERS, args![]).await?;
        let listed = listed.items()?;
        ensure!(listed.len() == 1);
        let entry = |p: &Payload, key: &str| -> anyhow::Result<String> {
            let pairs = p.entries()?;
            let value = pairs
                .iter()
                .find(|(k, _)| k.as_str().is_ok_and(|k| k == key))
                .ok_or_else(|| anyhow::anyhow!("no {key}"))?;
            Ok(value.1.as_str()?.to_string())
        };
        ensure!(entry(&listed[0], "worker")? == "worker1");
        ensure!(entry(&listed[0], "cause")? == "no heartbeat for 0.5 s");
        let next = agent.rpc_sync("worker0", NEXT_FAILURE, args![]).await?;
        ensure!(entry(&next, "worker")? == "worker1");
        // A watch past the failures it knows waits for the next one.
        let known = Payload::list([Payload::from("worker1")]);
        let later = agent.rpc_async("worker0", NEXT_FAILURE, args![known]);
        tokio::time::sleep(Duration::from_millis(300)).await;
        ensure!(!later.done(), "no second worker failed");
        let bad = agent.rpc_sync("worker0", NEXT_FAILURE, args![3i64]).await;
        expect_err(bad, ErrorKind::TypeError, "takes a list of worker names")?;
        let restarts = agent.rpc_sync("worker0", RESTART_COUNT, args![]).await?;
        ensure!(restarts.as_int()? == 0);
        // The real worker1 heard from worker0 all along.
        ensure!(c.agent(1).failed_workers().is_empty());

        // FAIL-3: graceful shutdown does not wait for a failed worker.
        let e = agent.shutdown(true, Duration::ZERO).await;
        expect_err(
            e,
            ErrorKind::RuntimeError,
            "graceful shutdown of worker0 gave up: worker1 failed: no heartbeat for 0.5 s",
        )?;
        let _ = c.agent(1).shutdown(false, Duration::ZERO).await;
        Ok(())
    });
}

/// No failure window: no heartbeats, and a silent peer is never declared
/// failed (its calls end by their own timeouts, as in PyTorch).
#[test]
fn without_a_failure_window_a_silent_peer_is_not_declared_failed() {
    timed(async {
        let options = RpcBackendOptions {
            failure_timeout: None,
            ..Default::default()
        };
        let builder = Cluster::builder(2).options(options).functions(register_all);
        let secret = builder.secret().to_vec();
        let ca = builder.authority().cloned();
        let c = builder.start().await?;
        let agent = c.agent(0).clone();
        agent.rpc_sync("worker1", wasmrpc::NOOP, args![]).await?;
        let addr = agent.local_addr().expect("worker0 listens");
        let _silent = silent_worker1(ca.as_ref(), addr, &secret).await?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        ensure!(agent.failed_workers().is_empty());
        agent.rpc_sync("worker1", wasmrpc::NOOP, args![]).await?;
        c.shutdown().await?;
        Ok(())
    });
}

/// FAIL-5: what the survivors held for a failed worker is released: the
/// forks of RRefs it held (its owner forgets the values they kept), the
/// distributed autograd contexts it made.
#[test]
fn a_failed_workers_forks_and_autograd_contexts_are_released() {
    timed(async {
        let options = RpcBackendOptions {
            failure_timeout: Some(Duration::from_millis(500)),
            ..Default::default()
        };
        let builder = Cluster::builder(2).options(options).functions(register_all);
        let secret = builder.secret().to_vec();
        let ca = builder.authority().cloned();
        let c = builder.start().await?;
        let (a0, a1) = (c.agent(0).clone(), c.agent(1).clone());
        let info = |key: &str| -> anyhow::Result<usize> {
            let all = a0.get_debug_info();
            let value = all.get(key).ok_or_else(|| anyhow::anyhow!("no {key}"))?;
            Ok(value.parse()?)
        };
        // worker1 holds an RRef whose value worker0 owns...
        let rref = a1.remote("worker0", "aten::add", args![ones(&[2]), 1])?;
        rref.to_here(&a1, None).await?;
        // ... and made an autograd context that reached worker0.
        let ctx = dist_autograd::new_context(&a1)?;
        let x = ones(&[2]).set_requires_grad(true);
        dist_autograd::with_context(ctx.context_id(), async {
            a1.rpc_sync("worker0", "aten::mul", args![x, 2]).await
        })
        .await??;
        ensure!(info("num_owner_rrefs")? == 1 && info("num_forks")? == 1);
        ensure!(info("num_autograd_contexts")? == 1);

        // worker1 as worker0 sees a stopped worker1: silent.
        let addr = a0.local_addr().expect("worker0 listens");
        let _silent = silent_worker1(ca.as_ref(), addr, &secret).await?;
        a0.next_failure(&[]).await;
        ensure!(info("num_forks")? == 0, "{:?}", a0.get_debug_info());
        ensure!(info("num_owner_rrefs")? == 0, "{:?}", a0.get_debug_info());
        ensure!(
            info("num_autograd_contexts")? == 0,
            "{:?}",
            a0.get_debug_info()
        );
        drop(rref);
        for a in [&a0, &a1] {
            let _ = a.shutdown(false, Duration::ZERO).await;
        }
        Ok(())
    });
}

/// A worker that dies with calls waiting on it (its connection closes
/// under them) is declared failed with the close's cause; a worker that
/// closes an idle connection is not (peers leaving or shutting down do).
#[test]
fn a_worker_gone_with_calls_waiting_on_it_is_declared_failed() {
    timed(async {
        let builder = Cluster::builder(3).functions(|r| {
            register_all(r);
            r.register_native(SLOW, |_ctx, _args| async move {
                tokio::time::sleep(Duration::from_secs(120)).await;
                Ok(Payload::none())
            });
        });
        let c = builder.start().await?;
        let a0 = c.agent(0).clone();
        // worker1 closes an idle connection: no failure.
        a0.rpc_sync("worker1", wasmrpc::NOOP, args![]).await?;
        c.agent(1).abort();
        tokio::time::sleep(Duration::from_millis(300)).await;
        ensure!(a0.failed_workers().is_empty(), "{:?}", a0.failed_workers());
        // worker2 dies under a call.
        let pending = a0.rpc_async("worker2", SLOW, args![]);
        let started = Instant::now();
        while c
            .agent(2)
            .get_debug_info()
            .get("agent.server_active_calls")
            .map(String::as_str)
            != Some("1")
        {
            ensure!(
                started.elapsed() < Duration::from_secs(10),
                "the call never ran"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        c.agent(2).abort();
        expect_err(pending.wait().await, ErrorKind::RuntimeError, "closed")?;
        let failure = tokio::time::timeout(Duration::from_secs(10), a0.next_failure(&[])).await?;
        ensure!(failure.worker == "worker2", "{failure:?}");
        ensure!(a0.failed_workers() == std::slice::from_ref(&failure));
        let call = a0.rpc_sync("worker2", wasmrpc::NOOP, args![]).await;
        expect_err(call, ErrorKind::RuntimeError, "worker2 failed: ")?;
        let _ = a0.shutdown(false, Duration::ZERO).await;
        Ok(())
    });
}

/// FAIL-2 from plugins: a Rust plugin (`wasmrpc_guest::supervision`) and a
/// Python one (`wasmrpc.rpc`) waiting for the next failure are told of it,
/// with the failures declared so far and the restart count.
#[test]
fn plugins_in_rust_and_python_are_told_of_a_failure() {
    timed(async {
        let host = wasmrpc::PluginHost::shared()?;
        let probe = host.load_file(wasmrpc_plugins::PROBE)?;
        let python = host.load_file(wasmrpc_plugins::TORCH_API_PY)?;
        let options = RpcBackendOptions {
            failure_timeout: Some(Duration::from_millis(500)),
            ..Default::default()
        };
        let builder = Cluster::builder(2).options(options).functions(move |r| {
            host.register(&probe, r);
            host.register(&python, r);
        });
        let secret = builder.secret().to_vec();
        let ca = builder.authority().cloned();
        let c = builder.start().await?;
        let agent = c.agent(0).clone();
        agent.rpc_sync("worker1", wasmrpc::NOOP, args![]).await?;
        let none = Payload::list(Vec::<Payload>::new());
        let rust = agent.rpc_async("worker0", "probe::supervision", args![none.clone()]);
        let python = agent.rpc_async("worker0", "torch_api_py::supervision", args![none]);
        tokio::time::sleep(Duration::from_millis(200)).await;
        ensure!(!rust.done() && !python.done(), "nothing failed yet");
        let addr = agent.local_addr().expect("worker0 listens");
        let _silent = silent_worker1(ca.as_ref(), addr, &secret).await?;
        let cause = "no heartbeat for 0.5 s";
        for (who, told) in [("rust", rust), ("python", python)] {
            let told = told.wait().await?;
            let parts = told.items()?;
            ensure!(parts.len() == 3, "{who}: {told:?}");
            ensure!(
                parts[0].as_int()? == 0,
                "{who}: restart count {:?}",
                parts[0]
            );
            let failed = parts[1].items()?;
            ensure!(failed.len() == 1, "{who}: {failed:?}");
            let text = |p: &Payload| -> anyhow::Result<Vec<String>> {
                match p.items() {
                    Ok(items) => items.iter().map(|i| Ok(i.as_str()?.to_string())).collect(),
                    // The Python kit answers dicts.
                    Err(_) => {
                        let entries = p.entries()?;
                        let field = |key: &str| -> anyhow::Result<String> {
                            let (_, v) = entries
                                .iter()
                                .find(|(k, _)| k.as_str().is_ok_and(|k| k == key))
                                .ok_or_else(|| anyhow::anyhow!("no {key}"))?;
                            Ok(v.as_str()?.to_string())
                        };
                        Ok(vec![field("worker")?, field("cause")?])
                    }
                }
            };
            ensure!(text(&failed[0])? == ["worker1", cause], "{who}: {failed:?}");
            ensure!(
                text(&parts[2])? == ["worker1", cause],
                "{who}: {:?}",
                parts[2]
            );
        }
        for a in [&agent, c.agent(1)] {
            let _ = a.shutdown(false, Duration::ZERO).await;
        }
        Ok(())
    });
}

/// Gives a graceful shutdown just started on its own task the time to
/// reach its all-gather's wait: a few loopback messages, and a busy
/// machine's late start of the task.
async fn shutting_down() {
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Whether `worker` is the one worker `agent` declared failed.
fn only_failed(agent: &wasmrpc::RpcAgent, worker: &str) -> bool {
    agent
        .failed_workers()
        .iter()
        .map(|f| f.worker.as_str())
        .eq([worker])
}

/// Waits at most 10 s for `shutdown`, a graceful shutdown running on its
/// own task, to end.
async fn ended(
    shutdown: tokio::task::JoinHandle<wasmrpc::Result<()>>,
    who: &str,
) -> anyhow::Result<wasmrpc::Result<()>> {
    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .map_err(|_| anyhow::anyhow!("{who}'s graceful shutdown still waits after 10 s"))?
        .map_err(anyhow::Error::from)
}

/// Checks that `who`'s graceful shutdown ended with `peer`'s failure. Two
/// waits notice it, and either may end first: the shutdown's own
/// ("graceful shutdown of WHO gave up: ...", FAIL-3) and the all-gather's
/// ("WHO gave up in _all_gather waiting for sequence id ...: ..."). Both
/// name the failed peer, which is what AG-8 asks.
fn gave_up_for(r: wasmrpc::Result<()>, who: &str, peer: &str) -> anyhow::Result<wasmrpc::Error> {
    let e = expect_err(r, ErrorKind::RuntimeError, &format!(": {peer} failed: "))?;
    let m = e.message();
    ensure!(
        m.starts_with(&format!("graceful shutdown of {who} gave up: "))
            || m.starts_with(&format!(
                "{who} gave up in _all_gather waiting for sequence id "
            )),
        "{who}'s shutdown ended with an unexpected error: {e}"
    );
    Ok(e)
}

/// AG-8: a follower in a graceful shutdown whose leader stops without a
/// word (its connections closed, as a killed process's are) ends it with
/// the leader's failure, though closes in a shutdown are otherwise peers
/// finishing theirs. It waited for the leader's signal forever before.
#[test]
fn a_graceful_shutdown_whose_leader_stops_ends_with_the_leaders_failure() {
    timed(async {
        let c = Cluster::builder(2).functions(register_all).start().await?;
        let follower = c.agent(1).clone();
        let shutdown = tokio::spawn(async move { follower.shutdown(true, Duration::ZERO).await });
        // worker1's report (a loopback call) reaches worker0 meanwhile; if
        // it does not, it is pending when worker0 stops, and fails the same.
        shutting_down().await;
        ensure!(
            !shutdown.is_finished(),
            "worker1 waits for worker0's signal"
        );
        let _ = c.agent(0).shutdown(false, Duration::ZERO).await;
        let e = gave_up_for(ended(shutdown, "worker1").await?, "worker1", "worker0")?;
        ensure!(
            only_failed(c.agent(1), "worker0"),
            "worker0 declared failed: {e}"
        );
        Ok(())
    });
}

/// AG-8 on the leader's side: a follower that stops before its report
/// ends the leader's graceful shutdown with the follower's failure.
#[test]
fn a_graceful_shutdown_whose_follower_stops_before_reporting_ends_with_its_failure() {
    timed(async {
        let c = Cluster::builder(2).functions(register_all).start().await?;
        // A connection between the two for the close to travel on.
        c.agent(1)
            .rpc_sync("worker0", wasmrpc::NOOP, args![])
            .await?;
        let leader = c.agent(0).clone();
        let shutdown = tokio::spawn(async move { leader.shutdown(true, Duration::ZERO).await });
        shutting_down().await;
        ensure!(
            !shutdown.is_finished(),
            "worker0 waits for worker1's report"
        );
        let _ = c.agent(1).shutdown(false, Duration::ZERO).await;
        gave_up_for(ended(shutdown, "worker0").await?, "worker0", "worker1")?;
        Ok(())
    });
}

/// FAIL-6: a follower that stops before it ever connected to the leader
/// leaves no connection whose close could tell; the leader's graceful
/// shutdown dials it, is refused, and ends with its failure. It waited for
/// the follower's report forever before.
#[test]
fn a_graceful_shutdown_whose_follower_stopped_before_connecting_ends_with_its_failure() {
    timed(async {
        let c = Cluster::builder(2).functions(register_all).start().await?;
        let _ = c.agent(1).shutdown(false, Duration::ZERO).await;
        let leader = c.agent(0).clone();
        let shutdown = tokio::spawn(async move { leader.shutdown(true, Duration::ZERO).await });
        let e = gave_up_for(ended(shutdown, "worker0").await?, "worker0", "worker1")?;
        ensure!(
            e.message().contains(
                "worker1 failed: not connected, and cannot connect to worker worker1 at "
            ),
            "the failure is not the refused dial: {e}"
        );
        ensure!(
            only_failed(c.agent(0), "worker1"),
            "worker1 declared failed: {e}"
        );
        Ok(())
    });
}
