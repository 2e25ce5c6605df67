//! Backends: the [`CollectiveBackend`] trait a process group dispatches to,
//! the process-wide registry of backend names and constructors
//! ([`Backend`], PyTorch's `dist.Backend`), and [`BackendConfig`], the
//! `"cpu:gloo,cuda:nccl"` device-to-backend map.
//!
//! The registry knows PyTorch's built-in names (`gloo`, `nccl`, `ucc`,
//! `mpi`): `gloo` is libtorch's `ProcessGroupGloo` and `nccl` libtorch's
//! `ProcessGroupNCCL` ([`crate::engine`]; nccl only in a CUDA build), `ucc`
//! and `mpi` are never available. `tcp` ([`crate::tcp`]) is this crate's own
//! TCP backend, usable by name but not one of PyTorch's. Plugins (PyTorch's
//! `Backend.register_backend`) add a name and a constructor. This module owns names, availability and construction;
//! it knows nothing of group membership or the wire.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use tch::Tensor;
use wasmrpc_store::Store;

use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;

/// What a backend needs to know about the collective it runs.
#[derive(Debug, Clone)]
pub struct OpContext {
    /// The collective's name as the user called it (`"all_reduce"`, ...).
    pub op: &'static str,
    /// The group's sequence number for this collective: equal on every
    /// member, so backends can match messages of one collective.
    pub seq: u64,
    /// Distinguishes the sub-operations of one collective (the tensors of a
    /// coalesced call).
    pub sub: u32,
    /// How long to wait for peers.
    pub timeout: Duration,
    /// The group's name, for error messages.
    pub group: Arc<str>,
}

impl OpContext {
    /// The same collective's `sub`-th part.
    pub fn part(&self, sub: u32) -> OpContext {
        OpContext {
            sub,
            ..self.clone()
        }
    }
}

/// A collective communication backend for one process group (PyTorch's
/// `c10d::Backend`, the per-device object a `ProcessGroup` dispatches to).
///
/// Tensors arrive as shallow clones of the caller's: writing into an output
/// (`copy_`) is how results reach the caller. Inputs are validated (dtypes,
/// ranks) by [`crate::World`] before a backend sees them. Every method that
/// a backend does not implement fails with [`Error::Unsupported`].
#[async_trait::async_trait]
pub trait CollectiveBackend: Send + Sync + fmt::Debug {
    /// The backend's name (`getBackendName()`, e.g. `"gloo"`).
    fn name(&self) -> String;
    /// This worker's rank in the group.
    fn rank(&self) -> usize;
    /// The group's size.
    fn size(&self) -> usize;

