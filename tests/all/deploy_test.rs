//! Plugins deployed to a running group (`RpcAgent::deploy_plugin`, issue 5):
//! the `hello` plugin (`plugins/hello`, written only against
//! `wasmrpc-guest` and loaded by no worker at start-up) shipped to a static
//! group of three in-process workers that serve seed-fns, then called by
//! name from every worker and from inside seed-fns (`seed_fns::call_str`).
//!
//! The groups are started here rather than with `Cluster` because some
//! tests give one worker other options (deployment off) than the rest.
//! Every test runs under the test timeout. The CLI's `wasmrpc plugin
//! deploy` is tested in `host/tests/cli.rs`.
//!
//! Least privilege (issue 18): the `probe` plugin (`plugins/probe`), which
//! declares `aten::from_file` and `seed_fns::identity` and tries more, is
//! deployed and held to the op families, its own functions, builtin ops and
//! what it declares, as far as the workers' op policy goes; loaded by the
//! operator instead, it gets the workers' whole policy.
//!
//! POLICY_TEST_NAMES_DENIED_OPS: the op names of the least-privilege tests
//! are refused on purpose.

use anyhow::{Context, ensure};
use wasmrpc::prelude::*;
use wasmrpc::testing::{fresh_store, worker_name};
use wasmrpc::{
    ErrorKind, FaultInjection, Future, OpPolicy, Payload, PluginHost, RpcAgent, RpcBackendOptions,
    args, collect_all, init_rpc, message_kinds,
};
use wasmrpc_tests::seed_fns::TimedOutRpcEvent;
use wasmrpc_tests::{expect_err, register_all, timed};

pub(crate) const WORLD: u32 = 3;

fn hello_wasm() -> Vec<u8> {
    std::fs::read(wasmrpc_plugins::HELLO).expect("the hello plugin was built")
}

/// Starts a static group of [`WORLD`] workers serving seed-fns;
/// `options(rank)` adjusts each worker's options.
pub(crate) async fn start(
    options: impl Fn(u32, RpcBackendOptions) -> RpcBackendOptions,
) -> anyhow::Result<Vec<RpcAgent>> {
    let store = fresh_store();
    let tasks: Vec<_> = (0..WORLD)
        .map(|rank| {
            let registry = wasmrpc::FunctionRegistry::new();
            register_all(&registry);
            let o = options(
                rank,
                RpcBackendOptions {
                    registry: std::sync::Arc::new(registry),
                    accept_plugin_deployment: true,
                    ..RpcBackendOptions::default()
                },
            );
            let store = store.clone();
            tokio::spawn(async move {
                init_rpc(&worker_name(rank), Some(rank), Some(WORLD), store, o).await
            })
        })
        .collect();
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await??);
    }
    Ok(agents)
}

/// Graceful shutdown of every worker at once.
pub(crate) async fn stop(agents: Vec<RpcAgent>) -> anyhow::Result<()> {
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|a| tokio::spawn(async move { a.shutdown(true, std::time::Duration::ZERO).await }))
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// `hello::greet(name)` on `dst`, called by `from`.
async fn greet(from: &RpcAgent, dst: &str, name: &str) -> wasmrpc::Result<String> {
    from.rpc_sync(dst, "hello::greet", args![name.to_string()])
        .await
        .and_then(|p| p.as_str().map(str::to_string))
}

