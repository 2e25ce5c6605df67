//! [`RpcBackendOptions`] and [`Dest`]: how an agent is configured, and how
//! a call names its destination.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::registry::FunctionRegistry;
use crate::abi::{Value, WorkerInfo};
use crate::device::{Device, DeviceMap, DeviceSpec, parse_device, to_device_map};
use crate::error::{Error, Result};
use crate::ops::OpPolicy;
use crate::tensor::budget::TensorMemoryBudget;
use crate::transport::{DEFAULT_MAX_FRAME_SIZE, FaultInjection, TlsCredentials};
pub use crate::worker::{validate_worker_name, worker_info};

/// `DEFAULT_RPC_TIMEOUT_SEC`: 60 s.
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(60);
/// `DEFAULT_NUM_WORKER_THREADS`: 16.
pub const DEFAULT_NUM_WORKER_THREADS: usize = 16;
/// The longest a reader busy-polls one wait by default
/// ([`RpcBackendOptions::busy_poll`]): above the waits of an exchange slept
/// through on a loaded VM, so that the polling that avoids the wake-ups
/// can begin. Those waits include the peer's own wake-ups: a small call's
/// round trip slept through takes 75-110 µs, and the waits of a 16x16
/// distributed autograd step slept through 100-470 µs (2026-12-03, a VM
/// phase where a thread woken after sleeping 10 µs or more took 90-150 µs
/// to run). A 200 µs window left such a step slept through in a third of
/// its runs; with 500 µs, six alternating `anatomy --call step16` pairs
/// each had the lower mean (153-257 µs against 198-652 µs) at no cost to
/// the no-op round trip or the async calls' rate.
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(500);
/// `DEFAULT_INIT_METHOD`.
pub const DEFAULT_INIT_METHOD: &str = "env://";
/// The environment variable that sets the cluster secret for every worker.
/// The environment of a process is readable only by its own user (and
/// root), unlike its command line; `wasmrpc launch` hands its workers the
/// secret it generates this way.
pub const CLUSTER_SECRET_ENV: &str = wasmrpc_credentials::secret::SECRET_ENV;

