//! Export over OTLP/HTTP (protobuf): the endpoint an operator names, the
//! provider that batches a worker's spans, and the HTTP client that posts
//! them.
//!
//! The exporter is `opentelemetry-otlp`'s; the client is ours, over the
//! hyper the metrics endpoint already uses, because the SDK exports from
//! its own thread (no tokio runtime there) and the crate's clients would
//! compile a second HTTP stack. Each export runs on a small runtime of its
//! own on that thread, so a worker's runtime is never blocked by it.
//!
//! Endpoints are loopback only (TRACE-5): spans name workers and
//! functions, and this client has no TLS; a collector on another machine is
//! reached through an OpenTelemetry Collector running beside the worker,
//! as the Collector's agent deployment does.

use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full, Limited};
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

use crate::error::{Error, Result};

/// How long one export may take, connection included.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest response a collector may send back (it is read and dropped).
const MAX_RESPONSE: usize = 1 << 20;

/// The OTLP/HTTP traces URL for the endpoint an operator named: a base URL
/// (`http://127.0.0.1:4318`) gets OTLP's `/v1/traces` path, a URL with a
/// path is taken as is.
///
/// # Errors
/// `ValueError` for a URL that does not parse, a scheme other than `http`,
/// or a host that is not loopback (TRACE-5).
pub fn traces_url(endpoint: &str) -> Result<Uri> {
    let bad = |why: &str| Error::value(format!("OTLP endpoint {endpoint:?}: {why}"));
    let uri: Uri = endpoint
        .parse()
        .map_err(|e| bad(&format!("not a URL ({e})")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(bad(&format!(
                "the scheme must be http, not {other} (spans go to a collector on this machine, which forwards them)"
            )));
        }
        None => return Err(bad("give the scheme, e.g. http://127.0.0.1:4318")),
    }
    let host = uri.host().ok_or_else(|| bad("no host"))?;
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return Err(bad(
            "only a loopback collector is taken (spans name workers and functions, and are sent without TLS); run an OpenTelemetry Collector beside the worker to forward them",
        ));
    }
    if uri.port_u16().is_none() {
        return Err(bad("give the port (OTLP/HTTP's is 4318)"));
    }
    if matches!(uri.path(), "" | "/") {
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or(host);
        return format!("http://{authority}/v1/traces")
            .parse()
            .map_err(|e| bad(&format!("not a URL ({e})")));
    }
    Ok(uri)
}

/// A provider exporting worker `worker`'s spans to `endpoint`, in batches
/// from the SDK's own thread. It records every span it is asked for: the
/// sampling decision is the caller's (TRACE-6, `trace::Exporter::decide`).
///
/// # Errors
/// An endpoint [`traces_url`] refuses, or the exporter's own refusal.
pub(crate) fn provider(endpoint: &str, worker: &str) -> Result<SdkTracerProvider> {
    let url = traces_url(endpoint)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.to_string())
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(LoopbackClient)
        .build()
        .map_err(|e| Error::value(format!("OTLP endpoint {endpoint:?}: {e}")))?;
    let resource = Resource::builder()
        .with_service_name("wasmrpc")
        .with_attribute(opentelemetry::KeyValue::new(
            "service.instance.id",
            worker.to_owned(),
        ))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_sampler(Sampler::AlwaysOn)
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Posts one request at a time over HTTP/1.1 to a loopback collector.
#[derive(Debug)]
struct LoopbackClient;

#[async_trait::async_trait]
impl HttpClient for LoopbackClient {
    async fn send_bytes(
        &self,
        request: Request<Bytes>,
    ) -> std::result::Result<Response<Bytes>, HttpError> {
        // The SDK calls this on its export thread, outside any runtime
        // (the module docs).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async {
            tokio::time::timeout(EXPORT_TIMEOUT, post(request))
                .await
                .map_err(|_| format!("no answer from the collector in {EXPORT_TIMEOUT:?}"))?
        })
    }
}

async fn post(request: Request<Bytes>) -> std::result::Result<Response<Bytes>, HttpError> {
    let uri = request.uri().clone();
    let host = uri.host().ok_or("the OTLP URL has no host")?;
    let port = uri.port_u16().ok_or("the OTLP URL has no port")?;
    let stream =
        tokio::net::TcpStream::connect((host.trim_start_matches('[').trim_end_matches(']'), port))
            .await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let driver = tokio::spawn(connection);
    let (mut parts, body) = request.into_parts();
    parts.uri = uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .parse()?;
    if let Some(authority) = uri.authority() {
        parts
            .headers
            .insert(http::header::HOST, authority.as_str().parse()?);
    }
    let response = sender
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?;
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, MAX_RESPONSE).collect().await?.to_bytes();
    driver.abort();
    Ok(Response::from_parts(parts, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_gets_the_traces_path_and_a_full_one_is_kept() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap().to_string(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://localhost:4318/").unwrap().to_string(),
            "http://localhost:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://[::1]:9/custom/traces")
                .unwrap()
                .to_string(),
            "http://[::1]:9/custom/traces"
        );
    }

    #[test]
    fn endpoints_other_than_a_loopback_http_url_are_refused() {
        for (endpoint, says) in [
            (
                "https://127.0.0.1:4318",
                "the scheme must be http, not https",
            ),
            ("127.0.0.1:4318", "give the scheme"),
            ("http://10.0.0.7:4318", "only a loopback collector"),
            ("http://collector.example:4318", "only a loopback collector"),
            ("http://127.0.0.1", "give the port"),
            ("http://127.0.0.1:4318 extra", "not a URL"),
            ("", "not a URL"),
        ] {
            let e = traces_url(endpoint).expect_err(endpoint).to_string();
            assert!(e.contains(says), "{endpoint}: {e}");
            assert!(e.starts_with("ValueError"), "{endpoint}: {e}");
        }
    }
}
