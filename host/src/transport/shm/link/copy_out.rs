//! The receiving side's copy of a storage out of a peer's segment (SHM-1,
//! SHM-5): behind the peer's fill, in stretches that let the thread's
//! other tasks run and that prove the peer alive (LIVE-3).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{COPY_STRETCH, LINK_TIMEOUT, PeerSegment, Record, SEGMENT_HEADER, SPIN, ShmLink};

impl ShmLink {
    /// Copies the storage a frame placed in the peer's segment `id` into
    /// `out` (SHM-1), behind the peer's fill of it (SHM-5), then gives the
    /// segment back. Calls `progress` after each [`COPY_STRETCH`], and lets
    /// the thread's other tasks run there.
    ///
    /// # Errors
    /// Fails if the segment never arrives or is not filled in time, the
    /// link failed, or `out` is longer than the segment holds.
    pub(crate) async fn copy_out(
        self: &Arc<Self>,
        id: u64,
        out: &mut [u8],
        progress: &(dyn Fn() + Sync),
    ) -> Result<(), String> {
        self.copy_out_within(id, out, progress, LINK_TIMEOUT).await
    }

    /// [`copy_out`](Self::copy_out), failing if the peer's fill has not
    /// ended within `fill_timeout` (a test's shorter wait than
    /// [`LINK_TIMEOUT`]).
    pub(crate) async fn copy_out_within(
        self: &Arc<Self>,
        id: u64,
        out: &mut [u8],
        progress: &(dyn Fn() + Sync),
        fill_timeout: Duration,
    ) -> Result<(), String> {
        let PeerSegment::Host(segment) = self.peer_segment(id).await? else {
            return Err(format!(
                "segment {id} is CUDA memory, named for a storage in host memory"
            ));
        };
        if out.len() > segment.len - SEGMENT_HEADER {
            return Err(format!(
                "a storage of {} bytes in a shared segment of {} bytes",
                out.len(),
                segment.len
            ));
        }
        let deadline = tokio::time::Instant::now() + fill_timeout;
        let (mut done, mut waiting_since) = (0, None::<std::time::Instant>);
        while done < out.len() {
            // What the peer says it filled; it can only lie about which
            // bytes arrive (SHM-1), never about where they are read.
            let filled = segment.mark().load(Ordering::Acquire);
            // At most a chunk at a time: copying into fresh memory faults
            // each page in, and on a loaded VM whose host had not backed
            // those pages yet a chunk took up to a third of a second
            // (2026-12-03; 16 MiB at a time, the peers then declared a
            // current-thread caller failed).
            let ready = usize::try_from(filled)
                .map_or(out.len(), |f| f.min(out.len()))
                .min(done + COPY_STRETCH);
            if ready > done {
                // SAFETY: the mapping is alive (the `Arc`) and holds
                // `SEGMENT_HEADER + out.len()` bytes (checked above); it is
                // read-only here.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        segment.ptr.add(SEGMENT_HEADER + done),
                        out.as_mut_ptr().add(done),
                        ready - done,
                    );
                }
                (done, waiting_since) = (ready, None);
                if done < out.len() {
                    progress();
                    tokio::task::yield_now().await;
                }
                continue;
            }
            if self.failed() {
                return Err(format!(
                    "the shared-memory link failed while reading segment {id}"
                ));
            }
            // The peer copies on another core, a chunk in well under a
            // millisecond: look again at once for a while (a timer would
            // wake a millisecond later), then back off.
            let since = *waiting_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() < SPIN {
                tokio::task::yield_now().await;
            } else if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "shared segment {id} was not filled within {fill_timeout:?}"
                ));
            } else {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
        self.send_soon(Record::Release { id });
        Ok(())
    }
}
