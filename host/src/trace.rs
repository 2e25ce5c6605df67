//! Traces across workers: every call carries a W3C trace context, and a
//! worker that exports traces records, for each call, the spans an
//! operator needs to see one call tree across the group.
//!
//! | span | where | from | to |
//! |---|---|---|---|
//! | `call FUNCTION` (client) | caller | the call leaves | its response (or failure) arrives |
//! | `serve FUNCTION` (server) | callee | the function is found | its result is ready to send |
//! | `run FUNCTION` (internal) | callee, inside `serve` | the function runs (an op, a plugin's code) | it returns |
//!
//! A call made while a function runs (a plugin calling another worker) is a
//! child of that function's `run` span, so a nested call's spans form one
//! tree across workers. Spans carry the function's name, the peer's name
//! and the call kind; a failed span's status is the error's kind.
//!
//! This module owns the trace context's wire form and the current span of
//! a task; it exports through [`otlp`]. It must not touch the calls'
//! payloads, and it reads nothing else of the call.
//!
//! Invariants:
//! - TRACE-1: the context travels as the `trace` field of a call: 16 bytes
//!   of trace id, 8 of the parent span id, 1 of flags (W3C `traceparent`,
//!   version 00, in binary). A field of another length, or with an all-zero
//!   id, is ignored: the call is served as the root of a new trace.
//! - TRACE-2: nothing is recorded or sent anywhere unless the operator
//!   named an OTLP endpoint ([`RpcBackendOptions::otlp_endpoint`](crate::RpcBackendOptions::otlp_endpoint)).
//!   A worker without one passes a context it received on to the calls its
//!   functions make, unchanged, so the tree stays whole through it.
//! - TRACE-3: spans never hold argument values or error messages (which
//!   may quote them): a failed span's status says the error's kind only.
//! - TRACE-4: a task a feature spawns for the current one
//!   ([`RpcAgent::spawn_inheriting`](crate::RpcAgent::spawn_inheriting))
//!   runs in its current span.
//! - TRACE-5: the endpoint is a plain-`http` URL on loopback
//!   ([`otlp::traces_url`]).
//! - TRACE-6: a trace is recorded or not where it starts (the worker's
//!   sample ratio, at random), and every worker after follows the
//!   context's sampled flag: a trace is whole or absent. A call of a trace
//!   not recorded builds no span; its context is passed on.

pub mod otlp;

use futures::FutureExt;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider, Span,
};

use crate::agent::{
    CallScope, Extension, Future, IncomingCall, Inherit, OutgoingCall, Run, ServeScope,
};
use crate::error::Result;
use crate::value::Payload;

/// The extension's name, and so the name of the field it sends (EXT-2).
const FIELD: &str = "trace";

/// The length of the wire form (TRACE-1).
const WIRE_LEN: usize = 16 + 8 + 1;

tokio::task_local! {
    /// The span the current task runs in: calls it makes are its children.
    static CURRENT: SpanContext;
}

/// The current task's span, if it runs in one.
fn current() -> Option<SpanContext> {
    CURRENT.try_with(SpanContext::clone).ok()
}

/// `context` as it travels (TRACE-1).
fn encode(context: &SpanContext) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(WIRE_LEN);
    bytes.extend_from_slice(&context.trace_id().to_bytes());
    bytes.extend_from_slice(&context.span_id().to_bytes());
    bytes.push(context.trace_flags().to_u8());
    bytes
}