#[test]
fn deploy_to_every_worker_then_call_it_from_every_worker_and_from_a_plugin() {
    timed(async {
        let agents = start(|_, o| o).await?;
        for a in &agents {
            expect_err(
                greet(a, a.name(), "x").await,
                ErrorKind::RuntimeError,
                "hello::greet",
            )?;
        }
        let report = agents[1].deploy_plugin(&hello_wasm()).await?;
        report.check()?;
        ensure!(report.plugin == "wasmrpc-plugin-hello", "{report:?}");
        ensure!(report.namespace == "hello", "{report:?}");
        ensure!(report.workers.len() == WORLD as usize, "{report:?}");
        for w in &report.workers {
            let names = w.result.as_ref().map_err(Clone::clone)?;
            ensure!(!w.already_served, "{w:?}");
            ensure!(names.contains(&"hello::greet".to_string()), "{w:?}");
            ensure!(names.contains(&"hello::double_on".to_string()), "{w:?}");
        }
        // Every worker calls every worker by name.
        for from in &agents {
            for to in 0..WORLD {
                let dst = worker_name(to);
                let got = greet(from, &dst, from.name()).await?;
                ensure!(got == format!("hello {} from {dst}", from.name()), "{got}");
            }
        }
        // A deployed function that makes a nested call of its own.
        let t = agents[0]
            .rpc_sync("worker2", "hello::double_on", args!["worker1", 3i64])
            .await?;
        ensure!(t.as_tensor()?.double_value(&[]) == 6.0, "{t:?}");
        // From inside another plugin, loaded before the deployment:
        // seed-fns on worker0 calls hello::greet on worker2 by name.
        let got = agents[1]
            .rpc_sync(
                "worker0",
                "seed_fns::call_str",
                args!["worker2", "hello::greet", "seed-fns"],
            )
            .await?;
        ensure!(
            got.as_str()? == "hello seed-fns from worker2",
            "{:?}",
            got.value
        );
        stop(agents).await
    });
}

#[test]
fn redeploying_the_same_bytes_is_a_no_op() {
    timed(async {
        let agents = start(|_, o| o).await?;
        let wasm = hello_wasm();
        let first = agents[0].deploy_plugin(&wasm).await?;
        first.check()?;
        let again = agents[2].deploy_plugin(&wasm).await?;
        again.check()?;
        ensure!(again.sha256 == first.sha256, "{again:?}");
        for (a, b) in first.workers.iter().zip(&again.workers) {
            ensure!(b.already_served, "{b:?}");
            ensure!(
                a.result.as_ref().ok() == b.result.as_ref().ok(),
                "{a:?} {b:?}"
            );
        }
        ensure!(greet(&agents[0], "worker1", "again").await? == "hello again from worker1");
        stop(agents).await
    });
}

#[test]
fn invalid_bytes_are_rejected_before_anything_is_sent() {
    timed(async {
        // worker0's first DeployPlugin send fails: if the invalid bytes were
        // sent, they would use that fault up.
        let faults = FaultInjection::new().fail_sends(&[message_kinds::DEPLOY_PLUGIN], 1);
        let agents = start(|rank, o| {
            if rank == 0 {
                RpcBackendOptions {
                    faults: faults.clone(),
                    ..o
                }
            } else {
                o
            }
        })
        .await?;
        let e = agents[0]
            .deploy_plugin(b"\0asm\x01\0\0\0 not a plugin")
            .await
            .err()
            .context("invalid bytes were accepted")?;
        ensure!(e.kind() == ErrorKind::RuntimeError, "{e}");
        ensure!(
            e.context()
                .iter()
                .any(|c| c.contains("validating a plugin before deploying it")),
            "{e} {:?}",
            e.context()
        );
        let e = agents[0]
            .deploy_plugin(&[])
            .await
            .err()
            .context("empty bytes were accepted")?;
        ensure!(e.kind() == ErrorKind::RuntimeError, "{e}");
        // The fault is still armed: exactly one worker misses the real
        // deployment, with the injected send failure.
        let report = agents[0].deploy_plugin(&hello_wasm()).await?;
        let failed: Vec<_> = report.failures().collect();
        ensure!(failed.len() == 1, "{report:?}");
        ensure!(
            failed[0].1.contains("injected fault for DeployPlugin"),
            "{report:?}"
        );
        // A second deployment reaches the one that missed it.
        agents[0].deploy_plugin(&hello_wasm()).await?.check()?;
        stop(agents).await
    });
}