/// The agent's options (`TensorPipeRpcBackendOptions`). Their `Debug`
/// output never shows the cluster secret or a key.
#[derive(Clone)]
pub struct RpcBackendOptions {
    /// The default timeout of calls; `Duration::ZERO` means none.
    pub rpc_timeout: Duration,
    /// Reported as `agent.thread_pool_size`. Callee work runs as tasks on
    /// the agent's tokio runtime; the embedder sizes that runtime (the
    /// `wasmrpc` binary gives it this many threads).
    pub num_worker_threads: usize,
    /// How workers find each other; reported, and consulted when the rank
    /// is missing (`env://` reads `RANK`).
    pub init_method: String,
    /// The address to listen on; port 0 picks a free port.
    pub listen_addr: SocketAddr,
    /// The largest frame a peer may send, and this worker may send.
    pub max_frame_size: u64,
    /// The cluster secret every connection is authenticated with (an HMAC
    /// handshake, `transport::handshake`). `None`: the
    /// `WASMRPC_CLUSTER_SECRET` variable if set and not empty, else the file
    /// `WASMRPC_CLUSTER_SECRET_FILE` names. Credentials
    /// only ever come from the operator: nothing secret is written to or
    /// read from the store (the store is PyTorch's unauthenticated
    /// TCPStore protocol, readable by anyone who can reach it).
    ///
    /// Without credentials a worker listening on a loopback address runs
    /// **unauthenticated** (one WARN line at init: every local user can
    /// connect); one listening on any other address refuses to start unless
    /// [`insecure`](Self::insecure) is set.
    pub cluster_secret: Option<Vec<u8>>,
    /// TLS 1.3 with mutual authentication on every connection
    /// (`transport::tls`): the cluster CA's certificate, this worker's
    /// certificate (which must name it) and key. `None`: the
    /// `WASMRPC_TLS_CA`/`_CERT`/`_KEY` files if set
    /// ([`TlsCredentials::from_env`]). With TLS, a cluster secret is
    /// optional (checked inside TLS when given).
    pub tls: Option<TlsCredentials>,
    /// Let a worker without credentials listen on a non-loopback address,
    /// unauthenticated (`wasmrpc worker --insecure`); a WARN line at init
    /// says so. Off by default: such a worker refuses to start.
    pub insecure: bool,
    /// The functions this worker serves.
    pub registry: Arc<FunctionRegistry>,
    /// Faults to inject into this worker's sends (tests).
    pub faults: FaultInjection,
    /// Device maps per destination (`set_device_map`): this worker's
    /// device → the destination's device, for the tensors of requests;
    /// responses use the inverse of the caller's map. Validated at init
    /// against every worker's maps and device count (`crate::device`).
    pub device_maps: BTreeMap<String, DeviceMap>,
    /// Devices this worker uses (`set_devices`); empty: the devices its
    /// maps name.
    pub devices: Vec<Device>,
    /// How long rendezvous waits for the other workers.
    pub init_timeout: Duration,
    /// Whether peers may deploy plugins to this worker at run time
    /// (`Deploy::deploy_plugin`, the `DeployPlugin` request). Off by default:
    /// a worker runs only the code its operator started it with unless the
    /// operator opts in (`wasmrpc worker --accept-plugin-deployment`); with
    /// it off a deployment is answered with "worker X does not accept plugin
    /// deployment". Deployments only ever arrive over authenticated
    /// connections (every peer proved the cluster secret).
    pub accept_plugin_deployment: bool,
    /// How long an old version of a deployed plugin stays loaded after an
    /// upgrade or a rollback replaced it, while calls still run on it or
    /// objects of it live (it is unloaded as soon as none do); the version
    /// just replaced stays regardless, for a rollback. 60 s by default
    /// (`wasmrpc worker --plugin-drain-timeout`).
    pub plugin_drain_timeout: Duration,
    /// How long a version staged by a deployment's first phase waits for
    /// its commit before this worker drops it (a deployer that died between
    /// the phases). 600 s by default (`wasmrpc worker
    /// --plugin-stage-timeout`).
    pub plugin_stage_timeout: Duration,
    /// How much CPU tensor memory the work this worker does for its peers
    /// and plugins may hold, in all and per call (`crate::tensor::budget`);
    /// by default half and a quarter of the machine's memory. An allocation
    /// over either fails the call that asked for it with "worker1: tensor
    /// memory budget of N bytes exceeded by aten::zeros (asked M bytes)".
    pub tensor_memory: TensorMemoryBudget,
    /// Which builtin ops this worker runs for peers and plugins (its op
    /// policy; see [`OpPolicy`]). Default: [`OpPolicy::shared_default`],
    /// the tensor-computing families and nothing else; `wasmrpc worker
    /// --allow-op/--deny-op/--op-policy` build others.
    pub op_policy: Arc<OpPolicy>,
    /// Whether tensor storages of 1 MiB and more to and from workers on the
    /// same host cross in shared memory (memfds lent over a Unix socket
    /// that only the two authenticated workers share) instead of the
    /// socket; TCP stays the fallback. On by default; `wasmrpc worker
    /// --no-shared-memory` turns it off.
    pub shared_memory: bool,
    /// The longest a connection's reader keeps polling its socket for the
    /// next frame before it sleeps (`transport::tcp::busy_poll`): a wake-up
    /// from sleep costs tens of microseconds on a VM, more than a small
    /// call's own work. Within it a reader polls about twice its recent
    /// waits, and not at all when those are as long as this, or while
    /// several calls are in progress on its connection. Default
    /// [`DEFAULT_BUSY_POLL`]; zero never polls (`wasmrpc worker
    /// --busy-poll-us 0`).
    pub busy_poll: Duration,
    /// The host folders this worker's plugins may use, by plugin namespace
    /// (`wasmrpc worker --grant-dir`; see [`wasmrpc_wasm::folders`]). Empty
    /// by default: a plugin reaches no file.
    pub plugin_folders: Arc<wasmrpc_wasm::FolderGrants>,
    /// How long a peer may send nothing (no message, no heartbeat) before
    /// this worker declares it failed ([`RpcAgent::failed_workers`](crate::RpcAgent::failed_workers)):
    /// its pending calls fail at once with the cause, and so do new calls
    /// to it. Idle connections carry a heartbeat every fifth of this.
    /// `None`: no heartbeats, and a stalled peer is noticed only by each
    /// call's own timeout. Default: [`DEFAULT_FAILURE_TIMEOUT`](crate::transport::DEFAULT_FAILURE_TIMEOUT) (2 s).
    pub failure_timeout: Option<Duration>,
    /// How many times this worker's group has been restarted after a
    /// failure: 0 on a first start. `wasmrpc worker` reads it from
    /// `TORCHELASTIC_RESTART_COUNT`, which torchrun's elastic agent and
    /// `wasmrpc launch --max-restarts` set; entry functions read it
    /// ([`RpcAgent::restart_count`](crate::RpcAgent::restart_count)) to
    /// resume from a checkpoint instead of starting over.
    pub restart_count: u32,
    /// Where to serve this worker's metrics in Prometheus' text format
    /// (`http://ADDR/metrics`, `crate::metrics`); `None` (the default):
    /// no metrics are kept or served (`wasmrpc worker --metrics-addr`).
    /// A non-loopback address is refused unless
    /// [`metrics_public`](Self::metrics_public) says the operator means it.
    pub metrics_addr: Option<SocketAddr>,
    /// Allow [`metrics_addr`](Self::metrics_addr) to be an address other
    /// machines reach. The metrics name functions and workers and count
    /// calls, never argument values, but anyone who reaches the address
    /// reads them (plain HTTP, no authentication).
    pub metrics_public: bool,
    /// The OpenTelemetry collector this worker exports its spans to, over
    /// OTLP/HTTP (`http://127.0.0.1:4318`; `crate::trace`). `None` (the
    /// default): no span is recorded or sent; trace contexts received are
    /// still passed on (TRACE-2). Loopback only (TRACE-5).
    pub otlp_endpoint: Option<String>,
    /// The share of the traces this worker starts that it records and
    /// exports, 0 to 1 (default 1: every one); a call inside a trace
    /// follows its caller's choice, so traces are whole or absent.
    pub otlp_sample_ratio: f64,
}