/// The remote parent a received field names, or `None` for a field that
/// names none (TRACE-1).
fn decode(bytes: &[u8]) -> Option<SpanContext> {
    let bytes: &[u8; WIRE_LEN] = bytes.try_into().ok()?;
    let trace = TraceId::from_bytes(bytes[..16].try_into().ok()?);
    let span = SpanId::from_bytes(bytes[16..24].try_into().ok()?);
    let context = SpanContext::new(
        trace,
        span,
        // Only the sampled bit is defined; the others are reserved.
        TraceFlags::new(bytes[24]) & TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    context.is_valid().then_some(context)
}

/// The feature: propagates trace contexts, and records spans when the
/// worker exports them.
pub struct Tracing {
    exporter: Option<Exporter>,
}

/// Where this worker's spans go.
struct Exporter {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    worker: String,
    /// The share of the traces this worker starts that it records.
    sample_ratio: f64,
}

/// What a worker that exports does for one call (TRACE-6).
enum Decision {
    /// The trace is not recorded: pass this context on, record nothing.
    Skip(SpanContext),
    /// Record the call's spans under this parent, or as a new trace's
    /// root without one.
    Record(Option<SpanContext>),
}

impl Exporter {
    /// Whether the spans of a call under `parent` (none: the call starts a
    /// trace) are recorded: a trace is recorded where it starts, for
    /// `sample_ratio` of them at random, and followed downstream by the
    /// context's sampled flag (TRACE-6). Nothing of the SDK is built for a
    /// trace that is not recorded, so sampling makes tracing cheap.
    fn decide(&self, parent: Option<SpanContext>) -> Decision {
        let ids = RandomIdGenerator::default();
        match parent {
            Some(p) if p.is_sampled() => Decision::Record(Some(p)),
            Some(p) => Decision::Skip(p),
            None => {
                let draw = u64::from_be_bytes(ids.new_span_id().to_bytes());
                // `as` saturates: a ratio of 1 takes every draw.
                if self.sample_ratio >= 1.0 || draw < (self.sample_ratio * u64::MAX as f64) as u64 {
                    Decision::Record(None)
                } else {
                    Decision::Skip(SpanContext::new(
                        ids.new_trace_id(),
                        ids.new_span_id(),
                        TraceFlags::NOT_SAMPLED,
                        false,
                        TraceState::default(),
                    ))
                }
            }
        }
    }
}

impl Tracing {
    /// Propagation only: contexts received are passed on, nothing is
    /// recorded (TRACE-2).
    pub fn propagating() -> Self {
        Tracing { exporter: None }
    }

    /// Records worker `worker`'s spans and exports them to the OTLP/HTTP
    /// collector at `endpoint`: `sample_ratio` of the traces this worker
    /// starts, and its part of every trace a caller records (TRACE-6).
    ///
    /// # Errors
    /// `ValueError` for a ratio outside 0..=1, or an endpoint
    /// [`otlp::traces_url`] refuses.
    pub fn exporting(endpoint: &str, worker: &str, sample_ratio: f64) -> Result<Self> {
        if !(0.0..=1.0).contains(&sample_ratio) {
            return Err(crate::error::Error::value(format!(
                "the OTLP sample ratio must be within 0 and 1, not {sample_ratio}"
            )));
        }
        let provider = otlp::provider(endpoint, worker)?;
        let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "wasmrpc");
        Ok(Tracing {
            exporter: Some(Exporter {
                provider,
                tracer,
                worker: worker.to_owned(),
                sample_ratio,
            }),
        })
    }

    /// Starts a span named `name` of `kind` under `parent` (a root span
    /// without one).
    fn start(
        exporter: &Exporter,
        name: String,
        kind: SpanKind,
        parent: Option<&SpanContext>,
        attributes: Vec<KeyValue>,
    ) -> Span {
        let parent = match parent {
            Some(p) => Context::new().with_remote_span_context(p.clone()),
            None => Context::new(),
        };
        exporter
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&exporter.tracer, &parent)
    }
}

