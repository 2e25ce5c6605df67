//! Traces across workers (`wasmrpc::trace`, issue 50): an in-process OTLP
//! receiver takes what the workers export, and the tests check the tree of
//! a nested call across three workers, what a span never holds, the trace
//! context against hostile fields, a worker without a collector in the
//! middle of a chain, and a collector that never answers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message as _;
use wasmrpc::{CallKind, CallOptions, Error, Field, Payload, Remote, RpcBackendOptions, args};
use wasmrpc_tests::{cluster, register_all, timed};

/// An argument no span may ever show (TRACE-3).
const SECRET_ARGUMENT: &str = "SECRET-ARGUMENT-VALUE-51c2";

/// One exported span, with the worker that exported it.
#[derive(Clone, Debug)]
struct Span {
    worker: String,
    name: String,
    kind: SpanKind,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    start: u64,
    end: u64,
    attributes: HashMap<String, String>,
    status: Option<(StatusCode, String)>,
    /// Everything the exporter posted for it, for leak checks.
    raw: String,
}

/// An OTLP/HTTP receiver on loopback: keeps every span posted to
/// `/v1/traces`.
struct Receiver {
    address: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
}

fn text(value: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        other => format!("{other:?}"),
    }
}

impl Receiver {
    async fn start() -> anyhow::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let spans = Arc::new(Mutex::new(Vec::new()));
        let keep = spans.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let keep = keep.clone();
                let service = hyper::service::service_fn(
                    move |request: hyper::Request<hyper::body::Incoming>| {
                        let keep = keep.clone();
                        async move {
                            let path = request.uri().path().to_owned();
                            let body = match request.into_body().collect().await {
                                Ok(body) => body.to_bytes(),
                                Err(_) => Bytes::new(),
                            };
                            let status = if path == "/v1/traces" {
                                match ExportTraceServiceRequest::decode(body) {
                                    Ok(export) => {
                                        keep.lock().unwrap().extend(spans_of(&export));
                                        200
                                    }
                                    Err(_) => 400,
                                }
                            } else {
                                404
                            };
                            hyper::Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::new()))
                        }
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
        Ok(Receiver { address, spans })
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }
}

fn spans_of(export: &ExportTraceServiceRequest) -> Vec<Span> {
    let mut out = Vec::new();
    for resource_spans in &export.resource_spans {
        let worker = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.instance.id")
            .map(|a| text(&a.value))
            .unwrap_or_default();
        for scope in &resource_spans.scope_spans {
            for s in &scope.spans {
                out.push(Span {
                    worker: worker.clone(),
                    name: s.name.clone(),
                    kind: SpanKind::try_from(s.kind).unwrap_or(SpanKind::Unspecified),
                    trace: s.trace_id.clone(),
                    id: s.span_id.clone(),
                    parent: s.parent_span_id.clone(),
                    start: s.start_time_unix_nano,
                    end: s.end_time_unix_nano,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|a| (a.key.clone(), text(&a.value)))
                        .collect(),
                    status: s.status.as_ref().map(|st| {
                        (
                            StatusCode::try_from(st.code).unwrap_or(StatusCode::Unset),
                            st.message.clone(),
                        )
                    }),
                    raw: format!("{s:?}"),
                });
            }
        }
    }
    out
}

fn with_collector(receiver: &Receiver) -> RpcBackendOptions {
    RpcBackendOptions {
        otlp_endpoint: Some(receiver.endpoint()),
        ..RpcBackendOptions::default()
    }
}

/// The one span named `name` exported by `worker` in `trace`.
fn one<'a>(spans: &'a [Span], trace: &[u8], worker: &str, name: &str) -> anyhow::Result<&'a Span> {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.trace == trace && s.worker == worker && s.name == name)
        .collect();
    ensure!(
        found.len() == 1,
        "{} spans `{name}` of {worker} in the trace, not one: {spans:#?}",
        found.len()
    );
    Ok(found[0])
}

/// `child` is a child of `parent`, within its time.
fn child_of(child: &Span, parent: &Span) -> anyhow::Result<()> {
    ensure!(
        child.parent == parent.id,
        "`{}` of {} is not a child of `{}` of {}",
        child.name,
        child.worker,
        parent.name,
        parent.worker
    );
    ensure!(
        parent.start <= child.start && child.end <= parent.end,
        "`{}` ({}..{}) is not within `{}` ({}..{})",
        child.name,
        child.start,
        child.end,
        parent.name,
        parent.start,
        parent.end
    );
    Ok(())
}