    /// Copies `root`'s tensors into everyone's.
    async fn broadcast(&self, ctx: &OpContext, tensors: Vec<Tensor>, root: usize) -> Result<()> {
        let _ = (tensors, root);
        Err(self.unsupported(ctx))
    }
    /// Reduces every rank's tensors into everyone's.
    async fn allreduce(&self, ctx: &OpContext, tensors: Vec<Tensor>, op: ReduceOp) -> Result<()> {
        let _ = (tensors, op);
        Err(self.unsupported(ctx))
    }
    /// [`Self::allreduce`] of several tensors as one flat buffer.
    async fn allreduce_coalesced(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        op: ReduceOp,
    ) -> Result<()> {
        let flat: Vec<Tensor> = tensors.iter().map(|t| t.reshape([-1])).collect();
        let buffer = Tensor::f_cat(&flat, 0).map_err(|e| self.tensor_error(ctx, e))?;
        self.allreduce(ctx, vec![buffer.shallow_clone()], op)
            .await?;
        let mut offset = 0;
        for mut t in tensors {
            let n = t.numel() as i64;
            let part = buffer.narrow(0, offset, n).view(t.size().as_slice());
            t.f_copy_(&part).map_err(|e| self.tensor_error(ctx, e))?;
            offset += n;
        }
        Ok(())
    }
    /// Reduces every rank's tensors into `root`'s.
    async fn reduce(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let _ = (tensors, root, op);
        Err(self.unsupported(ctx))
    }
    /// `outputs[i][r]` receives rank `r`'s `inputs[i]`.
    async fn allgather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        let _ = (outputs, inputs);
        Err(self.unsupported(ctx))
    }
    /// Like [`Self::allgather`], only `root` receives.
    async fn gather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
        root: usize,
    ) -> Result<()> {
        let _ = (outputs, inputs, root);
        Err(self.unsupported(ctx))
    }
    /// Rank `r`'s `outputs[i]` receives `root`'s `inputs[i][r]`.
    async fn scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        root: usize,
    ) -> Result<()> {
        let _ = (outputs, inputs, root);
        Err(self.unsupported(ctx))
    }
    /// Rank `r`'s `outputs[i]` receives the reduction of every rank's
    /// `inputs[i][r]`.
    async fn reduce_scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        op: ReduceOp,
    ) -> Result<()> {
        let _ = (outputs, inputs, op);
        Err(self.unsupported(ctx))
    }
    /// Splits `input` along dim 0 (`input_split` rows per rank, equal parts
    /// when empty) and sends part `r` to rank `r`; `output` receives the
    /// parts of every rank, in rank order (`output_split` rows each).
    async fn alltoall_base(
        &self,
        ctx: &OpContext,
        output: Tensor,
        input: Tensor,
        output_split: Vec<i64>,
        input_split: Vec<i64>,
    ) -> Result<()> {
        let _ = (output, input, output_split, input_split);
        Err(self.unsupported(ctx))
    }
    /// Rank `r`'s `outputs[s]` receives rank `s`'s `inputs[r]`.
    async fn alltoall(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        let _ = (outputs, inputs);
        Err(self.unsupported(ctx))
    }
    /// [`Self::alltoall`] through [`Self::alltoall_base`], for an engine
    /// that has only the single-tensor form (libtorch 2.11's Gloo): each
    /// side's list packed into one 1-D tensor, the element counts as splits,
    /// the received parts copied back.
    async fn alltoall_through_base(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        let flat: Vec<Tensor> = inputs.iter().map(|t| t.reshape([-1])).collect();
        let packed_in = Tensor::f_cat(&flat, 0).map_err(|e| self.tensor_error(ctx, e))?;
        let out_split: Vec<i64> = outputs.iter().map(|t| t.numel() as i64).collect();
        let in_split: Vec<i64> = inputs.iter().map(|t| t.numel() as i64).collect();
        let Some(first) = outputs.first() else {
            return Ok(());
        };
        let options = (first.kind(), first.device());
        let packed_out = Tensor::f_empty([out_split.iter().sum::<i64>()], options)
            .map_err(|e| self.tensor_error(ctx, e))?;
        self.alltoall_base(
            ctx,
            packed_out.shallow_clone(),
            packed_in,
            out_split.clone(),
            in_split,
        )
        .await?;
        let mut offset = 0;
        for (mut out, n) in outputs.into_iter().zip(out_split) {
            let part = packed_out.narrow(0, offset, n).view(out.size().as_slice());
            out.f_copy_(&part).map_err(|e| self.tensor_error(ctx, e))?;
            offset += n;
        }
        Ok(())
    }
    /// Returns once every rank has entered the barrier.
    async fn barrier(&self, ctx: &OpContext) -> Result<()> {
        Err(self.unsupported(ctx))
    }
    /// Sends `tensors` to group rank `dst`, matched with `dst`'s `recv` of
    /// the same tag.
    async fn send(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        dst: usize,
        tag: u64,
    ) -> Result<()> {
        let _ = (tensors, dst, tag);
        Err(self.unsupported(ctx))
    }
    /// Receives into `tensors` from group rank `src`.
    async fn recv(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        src: usize,
        tag: u64,
    ) -> Result<()> {
        let _ = (tensors, src, tag);
        Err(self.unsupported(ctx))
    }
    /// Releases connections; operations still waiting fail promptly.
    fn shutdown(&self) {}

    /// Whether an operation's future, once polled (which issues it),
    /// completes without being polled again: the backend's own threads do
    /// the work and the future only reports the outcome. [`crate::Work`]
    /// then waits for it on the caller's task instead of spawning it, which
    /// saves a thread hop per operation. Default `false` (the future is
    /// spawned); libtorch's engines say `true`.
    fn completes_without_polling(&self) -> bool {
        false
    }

    /// The error for an operation this backend lacks.
    fn unsupported(&self, ctx: &OpContext) -> Error {
        Error::Unsupported {
            backend: self.name(),
            op: ctx.op.to_owned(),
        }
    }
    /// A tensor error inside `ctx`'s collective, with context.
    fn tensor_error(&self, ctx: &OpContext, source: tch::TchError) -> Error {
        Error::Tensor {
            rank: self.rank(),
            group: ctx.group.to_string(),
            op: ctx.op.to_owned(),
            source,
        }
    }
}

