//! [`ProcessGroup`]: a set of global ranks, this worker's place in it, the
//! backends that run its collectives (one per device type), and its
//! sequence number.
//!
//! A group is a cheap handle (`Clone` shares it). A worker outside the group
//! holds a handle too (PyTorch's `GroupMember.NON_GROUP_MEMBER`): it knows
//! the members, so rank mapping works everywhere, but it has no backend and
//! collectives on it are no-ops with a warning ([`crate::World`]). This
//! module owns group identity and dispatch to backends; it does not validate
//! collective arguments.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tch::Device;

use crate::backend::{CollectiveBackend, OpContext};
use crate::error::{Error, Result};

pub(crate) struct Inner {
    pub(crate) group_name: String,
    /// Global ranks, sorted; a member's group rank is its index.
    pub(crate) ranks: Vec<usize>,
    pub(crate) group_rank: Option<usize>,
    /// `(device type, backend)`, in the backend config's order.
    pub(crate) backends: Vec<(String, Arc<dyn CollectiveBackend>)>,
    pub(crate) backend_name: String,
    pub(crate) seq: AtomicU64,
    pub(crate) timeout: Duration,
}

/// A process group (PyTorch's `ProcessGroup`).
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("group_name", &self.inner.group_name)
            .field("ranks", &self.inner.ranks)
            .field("group_rank", &self.inner.group_rank)
            .field("backend", &self.inner.backend_name)
            .finish()
    }
}

impl ProcessGroup {
    /// A group around one backend, outside any [`crate::World`] (what
    /// Python code gets by instantiating a `ProcessGroup` subclass such as
    /// the seeds' `DummyProcessGroup(rank, size)`). Its members are ranks
    /// `0..size`; it is not registered, so a world's rank-mapping calls
    /// reject it.
    pub fn from_backend(backend: Arc<dyn CollectiveBackend>) -> ProcessGroup {
        let size = backend.size();
        let rank = backend.rank();
        ProcessGroup {
            inner: Arc::new(Inner {
                group_name: String::new(),
                ranks: (0..size).collect(),
                group_rank: Some(rank),
                backend_name: backend.name(),
                backends: vec![
                    ("cpu".into(), Arc::clone(&backend)),
                    ("cuda".into(), backend),
                ],
                seq: AtomicU64::new(0),
                timeout: wasmrpc_store::DEFAULT_PG_TIMEOUT,
            }),
        }
    }

    /// This worker's rank in the group, -1 outside it.
    pub fn rank(&self) -> i64 {
        self.inner.group_rank.map_or(-1, |r| r as i64)
    }

    /// The number of members.
    pub fn size(&self) -> usize {
        self.inner.ranks.len()
    }

    /// The backend's name (`pg.name()`: `"gloo"`, or a plugin's
    /// `getBackendName()`); several distinct backends show their config
    /// string.
    pub fn name(&self) -> &str {
        &self.inner.backend_name
    }

    /// The group's registered name (`"0"` for the default group).
    pub fn group_name(&self) -> &str {
        &self.inner.group_name
    }

    /// The members' global ranks, sorted.
    pub fn ranks(&self) -> &[usize] {
        &self.inner.ranks
    }

    /// Whether this worker belongs to the group.
    pub fn is_member(&self) -> bool {
        self.inner.group_rank.is_some()
    }

    /// The group's timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// `pg._get_sequence_number_for_group()`: the number of collectives
    /// issued on this group so far; equal on every member between
    /// collectives.
    pub fn sequence_number_for_group(&self) -> u64 {
        self.inner.seq.load(Ordering::SeqCst)
    }

    /// Whether two handles are the same group.
    pub fn same(&self, other: &ProcessGroup) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The backend for tensors on `device`.
    ///
    /// # Errors
    /// [`Error::Runtime`] when no backend serves the device type.
    pub fn backend_for(&self, device: Device) -> Result<Arc<dyn CollectiveBackend>> {
        let kind = match device {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
            Device::Mps => "mps",
            Device::Vulkan => "vulkan",
        };
        self.inner
            .backends
            .iter()
            .find(|(d, _)| d == kind)
            .map(|(_, b)| Arc::clone(b))
            .ok_or_else(|| {
                Error::Runtime(format!(
                    "No backend type associated with device type {kind} in group {} (backend {})",
                    self.inner.group_name, self.inner.backend_name
                ))
            })
    }

    /// The backend for operations without tensors (barrier): cpu's, else
    /// the first.
    pub(crate) fn default_backend(&self) -> Result<Arc<dyn CollectiveBackend>> {
        self.backend_for(Device::Cpu).or_else(|e| {
            self.inner
                .backends
                .first()
                .map(|(_, b)| Arc::clone(b))
                .ok_or(e)
        })
    }

    /// The context of the next collective: takes a sequence number.
    pub(crate) fn next_op(&self, op: &'static str) -> OpContext {
        OpContext {
            op,
            seq: self.inner.seq.fetch_add(1, Ordering::SeqCst) + 1,
            sub: 0,
            timeout: self.inner.timeout,
            group: Arc::from(self.inner.group_name.as_str()),
        }
    }

    /// The context of a point-to-point operation (no sequence number).
    pub(crate) fn p2p_op(&self, op: &'static str) -> OpContext {
        OpContext {
            op,
            seq: 0,
            sub: 0,
            timeout: self.inner.timeout,
            group: Arc::from(self.inner.group_name.as_str()),
        }
    }

    /// Shuts every backend down.
    pub(crate) fn shutdown(&self) {
        for (_, b) in &self.inner.backends {
            b.shutdown();
        }
    }
}