impl Extension for Tracing {
    fn name(&self) -> &'static str {
        FIELD
    }

    fn on_call(&self, call: &OutgoingCall<'_>) -> Option<Box<dyn CallScope>> {
        let parent = current();
        let Some(exporter) = &self.exporter else {
            return parent.map(|p| Box::new(Passed(p)) as Box<dyn CallScope>);
        };
        let parent = match exporter.decide(parent) {
            Decision::Skip(context) => return Some(Box::new(Passed(context))),
            Decision::Record(parent) => parent,
        };
        let span = Tracing::start(
            exporter,
            format!("call {}", call.function),
            SpanKind::Client,
            parent.as_ref(),
            vec![
                KeyValue::new("rpc.system", "wasmrpc"),
                KeyValue::new("rpc.method", call.function.to_owned()),
                KeyValue::new("wasmrpc.peer", call.to.name.clone()),
                KeyValue::new("wasmrpc.call_kind", call.kind.name()),
            ],
        );
        Some(Box::new(Calling(span)))
    }

    fn on_serve(&self, call: &IncomingCall<'_>) -> Option<Box<dyn ServeScope>> {
        let parent = call.field.and_then(decode);
        let Some(exporter) = &self.exporter else {
            return parent.map(|p| Box::new(Passed(p)) as Box<dyn ServeScope>);
        };
        let parent = match exporter.decide(parent) {
            Decision::Skip(context) => return Some(Box::new(Passed(context))),
            Decision::Record(parent) => parent,
        };
        let attributes = || {
            vec![
                KeyValue::new("rpc.system", "wasmrpc"),
                KeyValue::new("rpc.method", call.function.to_owned()),
                KeyValue::new("wasmrpc.peer", call.caller.name.clone()),
            ]
        };
        let serve = Tracing::start(
            exporter,
            format!("serve {}", call.function),
            SpanKind::Server,
            parent.as_ref(),
            attributes(),
        );
        let serve_context = opentelemetry::trace::Span::span_context(&serve).clone();
        let run = Tracing::start(
            exporter,
            format!("run {}", call.runs),
            SpanKind::Internal,
            Some(&serve_context),
            attributes(),
        );
        Some(Box::new(Serving {
            serve,
            run: Some(run),
        }))
    }

    fn inherit(&self) -> Option<Inherit> {
        let context = current()?;
        Some(Box::new(move |task| CURRENT.scope(context, task).boxed()))
    }

    fn stopped(&self, _agent: &crate::RpcAgent) -> Result<()> {
        if let Some(exporter) = &self.exporter {
            // Spans still queued go out now; an unreachable collector costs
            // the stop at most this long, and never fails it.
            let shutdown = || {
                exporter
                    .provider
                    .shutdown_with_timeout(std::time::Duration::from_secs(5))
            };
            // The wait must not hold a runtime thread: a task queued on it
            // (a collector in this process) would wait for the wait.
            let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
            let shut = match flavor {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                    tokio::task::block_in_place(shutdown)
                }
                _ => shutdown(),
            };
            if let Err(e) = shut {
                tracing::warn!(worker = %exporter.worker, "the last spans were not exported: {e}");
            }
        }
        Ok(())
    }
}

/// Ends `span` with the status `outcome` gives it (TRACE-3).
fn end(mut span: Span, failed: Option<&'static str>) {
    use opentelemetry::trace::Span as _;
    if let Some(kind) = failed {
        span.set_status(Status::error(kind));
    }
    span.end();
}

/// A context passed on unchanged by a worker that records nothing (TRACE-2).
struct Passed(SpanContext);

impl CallScope for Passed {
    fn field(&mut self, _id: u64) -> Option<Vec<u8>> {
        Some(encode(&self.0))
    }
}

impl ServeScope for Passed {
    fn wrap(&mut self, run: Run) -> Run {
        CURRENT.scope(self.0.clone(), run).boxed()
    }
}

/// A call leaving, in its client span.
struct Calling(Span);

impl CallScope for Calling {
    fn field(&mut self, _id: u64) -> Option<Vec<u8>> {
        Some(encode(opentelemetry::trace::Span::span_context(&self.0)))
    }

    fn sent(self: Box<Self>, call: &Future) {
        let span = self.0;
        call.add_done_callback(move |done| {
            let failed = match done.outcome() {
                Some(Err(kind)) => Some(kind.python_name()),
                _ => None,
            };
            end(span, failed);
        });
    }
}

