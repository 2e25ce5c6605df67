//! [`World`]: one worker's view of `torch.distributed` — the default group,
//! the groups created after it, and the collective API with PyTorch's
//! argument checks.
//!
//! PyTorch keeps this state in module globals, one set per process. A Rust
//! host may run several ranks in one process (tests do), so the state lives
//! in a `World` value instead: `World::new()` is the uninitialised module,
//! and every `dist.*` function is a method. The backend registry stays
//! process-wide ([`crate::Backend`]), as in PyTorch.
//!
//! Collectives are issued synchronously and run as tokio tasks; each returns
//! a [`Work`] (PyTorch's `async_op=True`); `work.wait().await` is the
//! blocking form. Issuing takes the group's next sequence number, so a
//! collective issued by every member has the same number everywhere, and
//! the backend matches messages by it. This module owns validation, rank
//! mapping, group bookkeeping and the non-member warnings; it does not move
//! data (backends do).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use wasmrpc_store::{DEFAULT_PG_TIMEOUT, PrefixStore, Store, rendezvous_with};

use crate::backend::{Backend, BackendArgs, BackendConfig, CollectiveBackend};
use crate::error::{Error, Result};
use crate::group::{Inner, ProcessGroup};

mod collectives;
mod dtypes;
mod objects;
mod parts;

pub use dtypes::dtype_name;

/// An environment lookup for `env://` rendezvous (tests inject one instead
/// of touching the process environment).
pub type Env = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The arguments of [`World::init_process_group`].
#[derive(Clone, Default)]
pub struct InitOptions {
    /// A backend name or config string (`"gloo"`, `"cpu:gloo,cuda:dummy"`);
    /// `None` is PyTorch's default (gloo on cpu; nccl on cuda if available,
    /// else gloo).
    pub backend: Option<String>,
    /// `env://` (the default), `tcp://host:port` or `file:///path`.
    pub init_method: Option<String>,
    /// A store to use instead of an init method.
    pub store: Option<Arc<dyn Store>>,
    /// This worker's rank (-1 or `None`: from the init method).
    pub rank: Option<i64>,
    /// The number of workers (`None`: from the init method).
    pub world_size: Option<i64>,
    /// The timeout of the default store and of every collective
    /// ([`DEFAULT_PG_TIMEOUT`] if `None`).
    pub timeout: Option<Duration>,
    /// Environment variables for `env://` (`None`: the process's).
    pub env: Option<Env>,
}

impl std::fmt::Debug for InitOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InitOptions")
            .field("backend", &self.backend)
            .field("init_method", &self.init_method)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The arguments of [`World::new_group`].
#[derive(Debug, Clone, Default)]
pub struct NewGroupOptions {
    /// The backend (`None`: the default group's).
    pub backend: Option<String>,
    /// The group's timeout (`None`: the default group's).
    pub timeout: Option<Duration>,
    /// Only the members call `new_group` (PyTorch's
    /// `use_local_synchronization=True`); non-members get `None`.
    pub use_local_synchronization: bool,
}

struct State {
    rank: usize,
    world_size: usize,
    store: Arc<dyn Store>,
    config: BackendConfig,
    timeout: Duration,
    default_pg: ProcessGroup,
    groups: Vec<ProcessGroup>,
    group_count: u64,
    /// Local-sync groups created so far per member list: the members agree
    /// on the count, which names the group without a global counter.
    local_sync_count: HashMap<Vec<usize>, u64>,
}

/// One worker's `torch.distributed` state (see the module docs).
#[derive(Default)]
pub struct World {
    state: Mutex<Option<State>>,
    warned: Mutex<HashSet<String>>,
    warnings: Mutex<Vec<String>>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("initialized", &self.is_initialized())
            .finish_non_exhaustive()
    }
}

const NOT_INITIALIZED: &str =
    "Default process group has not been initialized, please make sure to call init_process_group.";

/// The outcome of resolving a `group` argument.
enum Target {
    /// This worker is outside the group: the collective is a no-op.
    Outside,
    Member(ProcessGroup),
}