#[test]
fn a_worker_with_deployment_off_refuses_and_nobody_switches() {
    timed(async {
        let agents = start(|rank, o| RpcBackendOptions {
            accept_plugin_deployment: rank != 1,
            ..o
        })
        .await?;
        let report = agents[0].deploy_plugin(&hello_wasm()).await?;
        ensure!(!report.is_complete() && !report.committed, "{report:?}");
        for w in &report.workers {
            if w.worker.name == "worker1" {
                let e = w.result.as_ref().err().context("worker1 accepted")?;
                ensure!(
                    e.contains("worker worker1 does not accept plugin deployment"),
                    "{e}"
                );
            } else {
                // Staged, then dropped: the deployment is all or nothing.
                ensure!(w.result.is_ok() && !w.committed, "{w:?}");
            }
        }
        let e = report.check().err().context("check passed")?;
        ensure!(
            e.contains("was not deployed: 1 of 3 workers refused it, so none made it current")
                && e.contains("worker1: worker worker1 does not accept plugin deployment"),
            "{e}"
        );
        for to in 0..WORLD {
            expect_err(
                greet(&agents[0], &worker_name(to), "b").await,
                ErrorKind::RuntimeError,
                "hello::greet",
            )?;
        }
        stop(agents).await
    });
}

#[test]
fn deploying_while_calls_are_running() {
    timed(async {
        let agents = start(|_, o| o).await?;
        // Calls that block on every worker until the test releases them
        // (`seed::timed_out_rpc` waits for the worker's event), so they are
        // running for the whole deployment whatever the machine's speed.
        let running: Vec<Future> = (0..WORLD)
            .flat_map(|to| {
                let a = &agents[0];
                (0..4).map(move |_| a.rpc_async(worker_name(to), "seed::timed_out_rpc", args![]))
            })
            .collect();
        agents[2].deploy_plugin(&hello_wasm()).await?.check()?;
        for to in 0..WORLD {
            let dst = worker_name(to);
            ensure!(greet(&agents[1], &dst, "busy").await? == format!("hello busy from {dst}"));
        }
        ensure!(
            running.iter().all(|f| !f.done()),
            "a blocked call ended before it was released"
        );
        for a in &agents {
            a.state::<TimedOutRpcEvent>().set();
        }
        for r in collect_all(&running).await {
            r?;
        }
        stop(agents).await
    });
}

#[test]
fn another_version_of_a_served_plugin_is_an_upgrade() {
    timed(async {
        let agents = start(|_, o| o).await?;
        let wasm = hello_wasm();
        agents[0].deploy_plugin(&wasm).await?.check()?;
        // The same module with one more custom section: other bytes, same
        // plugin name: a new version, which becomes current everywhere
        // (`upgrade_test` tests upgrades further).
        let mut v2 = wasm.clone();
        v2.extend_from_slice(&[0, 7, 4, b'n', b'o', b't', b'e', b'v', b'2']);
        let report = agents[0].deploy_plugin(&v2).await?;
        report.check()?;
        ensure!(
            report
                .workers
                .iter()
                .all(|w| w.committed && !w.already_served),
            "{report:?}"
        );
        ensure!(greet(&agents[2], "worker1", "v2").await? == "hello v2 from worker1");
        let held = agents[2].plugin_versions("worker1").await?;
        ensure!(
            held.iter()
                .any(|v| v.sha256 == report.sha256 && v.role == "current"),
            "{held:?}"
        );
        ensure!(held.iter().any(|v| v.role == "previous"), "{held:?}");
        stop(agents).await
    });
}

