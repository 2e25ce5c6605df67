//! The link's CUDA segments (SHM-6, SHM-7): lending this side's, copying
//! out of the peer's, and the warning when a CUDA storage goes through host
//! memory instead. The driver calls are `shm::cuda`'s; the bookkeeping
//! shared with host segments (lending, giving back, giving up) is the
//! link's.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::cuda::DeviceSegment;
use super::super::{Record, lock};
use super::{OwnMemory, PeerSegment, ShmLink};

/// A CUDA segment lent for one storage: filled at once, before the frame
/// naming it is queued.
pub(crate) struct LentCuda {
    link: Arc<ShmLink>,
    id: u64,
    segment: Arc<DeviceSegment>,
}

impl LentCuda {
    /// The segment's id, for the frame to name.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Copies `len` bytes of device memory at `src` into the segment. On
    /// failure the segment is free again, and the storage must travel
    /// another way.
    ///
    /// # Errors
    /// The driver's error.
    ///
    /// # Safety
    /// `src .. src + len` must be device memory of this process on the
    /// segment's device, alive for the call.
    pub(crate) unsafe fn fill(self, src: u64, len: usize) -> Result<(), String> {
        // SAFETY: the caller vouches for the source; the segment is this
        // side's to write while lent and not yet named by a frame (SHM-3).
        match unsafe { self.segment.fill(src, len) } {
            Ok(()) => {
                self.link.filled(self.id, len);
                self.link
                    .sent_cuda_bytes
                    .fetch_add(len as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.link.unlend(self.id);
                Err(e)
            }
        }
    }
}

impl ShmLink {
    /// Lends a free CUDA segment on `device` for a storage of `len` bytes
    /// there (SHM-6), to be filled at once (`LentCuda::fill`). `None` when
    /// the link failed, every segment is lent, or no segment can be made
    /// (no driver, the device out of memory): the storage then travels
    /// through host memory.
    pub(crate) fn lend_cuda(self: &Arc<Self>, len: usize, device: u32) -> Option<LentCuda> {
        if self.failed() || len == 0 {
            return None;
        }
        let mut pool = lock(&self.own);
        let segment = self.lend_from(&mut pool, len, Some(device), |size| {
            DeviceSegment::new(device, size)
                .map_err(|e| self.cuda_fell_back(&format!("cannot make a CUDA segment: {e}")))
                .ok()
                .map(|s| OwnMemory::Cuda(Arc::new(s)))
        })?;
        let OwnMemory::Cuda(cuda) = &segment.memory else {
            return None;
        };
        Some(LentCuda {
            link: Arc::clone(self),
            id: segment.id,
            segment: Arc::clone(cuda),
        })
    }

    /// Copies the storage a frame placed in the peer's CUDA segment `id`
    /// to `len` bytes of device memory at `dst` on CUDA `device` (SHM-1,
    /// SHM-7), then gives the segment back.
    ///
    /// # Errors
    /// Fails if the segment never arrives, is host memory, does not open,
    /// or holds fewer bytes; the driver's errors.
    ///
    /// # Safety
    /// `dst .. dst + len` must be device memory of this process on
    /// `device`, alive and read by no one until this returns.
    pub(crate) async unsafe fn copy_out_cuda(
        self: &Arc<Self>,
        id: u64,
        device: u32,
        dst: u64,
        len: usize,
    ) -> Result<(), String> {
        let PeerSegment::Cuda(segment) = self.peer_segment(id).await? else {
            return Err(format!(
                "segment {id} is host memory, named for a storage in CUDA memory"
            ));
        };
        // SAFETY: the caller vouches for the destination.
        unsafe { segment.copy_to(device, dst, len) }
            .map_err(|e| format!("CUDA segment {id}: {e}"))?;
        self.send_soon(Record::Release { id });
        Ok(())
    }

    /// Whether the peer's segment `id` is device memory (waiting for its
    /// record as `copy_out` does).
    ///
    /// # Errors
    /// As `copy_out`, when the segment never arrives.
    pub(crate) async fn is_cuda_segment(&self, id: u64) -> Result<bool, String> {
        Ok(matches!(self.peer_segment(id).await?, PeerSegment::Cuda(_)))
    }

    /// A CUDA storage goes through host memory because of `why`: a warning,
    /// once per link, since it costs the CUDA path's speed (two host copies
    /// and the socket instead of two device copies).
    pub(crate) fn cuda_fell_back(&self, why: &str) {
        if !self.cuda_fell_back.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                "CUDA storages to a worker on this host go through host memory: {why} \
                 (warned once per connection)"
            );
        }
    }
}