impl std::fmt::Debug for RpcBackendOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcBackendOptions")
            .field("rpc_timeout", &self.rpc_timeout)
            .field("num_worker_threads", &self.num_worker_threads)
            .field("init_method", &self.init_method)
            .field("listen_addr", &self.listen_addr)
            .field("max_frame_size", &self.max_frame_size)
            .field(
                "cluster_secret",
                &self.cluster_secret.as_ref().map(|_| "<redacted>"),
            )
            .field("insecure", &self.insecure)
            .field("tls", &self.tls)
            .field("registry", &self.registry)
            .field("faults", &self.faults)
            .field("device_maps", &self.device_maps)
            .field("devices", &self.devices)
            .field("init_timeout", &self.init_timeout)
            .field("accept_plugin_deployment", &self.accept_plugin_deployment)
            .field("plugin_drain_timeout", &self.plugin_drain_timeout)
            .field("plugin_stage_timeout", &self.plugin_stage_timeout)
            .field("tensor_memory", &self.tensor_memory)
            .field("op_policy", &self.op_policy)
            .field("shared_memory", &self.shared_memory)
            .field("busy_poll", &self.busy_poll)
            .field("plugin_folders", &self.plugin_folders.grants())
            .field("failure_timeout", &self.failure_timeout)
            .field("restart_count", &self.restart_count)
            .field("metrics_addr", &self.metrics_addr)
            .field("metrics_public", &self.metrics_public)
            .field("otlp_endpoint", &self.otlp_endpoint)
            .field("otlp_sample_ratio", &self.otlp_sample_ratio)
            .finish()
    }
}

impl Default for RpcBackendOptions {
    fn default() -> Self {
        RpcBackendOptions {
            rpc_timeout: DEFAULT_RPC_TIMEOUT,
            num_worker_threads: DEFAULT_NUM_WORKER_THREADS,
            init_method: DEFAULT_INIT_METHOD.into(),
            listen_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_frame_size: DEFAULT_MAX_FRAME_SIZE,
            cluster_secret: None,
            insecure: false,
            tls: None,
            registry: Arc::new(FunctionRegistry::new()),
            faults: FaultInjection::new(),
            device_maps: BTreeMap::new(),
            devices: Vec::new(),
            init_timeout: Duration::from_secs(300),
            accept_plugin_deployment: false,
            plugin_drain_timeout: Duration::from_secs(60),
            plugin_stage_timeout: Duration::from_secs(600),
            tensor_memory: TensorMemoryBudget::default(),
            op_policy: OpPolicy::shared_default(),
            shared_memory: true,
            busy_poll: DEFAULT_BUSY_POLL,
            plugin_folders: Arc::default(),
            failure_timeout: Some(crate::transport::DEFAULT_FAILURE_TIMEOUT),
            restart_count: 0,
            metrics_addr: None,
            metrics_public: false,
            otlp_endpoint: None,
            otlp_sample_ratio: 1.0,
        }
    }
}