#[test]
fn a_late_joiner_of_a_dynamic_group_installs_the_deployed_plugins() {
    timed(async {
        let store = fresh_store();
        let join = |rank: u32| {
            let store = store.clone();
            async move {
                let registry = wasmrpc::FunctionRegistry::new();
                register_all(&registry);
                // The operator's secret: store entries are signed with it.
                let o = RpcBackendOptions {
                    registry: std::sync::Arc::new(registry),
                    accept_plugin_deployment: true,
                    cluster_secret: Some(b"late-joiner-test-secret".to_vec()),
                    ..RpcBackendOptions::default()
                };
                init_rpc(&worker_name(rank), Some(rank), None, store, o).await
            }
        };
        let w0 = join(0).await?;
        // Nothing deployed yet: nothing to install.
        ensure!(w0.install_deployed_plugins().await?.is_empty());
        let report = w0.deploy_plugin(&hello_wasm()).await?;
        report.check()?;
        let w1 = join(1).await?;
        expect_err(
            greet(&w0, "worker1", "early").await,
            ErrorKind::RuntimeError,
            "hello::greet",
        )?;
        let names = w1.install_deployed_plugins().await?;
        ensure!(names.contains(&"hello::greet".to_string()), "{names:?}");
        ensure!(greet(&w0, "worker1", "late").await? == "hello late from worker1");
        ensure!(greet(&w1, "worker0", "back").await? == "hello back from worker0");
        // Installing again finds nothing new.
        ensure!(w1.install_deployed_plugins().await?.is_empty());
        // An entry written into the store by someone without the cluster
        // secret is not installed.
        // (Real bytes and their sha256, with a MAC made up.)
        let n = store.add("rpc/plugins/count", 1).await? - 1;
        store
            .set(
                &format!("rpc/plugins/{n}"),
                format!("{} {}", report.sha256, "00".repeat(32)).as_bytes(),
            )
            .await?;
        let e = w1
            .install_deployed_plugins()
            .await
            .err()
            .context("a forged entry was installed")?;
        ensure!(e.contains("is not signed with the cluster secret"), "{e}");
        w1.shutdown(true, std::time::Duration::ZERO).await?;
        w0.shutdown(true, std::time::Duration::ZERO).await?;
        Ok(())
    });
}

fn probe_wasm() -> Vec<u8> {
    std::fs::read(wasmrpc_plugins::PROBE).expect("the probe plugin was built")
}

/// Workers whose operator trusts its own plugins with two more ops.
fn trusting(o: RpcBackendOptions) -> RpcBackendOptions {
    let policy = OpPolicy::default()
        .allow("aten::from_file")
        .and_then(|p| p.allow("aten::empty"))
        .expect("valid patterns");
    RpcBackendOptions {
        op_policy: std::sync::Arc::new(policy),
        ..o
    }
}

/// A file of two float32s, removed on drop.
struct TwoFloats(std::path::PathBuf);

impl TwoFloats {
    fn new() -> anyhow::Result<TwoFloats> {
        let path = std::env::temp_dir().join(format!(
            "wasmrpc-probe-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos()
        ));
        let bytes: Vec<u8> = [1.5f32, 2.5].iter().flat_map(|f| f.to_le_bytes()).collect();
        std::fs::write(&path, bytes)?;
        Ok(TwoFloats(path))
    }

    /// `from_file(path, False, 2)`, as a list of arguments.
    fn args(&self) -> Payload {
        Payload::list(vec![
            self.0.display().to_string().into(),
            false.into(),
            2i64.into(),
        ])
    }
}

