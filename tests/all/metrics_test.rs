//! Metrics (`wasmrpc::metrics`, issue 50): what `/metrics` says after a
//! known load, checked against the calls the test made; what it never
//! says (argument values, names peers made up); and the endpoint against
//! hostile HTTP clients.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use wasmrpc::{Error, Payload, Remote, RpcAgent, RpcBackendOptions, args};
use wasmrpc_tests::{cluster, timed};

/// An argument no metric may ever show (MET-1).
const SECRET_ARGUMENT: &str = "SECRET-ARGUMENT-VALUE-7f3a";

fn with_metrics() -> RpcBackendOptions {
    RpcBackendOptions {
        metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
        ..RpcBackendOptions::default()
    }
}

fn address(agent: &RpcAgent) -> anyhow::Result<SocketAddr> {
    agent
        .state::<wasmrpc::metrics::Endpoint>()
        .address()
        .context("the worker serves no metrics")
}

/// Sends `request` as is and returns everything the endpoint answered
/// before closing the connection.
async fn raw(addr: SocketAddr, request: &[u8]) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer))
        .await
        .context("the endpoint kept the connection open")??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

async fn scrape(agent: &RpcAgent) -> anyhow::Result<String> {
    let answer = raw(
        address(agent)?,
        b"GET /metrics HTTP/1.1\r\nHost: test\r\nAccept: */*\r\n\r\n",
    )
    .await?;
    ensure!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    ensure!(
        answer.contains("content-type: text/plain; version=0.0.4"),
        "{answer}"
    );
    Ok(answer)
}

