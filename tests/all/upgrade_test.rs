//! Upgrading a plugin while the group serves (issue 48): versions side by
//! side, the two-phase switch (stage everywhere, then commit or abort),
//! rollback, pinned names, and what late joiners install.
//!
//! Two versions of `plugins/hello` are made here by replacing its version
//! marker (`hello::VERSION`, 32 bytes) in the module with one of the same
//! length: other bytes and behaviour, same plugin. The groups are the
//! deployment tests' (`deploy_test::start`): three in-process workers
//! serving seed-fns and accepting deployments unless a test says otherwise.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use wasmrpc::prelude::*;
use wasmrpc::testing::{fresh_store, worker_name};
use wasmrpc::{
    DEPLOY_PLUGIN, DeployPlugin, ErrorKind, PluginHost, RpcAgent, RpcBackendOptions, args, init_rpc,
};
use wasmrpc_tests::{expect_err, register_all, timed};

use crate::deploy_test::{WORLD, start, stop};

/// The hello plugin with the marker `hello-version-XXXXXXXXXXXXXXXXXX`
/// (`X` = `marker`).
fn hello_version(marker: u8) -> Vec<u8> {
    let bytes = std::fs::read(wasmrpc_plugins::HELLO).expect("the hello plugin was built");
    let old = b"hello-version-AAAAAAAAAAAAAAAAAA";
    let new = marked(marker);
    let mut out = bytes.clone();
    let mut found = 0;
    for i in 0..=bytes.len() - old.len() {
        if &bytes[i..i + old.len()] == old {
            out[i..i + old.len()].copy_from_slice(new.as_bytes());
            found += 1;
        }
    }
    assert!(found > 0, "the version marker is in the hello module");
    out
}

fn marked(marker: u8) -> String {
    format!("hello-version-{}", (marker as char).to_string().repeat(18))
}

/// `hello::version` (or a pinned name's) on `dst`.
async fn version_on(from: &RpcAgent, dst: &str, function: &str) -> wasmrpc::Result<String> {
    from.rpc_sync(dst, function, args![])
        .await
        .and_then(|p| p.as_str().map(str::to_string))
}

/// Every worker answers `hello::version` with `marker`'s version.
async fn all_run(agents: &[RpcAgent], marker: u8) -> anyhow::Result<()> {
    for from in agents {
        for to in 0..WORLD {
            let got = version_on(from, &worker_name(to), "hello::version").await?;
            ensure!(
                got == marked(marker),
                "{} -> worker{to}: {got}, expected version {}",
                from.name(),
                marker as char
            );
        }
    }
    Ok(())
}