impl Drop for TwoFloats {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn list(items: Vec<Payload>) -> Payload {
    Payload::list(items)
}

/// `probe::relay(dst, function, args)` on worker1, towards worker2.
async fn relay(a: &RpcAgent, how: &str, function: &str, args: Payload) -> wasmrpc::Result<Payload> {
    a.rpc_sync("worker1", how, args!["worker2", function, args])
        .await
}

/// `probe::run_op(name, args)` on worker1.
async fn run_op(a: &RpcAgent, name: &str, args: Payload) -> wasmrpc::Result<Payload> {
    a.rpc_sync("worker1", "probe::run_op", args![name, args])
        .await
}

#[test]
fn a_deployed_plugin_gets_least_privilege_and_what_it_declares() {
    timed(async {
        let file = TwoFloats::new()?;
        let agents = start(|_, o| trusting(o)).await?;
        agents[0].deploy_plugin(&probe_wasm()).await?.check()?;
        let a = &agents[0];
        for how in ["probe::relay", "probe::relay_remote"] {
            // Builtin ops and its own functions.
            let r = relay(a, how, "aten::add", list(vec![1i64.into(), 2i64.into()])).await?;
            ensure!(r.as_int()? == 3, "{how}: {r:?}");
            let mul = list(vec![
                "aten::mul".into(),
                list(vec![2i64.into(), 3i64.into()]),
            ]);
            let r = relay(a, how, "probe::run_op", mul).await?;
            ensure!(r.as_int()? == 6, "{how}: {r:?}");
            // The one function of another plugin it declares.
            let r = relay(a, how, "seed_fns::identity", list(vec![7i64.into()])).await?;
            ensure!(r.as_int()? == 7, "{how}: {r:?}");
            // Any other: refused on worker1, before anything is sent.
            expect_err(
                relay(a, how, "seed_fns::raise_func", list(vec![])).await,
                ErrorKind::RuntimeError,
                "worker1 does not let plugin probe call seed_fns::raise_func",
            )?;
        }
        // Ops: the families, and the op it declares, which the operator allows.
        let two = || {
            list(vec![
                wasmrpc_tests::ones(&[2]).into(),
                wasmrpc_tests::ones(&[2]).into(),
            ])
        };
        let r = run_op(a, "aten::add", two()).await?;
        ensure!(r.as_tensor()?.sum(tch::Kind::Float).double_value(&[]) == 4.0);
        let r = run_op(a, "aten::from_file", file.args()).await?;
        ensure!(
            Vec::<f32>::try_from(&r.as_tensor()?)? == [1.5, 2.5],
            "{r:?}"
        );
        // An op the operator allows for its own plugins, not declared.
        expect_err(
            run_op(a, "aten::empty", list(vec![list(vec![2i64.into()])])).await,
            ErrorKind::RuntimeError,
            "worker1 does not run aten::empty for plugin probe",
        )?;
        stop(agents).await?;

        // Declaring an op is not enough where the operator does not allow it.
        let agents = start(|_, o| o).await?;
        agents[0].deploy_plugin(&probe_wasm()).await?.check()?;
        expect_err(
            run_op(&agents[0], "aten::from_file", file.args()).await,
            ErrorKind::RuntimeError,
            "worker1 does not run aten::from_file: the op takes a file name",
        )?;
        stop(agents).await
    });
}

#[test]
fn a_plugin_the_operator_loads_gets_the_whole_op_policy_and_no_more() {
    timed(async {
        let agents = start(|_, o| {
            let o = trusting(o);
            let host = PluginHost::shared().expect("the plugin host starts");
            let probe = host
                .load_file(wasmrpc_plugins::PROBE)
                .expect("the probe plugin loads");
            host.register(&probe, &o.registry);
            o
        })
        .await?;
        let a = &agents[0];
        // Any function: seed_fns::raise_func runs, and raises.
        expect_err(
            relay(a, "probe::relay", "seed_fns::raise_func", list(vec![])).await,
            ErrorKind::ValueError,
            "Expected error",
        )?;
        // Every op the policy serves, declared or not.
        run_op(a, "aten::empty", list(vec![list(vec![2i64.into()])])).await?;
        // Nothing the policy refuses.
        expect_err(
            run_op(
                a,
                "aten::set_",
                list(vec![
                    wasmrpc_tests::ones(&[2]).into(),
                    wasmrpc_tests::ones(&[4]).into(),
                ]),
            )
            .await,
            ErrorKind::RuntimeError,
            "worker1 does not run aten::set_",
        )?;
        stop(agents).await
    });
}
