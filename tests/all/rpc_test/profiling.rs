//! `rpc_test` area L (RPC profiling) on `wasmrpc::profiler`, caller side:
//! the profiling key, one event per RPC made in a scope, user ranges, and
//! the Chrome trace export.
//!
//! Only `test_build_rpc_profiling_key` is a seed port so far: every other
//! area L seed asserts the callee's events ("remote events profiled",
//! `node_id == dst`), which the profiler does not ship back yet (see the
//! module doc of `wasmrpc::profiler`); they are listed with that reason in
//! `wasmrpc_tests::skips`. The other tests here check what the caller side
//! records, in the seeds' terms (`_profiler_test_with_rpc`'s checks on the
//! RPC event and the `record_function` scope).

use anyhow::ensure;
use wasmrpc::profiler::{
    Event, Profile, RpcExecMode, build_rpc_profiling_key, profile, record_function,
};
use wasmrpc::testing::{Worker, worker_name};
use wasmrpc::{Payload, args};
use wasmrpc_tests::{dist, expect_tensor, ones};

const MODES: [RpcExecMode; 3] = [RpcExecMode::Sync, RpcExecMode::Async, RpcExecMode::Remote];

#[test]
fn test_build_rpc_profiling_key() {
    for mode in MODES {
        let key = build_rpc_profiling_key(mode, "foo", "worker0", "worker1");
        for part in [mode.value(), "foo", "worker0", "worker1"] {
            assert!(key.contains(part), "{key} lacks {part}");
        }
    }
}

async fn call(w: &Worker, mode: RpcExecMode, dst: &str) -> anyhow::Result<Payload> {
    let a = args![ones(&[1]), ones(&[1])];
    Ok(match mode {
        RpcExecMode::Sync => w.agent.rpc_sync(dst, "aten::mul", a).await?,
        RpcExecMode::Async => w.agent.rpc_async(dst, "aten::mul", a).wait().await?,
        RpcExecMode::Remote => {
            let r = w.agent.remote(dst, "aten::mul", a)?;
            r.get_future().wait().await?;
            r.to_here(&w.agent, None).await?
        }
    })
}

/// `check_profiling_info`: the one RPC event names both workers, the
/// function and the mode, and ran on the caller.
fn rpc_event<'a>(
    p: &'a Profile,
    w: &Worker,
    mode: RpcExecMode,
    dst: &str,
) -> anyhow::Result<&'a Event> {
    let key = build_rpc_profiling_key(mode, "aten::mul", &worker_name(w.rank), dst);
    let found = p.find(&key);
    ensure!(found.len() == 1, "{key}: {} events in {p:?}", found.len());
    let e = found[0];
    ensure!(e.worker == w.rank, "node_id {} for {key}", e.worker);
    ensure!(e.end_us.is_some(), "{key} never ended");
    Ok(e)
}

#[test]
fn rpc_events_are_recorded_under_their_keys() {
    dist(|w| async move {
        if w.rank != 1 {
            return Ok(());
        }
        for dst in [w.dst(), worker_name(w.rank)] {
            for mode in MODES {
                let (r, p) = profile(&w.agent, call(&w, mode, &dst)).await;
                expect_tensor(&r?, &ones(&[1]))?;
                rpc_event(&p, &w, mode, &dst)?;
                ensure!(p.events.len() == 1, "extra events: {p:?}");
            }
        }
        // Outside a scope nothing is recorded, and a call still works.
        expect_tensor(&call(&w, RpcExecMode::Sync, &w.dst()).await?, &ones(&[1]))?;
        Ok(())
    });
}

#[test]
fn record_function_encloses_the_rpcs_it_makes() {
    dist(|w| async move {
        if w.rank != 1 {
            return Ok(());
        }
        let dst = w.dst();
        for mode in MODES {
            let (r, p) = profile(&w.agent, record_function("foo", call(&w, mode, &dst))).await;
            r?;
            let rpc = rpc_event(&p, &w, mode, &dst)?;
            let foo: Vec<&Event> = p.events.iter().filter(|e| e.name == "foo").collect();
            ensure!(foo.len() == 1, "{p:?}");
            ensure!(foo[0].encloses(rpc), "foo {:?} vs {rpc:?}", foo[0]);
            let pos = |e: &Event| p.events.iter().position(|x| x == e);
            ensure!(pos(foo[0]) < pos(rpc), "foo comes after the RPC: {p:?}");
        }
        Ok(())
    });
}

#[test]
fn profile_exports_a_chrome_trace() {
    dist(|w| async move {
        if w.rank != 1 {
            return Ok(());
        }
        let dst = w.dst();
        let (r, p) = profile(&w.agent, async {
            record_function("\"quoted\" scope", async {
                call(&w, RpcExecMode::Async, &dst).await?;
                call(&w, RpcExecMode::Remote, &dst).await
            })
            .await
        })
        .await;
        r?;
        let path = std::env::temp_dir().join(format!(
            "wasmrpc-profile-{}-{}.json",
            std::process::id(),
            w.rank
        ));
        p.export_chrome_trace(&path)?;
        let trace = std::fs::read_to_string(&path);
        let _ = std::fs::remove_file(&path);
        let trace = trace?;
        ensure!(trace.starts_with('[') && trace.ends_with(']'), "{trace}");
        ensure!(trace.matches("\"ph\": \"X\"").count() == 3, "{trace}");
        ensure!(trace.contains("\\\"quoted\\\" scope"), "{trace}");
        for mode in [RpcExecMode::Async, RpcExecMode::Remote] {
            let key = build_rpc_profiling_key(mode, "aten::mul", &worker_name(w.rank), &dst);
            ensure!(trace.contains(&key), "{key} missing from {trace}");
        }
        ensure!(trace.contains("\"node_id\": 1"), "{trace}");
        Ok(())
    });
}