/// Waits until the receiver holds `n` spans (exports come in batches).
async fn wait_for(receiver: &Receiver, n: usize) -> anyhow::Result<Vec<Span>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans = receiver.spans();
        if spans.len() >= n {
            return Ok(spans);
        }
        ensure!(
            Instant::now() < deadline,
            "{} spans arrived, {n} expected: {spans:#?}",
            spans.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn relay_functions(r: &wasmrpc::FunctionRegistry) {
    register_all(r);
    // worker1 relays to worker2, whose function fails with the argument
    // in its message: the spans must say the kind only.
    r.register_native("demo::relay", |ctx, args| async move {
        let secret = args.get(0)?.as_str()?.to_owned();
        ctx.agent()
            .rpc_sync("worker2", "demo::leaf", args![secret])
            .await
    });
    // worker1 calls a method of an RRef's value through the proxy, whose
    // call leaves from a task spawned for it (TRACE-4).
    r.register_native("demo::proxy", |ctx, args| async move {
        let rref = args.get(0)?.as_rref()?.clone();
        rref.rpc_async(ctx.agent(), None)
            .call_async("add", args![1])
            .wait()
            .await
    });
    r.register_native("demo::leaf", |_ctx, args| async move {
        let secret = args.get(0)?.as_str()?.to_owned();
        Err::<Payload, _>(Error::value(format!("leaf refuses {secret}")))
    });
}

#[test]
fn a_nested_call_is_one_trace_tree_across_three_workers() {
    timed(async {
        let receiver = Receiver::start().await?;
        let c = cluster(3)
            .options(with_collector(&receiver))
            .functions(relay_functions)
            .start()
            .await?;
        // A plugin's function calls another worker from inside the wasm
        // sandbox: worker0 -> worker1 (seed_fns::nested_rpc) -> worker2
        // (aten::add).
        c.agent(0)
            .rpc_sync("worker1", "seed_fns::nested_rpc", args!["worker2"])
            .await?;
        // A native function relays a failing call.
        let e = c
            .agent(0)
            .rpc_sync("worker1", "demo::relay", args![SECRET_ARGUMENT])
            .await
            .expect_err("demo::leaf fails");
        ensure!(e.to_string().contains(SECRET_ARGUMENT), "{e}");
        // An RRef owned by worker2, used by worker1 through its proxy.
        let rref = c.agent(0).remote(
            "worker2",
            "seed_fns::my_function",
            args![wasmrpc_tests::ones(&[2, 2]), 1, 3],
        )?;
        c.agent(0)
            .rpc_sync("worker1", "demo::proxy", args![rref.clone()])
            .await?;
        drop(rref);
        c.shutdown().await?;
        // Every worker's provider was shut down with its agent: what it had
        // is exported by now.
        let spans = wait_for(&receiver, 16).await?;

        let root = spans
            .iter()
            .find(|s| s.worker == "worker0" && s.name == "call seed_fns::nested_rpc")
            .context("worker0's call span")?;
        ensure!(root.parent.is_empty(), "the first call is a trace's root");
        ensure!(root.kind == SpanKind::Client);
        ensure!(root.attributes["wasmrpc.peer"] == "worker1");
        ensure!(root.attributes["wasmrpc.call_kind"] == "sync");
        ensure!(root.attributes["rpc.method"] == "seed_fns::nested_rpc");
        let trace = root.trace.clone();
        let serve = one(&spans, &trace, "worker1", "serve seed_fns::nested_rpc")?;
        let run = one(&spans, &trace, "worker1", "run seed_fns::nested_rpc")?;
        let nested = one(&spans, &trace, "worker1", "call aten::add")?;
        let leaf_serve = one(&spans, &trace, "worker2", "serve aten::add")?;
        let leaf_run = one(&spans, &trace, "worker2", "run aten::add")?;
        ensure!(serve.kind == SpanKind::Server && serve.attributes["wasmrpc.peer"] == "worker0");
        ensure!(nested.kind == SpanKind::Client && nested.attributes["wasmrpc.peer"] == "worker2");
        child_of(serve, root)?;
        child_of(run, serve)?;
        child_of(nested, run)?;
        child_of(leaf_serve, nested)?;
        child_of(leaf_run, leaf_serve)?;
        let in_trace = spans.iter().filter(|s| s.trace == trace).count();
        ensure!(
            in_trace == 6,
            "{in_trace} spans in the nested call's trace, not 6"
        );
        for s in spans.iter().filter(|s| s.trace == trace) {
            ensure!(
                s.status
                    .as_ref()
                    .is_none_or(|(c, _)| *c != StatusCode::Error),
                "{s:#?}"
            );
        }

        // The failing chain: a second trace, failed at every level with
        // the error's kind and never its message (TRACE-3).
        let relay = spans
            .iter()
            .find(|s| s.worker == "worker0" && s.name == "call demo::relay")
            .context("worker0's relay span")?;
        ensure!(
            relay.trace != trace,
            "each call from outside a span starts its own trace"
        );
        let chain = [
            one(&spans, &relay.trace, "worker1", "serve demo::relay")?,
            one(&spans, &relay.trace, "worker1", "run demo::relay")?,
            one(&spans, &relay.trace, "worker1", "call demo::leaf")?,
            one(&spans, &relay.trace, "worker2", "serve demo::leaf")?,
            one(&spans, &relay.trace, "worker2", "run demo::leaf")?,
        ];
        let mut parent = relay;
        for s in chain {
            child_of(s, parent)?;
            parent = s;
        }
        for s in std::iter::once(relay).chain(chain) {
            ensure!(
                s.status == Some((StatusCode::Error, "ValueError".into())),
                "{} of {}: {:?}",
                s.name,
                s.worker,
                s.status
            );
        }
        for s in &spans {
            ensure!(
                !s.raw.contains(SECRET_ARGUMENT),
                "a span holds an argument: {s:#?}"
            );
        }

        // The proxy's call, made from a task spawned for the function, is a
        // child of the function's run span (TRACE-4).
        let proxy = spans
            .iter()
            .find(|s| s.worker == "worker0" && s.name == "call demo::proxy")
            .context("worker0's proxy span")?;
        let run = one(&spans, &proxy.trace, "worker1", "run demo::proxy")?;
        let invoke = one(
            &spans,
            &proxy.trace,
            "worker1",
            "call wasmrpc::_rref_local_invoke",
        )?;
        child_of(invoke, run)?;
        ensure!(invoke.attributes["wasmrpc.peer"] == "worker2");
        let served = one(
            &spans,
            &proxy.trace,
            "worker2",
            "serve wasmrpc::_rref_local_invoke",
        )?;
        child_of(served, invoke)?;
        Ok(())
    });
}

/// A hostile or foreign trace field: a malformed one is ignored (the call
/// is served as a new trace's root), a valid one is joined.
#[test]
fn a_malformed_trace_field_starts_a_new_trace_and_a_valid_one_is_joined() {
    timed(async {
        let receiver = Receiver::start().await?;
        let c = cluster(2)
            .options(with_collector(&receiver))
            .start()
            .await?;
        let send = |bytes: Vec<u8>| {
            let options = CallOptions {
                fields: vec![Field {
                    feature: "trace".into(),
                    bytes,
                }],
                ..CallOptions::new(CallKind::Sync)
            };
            let call = c
                .agent(0)
                .call("worker1", "aten::add", args![1i64, 2i64], options);
            async move { call.wait().await }
        };
        let valid = [[0xab; 16].as_slice(), &[0xcd; 8], &[1]].concat();
        let mut zero_trace = valid.clone();
        zero_trace[..16].fill(0);
        let hostile = [
            Vec::new(),
            vec![0xff; 3],
            [valid.clone(), vec![0]].concat(),
            zero_trace,
            vec![0xff; 1 << 16],
        ];
        for bytes in &hostile {
            send(bytes.clone()).await?;
        }
        send(valid).await?;
        c.shutdown().await?;
        let spans = wait_for(&receiver, 2 * (hostile.len() + 1)).await?;
        let served: Vec<_> = spans
            .iter()
            .filter(|s| s.worker == "worker1" && s.name == "serve aten::add")
            .collect();
        ensure!(served.len() == hostile.len() + 1, "{served:#?}");
        let joined: Vec<_> = served.iter().filter(|s| s.trace == [0xab; 16]).collect();
        ensure!(
            joined.len() == 1,
            "the valid context was not joined: {served:#?}"
        );
        ensure!(joined[0].parent == [0xcd; 8]);
        let roots = served.iter().filter(|s| s.parent.is_empty()).count();
        ensure!(
            roots == hostile.len(),
            "{roots} roots for {} malformed fields: {served:#?}",
            hostile.len()
        );
        // Explicit fields replace what the feature adds: worker0 recorded
        // no span of its own for these calls.
        ensure!(
            !spans.iter().any(|s| s.name == "call aten::add"),
            "{spans:#?}"
        );
        Ok(())
    });
}

/// A worker that exports nothing passes the context on unchanged
/// (TRACE-2): the callee of its nested call joins the caller's trace, as a
/// child of the caller's span.
#[test]
fn a_worker_without_a_collector_passes_the_trace_on() {
    timed(async {
        let receiver = Receiver::start().await?;
        let c = cluster(3)
            .options(with_collector(&receiver))
            .configure(|rank, o| {
                if rank == 1 {
                    o.otlp_endpoint = None;
                }
            })
            .start()
            .await?;
        c.agent(0)
            .rpc_sync("worker1", "seed_fns::nested_rpc", args!["worker2"])
            .await?;
        c.shutdown().await?;
        let spans = wait_for(&receiver, 3).await?;
        ensure!(spans.iter().all(|s| s.worker != "worker1"), "{spans:#?}");
        let root = spans
            .iter()
            .find(|s| s.worker == "worker0" && s.name == "call seed_fns::nested_rpc")
            .context("worker0's call span")?;
        let serve = one(&spans, &root.trace, "worker2", "serve aten::add")?;
        one(&spans, &root.trace, "worker2", "run aten::add")?;
        ensure!(serve.parent == root.id, "{spans:#?}");
        let in_trace = spans.iter().filter(|s| s.trace == root.trace).count();
        ensure!(
            in_trace == 3,
            "{in_trace} spans in the trace, not 3: {spans:#?}"
        );
        Ok(())
    });
}

/// A collector that takes the connection and never answers holds neither
/// calls nor the stop for long, and refused endpoints say why.
#[test]
fn a_silent_collector_holds_nothing_up_and_bad_endpoints_are_refused() {
    timed(async {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = silent.local_addr()?;
        let held = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                held.push(stream);
            }
        });
        let c = cluster(2)
            .options(RpcBackendOptions {
                otlp_endpoint: Some(format!("http://{address}")),
                ..RpcBackendOptions::default()
            })
            .start()
            .await?;
        let started = Instant::now();
        for _ in 0..50 {
            c.agent(0)
                .rpc_sync("worker1", "aten::add", args![1i64, 2i64])
                .await?;
        }
        c.shutdown().await?;
        let took = started.elapsed();
        // The stop waits for the last export at most 5 s per worker.
        ensure!(
            took < Duration::from_secs(30),
            "calls and stop took {took:?}"
        );
        held.abort();

        for (endpoint, says) in [
            ("https://127.0.0.1:4318", "the scheme must be http"),
            ("http://192.0.2.1:4318", "only a loopback collector"),
        ] {
            let e = cluster(1)
                .options(RpcBackendOptions {
                    otlp_endpoint: Some(endpoint.into()),
                    ..RpcBackendOptions::default()
                })
                .start()
                .await
                .err()
                .with_context(|| format!("{endpoint} was taken"))?;
            ensure!(format!("{e:#}").contains(says), "{endpoint}: {e:#}");
        }
        Ok(())
    });
}

