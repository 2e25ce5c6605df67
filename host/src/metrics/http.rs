//! The `/metrics` endpoint: plain HTTP/1.1 (hyper), `GET /metrics` only.
//!
//! Invariants:
//! - MET-4: a non-loopback address is refused unless the operator said
//!   so ([`RpcBackendOptions::metrics_public`](crate::RpcBackendOptions::metrics_public)).
//! - MET-5: a client gets what it asked for or an error status, never the
//!   worker's attention for long: a request's head must arrive within
//!   [`HEADER_TIMEOUT`] and its connection closes after one answer; at
//!   most [`MAX_CLIENTS`] connections are served at once (others wait in
//!   the listener's backlog). Anything but `GET` or `HEAD` of `/metrics` is
//!   answered 404 or 405.
//! - MET-6: the endpoint stops when its agent stops.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::{info, warn};

use crate::RpcAgent;
use crate::error::{Error, Result};

/// How long a client has to send its request's head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How many clients are served at once.
pub const MAX_CLIENTS: usize = 16;

/// The content type of Prometheus' text format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// An agent's endpoint, if it serves one (agent state).
#[derive(Default)]
pub struct Endpoint {
    inner: Mutex<Option<(SocketAddr, watch::Sender<bool>)>>,
}

impl Endpoint {
    /// The address it serves on.
    pub fn address(&self) -> Option<SocketAddr> {
        self.lock().as_ref().map(|(addr, _)| *addr)
    }

    pub(crate) fn stop(&self) {
        if let Some((_, stop)) = self.lock().take() {
            let _ = stop.send(true);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(SocketAddr, watch::Sender<bool>)>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running endpoint, as [`serve`] returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsServer {
    /// Where it listens (the port chosen when the address's was 0).
    pub addr: SocketAddr,
}

/// Serves `agent`'s metrics at `http://addr/metrics` until the agent
/// stops. `public` allows an address other than loopback (MET-4).
///
/// # Errors
/// A non-loopback `addr` without `public`, or an address that cannot be
/// bound; each names the worker and the address.
pub async fn serve(agent: &RpcAgent, addr: SocketAddr, public: bool) -> Result<MetricsServer> {
    let worker = agent.name().to_owned();
    if !addr.ip().is_loopback() && !public {
        return Err(Error::value(format!(
            "worker {worker}: metrics on {addr}, which is not a loopback address: anyone who \
             reaches it reads them (plain HTTP, no authentication); say so with \
             --metrics-public (RpcBackendOptions::metrics_public) or use 127.0.0.1"
        )));
    }
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        Error::runtime(format!(
            "worker {worker}: cannot serve metrics on {addr}: {e}"
        ))
    })?;
    let bound = listener.local_addr().map_err(|e| {
        Error::runtime(format!(
            "worker {worker}: the metrics listener has no address: {e}"
        ))
    })?;
    let (stop_tx, mut stop) = watch::channel(false);
    let endpoint = agent.state::<Endpoint>();
    if let Some((old, _)) = endpoint.lock().replace((bound, stop_tx)) {
        warn!("worker {worker}: metrics moved from {old} to {bound}");
    }
    info!("worker {worker}: metrics on http://{bound}/metrics");
    let agent = agent.clone();
    let clients = Arc::new(Semaphore::new(MAX_CLIENTS));
    agent.runtime_handle().spawn(async move {
        loop {
            let permit = tokio::select! {
                _ = stop.changed() => break,
                permit = clients.clone().acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let stream = tokio::select! {
                _ = stop.changed() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        warn!("metrics endpoint: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let agent = agent.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    let agent = agent.clone();
                    async move { Ok::<_, Infallible>(answer(&agent, &request)) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(false)
                    .max_buf_size(16 * 1024)
                    .serve_connection(TokioIo::new(stream), service);
                // A client that goes away or sends garbage is its own
                // problem; hyper answered it 400 if it could.
                let _ = tokio::time::timeout(HEADER_TIMEOUT * 2, connection).await;
                drop(permit);
            });
        }
    });
    Ok(MetricsServer { addr: bound })
}

/// The answer to one request.
fn answer(agent: &RpcAgent, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let status = |code: StatusCode, text: &'static str| {
        let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
        *response.status_mut() = code;
        response
    };
    if request.uri().path() != "/metrics" {
        return status(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics\n",
        );
    }
    let head = match *request.method() {
        Method::GET => false,
        Method::HEAD => true,
        _ => {
            let mut response = status(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics only\n");
            response.headers_mut().insert(
                hyper::header::ALLOW,
                hyper::header::HeaderValue::from_static("GET, HEAD"),
            );
            return response;
        }
    };
    let text = super::render(agent);
    let body = match head {
        true => Bytes::new(),
        false => Bytes::from(text),
    };
    let mut response = Response::new(Full::new(body));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(CONTENT_TYPE),
    );
    response
}