/// What a backend constructor receives (PyTorch's creator arguments
/// `store, group_rank, group_size, timeout`, plus the group's name).
#[derive(Debug, Clone)]
pub struct BackendArgs {
    /// The group's store, already prefixed for this group and backend.
    pub store: Arc<dyn Store>,
    /// This worker's rank in the group.
    pub group_rank: usize,
    /// The group's size.
    pub group_size: usize,
    /// The group's timeout.
    pub timeout: Duration,
    /// The group's name (for error messages).
    pub group_name: String,
}

/// A future returned by a [`BackendCreator`].
pub type BackendFuture = Pin<Box<dyn Future<Output = Result<Arc<dyn CollectiveBackend>>> + Send>>;

/// A backend constructor (PyTorch's `creator_fn`).
pub type BackendCreator = Arc<dyn Fn(BackendArgs) -> BackendFuture + Send + Sync>;

/// A registered plugin backend (`Backend._plugins[NAME]`).
#[derive(Clone)]
pub struct BackendPlugin {
    /// The constructor given to [`Backend::register_backend`].
    pub creator_fn: BackendCreator,
    /// The devices it serves (`"cpu"`, `"cuda"`).
    pub devices: Vec<String>,
}

impl fmt::Debug for BackendPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendPlugin")
            .field("devices", &self.devices)
            .finish_non_exhaustive()
    }
}

static PLUGINS: LazyLock<RwLock<BTreeMap<String, BackendPlugin>>> =
    LazyLock::new(|| RwLock::new(BTreeMap::new()));

/// Backend names and the plugin registry (PyTorch's `dist.Backend`).
///
/// Names are lower case; [`Backend::parse`] accepts any case.
#[derive(Debug)]
pub struct Backend;

impl Backend {
    /// `Backend.UNDEFINED`.
    pub const UNDEFINED: &'static str = "undefined";
    /// `Backend.GLOO`: libtorch's `ProcessGroupGloo` ([`crate::engine`]).
    pub const GLOO: &'static str = "gloo";
    /// `Backend.NCCL`: libtorch's `ProcessGroupNCCL` ([`crate::engine`]),
    /// available in a CUDA build only.
    pub const NCCL: &'static str = "nccl";
    /// This crate's own TCP backend ([`crate::tcp`]); not a PyTorch name, so
    /// not in [`Backend::backend_list`].
    pub const TCP: &'static str = "tcp";
    /// `Backend.UCC` (known name, not available).
    pub const UCC: &'static str = "ucc";
    /// `Backend.MPI` (known name, not available).
    pub const MPI: &'static str = "mpi";

    const BUILT_IN: [&'static str; 5] = [
        Self::UNDEFINED,
        Self::GLOO,
        Self::NCCL,
        Self::UCC,
        Self::MPI,
    ];

    /// `Backend(name)`: the lower-case name.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty name.
    pub fn parse(name: &str) -> Result<String> {
        if name.is_empty() {
            return Err(Error::InvalidArgument(
                "Backend name must be a string".into(),
            ));
        }
        Ok(name.to_lowercase())
    }

    /// `Backend.NAME` for a built-in or registered name (`Backend::attr("DUMMY")`
    /// is `Some("dummy")` once "dummy" is registered).
    pub fn attr(upper: &str) -> Option<String> {
        let lower = upper.to_lowercase();
        if upper != upper.to_uppercase() {
            return None;
        }
        if Self::BUILT_IN.contains(&lower.as_str()) || plugins().contains_key(upper) {
            Some(lower)
        } else {
            None
        }
    }

