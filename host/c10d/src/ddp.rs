//! DDP's gradient synchronisation: a [`Reducer`] that groups a model's
//! gradients into buckets ([`compute_bucket_assignment_by_size`]) and runs
//! a communication hook on each bucket after backward (PyTorch's
//! `DistributedDataParallel` reducer with `register_comm_hook`; the default
//! hook averages gradients with an allreduce through a process group).
//!
//! This is the part of DDP that talks to process groups, for Rust training
//! loops over `tch` parameters: it does not wrap a module's forward, hook
//! into autograd, overlap communication with backward, or find unused
//! parameters. The caller runs backward, then [`Reducer::sync_gradients`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tch::Tensor;

use crate::bucketing::compute_bucket_assignment_by_size;
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::reduce_op::ReduceOp;
use crate::world::World;

/// PyTorch's `dist._DEFAULT_FIRST_BUCKET_BYTES`: the first bucket is small
/// so that communication starts early.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1024 * 1024;

/// One bucket of gradients handed to a communication hook (PyTorch's
/// `GradBucket`).
#[derive(Debug)]
pub struct GradBucket {
    /// The bucket's position.
    pub index: usize,
    /// The bucket's gradients, flattened and concatenated.
    pub buffer: Tensor,
    /// Which parameters' gradients the buffer holds, in buffer order.
    pub parameter_indices: Vec<usize>,
}

/// What a communication hook returns: the bucket's new gradients (same
/// size as the buffer).
pub type HookFuture = Pin<Box<dyn Future<Output = Result<Tensor>> + Send>>;

/// A communication hook (`register_comm_hook(state, hook)`; the state is
/// whatever the closure captures).
pub type CommHook = Arc<dyn Fn(GradBucket) -> HookFuture + Send + Sync>;

/// PyTorch's default hook (`allreduce_hook`): divides the bucket by the
/// group size and allreduces it (SUM) through `group` (the default group
/// for `None`), so every rank ends with the mean gradient.
pub fn allreduce_hook(world: Arc<World>, group: Option<ProcessGroup>) -> CommHook {
    Arc::new(move |bucket: GradBucket| {
        let world = Arc::clone(&world);
        let group = group.clone();
        Box::pin(async move {
            let size = world.get_world_size(group.as_ref())?;
            let buffer = bucket
                .buffer
                .f_div_scalar(size as f64)
                .map_err(|e| Error::Runtime(format!("allreduce_hook: {e}")))?;
            world
                .all_reduce(&buffer, ReduceOp::SUM, group.as_ref())?
                .wait()
                .await?;
            Ok(buffer)
        })
    })
}

/// Synchronises the gradients of a set of parameters across a group.
pub struct Reducer {
    params: Vec<Tensor>,
    buckets: Vec<Vec<usize>>,
    hook: CommHook,
}

impl std::fmt::Debug for Reducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reducer")
            .field("parameters", &self.params.len())
            .field("buckets", &self.buckets)
            .finish_non_exhaustive()
    }
}

impl Reducer {
    /// A reducer for `params` (shallow clones of the model's parameters),
    /// with buckets of at most `bucket_cap_bytes` (after a first bucket of
    /// [`DEFAULT_FIRST_BUCKET_BYTES`] at most) and the default
    /// [`allreduce_hook`]. As DDP's constructor does, it first broadcasts
    /// the parameters from the group's first rank, so every replica starts
    /// equal.
    ///
    /// # Errors
    /// Collective errors from the broadcast.
    pub async fn new(
        world: Arc<World>,
        params: Vec<Tensor>,
        bucket_cap_bytes: usize,
        group: Option<ProcessGroup>,
    ) -> Result<Reducer> {
        let src = match &group {
            Some(g) => g.ranks().first().copied().unwrap_or(0),
            None => 0,
        };
        let works = params
            .iter()
            .map(|p| world.broadcast(&p.detach(), src, group.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        for work in works {
            work.wait().await?;
        }
        let limits = [
            DEFAULT_FIRST_BUCKET_BYTES.min(bucket_cap_bytes),
            bucket_cap_bytes,
        ];
        // DDP buckets parameters in reverse order, the order backward
        // produces their gradients.
        let reversed: Vec<Tensor> = params.iter().rev().map(Tensor::shallow_clone).collect();
        let (buckets, _) = compute_bucket_assignment_by_size(&reversed, &limits);
        let n = params.len();
        let buckets = buckets
            .into_iter()
            .map(|b| b.into_iter().map(|i| n - 1 - i).collect())
            .collect();
        Ok(Reducer {
            hook: allreduce_hook(world, group),
            params,
            buckets,
        })
    }

    /// `register_comm_hook`: replaces the hook.
    pub fn register_comm_hook(&mut self, hook: CommHook) {
        self.hook = hook;
    }

    /// The buckets, as parameter indices.
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.buckets
    }

    /// Runs the hook on every bucket of the parameters' gradients (after
    /// backward) and writes its results back into the gradients. All hooks
    /// are issued before any is awaited, as DDP launches buckets as they
    /// fill. Parameters without a gradient contribute zeros.
    ///
    /// # Errors
    /// The hooks' errors, or [`Error::InvalidArgument`] if a hook returns a
    /// tensor of the wrong size.
    pub async fn sync_gradients(&mut self) -> Result<()> {
        let mut pending = Vec::with_capacity(self.buckets.len());
        for (index, members) in self.buckets.iter().enumerate() {
            let flat: Vec<Tensor> = members
                .iter()
                .map(|&i| {
                    let p = &self.params[i];
                    let g = p.grad();
                    if g.defined() {
                        g.detach().reshape([-1])
                    } else {
                        p.zeros_like().reshape([-1])
                    }
                })
                .collect();
            let buffer = Tensor::f_cat(&flat, 0)
                .map_err(|e| Error::Runtime(format!("gradient bucket {index}: {e}")))?;
            let numel = buffer.numel();
            let hook = (self.hook)(GradBucket {
                index,
                buffer,
                parameter_indices: members.clone(),
            });
            pending.push((index, numel, hook));
        }
        for (index, numel, hook) in pending {
            let reduced = hook.await?;
            if reduced.numel() != numel {
                return Err(Error::InvalidArgument(format!(
                    "the communication hook returned {} elements for gradient bucket {index} of {numel}",
                    reduced.numel()
                )));
            }
            let mut offset = 0;
            for &i in &self.buckets[index] {
                let p = &self.params[i];
                let n = p.numel() as i64;
                let part = reduced.narrow(0, offset, n).view(p.size().as_slice());
                let mut g = p.grad();
                if g.defined() {
                    g.f_copy_(&part)
                        .map_err(|e| Error::Runtime(format!("gradient bucket {index}: {e}")))?;
                }
                offset += n;
            }
        }
        Ok(())
    }
}
