//! The collective API of [`World`] (`dist.all_reduce`, ..., `dist.send`):
//! each collective's own argument checks, and the preamble they all share
//! ([`World::issue`]): resolving the group (a no-op with a warning outside
//! it), the backend serving the tensors' device, the op's sequence number,
//! and issuing the backend call as a [`Work`].

use std::future::Future;
use std::sync::Arc;

use tch::{Device, Tensor};

use super::dtypes::{ensure_same_dtype, real_view, shallow};
use super::parts::{PartFuture, join_in_order};
use super::{Target, World, check_len};
use crate::backend::{CollectiveBackend, OpContext};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::reduce_op::{ReduceOp, is_complex};
use crate::work::Work;

/// How an op counts in its group's sequence.
#[derive(Clone, Copy)]
enum Seq {
    /// A collective: takes the group's next sequence number.
    Collective,
    /// A point-to-point op: no sequence number.
    PointToPoint,
}

/// What a collective's own checks found: the device whose backend runs it
/// (`None`: the group's default backend) and what it carries on to the
/// backend call. `None` in its place: nothing to do (no tensors).
type Prepared<T> = Option<(Option<Device>, T)>;

impl World {
    /// The preamble every collective shares, in this order: the tensors in
    /// `same_dtype` share a dtype; `group` is resolved (outside it the
    /// collective is a no-op, with the warning); the collective's own
    /// checks against the group (`prepare`) pass; the backend serving the
    /// device is found; the op takes its context (and, for a collective,
    /// the group's next sequence number); `run` makes the backend call,
    /// issued as a [`Work`].
    fn issue<'a, T, F>(
        &self,
        op: &'static str,
        group: Option<&ProcessGroup>,
        seq: Seq,
        same_dtype: impl IntoIterator<Item = &'a Tensor>,
        prepare: impl FnOnce(&ProcessGroup) -> Result<Prepared<T>>,
        run: impl FnOnce(Arc<dyn CollectiveBackend>, OpContext, T) -> Result<F>,
    ) -> Result<Work>
    where
        F: Future<Output = Result<()>> + Send + 'static,
    {
        ensure_same_dtype(same_dtype)?;
        let Target::Member(pg) = self.target(group, op)? else {
            return Ok(Work::completed(op));
        };
        let Some((device, prepared)) = prepare(&pg)? else {
            return Ok(Work::completed(op));
        };
        let backend = match device {
            Some(device) => pg.backend_for(device)?,
            None => pg.default_backend()?,
        };
        let ctx = match seq {
            Seq::Collective => pg.next_op(op),
            Seq::PointToPoint => pg.p2p_op(op),
        };
        let (inline, op, timeout) = (backend.completes_without_polling(), ctx.op, ctx.timeout);
        let fut = run(backend, ctx, prepared)?;
        Ok(Work::spawn(inline, op, timeout, fut))
    }

    /// A global rank as a rank of `pg`.
    fn group_rank_of(&self, pg: &ProcessGroup, global: usize, what: &str) -> Result<usize> {
        pg.ranks().iter().position(|&r| r == global).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what} rank {global} is not part of group {}",
                pg.group_name()
            ))
        })
    }

    /// `dist.all_reduce(tensor, op, group)`.
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group` or when no backend
    /// serves the tensor's device.
    pub fn all_reduce(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "all_reduce",
            group,
            Seq::Collective,
            None,
            |_| Ok(Some((Some(tensor.device()), ()))),
            |backend, ctx, ()| {
                let t = real_view(tensor)?;
                Ok(async move { backend.allreduce(&ctx, vec![t], op).await })
            },
        )
    }

    /// `dist.all_reduce_coalesced(tensors, op, group)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "tensors with different dtypes".
    pub fn all_reduce_coalesced(
        &self,
        tensors: &[Tensor],
        op: ReduceOp,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "all_reduce_coalesced",
            group,
            Seq::Collective,
            tensors,
            |_| Ok(tensors.first().map(|first| (Some(first.device()), ()))),
            |backend, ctx, ()| {
                let ts = tensors.iter().map(real_view).collect::<Result<Vec<_>>>()?;
                Ok(async move { backend.allreduce_coalesced(&ctx, ts, op).await })
            },
        )
    }

    /// `dist.broadcast(tensor, src, group)`; `src` is a global rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `src` is not in the group.
    pub fn broadcast(
        &self,
        tensor: &Tensor,
        src: usize,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "broadcast",
            group,
            Seq::Collective,
            None,
            |pg| {
                let root = self.group_rank_of(pg, src, "Source")?;
                Ok(Some((Some(tensor.device()), root)))
            },
            |backend, ctx, root| {
                let t = real_view(tensor)?;
                Ok(async move { backend.broadcast(&ctx, vec![t], root).await })
            },
        )
    }

    /// `dist.reduce(tensor, dst, op, group)`; `dst` is a global rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dst` is not in the group.
    pub fn reduce(
        &self,
        tensor: &Tensor,
        dst: usize,
        op: ReduceOp,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "reduce",
            group,
            Seq::Collective,
            None,
            |pg| {
                let root = self.group_rank_of(pg, dst, "Destination")?;
                Ok(Some((Some(tensor.device()), root)))
            },
            |backend, ctx, root| {
                let t = real_view(tensor)?;
                Ok(async move { backend.reduce(&ctx, vec![t], root, op).await })
            },
        )
    }

    /// `dist.all_gather(tensor_list, tensor, group)`: `outputs[r]` receives
    /// group rank `r`'s `input`. Complex tensors travel as their real view,
    /// so complex and real tensors of the same bytes mix.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "tensors with different dtypes", or a list
    /// whose length is not the group size.
    pub fn all_gather(
        &self,
        outputs: &[Tensor],
        input: &Tensor,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "all_gather",
            group,
            Seq::Collective,
            outputs.iter().chain([input]),
            |pg| {
                check_len("all_gather", "tensor_list", outputs.len(), pg.size())?;
                Ok(Some((Some(input.device()), ())))
            },
            |backend, ctx, ()| {
                let outs = outputs.iter().map(real_view).collect::<Result<Vec<_>>>()?;
                let input = real_view(input)?;
                Ok(async move { backend.allgather(&ctx, vec![outs], vec![input]).await })
            },
        )
    }

    /// `dist.all_gather_coalesced(output_tensor_lists, input_tensor_list,
    /// group)`: `outputs[r][j]` receives group rank `r`'s `inputs[j]`,
    /// converted to the output's dtype. As in the seed's PyTorch, mixed
    /// dtypes are accepted (each rank's inputs have the same dtypes and
    /// shapes on every rank, so a receiver knows what it receives).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lists do not match the group
    /// size or the number of inputs.
    pub fn all_gather_coalesced(
        &self,
        outputs: &[Vec<Tensor>],
        inputs: &[Tensor],
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        const OP: &str = "all_gather_coalesced";
        self.issue(
            OP,
            group,
            Seq::Collective,
            None,
            |pg| {
                check_len(OP, "output_tensor_lists", outputs.len(), pg.size())?;
                for list in outputs {
                    check_len(OP, "each output list", list.len(), inputs.len())?;
                }
                Ok(inputs
                    .first()
                    .map(|first| (Some(first.device()), pg.size())))
            },
            |backend, ctx, size| {
                let mut jobs = Vec::with_capacity(inputs.len());
                for (j, input) in inputs.iter().enumerate() {
                    let input = real_view(input)?.contiguous();
                    let staging = (0..size)
                        .map(|_| input.f_empty_like())
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| Error::Runtime(format!("{OP}: {e}")))?;
                    let outs: Vec<Tensor> = outputs.iter().map(|l| l[j].shallow_clone()).collect();
                    jobs.push((input, staging, outs));
                }
                Ok(async move {
                    // Every part is issued at the first poll, in order: an
                    // engine tags operations by issue order, so no later
                    // collective may slip between the parts.
                    let mut parts: Vec<PartFuture> = Vec::with_capacity(jobs.len());
                    let mut copies = Vec::with_capacity(jobs.len());
                    for (j, (input, staging, outs)) in jobs.into_iter().enumerate() {
                        let part = ctx.part(j as u32);
                        let backend = Arc::clone(&backend);
                        let gathered = shallow(&staging);
                        parts.push(Box::pin(async move {
                            backend.allgather(&part, vec![gathered], vec![input]).await
                        }));
                        copies.push((staging, outs));
                    }
                    join_in_order(parts).await?;
                    for (staging, outs) in copies {
                        for (mut out, got) in outs.into_iter().zip(staging) {
                            // The output may differ in dtype: copy_ converts.
                            let got = if is_complex(out.kind()) {
                                got.f_view_as_complex()
                            } else {
                                Ok(got)
                            };
                            got.and_then(|g| out.f_copy_(&g.reshape(out.size())))
                                .map_err(|e| Error::Runtime(format!("{OP}: {e}")))?;
                        }
                    }
                    Ok(())
                })
            },
        )
    }

    /// `dist.gather(tensor, gather_list, dst, group)`: only `dst` passes a
    /// list (of the group's size).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "tensors with different dtypes", a list on
    /// a non-destination rank, or a missing list on the destination.
    pub fn gather(
        &self,
        input: &Tensor,
        outputs: Option<&[Tensor]>,
        dst: usize,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "gather",
            group,
            Seq::Collective,
            outputs.unwrap_or_default().iter().chain([input]),
            |pg| {
                let root = self.group_rank_of(pg, dst, "Destination")?;
                let me = pg.rank() as usize;
                let outs = match (me == root, outputs) {
                    (true, Some(list)) => {
                        check_len("gather", "gather_list", list.len(), pg.size())?;
                        vec![list.iter().map(real_view).collect::<Result<Vec<_>>>()?]
                    }
                    (true, None) => {
                        return Err(Error::InvalidArgument(
                            "Argument ``gather_list`` must be specified on destination rank."
                                .into(),
                        ));
                    }
                    (false, Some(l)) if !l.is_empty() => {
                        return Err(Error::InvalidArgument(
                            "Argument ``gather_list`` must NOT be specified on non-destination \
                             ranks."
                                .into(),
                        ));
                    }
                    (false, _) => Vec::new(),
                };
                Ok(Some((Some(input.device()), (root, outs))))
            },
            |backend, ctx, (root, outs)| {
                let input = real_view(input)?;
                Ok(async move { backend.gather(&ctx, outs, vec![input], root).await })
            },
        )
    }

    /// `dist.scatter(tensor, scatter_list, src, group)`: only `src` passes a
    /// list (of the group's size).
    ///
    /// # Errors
    /// As [`World::gather`].
    pub fn scatter(
        &self,
        output: &Tensor,
        inputs: Option<&[Tensor]>,
        src: usize,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "scatter",
            group,
            Seq::Collective,
            inputs.unwrap_or_default().iter().chain([output]),
            |pg| {
                let root = self.group_rank_of(pg, src, "Source")?;
                let me = pg.rank() as usize;
                let ins = match (me == root, inputs) {
                    (true, Some(list)) => {
                        check_len("scatter", "scatter_list", list.len(), pg.size())?;
                        vec![list.iter().map(real_view).collect::<Result<Vec<_>>>()?]
                    }
                    (true, None) => {
                        return Err(Error::InvalidArgument(
                            "Argument ``scatter_list`` must be specified on source rank.".into(),
                        ));
                    }
                    (false, Some(l)) if !l.is_empty() => {
                        return Err(Error::InvalidArgument(
                            "Argument ``scatter_list`` must NOT be specified on non-source ranks."
                                .into(),
                        ));
                    }
                    (false, _) => Vec::new(),
                };
                Ok(Some((Some(output.device()), (root, ins))))
            },
            |backend, ctx, (root, ins)| {
                let output = real_view(output)?;
                Ok(async move { backend.scatter(&ctx, vec![output], ins, root).await })
            },
        )
    }

    /// `dist.reduce_scatter(output, input_list, op, group)`: `output`
    /// receives the reduction of every rank's `inputs[my group rank]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "tensors with different dtypes", or a list
    /// whose length is not the group size.
    pub fn reduce_scatter(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "reduce_scatter",
            group,
            Seq::Collective,
            inputs.iter().chain([output]),
            |pg| {
                check_len("reduce_scatter", "input_list", inputs.len(), pg.size())?;
                Ok(Some((Some(output.device()), ())))
            },
            |backend, ctx, ()| {
                let ins = inputs.iter().map(real_view).collect::<Result<Vec<_>>>()?;
                let output = real_view(output)?;
                Ok(async move {
                    backend
                        .reduce_scatter(&ctx, vec![output], vec![ins], op)
                        .await
                })
            },
        )
    }

    /// `dist.all_to_all_single(output, input, output_split_sizes,
    /// input_split_sizes, group)`: empty splits mean equal parts of dim 0.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "tensors with different dtypes".
    pub fn all_to_all_single(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_split_sizes: &[i64],
        input_split_sizes: &[i64],
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "all_to_all_single",
            group,
            Seq::Collective,
            [output, input],
            |_| Ok(Some((Some(input.device()), ()))),
            |backend, ctx, ()| {
                let (output, input) = (real_view(output)?, real_view(input)?);
                let (out_split, in_split) =
                    (output_split_sizes.to_vec(), input_split_sizes.to_vec());
                Ok(async move {
                    backend
                        .alltoall_base(&ctx, output, input, out_split, in_split)
                        .await
                })
            },
        )
    }

    /// `dist.all_to_all(output_list, input_list, group)`: `outputs[s]`
    /// receives group rank `s`'s `inputs[my group rank]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "tensors with different dtypes", or lists
    /// whose length is not the group size.
    pub fn all_to_all(
        &self,
        outputs: &[Tensor],
        inputs: &[Tensor],
        group: Option<&ProcessGroup>,
    ) -> Result<Work> {
        self.issue(
            "all_to_all",
            group,
            Seq::Collective,
            outputs.iter().chain(inputs),
            |pg| {
                check_len("all_to_all", "output_tensor_list", outputs.len(), pg.size())?;
                check_len("all_to_all", "input_tensor_list", inputs.len(), pg.size())?;
                Ok(inputs.first().map(|first| (Some(first.device()), ())))
            },
            |backend, ctx, ()| {
                let outs = outputs.iter().map(real_view).collect::<Result<Vec<_>>>()?;
                let ins = inputs.iter().map(real_view).collect::<Result<Vec<_>>>()?;
                Ok(async move { backend.alltoall(&ctx, outs, ins).await })
            },
        )
    }

    /// `dist.barrier(group)`.
    ///
    /// # Errors
    /// [`Error::Runtime`] before `init_process_group`.
    pub fn barrier(&self, group: Option<&ProcessGroup>) -> Result<Work> {
        self.issue(
            "barrier",
            group,
            Seq::Collective,
            None,
            |_| Ok(Some((None, ()))),
            |backend, ctx, ()| Ok(async move { backend.barrier(&ctx).await }),
        )
    }

    /// `dist.send(tensor, dst, group, tag)` (`isend` when the work is not
    /// waited for); `dst` is a global rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "Invalid destination rank: destination
    /// rank should not be the same as the rank of the current process." or
    /// a `dst` outside the group.
    pub fn send(
        &self,
        tensor: &Tensor,
        dst: usize,
        group: Option<&ProcessGroup>,
        tag: u64,
    ) -> Result<Work> {
        if self.get_rank(None)? == dst as i64 {
            return Err(Error::InvalidArgument(
                "Invalid destination rank: destination rank should not be the same as the rank \
                 of the current process."
                    .into(),
            ));
        }
        self.issue(
            "send",
            group,
            Seq::PointToPoint,
            None,
            |pg| {
                let peer = self.group_rank_of(pg, dst, "Destination")?;
                Ok(Some((Some(tensor.device()), peer)))
            },
            |backend, ctx, peer| {
                let t = real_view(tensor)?;
                Ok(async move { backend.send(&ctx, vec![t], peer, tag).await })
            },
        )
    }

    /// `dist.recv(tensor, src, group, tag)` (`irecv` when the work is not
    /// waited for); `src` is a global rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] "Invalid source rank: source rank should
    /// not be the same as the rank of the current process." or a `src`
    /// outside the group.
    pub fn recv(
        &self,
        tensor: &Tensor,
        src: usize,
        group: Option<&ProcessGroup>,
        tag: u64,
    ) -> Result<Work> {
        if self.get_rank(None)? == src as i64 {
            return Err(Error::InvalidArgument(
                "Invalid source rank: source rank should not be the same as the rank of the \
                 current process."
                    .into(),
            ));
        }
        self.issue(
            "recv",
            group,
            Seq::PointToPoint,
            None,
            |pg| {
                let peer = self.group_rank_of(pg, src, "Source")?;
                Ok(Some((Some(tensor.device()), peer)))
            },
            |backend, ctx, peer| {
                let t = real_view(tensor)?;
                Ok(async move { backend.recv(&ctx, vec![t], peer, tag).await })
            },
        )
    }
}