    /// `Backend.backend_list`: the built-in names, then registered plugins.
    pub fn backend_list() -> Vec<String> {
        let mut list: Vec<String> = Self::BUILT_IN.iter().map(|s| (*s).to_owned()).collect();
        list.extend(plugins().keys().map(|k| k.to_lowercase()));
        list
    }

    /// `Backend.backend_capability[name]`: the devices a backend serves.
    pub fn capability(name: &str) -> Option<Vec<String>> {
        let devices: &[&str] = match name {
            Self::GLOO | Self::UCC | Self::MPI | Self::TCP => &["cpu", "cuda"],
            Self::NCCL => &["cuda"],
            _ => {
                return plugins()
                    .get(&name.to_uppercase())
                    .map(|p| p.devices.clone());
            }
        };
        Some(devices.iter().map(|d| (*d).to_owned()).collect())
    }

    /// `Backend.register_backend(name, func, devices=...)`: makes `name`
    /// usable in `init_process_group`, `new_group` and [`BackendConfig`].
    /// `devices` defaults to cpu and cuda.
    ///
    /// Registering a plugin name again replaces it: in PyTorch the class
    /// attribute makes that an error, but one Rust process may hold many
    /// independent tests that each register their plugin.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "{NAME} c10d backend already exist" for a
    /// built-in name.
    pub fn register_backend(
        name: &str,
        creator_fn: BackendCreator,
        devices: Option<&[&str]>,
    ) -> Result<()> {
        let upper = name.to_uppercase();
        if Self::BUILT_IN.contains(&name.to_lowercase().as_str()) {
            return Err(Error::InvalidArgument(format!(
                "{upper} c10d backend already exist"
            )));
        }
        let devices = devices
            .unwrap_or(&["cpu", "cuda"])
            .iter()
            .map(|d| (*d).to_owned())
            .collect();
        PLUGINS.write().unwrap_or_else(|e| e.into_inner()).insert(
            upper,
            BackendPlugin {
                creator_fn,
                devices,
            },
        );
        Ok(())
    }

    /// `Backend._plugins[NAME]`.
    pub fn plugin(upper: &str) -> Option<BackendPlugin> {
        plugins().get(upper).cloned()
    }

    /// The constructor for `name`: gloo, nccl (when available), tcp, or a
    /// plugin.
    ///
    /// # Errors
    /// [`Error::Runtime`] for a known but unavailable backend or an unknown
    /// name.
    pub(crate) fn creator(name: &str) -> Result<BackendCreator> {
        match name {
            Self::GLOO => Ok(Arc::new(|args| Box::pin(crate::engine::create_gloo(args)))),
            Self::NCCL if is_nccl_available() => {
                Ok(Arc::new(|args| Box::pin(crate::engine::create_nccl(args))))
            }
            Self::TCP => Ok(Arc::new(|args| Box::pin(crate::tcp::create(args)))),
            Self::NCCL | Self::UCC | Self::MPI => Err(Error::Runtime(format!(
                "Distributed package doesn't have {} built in",
                name.to_uppercase()
            ))),
            _ => Self::plugin(&name.to_uppercase())
                .map(|p| p.creator_fn)
                .ok_or_else(|| Error::Runtime(format!("Invalid backend: '{name}'"))),
        }
    }
}

fn plugins() -> std::sync::RwLockReadGuard<'static, BTreeMap<String, BackendPlugin>> {
    PLUGINS.read().unwrap_or_else(|e| e.into_inner())
}

/// `dist.is_backend_available(name)`: gloo, nccl in a CUDA build, tcp, or a
/// registered plugin.
pub fn is_backend_available(name: &str) -> bool {
    match name.to_lowercase().as_str() {
        Backend::GLOO => is_gloo_available(),
        Backend::NCCL => is_nccl_available(),
        Backend::UCC => is_ucc_available(),
        Backend::MPI => is_mpi_available(),
        Backend::TCP => true,
        other => plugins().contains_key(&other.to_uppercase()),
    }
}