/// A call served, in its server span, its function in a run span.
struct Serving {
    serve: Span,
    run: Option<Span>,
}

impl ServeScope for Serving {
    fn wrap(&mut self, run: Run) -> Run {
        let Some(span) = self.run.take() else {
            return run;
        };
        let context = opentelemetry::trace::Span::span_context(&span).clone();
        async move {
            let result = CURRENT.scope(context, run).await;
            end(span, failure(&result));
            result
        }
        .boxed()
    }

    fn reply_field(self: Box<Self>, result: &Result<Payload>) -> Option<Vec<u8>> {
        end(self.serve, failure(result));
        None
    }
}

fn failure(result: &Result<Payload>) -> Option<&'static str> {
    result.as_ref().err().map(|e| e.kind().python_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(flags: u8) -> SpanContext {
        SpanContext::new(
            TraceId::from_bytes([7; 16]),
            SpanId::from_bytes([9; 8]),
            TraceFlags::new(flags),
            false,
            TraceState::default(),
        )
    }

    #[test]
    fn the_wire_form_is_traceparent_in_binary_and_round_trips() {
        let bytes = encode(&context(1));
        assert_eq!(bytes.len(), WIRE_LEN);
        assert_eq!(&bytes[..16], &[7; 16]);
        assert_eq!(&bytes[16..24], &[9; 8]);
        assert_eq!(bytes[24], 1);
        let back = decode(&bytes).expect("a valid context");
        assert_eq!(back.trace_id(), TraceId::from_bytes([7; 16]));
        assert_eq!(back.span_id(), SpanId::from_bytes([9; 8]));
        assert!(back.is_sampled());
        assert!(back.is_remote());
    }

    #[test]
    fn a_trace_is_sampled_where_it_starts_and_followed_after() {
        let tracing = Tracing::exporting("http://127.0.0.1:9", "worker0", 0.25).unwrap();
        let exporter = tracing.exporter.as_ref().unwrap();
        let recorded = (0..4000)
            .filter(|_| matches!(exporter.decide(None), Decision::Record(None)))
            .count();
        // 1000 expected; the binomial's deviation is 27.
        assert!((850..=1150).contains(&recorded), "{recorded} of 4000");
        match exporter.decide(None) {
            Decision::Skip(c) => assert!(c.is_valid() && !c.is_sampled()),
            Decision::Record(None) => {}
            Decision::Record(Some(_)) => panic!("a root has no parent"),
        }
        // Downstream, the caller's flag decides, whatever the ratio.
        assert!(matches!(
            exporter.decide(Some(context(1))),
            Decision::Record(Some(_))
        ));
        assert!(matches!(exporter.decide(Some(context(0))), Decision::Skip(c) if c == context(0)));
        for ratio in [0.0, 1.0] {
            let t = Tracing::exporting("http://127.0.0.1:9", "worker0", ratio).unwrap();
            let e = t.exporter.as_ref().unwrap();
            let all = (0..100).all(|_| matches!(e.decide(None), Decision::Record(None)));
            assert_eq!(all, ratio == 1.0, "ratio {ratio}");
        }
    }

    #[test]
    fn hostile_fields_name_no_parent() {
        let good = encode(&context(1));
        // Too short, too long, empty.
        assert!(decode(&good[..24]).is_none());
        assert!(decode(&[good.clone(), vec![0]].concat()).is_none());
        assert!(decode(&[]).is_none());
        // An all-zero trace id or span id is invalid in W3C's terms.
        let mut zero_trace = good.clone();
        zero_trace[..16].fill(0);
        assert!(decode(&zero_trace).is_none());
        let mut zero_span = good.clone();
        zero_span[16..24].fill(0);
        assert!(decode(&zero_span).is_none());
        // Reserved flag bits are dropped; the sampled bit is kept as sent.
        let mut flags = good;
        flags[24] = 0xfe;
        assert_eq!(
            decode(&flags).unwrap().trace_flags(),
            TraceFlags::NOT_SAMPLED
        );
    }
}
