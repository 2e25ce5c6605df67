//! Each collective of [`CollectiveBackend`] mapped onto the engine's
//! `c10d::Backend` virtual call, issued at once and waited for as a work.

use std::ffi::c_void;

use tch::Tensor;

use super::{Engine, ffi, millis, ptrs};
use crate::backend::{CollectiveBackend, OpContext};
use crate::error::Result;
use crate::reduce_op::ReduceOp;

#[async_trait::async_trait]
impl CollectiveBackend for Engine {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    async fn broadcast(&self, ctx: &OpContext, tensors: Vec<Tensor>, root: usize) -> Result<()> {
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: b is live; ts are live tensors for the call.
            ffi::wrc_broadcast(b, ts.as_ptr(), ts.len(), root as i64, ms, err)
        })
        .await
    }

    async fn allreduce(&self, ctx: &OpContext, tensors: Vec<Tensor>, op: ReduceOp) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_allreduce(b, ts.as_ptr(), ts.len(), op, ms, err)
        })
        .await
    }

    async fn allreduce_coalesced(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_allreduce_coalesced(b, ts.as_ptr(), ts.len(), op, ms, err)
        })
        .await
    }

    async fn reduce(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let ts = ptrs(&tensors);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_reduce(b, ts.as_ptr(), ts.len(), root as i64, op, ms, err)
        })
        .await
    }

    async fn allgather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        let (outs, outer, inner) = self.nested(ctx, &outputs)?;
        let ins = ptrs(&inputs);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_allgather(
                b,
                outs.as_ptr(),
                outer,
                inner,
                ins.as_ptr(),
                ins.len(),
                ms,
                err,
            )
        })
        .await
    }

    async fn gather(
        &self,
        ctx: &OpContext,
        outputs: Vec<Vec<Tensor>>,
        inputs: Vec<Tensor>,
        root: usize,
    ) -> Result<()> {
        let (outs, outer, inner) = self.nested(ctx, &outputs)?;
        let ins = ptrs(&inputs);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_gather(
                b,
                outs.as_ptr(),
                outer,
                inner,
                ins.as_ptr(),
                ins.len(),
                root as i64,
                ms,
                err,
            )
        })
        .await
    }

    async fn scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        root: usize,
    ) -> Result<()> {
        let outs = ptrs(&outputs);
        let (ins, outer, inner) = self.nested(ctx, &inputs)?;
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_scatter(
                b,
                outs.as_ptr(),
                outs.len(),
                ins.as_ptr(),
                outer,
                inner,
                root as i64,
                ms,
                err,
            )
        })
        .await
    }

    async fn reduce_scatter(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Vec<Tensor>>,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.red_op(ctx, op)?;
        let outs = ptrs(&outputs);
        let (ins, outer, inner) = self.nested(ctx, &inputs)?;
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_reduce_scatter(
                b,
                outs.as_ptr(),
                outs.len(),
                ins.as_ptr(),
                outer,
                inner,
                op,
                ms,
                err,
            )
        })
        .await
    }

    async fn alltoall_base(
        &self,
        ctx: &OpContext,
        output: Tensor,
        input: Tensor,
        output_split: Vec<i64>,
        input_split: Vec<i64>,
    ) -> Result<()> {
        let o = ffi::T(output.as_ptr() as *const c_void);
        let i = ffi::T(input.as_ptr() as *const c_void);
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast; the split vectors outlive the call.
            ffi::wrc_alltoall_base(
                b,
                o,
                i,
                output_split.as_ptr(),
                output_split.len(),
                input_split.as_ptr(),
                input_split.len(),
                ms,
                err,
            )
        })
        .await
    }

    async fn alltoall(
        &self,
        ctx: &OpContext,
        outputs: Vec<Tensor>,
        inputs: Vec<Tensor>,
    ) -> Result<()> {
        if !self.has_alltoall {
            return self.alltoall_through_base(ctx, outputs, inputs).await;
        }
        let (outs, ins) = (ptrs(&outputs), ptrs(&inputs));
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_alltoall(
                b,
                outs.as_ptr(),
                outs.len(),
                ins.as_ptr(),
                ins.len(),
                ms,
                err,
            )
        })
        .await
    }

    async fn barrier(&self, ctx: &OpContext) -> Result<()> {
        let ms = millis(ctx.timeout);
        self.run(ctx, |b, err| unsafe {
            // SAFETY: b is live.
            ffi::wrc_barrier(b, ms, err)
        })
        .await
    }

    async fn send(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        dst: usize,
        tag: u64,
    ) -> Result<()> {
        let ts = ptrs(&tensors);
        let tag = self.tag(ctx, tag)?;
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_send(b, ts.as_ptr(), ts.len(), dst as i32, tag, err)
        })
        .await
    }

    async fn recv(
        &self,
        ctx: &OpContext,
        tensors: Vec<Tensor>,
        src: usize,
        tag: u64,
    ) -> Result<()> {
        let ts = ptrs(&tensors);
        let tag = self.tag(ctx, tag)?;
        self.run(ctx, |b, err| unsafe {
            // SAFETY: as in broadcast.
            ffi::wrc_recv(b, ts.as_ptr(), ts.len(), src as i32, tag, err)
        })
        .await
    }

    fn completes_without_polling(&self) -> bool {
        // Issued at the first poll; then a completion callback (gloo) or a
        // blocking-pool wait (nccl) finishes the future without polling.
        true
    }

    /// Drops this side's reference (see the module docs: no abort).
    fn shutdown(&self) {
        let raw = self.raw.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(raw) = raw {
            // SAFETY: raw is live; shutdown fails pending operations.
            unsafe { ffi::wrc_backend_shutdown(raw.0) }
        }
    }
}