/// `dist.is_gloo_available()`: always (libtorch's `ProcessGroupGloo` is
/// compiled into every build).
pub fn is_gloo_available() -> bool {
    true
}

/// `dist.is_nccl_available()`: whether this build compiled libtorch's
/// `ProcessGroupNCCL` in (a CUDA libtorch with NCCL's headers). It says
/// nothing of whether a GPU is present, as in PyTorch.
pub fn is_nccl_available() -> bool {
    crate::engine::nccl_compiled()
}

/// `dist.is_ucc_available()`: never.
pub fn is_ucc_available() -> bool {
    false
}

/// `dist.is_mpi_available()`: never.
pub fn is_mpi_available() -> bool {
    false
}

/// Which backend serves which device type (PyTorch's `BackendConfig`);
/// `Display` gives `"cpu:gloo,cuda:nccl"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendConfig {
    map: Vec<(String, String)>,
}

impl BackendConfig {
    /// Parses a backend string as PyTorch does: `undefined` (the default:
    /// gloo on cpu, nccl on cuda if available and a GPU is present,
    /// otherwise gloo), a known
    /// name (its devices), `device:backend` pairs (in order), or any other
    /// single name (cpu and cuda).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a malformed pair (such as a trailing
    /// comma) or a device named twice.
    pub fn new(backend: &str) -> Result<Self> {
        let lower = backend.to_lowercase();
        let map = if lower == Backend::UNDEFINED {
            // As PyTorch, which picks the accelerator's backend only when
            // there is an accelerator: ProcessGroupNCCL refuses to be
            // constructed without a GPU.
            // Asking whether CUDA is loaded loads it where a device is
            // present: before libtorch's own device query.
            let cuda = if is_nccl_available()
                && wasmrpc_torch_sys::cuda::is_loaded()
                && tch::Cuda::is_available()
            {
                Backend::NCCL
            } else {
                Backend::GLOO
            };
            vec![
                ("cpu".to_owned(), Backend::GLOO.to_owned()),
                ("cuda".to_owned(), cuda.to_owned()),
            ]
        } else if let Some(devices) = Backend::capability(&lower) {
            devices.into_iter().map(|d| (d, lower.clone())).collect()
        } else if lower.contains(':') {
            let usage = format!(
                "The custom backend string argument is invalid: {backend}. Custom backend string \
                 is an experimental feature where the backend string must be in the format: \
                 \"<device_type1>:<backend1>,<device_type2>:<backend2>...\". e.g. 'cpu:gloo,cuda:nccl'"
            );
            let mut map: Vec<(String, String)> = Vec::new();
            for pair in lower.split(',') {
                let parts: Vec<&str> = pair.split(':').collect();
                let [device, name] = parts.as_slice() else {
                    return Err(Error::InvalidArgument(format!(
                        "Invalid device:backend pairing: {pair}. {usage}"
                    )));
                };
                if map.iter().any(|(d, _)| d == device) {
                    return Err(Error::InvalidArgument(format!(
                        "Duplicate device type {device} in backend string: {backend}. {usage}"
                    )));
                }
                map.push(((*device).to_owned(), Backend::parse(name)?));
            }
            map
        } else {
            let name = Backend::parse(&lower)?;
            vec![("cpu".to_owned(), name.clone()), ("cuda".to_owned(), name)]
        };
        Ok(BackendConfig { map })
    }

    /// The `(device, backend)` pairs, in order.
    pub fn device_backend_map(&self) -> &[(String, String)] {
        &self.map
    }

    /// The backend for a device type (`"cpu"`, `"cuda"`).
    pub fn backend_for(&self, device: &str) -> Option<&str> {
        self.map
            .iter()
            .find(|(d, _)| d == device)
            .map(|(_, b)| b.as_str())
    }
}

impl fmt::Display for BackendConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pairs: Vec<String> = self.map.iter().map(|(d, b)| format!("{d}:{b}")).collect();
        f.write_str(&pairs.join(","))
    }
}

#[cfg(test)]
mod tests;