impl RpcBackendOptions {
    /// Checks that worker `name` may start with these credentials: it has a
    /// cluster secret (from [`cluster_secret`](Self::cluster_secret) or
    /// `WASMRPC_CLUSTER_SECRET`), or it listens on a loopback address, or
    /// [`insecure`](Self::insecure) is set. `init_rpc` checks the same
    /// before touching the store; the `wasmrpc` binary checks it before the
    /// rendezvous.
    ///
    /// # Errors
    /// `ValueError` saying how to create credentials when a worker would
    /// listen on a non-loopback address without any; `ValueError` for an
    /// empty secret.
    pub fn check_credentials(&self, name: &str) -> Result<()> {
        self.resolve_credentials(name).map(|_| ())
    }

    /// The operator's credentials: the secret (the options, else
    /// `WASMRPC_CLUSTER_SECRET[_FILE]`) and TLS (the options, else the
    /// environment), checked to be worker `name`'s; both `None` where
    /// running without any is allowed.
    pub(crate) fn resolve_credentials(
        &self,
        name: &str,
    ) -> Result<(Option<Vec<u8>>, Option<TlsCredentials>)> {
        let tls = match &self.tls {
            Some(t) => Some(t.clone()),
            None => TlsCredentials::from_env()?,
        };
        if let Some(t) = &tls {
            t.check_worker(name)?;
        }
        let secret = match &self.cluster_secret {
            Some(s) if s.is_empty() => {
                return Err(Error::value(format!(
                    "worker {name}: the cluster secret is empty; give a non-empty secret or none"
                )));
            }
            Some(s) => Some(s.clone()),
            None => wasmrpc_credentials::secret::secret_from_env()?,
        };
        if secret.is_some() || tls.is_some() || self.insecure || self.listen_addr.ip().is_loopback()
        {
            return Ok((secret, tls));
        }
        Err(Error::value(no_credentials_message(name, self.listen_addr)))
    }
    /// `set_device_map(to, device_map)`: maps this worker's devices to
    /// `to`'s devices for the tensors of requests to `to` (responses from
    /// `to` travel the inverse way). Calls for one destination merge.
    ///
    /// # Errors
    /// `RuntimeError` "Device index must not be negative" and other
    /// `torch.device` parse errors; `ValueError` "`set_device_map` only
    /// supports 1-to-1 mapping, trying to map A to B and C" when a source
    /// device is already mapped elsewhere; "`device_map` only supports
    /// 1-to-1 mapping ..." for two sources to one target in one call.
    /// Invalid indices and targets mapped twice across calls are found at
    /// init, where the device counts of all workers are known.
    pub fn set_device_map<K, V>(
        &mut self,
        to: &str,
        device_map: impl IntoIterator<Item = (K, V)>,
    ) -> Result<()>
    where
        K: Into<DeviceSpec>,
        V: Into<DeviceSpec>,
    {
        let full = to_device_map(device_map)?;
        if let Some(curr) = self.device_maps.get(to) {
            for (k, v) in &full {
                if let Some(prev) = curr.get(k).filter(|prev| *prev != v) {
                    return Err(Error::value(format!(
                        "`set_device_map` only supports 1-to-1 mapping, trying to map {k} to {v} and {prev}"
                    )));
                }
            }
        }
        self.device_maps.entry(to.into()).or_default().extend(full);
        Ok(())
    }

    /// `set_devices(devices)`: the devices this worker uses.
    ///
    /// # Errors
    /// `torch.device` parse errors.
    pub fn set_devices<D: Into<DeviceSpec>>(
        &mut self,
        devices: impl IntoIterator<Item = D>,
    ) -> Result<()> {
        self.devices = devices
            .into_iter()
            .map(parse_device)
            .collect::<Result<_>>()?;
        Ok(())
    }
}

/// The refusal of a worker that would listen beyond this machine without
/// credentials: says how to create them.
fn no_credentials_message(name: &str, listen: SocketAddr) -> String {
    format!(
        "worker {name} would listen on {listen}, which is not a loopback address, without \
         credentials: anyone who can reach it could call its functions. Give every worker TLS \
         credentials (`wasmrpc cert init --out ca/` once, `wasmrpc cert issue {name} --ca ca/ \
         --out certs/` per worker, then `--tls-ca ca/ca.pem --tls-cert certs/{name}.pem \
         --tls-key certs/{name}.key`), or the same secret (e.g. `head -c 32 /dev/urandom | \
         base64 > secret; chmod 600 secret`, then `--cluster-secret-file secret`, or the \
         {CLUSTER_SECRET_ENV} variable), or pass --insecure to run unauthenticated anyway"
    )
}