impl World {
    /// An uninitialised world (`is_initialized() == false`).
    pub fn new() -> World {
        World::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<State>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        match self.lock().as_mut() {
            Some(state) => f(state),
            None => Err(Error::Runtime(NOT_INITIALIZED.into())),
        }
    }

    /// `dist.is_initialized()`.
    pub fn is_initialized(&self) -> bool {
        self.lock().is_some()
    }

    /// `dist.init_process_group(...)`: rendezvous (unless a store is given),
    /// then the default group with one backend per distinct name in the
    /// backend config.
    ///
    /// # Errors
    /// [`Error::Runtime`] "trying to initialize the default process group
    /// twice!"; [`Error::InvalidArgument`] "Cannot specify both init_method
    /// and store." or a bad backend string; rendezvous and backend errors.
    pub async fn init_process_group(&self, opts: InitOptions) -> Result<()> {
        if self.is_initialized() {
            return Err(Error::Runtime(
                "trying to initialize the default process group twice!".into(),
            ));
        }
        let timeout = opts.timeout.unwrap_or(DEFAULT_PG_TIMEOUT);
        let config = BackendConfig::new(opts.backend.as_deref().unwrap_or(Backend::UNDEFINED))?;
        let (store, rank, world_size) = match opts.store {
            Some(store) => {
                if opts.init_method.is_some() {
                    return Err(Error::InvalidArgument(
                        "Cannot specify both init_method and store.".into(),
                    ));
                }
                let world_size = opts.world_size.filter(|&n| n > 0).ok_or_else(|| {
                    Error::InvalidArgument("world_size must be positive if using store".into())
                })?;
                let rank = opts.rank.filter(|&r| r >= 0).ok_or_else(|| {
                    Error::InvalidArgument("rank must be non-negative if using store".into())
                })?;
                (store, rank, world_size)
            }
            None => {
                let url = opts.init_method.as_deref().unwrap_or("env://");
                let env = opts.env.clone();
                let lookup = move |name: &str| match &env {
                    Some(env) => env(name),
                    None => wasmrpc_store::process_env(name),
                };
                rendezvous_with(
                    url,
                    opts.rank.unwrap_or(-1),
                    opts.world_size.unwrap_or(-1),
                    timeout,
                    &lookup,
                )
                .await?
            }
        };
        let (rank, world_size) = (rank as usize, world_size as usize);
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not below world_size {world_size}"
            )));
        }
        // As PyTorch: the default group's store is the rendezvous store
        // under "default_pg/", and every later group nests its own prefix in
        // it. (The prefix store keeps the rendezvous store, and with it a
        // TCP store's server, alive.)
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new("default_pg", store));
        let default_pg = build_group(
            Arc::clone(&store),
            &config,
            "0",
            (0..world_size).collect(),
            Some(rank),
            timeout,
        )
        .await?;
        let mut state = self.lock();
        if state.is_some() {
            default_pg.shutdown();
            return Err(Error::Runtime(
                "trying to initialize the default process group twice!".into(),
            ));
        }
        *state = Some(State {
            rank,
            world_size,
            store,
            config,
            timeout,
            groups: vec![default_pg.clone()],
            default_pg,
            group_count: 1,
            local_sync_count: HashMap::new(),
        });
        Ok(())
    }

    /// `dist.destroy_process_group(group)`: the default group (and with it
    /// every group) when `None`. Operations still waiting on a destroyed
    /// group fail promptly.
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`;
    /// [`Error::InvalidArgument`] for a group this world did not create.
    pub fn destroy_process_group(&self, group: Option<&ProcessGroup>) -> Result<()> {
        let mut guard = self.lock();
        let Some(state) = guard.as_mut() else {
            return Err(Error::Runtime(NOT_INITIALIZED.into()));
        };
        match group {
            None => {
                for g in &state.groups {
                    g.shutdown();
                }
                *guard = None;
            }
            Some(g) if g.same(&state.default_pg) => {
                drop(guard);
                return self.destroy_process_group(None);
            }
            Some(g) => {
                let before = state.groups.len();
                state.groups.retain(|x| !x.same(g));
                if state.groups.len() == before {
                    return Err(not_registered(g));
                }
                g.shutdown();
            }
        }
        Ok(())
    }

    /// `c10d._get_default_group()`.
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`.
    pub fn default_group(&self) -> Result<ProcessGroup> {
        self.with_state(|s| Ok(s.default_pg.clone()))
    }

    /// `c10d._get_default_store()`: the default group's store (the
    /// rendezvous store under the `default_pg/` prefix).
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`.
    pub fn default_store(&self) -> Result<Arc<dyn Store>> {
        self.with_state(|s| Ok(Arc::clone(&s.store)))
    }

    /// `dist.get_backend_config()`.
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`.
    pub fn backend_config(&self) -> Result<BackendConfig> {
        self.with_state(|s| Ok(s.config.clone()))
    }

    /// `dist.get_rank(group)`: the global rank for `None`, the group rank
    /// otherwise (-1 outside the group).
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`.
    pub fn get_rank(&self, group: Option<&ProcessGroup>) -> Result<i64> {
        self.with_state(|s| {
            Ok(match group {
                None => s.rank as i64,
                Some(g) => g.rank(),
            })
        })
    }

    /// `dist.get_world_size(group)` (-1 outside the group).
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`.
    pub fn get_world_size(&self, group: Option<&ProcessGroup>) -> Result<i64> {
        self.with_state(|s| {
            Ok(match group {
                None => s.world_size as i64,
                Some(g) if g.is_member() => g.size() as i64,
                Some(_) => -1,
            })
        })
    }

    fn registered(&self, group: &ProcessGroup) -> Result<()> {
        self.with_state(|s| {
            if s.groups.iter().any(|g| g.same(group)) {
                Ok(())
            } else {
                Err(not_registered(group))
            }
        })
    }

    /// `dist.get_group_rank(group, global_rank)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "Group ... is not registered, ..." or
    /// "Global rank {r} is not part of group {g}".
    pub fn get_group_rank(&self, group: &ProcessGroup, global_rank: usize) -> Result<usize> {
        self.registered(group)?;
        group
            .ranks()
            .iter()
            .position(|&r| r == global_rank)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "Global rank {global_rank} is not part of group {}",
                    group.group_name()
                ))
            })
    }

    /// `dist.get_global_rank(group, group_rank)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "Group ... is not registered, ..." or
    /// "Group rank {r} is not part of group {g}".
    pub fn get_global_rank(&self, group: &ProcessGroup, group_rank: usize) -> Result<usize> {
        self.registered(group)?;
        group.ranks().get(group_rank).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "Group rank {group_rank} is not part of group {}",
                group.group_name()
            ))
        })
    }

    /// `dist.get_process_group_ranks(group)`: the members' global ranks.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unregistered group.
    pub fn get_process_group_ranks(&self, group: &ProcessGroup) -> Result<Vec<usize>> {
        self.registered(group)?;
        Ok(group.ranks().to_vec())
    }

    /// `dist.new_group(ranks, ...)`: a group of the given global ranks
    /// (sorted; all ranks if empty).
    ///
    /// Without local synchronisation every rank of the world must call it,
    /// in the same order; a non-member gets a handle outside the group
    /// (`GroupMember.NON_GROUP_MEMBER`). With it, only members call it and
    /// non-members get `None`; members name the group by its member list
    /// and how many such groups they made, so groups with the same members
    /// coexist.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank outside the world; backend
    /// errors from connecting the members.
    pub async fn new_group(
        &self,
        ranks: &[usize],
        opts: NewGroupOptions,
    ) -> Result<Option<ProcessGroup>> {
        let planned = self.with_state(|s| {
            let mut ranks: Vec<usize> = if ranks.is_empty() {
                (0..s.world_size).collect()
            } else {
                ranks.to_vec()
            };
            ranks.sort_unstable();
            ranks.dedup();
            if let Some(bad) = ranks.iter().find(|&&r| r >= s.world_size) {
                return Err(Error::InvalidArgument(format!(
                    "The new group's rank should be within the world_size set by \
                     init_process_group (rank {bad}, world_size {})",
                    s.world_size
                )));
            }
            let group_rank = ranks.iter().position(|&r| r == s.rank);
            let name = if opts.use_local_synchronization {
                if group_rank.is_none() {
                    return Ok(None);
                }
                let n = s.local_sync_count.entry(ranks.clone()).or_default();
                *n += 1;
                let members: Vec<String> = ranks.iter().map(usize::to_string).collect();
                format!("local_{}_{}", members.join("_"), n)
            } else {
                s.group_count += 1;
                (s.group_count - 1).to_string()
            };
            let config = match &opts.backend {
                Some(b) => BackendConfig::new(b)?,
                None => s.config.clone(),
            };
            Ok(Some((
                Arc::clone(&s.store),
                config,
                name,
                ranks,
                group_rank,
                opts.timeout.unwrap_or(s.timeout),
            )))
        })?;
        let Some((store, config, name, ranks, group_rank, timeout)) = planned else {
            return Ok(None);
        };
        let group_store: Arc<dyn Store> = Arc::new(PrefixStore::new(name.clone(), store));
        let pg = build_group(group_store, &config, &name, ranks, group_rank, timeout).await?;
        let registered = self.with_state(|s| {
            s.groups.push(pg.clone());
            Ok(())
        });
        if let Err(e) = registered {
            pg.shutdown();
            return Err(e);
        }
        Ok(Some(pg))
    }

    /// Resolves a `group` argument: the default group for `None`; a no-op
    /// (with a warning, once per op and group) outside the group.
    fn target(&self, group: Option<&ProcessGroup>, op: &'static str) -> Result<Target> {
        let (rank, pg) = self.with_state(|s| {
            Ok((
                s.rank,
                group.cloned().unwrap_or_else(|| s.default_pg.clone()),
            ))
        })?;
        if pg.is_member() {
            return Ok(Target::Member(pg));
        }
        let text =
            format!("Running {op} on global rank {rank} which does not belong to the given group.");
        let first = self
            .warned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(format!("{}\u{0}{text}", pg.group_name()));
        if first {
            tracing::warn!("{text}");
            self.warnings
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(text);
        }
        Ok(Target::Outside)
    }

    /// The warnings (PyTorch's `UserWarning`s) emitted since the last call,
    /// each once: collectives on a group this worker is not in.
    pub fn take_warnings(&self) -> Vec<String> {
        std::mem::take(&mut *self.warnings.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

fn check_len(op: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{op}: {what} has {got} tensors, expected {want}"
        )))
    }
}