/// The value of the sample `series` (name and labels, exactly as
/// exported).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn metrics_count_every_call_served_and_made_by_function_peer_and_outcome() {
    timed(async {
        let c = cluster(2)
            .options(with_metrics())
            .functions(|r| {
                r.register_native("demo::echo", |_ctx, args| async move {
                    Ok(Payload::from(args.get(0)?.as_str()?.to_owned()))
                });
                r.register_native("demo::fail", |_ctx, _args| async move {
                    Err::<Payload, _>(Error::value("demo::fail fails"))
                });
            })
            .start()
            .await?;
        let a = c.agent(0);
        for _ in 0..25 {
            a.rpc_sync("worker1", "demo::echo", args![SECRET_ARGUMENT])
                .await?;
        }
        for _ in 0..5 {
            ensure!(a.rpc_sync("worker1", "demo::fail", args![]).await.is_err());
        }
        let futures: Vec<_> = (0..4)
            .map(|_| a.rpc_async("worker1", "demo::echo", args!["async"]))
            .collect();
        for f in futures {
            f.wait().await?;
        }
        // Names a peer made up: counted, but under one label (MET-2).
        for i in 0..7 {
            let name = format!("made_up::function_{i}");
            ensure!(a.rpc_sync("worker1", &name, args![]).await.is_err());
        }

        let served = scrape(c.agent(1)).await?;
        let echo = r#"{caller="worker0",function="demo::echo""#;
        for (series, want) in [
            (format!(r#"wasmrpc_calls_served_total{echo},outcome="ok"}}"#), 29.0),
            (
                r#"wasmrpc_calls_served_total{caller="worker0",function="demo::fail",outcome="ValueError"}"#.into(),
                5.0,
            ),
            ("wasmrpc_agent_unknown_function_calls".into(), 7.0),
            (format!("wasmrpc_call_serve_seconds_count{echo}}}"), 29.0),
            (
                format!(r#"wasmrpc_call_serve_seconds_bucket{{le="+Inf",{}}}"#, &echo[1..]),
                29.0,
            ),
            ("wasmrpc_agent_num_workers".into(), 2.0),
        ] {
            ensure!(
                sample(&served, &series) == Some(want),
                "{series} is not {want} in:\n{served}"
            );
        }
        ensure!(
            !served.contains(SECRET_ARGUMENT),
            "an argument leaked:\n{served}"
        );
        ensure!(
            !served.contains("made_up::"),
            "a made-up name is a label:\n{served}"
        );

        let made = scrape(a).await?;
        let to = r#"{peer="worker1",function="demo::echo""#;
        for (series, want) in [
            (format!(r#"wasmrpc_calls_made_total{to},kind="sync",outcome="ok"}}"#), 25.0),
            (format!(r#"wasmrpc_calls_made_total{to},kind="async",outcome="ok"}}"#), 4.0),
            (
                r#"wasmrpc_calls_made_total{peer="worker1",function="demo::fail",kind="sync",outcome="ValueError"}"#.into(),
                5.0,
            ),
            (format!("wasmrpc_call_seconds_count{to}}}"), 29.0),
        ] {
            ensure!(
                sample(&made, &series) == Some(want),
                "{series} is not {want} in:\n{made}"
            );
        }
        // Traffic: worker1 was scraped first, and counts only what worker0
        // had sent by then; in between, at most heartbeats (4 bytes each).
        // `tcp`, or `tls` when the suite runs over TLS.
        let channel = a
            .traffic()
            .into_iter()
            .find(|t| t.peer == "worker1" && t.channel != wasmrpc::transport::Channel::SharedMemory)
            .context("worker0 counted no traffic to worker1")?
            .channel
            .as_str();
        let w0_to_w1 = format!(r#"{{peer="worker1",channel="{channel}"}}"#);
        let w1_from_w0 = format!(r#"{{peer="worker0",channel="{channel}"}}"#);
        let count = |text: &str, family: &str, labels: &str| {
            sample(text, &format!("wasmrpc_{family}_total{labels}")).unwrap_or(-1.0)
        };
        let (sent, received) = (
            count(&made, "bytes_sent", &w0_to_w1),
            count(&served, "bytes_received", &w1_from_w0),
        );
        ensure!(
            received > 25.0 * SECRET_ARGUMENT.len() as f64
                && received <= sent
                && sent <= received + 1024.0,
            "worker0 sent {sent} bytes to worker1, which received {received}:\n{made}\n{served}"
        );
        let (frames_sent, frames_received) = (
            count(&made, "frames_sent", &w0_to_w1),
            count(&served, "frames_received", &w1_from_w0),
        );
        // 41 calls, and their 41 responses.
        ensure!(
            (41.0..=frames_sent).contains(&frames_received)
                && count(&made, "frames_received", &w0_to_w1) >= 41.0
                && count(&served, "frames_sent", &w1_from_w0) >= 41.0,
            "frames: worker0 sent {frames_sent}, worker1 received {frames_received}"
        );
        // A connection that is no handshake is refused, and counted by
        // its reason only (over TLS, TLS refuses it first): nothing it
        // sent becomes a label (TRAFFIC-2).
        let rpc_port = c.agent(1).local_addr().context("no address")?;
        let mut garbage = tokio::net::TcpStream::connect(rpc_port).await?;
        garbage.write_all(SECRET_ARGUMENT.as_bytes()).await?;
        let mut rest = Vec::new();
        let _ = garbage.read_to_end(&mut rest).await;
        let (reason, other) = match channel {
            "tls" => ("tls", "handshake"),
            _ => ("handshake", "tls"),
        };
        let refused = format!(r#"wasmrpc_connections_refused_total{{reason="{reason}"}}"#);
        let not_refused = format!(r#"wasmrpc_connections_refused_total{{reason="{other}"}}"#);
        let deadline = Instant::now() + Duration::from_secs(10);
        let after = loop {
            let text = scrape(c.agent(1)).await?;
            if sample(&text, &refused) == Some(1.0) || Instant::now() > deadline {
                break text;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        ensure!(
            sample(&after, &refused) == Some(1.0)
                && sample(&after, &not_refused) == Some(0.0)
                && !after.contains(SECRET_ARGUMENT),
            "the refused connection is not counted as one {reason} refusal:\n{after}"
        );
        dashboard_queries_only_exported_metrics(&format!("{served}{made}"))?;
        ensure!(
            !made.contains(SECRET_ARGUMENT),
            "an argument leaked:\n{made}"
        );

        // The endpoint stops with its agent (MET-6).
        let addr = address(a)?;
        c.shutdown().await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            ensure!(
                Instant::now() < deadline,
                "{addr} still serves after shutdown"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    });
}

/// The plugins' gauges follow what a worker's plugins hold: objects made
/// and dropped, calls running, warm instances, the plugins served.
#[test]
fn plugin_gauges_follow_objects_calls_and_instances() {
    timed(async {
        let c = cluster(2).options(with_metrics()).start().await?;
        let a = c.agent(0);
        let gauge = |text: &str, name: &str| {
            sample(text, name).with_context(|| format!("no {name} in:\n{text}"))
        };
        let before = scrape(c.agent(1)).await?;
        // The seed-fns plugin (`register_all`), once however many names
        // it registers.
        ensure!(
            gauge(&before, "wasmrpc_agent_plugin_served")? == 1.0,
            "{before}"
        );
        ensure!(
            gauge(&before, "wasmrpc_agent_plugin_objects")? == 0.0,
            "{before}"
        );
        ensure!(
            gauge(&before, "wasmrpc_agent_plugin_calls_in_flight")? == 0.0,
            "{before}"
        );
        let objects: Vec<wasmrpc::RRef> = (0..3)
            .map(|i| a.remote("worker1", "seed_fns::MyClass", args![i]))
            .collect::<wasmrpc::Result<_>>()?;
        for o in &objects {
            o.get_type(a, None).await?;
        }
        let held = scrape(c.agent(1)).await?;
        ensure!(
            gauge(&held, "wasmrpc_agent_plugin_objects")? == 3.0,
            "{held}"
        );
        // A function of the plugin ran: an instance waits in the pool.
        a.rpc_sync("worker1", "seed_fns::my_function", args![1, 2, 3])
            .await?;
        let warm = scrape(c.agent(1)).await?;
        ensure!(
            gauge(&warm, "wasmrpc_agent_plugin_idle_instances")? >= 1.0,
            "{warm}"
        );
        // Dropped by their last user, the objects go (RREF-3, OBJ-3).
        drop(objects);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = scrape(c.agent(1)).await?;
            if gauge(&text, "wasmrpc_agent_plugin_objects")? == 0.0 {
                break;
            }
            ensure!(Instant::now() < deadline, "objects still counted:\n{text}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn the_metrics_endpoint_answers_hostile_clients_and_serves_on() {
    timed(async {
        let c = cluster(1).options(with_metrics()).start().await?;
        let agent = c.agent(0);
        let addr = address(agent)?;
        for (request, status) in [
            (
                b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".to_vec(),
                "405",
            ),
            (
                b"GET /metrics/../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
                "404",
            ),
            (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), "404"),
            (
                b"\x16\x03\x01\x02\x00garbage that is no HTTP\r\n\r\n".to_vec(),
                "400",
            ),
            (
                [
                    b"GET /metrics HTTP/1.1\r\nX-Big: ".as_slice(),
                    &[b'a'; 64 * 1024],
                    b"\r\n\r\n",
                ]
                .concat(),
                "431",
            ),
        ] {
            let answer = raw(addr, &request).await?;
            ensure!(
                answer.starts_with(&format!("HTTP/1.1 {status}")),
                "{status} expected for {:?}, got:\n{answer}",
                String::from_utf8_lossy(&request[..request.len().min(40)])
            );
            ensure!(
                !answer.contains("wasmrpc_"),
                "metrics answered a bad request:\n{answer}"
            );
        }
        // HEAD: the headers, no body.
        let answer = raw(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await?;
        ensure!(
            answer.starts_with("HTTP/1.1 200") && !answer.contains("wasmrpc_"),
            "{answer}"
        );
        // A client that sends half a request and stalls is dropped after the
        // header timeout, and holds nothing meanwhile: scrapes go on.
        let started = Instant::now();
        let stalled = tokio::spawn(raw(addr, b"GET /metr"));
        scrape(agent).await?;
        let answer = stalled.await??;
        let waited = started.elapsed();
        ensure!(
            waited >= wasmrpc::metrics::http::HEADER_TIMEOUT.mul_f64(0.9)
                && waited < Duration::from_secs(15),
            "the stalled client was dropped after {waited:?}: {answer}"
        );
        // More clients than it serves at once, all stalled: a scrape still
        // gets its answer once the stalled ones time out.
        let stalled: Vec<_> = (0..wasmrpc::metrics::http::MAX_CLIENTS + 4)
            .map(|_| tokio::spawn(raw(addr, b"GET")))
            .collect();
        scrape(agent).await?;
        for s in stalled {
            let _ = s.await?;
        }
        scrape(agent).await?;
        c.shutdown().await?;
        Ok(())
    });
}

#[test]
fn metrics_are_off_by_default_and_refuse_a_public_address_unless_told() {
    timed(async {
        let c = cluster(2).start().await?;
        let a = c.agent(0);
        a.rpc_sync("worker1", wasmrpc::NOOP, args![]).await?;
        ensure!(a.state::<wasmrpc::metrics::Endpoint>().address().is_none());
        // No extension counted the call (MET-3).
        let text = wasmrpc::metrics::render(a);
        ensure!(!text.contains("wasmrpc_calls_made_total{"), "{text}");
        ensure!(text.contains("wasmrpc_agent_num_workers 2"), "{text}");

        let public = SocketAddr::from(([0, 0, 0, 0], 0));
        let refused = wasmrpc::metrics::serve(a, public, false)
            .await
            .expect_err("a public address without metrics_public");
        ensure!(
            refused
                .message()
                .contains("worker worker0: metrics on 0.0.0.0:0")
                && refused.message().contains("not a loopback address")
                && refused.message().contains("--metrics-public"),
            "{refused}"
        );
        let served = wasmrpc::metrics::serve(a, public, true).await?;
        ensure!(served.addr.port() != 0);
        c.shutdown().await?;
        Ok(())
    });
}

/// The Grafana dashboard shipped in `examples/deploy/grafana` queries only
/// metrics a worker exports (the families `scrape` declares, and the call
/// metrics' families, which a scrape shows once they have a sample).
fn dashboard_queries_only_exported_metrics(scrape: &str) -> anyhow::Result<()> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/deploy/grafana/wasmrpc-workers.json"
    );
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)
        .with_context(|| format!("{path} is not JSON"))?;
    let families: Vec<&str> = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next())
        .chain(wasmrpc::metrics::CALL_FAMILIES.iter().copied())
        .collect();
    let exported = |metric: &str| {
        families.iter().any(|f| {
            ["", "_total", "_bucket", "_sum", "_count", "_info"]
                .iter()
                .any(|suffix| metric == format!("{f}{suffix}"))
        })
    };
    let mut queried = 0;
    for panel in dashboard["panels"].as_array().context("no panels")? {
        for target in panel["targets"]
            .as_array()
            .context("a panel without targets")?
        {
            let expr = target["expr"].as_str().context("a target without expr")?;
            for metric in expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("wasmrpc_"))
            {
                ensure!(
                    exported(metric),
                    "{path}: panel {:?} queries {metric}, which no worker exports",
                    panel["title"]
                );
                queried += 1;
            }
        }
    }
    ensure!(queried >= 10, "{path} queries only {queried} metrics");
    Ok(())
}