/// Sampling is decided where a trace starts, and followed downstream: a
/// worker sampling nothing records none of its own traces, but records its
/// part of a trace its caller records; a ratio outside 0..=1 is refused.
#[test]
fn sampling_is_decided_where_a_trace_starts_and_followed_downstream() {
    timed(async {
        let receiver = Receiver::start().await?;
        let c = cluster(2)
            .options(with_collector(&receiver))
            .configure(|rank, o| {
                if rank == 0 {
                    o.otlp_sample_ratio = 0.0;
                }
            })
            .start()
            .await?;
        for _ in 0..20 {
            c.agent(0)
                .rpc_sync("worker1", "aten::add", args![1i64, 2i64])
                .await?;
        }
        for _ in 0..10 {
            c.agent(1)
                .rpc_sync("worker0", "aten::mul", args![3i64, 2i64])
                .await?;
        }
        c.shutdown().await?;
        let spans = wait_for(&receiver, 20).await?;
        let count = |worker: &str, name: &str| {
            spans
                .iter()
                .filter(|s| s.worker == worker && s.name == name)
                .count()
        };
        ensure!(count("worker0", "call aten::add") == 0, "{spans:#?}");
        ensure!(count("worker1", "serve aten::add") == 0, "{spans:#?}");
        ensure!(count("worker1", "call aten::mul") == 10, "{spans:#?}");
        ensure!(count("worker0", "serve aten::mul") == 10, "{spans:#?}");
        ensure!(count("worker0", "run aten::mul") == 10, "{spans:#?}");

        for ratio in [1.5, -0.1, f64::NAN] {
            let e = cluster(1)
                .options(RpcBackendOptions {
                    otlp_sample_ratio: ratio,
                    ..with_collector(&receiver)
                })
                .start()
                .await
                .err()
                .with_context(|| format!("the ratio {ratio} was taken"))?;
            ensure!(
                format!("{e:#}").contains("the OTLP sample ratio must be within 0 and 1"),
                "{ratio}: {e:#}"
            );
        }
        Ok(())
    });
}