fn not_registered(group: &ProcessGroup) -> Error {
    Error::InvalidArgument(format!(
        "Group {group:?} is not registered, please create group with torch.distributed.new_group API"
    ))
}

/// Builds a group: one backend per distinct backend name in `config` (a
/// member only), each on its own prefix of `store`.
async fn build_group(
    store: Arc<dyn Store>,
    config: &BackendConfig,
    group_name: &str,
    ranks: Vec<usize>,
    group_rank: Option<usize>,
    timeout: Duration,
) -> Result<ProcessGroup> {
    let mut made: Vec<(String, Arc<dyn CollectiveBackend>)> = Vec::new();
    let mut backends = Vec::new();
    if let Some(group_rank) = group_rank {
        for (device, name) in config.device_backend_map() {
            let backend = match made.iter().find(|(n, _)| n == name) {
                Some((_, b)) => Arc::clone(b),
                None => {
                    let creator = Backend::creator(name)?;
                    let args = BackendArgs {
                        store: Arc::new(PrefixStore::new(name.clone(), Arc::clone(&store))),
                        group_rank,
                        group_size: ranks.len(),
                        timeout,
                        group_name: group_name.to_owned(),
                    };
                    let b = creator(args).await?;
                    made.push((name.clone(), Arc::clone(&b)));
                    b
                }
            };
            backends.push((device.clone(), backend));
        }
    }
    let backend_name = match made.as_slice() {
        [(_, only)] => only.name(),
        _ if group_rank.is_none() => String::new(),
        _ => config.to_string(),
    };
    Ok(ProcessGroup {
        inner: Arc::new(Inner {
            group_name: group_name.to_owned(),
            ranks,
            group_rank,
            backends,
            backend_name,
            seq: std::sync::atomic::AtomicU64::new(0),
            timeout,
        }),
    })
}