/// A call's destination: a name, a rank or a `WorkerInfo`
/// (`_to_worker_info`).
#[derive(Clone, Debug, PartialEq)]
pub enum Dest {
    /// A worker name.
    Name(String),
    /// A rank (negative ranks are unknown destinations).
    Rank(i64),
    /// A worker info.
    Info(WorkerInfo),
    /// Something that names no worker (e.g. a float); resolving it is a
    /// `ValueError`.
    Invalid(String),
}

impl From<&str> for Dest {
    fn from(v: &str) -> Self {
        Dest::Name(v.into())
    }
}
impl From<String> for Dest {
    fn from(v: String) -> Self {
        Dest::Name(v)
    }
}
impl From<&String> for Dest {
    fn from(v: &String) -> Self {
        Dest::Name(v.clone())
    }
}
impl From<WorkerInfo> for Dest {
    fn from(v: WorkerInfo) -> Self {
        Dest::Info(v)
    }
}
impl From<&WorkerInfo> for Dest {
    fn from(v: &WorkerInfo) -> Self {
        Dest::Info(v.clone())
    }
}
impl From<u32> for Dest {
    fn from(v: u32) -> Self {
        Dest::Rank(v.into())
    }
}
impl From<i32> for Dest {
    fn from(v: i32) -> Self {
        Dest::Rank(v.into())
    }
}
impl From<i64> for Dest {
    fn from(v: i64) -> Self {
        Dest::Rank(v)
    }
}
impl From<usize> for Dest {
    fn from(v: usize) -> Self {
        Dest::Rank(v as i64)
    }
}
impl From<f64> for Dest {
    fn from(v: f64) -> Self {
        Dest::Invalid(format!("{v}"))
    }
}
impl From<&Value> for Dest {
    fn from(v: &Value) -> Self {
        match v {
            Value::Str(s) => Dest::Name(s.clone()),
            Value::Int(i) => Dest::Rank(*i),
            Value::WorkerInfo(w) => Dest::Info(w.clone()),
            Value::Float(f) => Dest::Invalid(format!("{f}")),
            other => Dest::Invalid(format!("{other:?}")),
        }
    }
}
impl From<Value> for Dest {
    fn from(v: Value) -> Self {
        Dest::from(&v)
    }
}

#[cfg(test)]
mod credential_tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_the_secret_or_a_key() {
        let ca = crate::CertificateAuthority::generate().unwrap();
        let o = RpcBackendOptions {
            cluster_secret: Some(b"hunter2-secret".to_vec()),
            tls: Some(ca.credentials_for("worker0").unwrap()),
            ..RpcBackendOptions::default()
        };
        let shown = format!("{o:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("104, 117"), "{shown}"); // "hu" as bytes
        assert!(!shown.contains("PRIVATE"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn no_credentials_are_refused_off_loopback_unless_insecure() {
        let o = RpcBackendOptions {
            listen_addr: "0.0.0.0:0".parse().unwrap(),
            ..RpcBackendOptions::default()
        };
        // The test process has no WASMRPC_CLUSTER_SECRET or WASMRPC_TLS_*.
        let e = o.check_credentials("w").unwrap_err();
        assert!(e.message().contains("not a loopback address"), "{e}");
        let insecure = RpcBackendOptions {
            insecure: true,
            ..o.clone()
        };
        insecure.check_credentials("w").unwrap();
        let with_secret = RpcBackendOptions {
            cluster_secret: Some(b"s".to_vec()),
            ..o.clone()
        };
        with_secret.check_credentials("w").unwrap();
        let empty = RpcBackendOptions {
            cluster_secret: Some(Vec::new()),
            ..o
        };
        assert!(empty.check_credentials("w").is_err());
        // TLS credentials must name the worker.
        let ca = crate::CertificateAuthority::generate().unwrap();
        let tls = RpcBackendOptions {
            tls: Some(ca.credentials_for("w").unwrap()),
            ..RpcBackendOptions::default()
        };
        tls.check_credentials("w").unwrap();
        assert!(tls.check_credentials("other").is_err());
    }
}