fn sha_of(wasm: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(wasm)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn calls_running_through_an_upgrade_and_a_rollback_are_all_answered_each_by_one_version() {
    timed(async {
        let agents = start(|_, o| o).await?;
        let (a, b) = (hello_version(b'A'), hello_version(b'B'));
        agents[0].deploy_plugin(&a).await?.check()?;
        all_run(&agents, b'A').await?;
        // A steady load: each call runs `version_chain` on one worker,
        // which sleeps, then calls `version` on another by its short name.
        let stopping = Arc::new(AtomicBool::new(false));
        let load: Vec<_> = (0..6usize)
            .map(|i| {
                let from = agents[i % 3].clone();
                let (dst, on) = (
                    worker_name((i as u32 + 1) % 3),
                    worker_name((i as u32 + 2) % 3),
                );
                let stopping = stopping.clone();
                tokio::spawn(async move {
                    let mut answers = Vec::new();
                    while !stopping.load(Ordering::SeqCst) {
                        let r = from
                            .rpc_sync(
                                dst.as_str(),
                                "hello::version_chain",
                                args![on.clone(), 0.003f64],
                            )
                            .await
                            .and_then(|p| p.as_str().map(str::to_string));
                        answers.push(r);
                    }
                    answers
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let up = agents[1].deploy_plugin(&b).await?;
        up.check()?;
        ensure!(
            up.committed && up.workers.iter().all(|w| w.committed),
            "{up:?}"
        );
        // A call that starts after the deployer's commit returned runs the
        // new version on every worker.
        all_run(&agents, b'B').await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let back = agents[2]
            .rollback_plugin("hello", &agents[2].get_worker_infos())
            .await?;
        back.check()?;
        ensure!(back.sha256 == sha_of(&a), "{back:?}");
        all_run(&agents, b'A').await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        stopping.store(true, Ordering::SeqCst);
        let (mut total, mut seen_a, mut seen_b) = (0, 0, 0);
        for task in load {
            for answer in task.await? {
                total += 1;
                let answer = answer.context("a call was lost in the switch")?;
                let (here, there) = answer.split_once(' ').context("two markers")?;
                ensure!(here == there, "one call saw two versions: {answer}");
                if here == marked(b'A') {
                    seen_a += 1;
                } else if here == marked(b'B') {
                    seen_b += 1;
                } else {
                    anyhow::bail!("unexpected answer {answer}");
                }
            }
        }
        ensure!(
            seen_a > 0 && seen_b > 0,
            "{total} calls: {seen_a} A, {seen_b} B"
        );
        // Each version counted its own calls in its own globals.
        let (sha_a, sha_b) = (sha_of(&a), sha_of(&b));
        let mut counted = 0;
        for to in 0..WORLD {
            for sha in [&sha_a, &sha_b] {
                counted += agents[0]
                    .rpc_sync(
                        worker_name(to),
                        &format!("hello@{}::calls", &sha[..8]),
                        args![],
                    )
                    .await?
                    .as_int()?;
            }
        }
        ensure!(counted == total, "{counted} calls counted, {total} made");
        // Pinned names: the version whose sha256 starts with the prefix.
        let pinned = version_on(
            &agents[0],
            "worker1",
            &format!("hello@{}::version", &sha_b[..8]),
        )
        .await?;
        ensure!(pinned == marked(b'B'), "{pinned}");
        let pinned = version_on(&agents[0], "worker1", &format!("hello@{sha_a}::version")).await?;
        ensure!(pinned == marked(b'A'), "{pinned}");
        expect_err(
            version_on(
                &agents[0],
                "worker1",
                &format!("hello@{}::version", &sha_b[..7]),
            )
            .await,
            ErrorKind::ValueError,
            "at least 8 hex digits",
        )?;
        let e = expect_err(
            version_on(&agents[0], "worker2", "hello@0000000000::version").await,
            ErrorKind::RuntimeError,
            "no version of plugin hello has a sha256 starting with 0000000000",
        )?;
        ensure!(
            e.contains(&format!("{} (current)", &sha_a[..16]))
                && e.contains(&format!("{} (previous)", &sha_b[..16])),
            "{e}"
        );
        // What each worker holds.
        for to in 0..WORLD {
            let held = agents[0].plugin_versions(&worker_name(to)).await?;
            let role = |sha: &str| {
                held.iter()
                    .find(|v| v.sha256 == sha)
                    .map(|v| v.role.clone())
            };
            ensure!(role(&sha_a).as_deref() == Some("current"), "{held:?}");
            ensure!(role(&sha_b).as_deref() == Some("previous"), "{held:?}");
            ensure!(
                held.iter()
                    .all(|v| v.in_flight == 0 && v.namespace == "hello"),
                "{held:?}"
            );
            ensure!(
                held.iter()
                    .any(|v| v.sha256 == sha_b && v.deployed_by == "worker1"),
                "{held:?}"
            );
        }
        stop(agents).await
    });
}

#[test]
fn a_deployer_that_dies_between_the_phases_leaves_the_group_on_the_old_version() {
    timed(async {
        let agents = start(|_, o| RpcBackendOptions {
            plugin_stage_timeout: Duration::from_secs(1),
            ..o
        })
        .await?;
        let (a, b) = (hello_version(b'A'), hello_version(b'B'));
        agents[0].deploy_plugin(&a).await?.check()?;
        // A deployer's first phase, by hand, and no second.
        let sha256: [u8; 32] = {
            use sha2::Digest;
            sha2::Sha256::digest(&b).into()
        };
        let body = DeployPlugin {
            name: "wasmrpc-plugin-hello".into(),
            sha256,
            wasm: b.clone(),
            stage: true,
        }
        .encode()?;
        for to in 0..WORLD {
            agents[2]
                .request(worker_name(to), DEPLOY_PLUGIN, body.clone(), &[], None)
                .wait()
                .await?;
        }
        all_run(&agents, b'A').await?;
        let held = agents[0].plugin_versions("worker1").await?;
        ensure!(
            held.iter()
                .any(|v| v.sha256 == sha_of(&b) && v.role == "staged"),
            "{held:?}"
        );
        // A staged version answers only its pinned names.
        let pinned = version_on(
            &agents[0],
            "worker1",
            &format!("hello@{}::version", &sha_of(&b)[..8]),
        )
        .await?;
        ensure!(pinned == marked(b'B'), "{pinned}");
        // The stage expires.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        for to in 0..WORLD {
            let held = agents[0].plugin_versions(&worker_name(to)).await?;
            ensure!(held.iter().all(|v| v.sha256 != sha_of(&b)), "{held:?}");
        }
        all_run(&agents, b'A').await?;
        // A later deployment proceeds.
        agents[1].deploy_plugin(&b).await?.check()?;
        all_run(&agents, b'B').await?;
        stop(agents).await
    });
}

#[test]
fn a_worker_that_refuses_the_new_version_keeps_the_whole_group_on_the_old_one() {
    timed(async {
        // Version A loaded by the operator at start-up on every worker;
        // worker1 does not accept deployments.
        let host = PluginHost::shared()?;
        let a = hello_version(b'A');
        let plugin = host.load_version(&a)?;
        let agents = start(|rank, o| {
            host.register(&plugin, &o.registry);
            RpcBackendOptions {
                accept_plugin_deployment: rank != 1,
                ..o
            }
        })
        .await?;
        all_run(&agents, b'A').await?;
        let report = agents[0].deploy_plugin(&hello_version(b'B')).await?;
        ensure!(!report.committed && !report.is_complete(), "{report:?}");
        let e = report.check().err().context("check passed")?;
        ensure!(
            e.contains("none made it current (the group stays on its current version)")
                && e.contains("worker1: worker worker1 does not accept plugin deployment"),
            "{e}"
        );
        all_run(&agents, b'A').await?;
        // The aborted version is gone where it was staged.
        for to in [0, 2] {
            let held = agents[0].plugin_versions(&worker_name(to)).await?;
            ensure!(
                held.len() == 1 && held[0].role == "current" && held[0].deployed_by == "operator",
                "{held:?}"
            );
        }
        // Nor does worker1 take a switch.
        let e = agents[0]
            .rollback_plugin("hello", &agents[0].get_worker_infos())
            .await
            .err()
            .context("a rollback without a previous version")?;
        ensure!(e.contains("no worker switched"), "{e}");
        stop(agents).await
    });
}

#[test]
fn an_rref_object_keeps_its_version_through_an_upgrade() {
    timed(async {
        let agents = start(|_, o| o).await?;
        let (a, b) = (hello_version(b'A'), hello_version(b'B'));
        agents[0].deploy_plugin(&a).await?.check()?;
        let old = agents[0].remote("worker1", "hello::Versioned", args![])?;
        let method = |r: wasmrpc::RRef, agent: RpcAgent| async move {
            r.rpc_sync(&agent, None)
                .call("version", args![])
                .await
                .and_then(|p| p.as_str().map(str::to_string))
        };
        ensure!(method(old.clone(), agents[0].clone()).await? == marked(b'A'));
        agents[2].deploy_plugin(&b).await?.check()?;
        ensure!(method(old.clone(), agents[0].clone()).await? == marked(b'A'));
        let new = agents[0].remote("worker1", "hello::Versioned", args![])?;
        ensure!(method(new, agents[0].clone()).await? == marked(b'B'));
        let held = agents[0].plugin_versions("worker1").await?;
        let v1 = held
            .iter()
            .find(|v| v.sha256 == sha_of(&a))
            .context("version A is held")?;
        ensure!(v1.role == "previous" && v1.objects >= 1, "{held:?}");
        drop(old);
        stop(agents).await
    });
}

#[test]
fn a_late_joiner_gets_the_version_the_group_switched_to_last() {
    timed(async {
        let store = fresh_store();
        let join = |rank: u32| {
            let store = store.clone();
            async move {
                let registry = wasmrpc::FunctionRegistry::new();
                register_all(&registry);
                let o = RpcBackendOptions {
                    registry: std::sync::Arc::new(registry),
                    accept_plugin_deployment: true,
                    cluster_secret: Some(b"upgrade-late-joiner-secret".to_vec()),
                    ..RpcBackendOptions::default()
                };
                init_rpc(&worker_name(rank), Some(rank), None, store, o).await
            }
        };
        let w0 = join(0).await?;
        let (a, b) = (hello_version(b'A'), hello_version(b'B'));
        w0.deploy_plugin(&a).await?.check()?;
        w0.deploy_plugin(&b).await?.check()?;
        w0.rollback_plugin("hello", &w0.get_worker_infos())
            .await?
            .check()?;
        ensure!(version_on(&w0, "worker0", "hello::version").await? == marked(b'A'));
        let w1 = join(1).await?;
        let names = w1.install_deployed_plugins().await?;
        ensure!(names.contains(&"hello::version".to_string()), "{names:?}");
        ensure!(version_on(&w0, "worker1", "hello::version").await? == marked(b'A'));
        let held = w0.plugin_versions("worker1").await?;
        ensure!(
            held.iter()
                .any(|v| v.sha256 == sha_of(&a) && v.role == "current"),
            "{held:?}"
        );
        // A switch written into the store without the secret is refused.
        store
            .set(
                "rpc/plugins/current/hello",
                format!("{} {}", sha_of(&b), "00".repeat(32)).as_bytes(),
            )
            .await?;
        let w2 = join(2).await?;
        let e = w2
            .install_deployed_plugins()
            .await
            .err()
            .context("a forged switch was followed")?;
        ensure!(e.contains("is not signed with the cluster secret"), "{e}");
        for w in [w2, w1, w0] {
            w.shutdown(true, Duration::ZERO).await?;
        }
        Ok(())
    });
}
