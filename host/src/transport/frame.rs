//! Frames: a length-prefixed postcard header, then raw storage bytes.
//!
//! A frame carries one message as opaque bytes (the agent's protocol,
//! `crate::agent::message`, encodes and decodes them) and the tensors its
//! values refer to. This module knows how tensors travel, not what a
//! message means.
//!
//! A frame whose length prefix is zero is a heartbeat ([`OutFrame::heartbeat`]):
//! it carries nothing, and the reader skips it. No encoded header is empty,
//! so the two never meet.

use std::io::{self, IoSlice};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tch::Tensor;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use wasmrpc_torch_sys::{BudgetRefusal, MemoryBudget};

use super::MessageKind;

/// The kind of a heartbeat frame ([`OutFrame::heartbeat`]).
pub(crate) const HEARTBEAT: MessageKind = MessageKind::new("heartbeat");
use super::shm::{Lent, PIPELINE_FROM, SHARE_THRESHOLD, ShmLink, ShmSlot};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::{
    Blob, BlobDesc, DecodedBlob, WireTensor, cuda_landings, decode_tensors, encode_tensors,
    sole_shapes,
};

#[derive(Serialize, Deserialize)]
struct Header {
    /// The message, encoded by its owner (the agent).
    message: Vec<u8>,
    tensors: Vec<WireTensor>,
    /// Where each tensor lands (`crate::device::devices_for`); empty: CPU.
    devices: Vec<Device>,
    blobs: Vec<BlobDesc>,
    /// Storages that cross in shared memory instead of after the header
    /// (TR-9), host or CUDA segments alike, by increasing blob index.
    shared: Vec<SharedBlob>,
}

/// A storage in a segment of the sender's shared-memory link.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct SharedBlob {
    /// Its index in `Header::blobs`.
    blob: u32,
    /// The segment it was copied into.
    segment: u64,
}

/// An encoded frame waiting to be placed ([`OutFrame::place`]) and written.
pub(crate) struct OutFrame {
    /// What `head` encodes, kept (only when a storage is large enough to
    /// move to shared memory, or on a CUDA device) to encode again after
    /// placing it.
    header: Option<Box<Header>>,
    /// Length prefix and header.
    head: Vec<u8>,
    /// Storages written after the header, from tensor memory.
    blobs: Vec<Blob>,
    /// Whether [`place`](Self::place) ran.
    placed: bool,
    /// The message's kind.
    pub(crate) kind: MessageKind,
}

impl OutFrame {
    /// Encodes `message` (bytes of kind `kind`) with the tensors its values
    /// refer to, each to land on `devices[i]` (empty: all on the CPU).
    ///
    /// # Errors
    /// Fails if a tensor cannot travel.
    pub(crate) fn encode(
        message: Vec<u8>,
        kind: MessageKind,
        tensors: &[Tensor],
        devices: &[Device],
    ) -> Result<Self> {
        let (tensors, blobs_desc, blobs) = encode_tensors(tensors)?;
        let header = Header {
            message,
            tensors,
            devices: devices.to_vec(),
            blobs: blobs_desc,
            shared: Vec::new(),
        };
        let head = encode_head(&header)?;
        let header = blobs
            .iter()
            .any(|b| b.len() >= SHARE_THRESHOLD || b.cuda_device().is_some())
            .then(|| Box::new(header));
        Ok(OutFrame {
            header,
            head,
            blobs,
            placed: false,
            kind,
        })
    }

    /// Decides where each storage travels, once, before the frame is
    /// queued: with a `link` (a peer on this host, TR-9), a CUDA storage
    /// that lands on a CUDA device goes into a CUDA segment (SHM-6,
    /// SHM-7) and a host storage of at least [`SHARE_THRESHOLD`] bytes into
    /// a host segment; every other CUDA storage is staged in host memory,
    /// and every other storage stays in the frame, after the header.
    /// Storages of [`PIPELINE_FROM`] bytes and more in host segments are
    /// copied by the returned fills, which the caller runs after queueing
    /// the frame (SHM-5).
    ///
    /// # Errors
    /// Fails if a CUDA storage cannot be staged or the header cannot be
    /// encoded again.
    pub(crate) fn place(&mut self, link: Option<&Arc<ShmLink>>) -> Result<Vec<SharedFill>> {
        if std::mem::replace(&mut self.placed, true) {
            return Ok(Vec::new());
        }
        let Some(header) = self.header.as_mut() else {
            return Ok(Vec::new());
        };
        let landings = match link {
            Some(_) if self.blobs.iter().any(|b| b.cuda_device().is_some()) => {
                cuda_landings(&header.tensors, &header.devices, self.blobs.len())
            }
            _ => Vec::new(),
        };
        let (mut kept, mut fills) = (Vec::with_capacity(self.blobs.len()), Vec::new());
        for (i, blob) in std::mem::take(&mut self.blobs).into_iter().enumerate() {
            let index = u32::try_from(i)
                .map_err(|_| Error::runtime("more than 2^32 storages in one message"))?;
            let blob = match (blob.cuda_device(), link, landings.get(i).copied().flatten()) {
                (None, ..) => blob,
                (Some(device), Some(link), Some(_)) => match share_cuda(link, &blob, device) {
                    Some(segment) => {
                        header.shared.push(SharedBlob {
                            blob: index,
                            segment,
                        });
                        continue;
                    }
                    None => blob.into_host()?,
                },
                (Some(_), ..) => blob.into_host()?,
            };
            let lent = (blob.len() >= SHARE_THRESHOLD)
                .then(|| link.and_then(|l| l.lend(blob.len())))
                .flatten();
            match lent {
                Some(lent) => {
                    header.shared.push(SharedBlob {
                        blob: index,
                        segment: lent.id(),
                    });
                    if blob.len() < PIPELINE_FROM {
                        lent.fill(blob.as_bytes());
                    } else {
                        fills.push(SharedFill { lent, blob });
                    }
                }
                None => kept.push(blob),
            }
        }
        self.blobs = kept;
        if !header.shared.is_empty() {
            self.head = encode_head(header)?;
        }
        Ok(fills)
    }

    /// A heartbeat: a zero length prefix and nothing else, sent on a
    /// connection that has been idle for a while (LIVE-1). The reader skips
    /// it; that bytes arrived at all is the news.
    pub(crate) fn heartbeat() -> Self {
        OutFrame {
            header: None,
            head: vec![0; 4],
            blobs: Vec::new(),
            placed: true,
            kind: HEARTBEAT,
        }
    }

    /// The frame's total size in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.head.len() as u64 + self.blobs.iter().map(|b| b.len() as u64).sum::<u64>()
    }
}

impl OutFrame {
    /// The frame's bytes from `offset` on, as slices of the header and of
    /// tensor memory.
    fn slices(&self, offset: usize) -> Vec<IoSlice<'_>> {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(1 + self.blobs.len());
        slices.push(IoSlice::new(&self.head));
        slices.extend(self.blobs.iter().map(|b| IoSlice::new(b.as_bytes())));
        let mut skip = offset;
        let first = slices
            .iter()
            .position(|s| {
                if skip < s.len() {
                    true
                } else {
                    skip -= s.len();
                    false
                }
            })
            .unwrap_or(slices.len());
        slices.drain(..first);
        if let Some(s) = slices.first_mut() {
            let mut one = [*s];
            IoSlice::advance_slices(&mut &mut one[..], skip);
            *s = one[0];
        }
        slices
    }
}

/// Copies a CUDA storage into a CUDA segment of `link` on its device
/// (SHM-6): the segment's id, or `None` when the link has none to lend or
/// the copy fails (the storage then travels through host memory).
fn share_cuda(link: &Arc<ShmLink>, blob: &Blob, device: u32) -> Option<u64> {
    let Some(lent) = link.lend_cuda(blob.len(), device) else {
        link.cuda_fell_back("no CUDA segment to lend (all lent, or none could be made)");
        return None;
    };
    let id = lent.id();
    // SAFETY: the blob's bytes are device memory on `device`, kept alive by
    // the blob for the call.
    match unsafe { lent.fill(blob.address(), blob.len()) } {
        Ok(()) => Some(id),
        Err(e) => {
            link.cuda_fell_back(&e);
            None
        }
    }
}

/// A storage to copy into the segment lent for it, once its frame is
/// queued (SHM-5).
pub(crate) struct SharedFill {
    lent: Lent,
    blob: Blob,
}

impl SharedFill {
    /// Copies the storage into its segment; the receiver reads behind.
    ///
    /// A long fill (a fresh segment of a GiB took 2.6 s to fault in on a
    /// 2-core VM) runs on tokio's blocking pool and this returns at once,
    /// so that the caller's runtime thread stays free: on a runtime of one
    /// thread its readers and heartbeats would otherwise wait for the fill,
    /// and peers other than the receiver (which sees the fill's progress)
    /// would declare this worker failed (LIVE-2). The storage is read after
    /// this returns, as a frame the writer task sends is; callers keep
    /// argument tensors unchanged until their call completes anyway
    /// (`rpc_async`'s contract). Without a runtime the fill runs here.
    pub(crate) fn run(self) {
        if self.blob.as_bytes().len() >= super::shm::LONG_COPY {
            super::shm::off_the_runtime(move || self.fill());
        } else {
            self.fill();
        }
    }

    fn fill(self) {
        #[cfg(test)]
        let _held = super::shm::BULK_WORK_GATE.read();
        self.lent.fill(self.blob.as_bytes());
    }
}

impl std::fmt::Debug for OutFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutFrame")
            .field("kind", &self.kind)
            .field("len", &self.len())
            .field(
                "shared",
                &self.header.as_ref().map_or(0, |h| h.shared.len()),
            )
            .finish()
    }
}

/// The length prefix and the encoded header, in one buffer sized once:
/// every frame sent pays for this, and a buffer grown from empty (or the
/// header encoded apart and copied behind the prefix) cost the callee of
/// small calls with 128 in flight about a tenth of its CPU in reallocations.
fn encode_head(header: &Header) -> Result<Vec<u8>> {
    // An upper bound for all but unusual tensors (a dense tensor's entry is
    // a dozen bytes plus a few per dimension), so the buffer rarely grows;
    // 17: the prefix, the message's length and the vectors' lengths.
    let entries = 48 * header.tensors.len() + 2 * header.devices.len();
    let storages = 12 * header.blobs.len() + 16 * header.shared.len();
    let mut head = Vec::with_capacity(17 + header.message.len() + entries + storages);
    head.extend_from_slice(&[0u8; 4]);
    let mut head = crate::abi::encode_append(header, head)
        .map_err(|e| Error::runtime(format!("cannot encode message: {e}")))?;
    let len = u32::try_from(head.len() - 4)
        .map_err(|_| Error::runtime("message header larger than 4 GiB"))?;
    head[..4].copy_from_slice(&len.to_le_bytes());
    Ok(head)
}

/// Where writing a batch of frames stands: frames before `frame` went
/// whole, and `offset` bytes of `frame`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BatchPosition {
    pub(crate) frame: usize,
    pub(crate) offset: usize,
}

/// Writes what the socket takes of `frames`, in order, from `at` on,
/// without waiting, the frames' slices gathered into as few vectored
/// writes as it takes (one syscall for many small frames): returns where
/// the writing stopped (`frame == frames.len()` when all went). `try_write`
/// is one non-blocking `writev` attempt, as tokio's `try_write_vectored`.
pub(crate) fn try_write_frames(
    frames: &[OutFrame],
    mut at: BatchPosition,
    mut try_write: impl FnMut(&[IoSlice<'_>]) -> io::Result<usize>,
) -> io::Result<BatchPosition> {
    // writev takes at most IOV_MAX (1024) slices.
    const IOV_MAX: usize = 1024;
    while at.frame < frames.len() {
        let mut slices = frames[at.frame].slices(at.offset);
        for frame in &frames[at.frame + 1..] {
            if slices.len() >= IOV_MAX {
                break;
            }
            slices.extend(frame.slices(0));
        }
        let mut written = match try_write(&slices[..slices.len().min(IOV_MAX)]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "connection closed while writing a frame",
                ));
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        };
        while written > 0 {
            let rest = frames[at.frame].len() as usize - at.offset;
            if written < rest {
                at.offset += written;
                break;
            }
            written -= rest;
            at = BatchPosition {
                frame: at.frame + 1,
                offset: 0,
            };
        }
    }
    Ok(at)
}

/// Writes `frame` from byte `offset` on, with vectored writes straight from
/// tensor memory.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    frame: &OutFrame,
    offset: usize,
) -> io::Result<()> {
    let mut slices = frame.slices(offset);
    let mut bufs = &mut slices[..];
    while !bufs.is_empty() {
        // writev takes at most IOV_MAX (1024) slices.
        let window = bufs.len().min(1024);
        let n = w.write_vectored(&bufs[..window]).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "connection closed while writing a frame",
            ));
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Why a frame could not be read. Every variant closes the connection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The socket failed or closed in the middle of a frame.
    #[error("connection failed: {0}")]
    Io(#[from] io::Error),
    /// The frame is larger than the configured maximum.
    #[error("frame of {size} bytes exceeds the maximum frame size of {max} bytes")]
    TooLarge {
        /// The announced size.
        size: u64,
        /// The configured maximum.
        max: u64,
    },
    /// The header does not decode.
    #[error("malformed frame header: {0}")]
    Malformed(String),
    /// The tensors do not match their blobs.
    #[error("malformed tensor in frame: {0}")]
    Tensor(Error),
    /// Receiving the frame's tensors would take the receiver's tensor
    /// memory budget over its limit. The frame was read to its end (the
    /// connection stays usable) and its tensors were dropped; the message
    /// is kept so the receiver can answer it.
    #[error("receiving {} bytes of tensors exceeds the tensor memory budget of {} bytes", .1.asked, .1.limit)]
    OverBudget(Vec<u8>, BudgetRefusal),
}

/// The network layer's reading errors as the transport's: a socket that
/// failed or ended inside a frame is a broken connection (the peer is gone,
/// `crate::agent`'s failures), a head over the limit a frame too large.
impl From<wasmrpc_net::frame::FrameError> for FrameError {
    fn from(e: wasmrpc_net::frame::FrameError) -> Self {
        use wasmrpc_net::frame::FrameError as Net;
        match e {
            Net::Io(e) => FrameError::Io(e),
            Net::Truncated { .. } => {
                FrameError::Io(io::Error::new(io::ErrorKind::UnexpectedEof, e.to_string()))
            }
            Net::TooLarge { len, max } => FrameError::TooLarge {
                size: len + 4,
                max: max + 4,
            },
        }
    }
}

/// Reads one frame. `Ok(None)` is a clean end of stream between frames.
/// The storage of its tensors is charged to `budget` when there is one
/// (BUDGET-1 in `crate::tensor::budget`); storages in shared memory are
/// copied out of the connection's link `shm` (TR-9).
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u64,
    budget: Option<&MemoryBudget>,
    shm: Option<&ShmSlot>,
    activity: Option<&wasmrpc_net::liveness::Activity>,
) -> std::result::Result<Option<(Vec<u8>, Vec<Tensor>)>, FrameError> {
    // The prefix and the head are read by the network layer's rules
    // (`wasmrpc_net::frame`, FRAME-1 to FRAME-3), as the c10d mesh reads
    // its frames.
    let head_len = loop {
        let Some(len) = wasmrpc_net::frame::read_prefix::<_, 4>(r).await? else {
            return Ok(None);
        };
        // A heartbeat: nothing to deliver.
        match u32::from_le_bytes(len) {
            0 => continue,
            n => break u64::from(n),
        }
    };
    if head_len + 4 > max {
        return Err(FrameError::TooLarge {
            size: head_len + 4,
            max,
        });
    }
    let head = wasmrpc_net::frame::read_body(r, head_len, max - 4).await?;
    let header: Header =
        crate::abi::decode(&head).map_err(|e| FrameError::Malformed(e.to_string()))?;
    let total = header
        .blobs
        .iter()
        .try_fold(head_len + 4, |acc, b| acc.checked_add(b.len))
        .unwrap_or(u64::MAX);
    if total > max {
        return Err(FrameError::TooLarge { size: total, max });
    }
    let segments = shared_segments(&header)?;
    let link = match (segments.iter().any(Option::is_some), shm) {
        (false, _) => None,
        (true, Some(slot)) => slot.wait().await,
        (true, None) => None,
    };
    if segments.iter().any(Option::is_some) && link.is_none() {
        return Err(FrameError::Malformed(
            "the frame names shared-memory segments, but the connection has no link".into(),
        ));
    }
    let shapes = sole_shapes(&header.tensors, header.blobs.len());
    // No landing devices: everything lands on the CPU (the small calls' case,
    // which pays for nothing here).
    let landings = if header.devices.is_empty() {
        Vec::new()
    } else {
        cuda_landings(&header.tensors, &header.devices, header.blobs.len())
    };
    let mut blobs = Vec::with_capacity(header.blobs.len());
    for (i, desc) in header.blobs.iter().enumerate() {
        // A storage in a CUDA segment is copied straight to the device it
        // lands on, and only a storage that lands on one (SHM-7).
        let cuda = match (segments[i], link) {
            (Some(segment), Some(link)) => {
                if link
                    .is_cuda_segment(segment)
                    .await
                    .map_err(FrameError::Malformed)?
                {
                    Some(landings.get(i).copied().flatten().ok_or_else(|| {
                        FrameError::Malformed(format!(
                            "CUDA segment {segment} named for storage {i}, which does not land \
                             on one CUDA device as a dense tensor"
                        ))
                    })?)
                } else {
                    None
                }
            }
            _ => None,
        };
        let on = cuda.map_or(tch::Device::Cpu, |d| Device::Cuda(d).to_tch());
        let blob = match budget {
            None => DecodedBlob::new_on(*desc, shapes[i], on),
            Some(budget) => match budget.run(|| DecodedBlob::new_on(*desc, shapes[i], on)) {
                (_, Some(refusal)) => {
                    drop(blobs);
                    let mut rest = 0;
                    for (desc, segment) in header.blobs[i..].iter().zip(&segments[i..]) {
                        match (segment, link) {
                            (Some(segment), Some(link)) => link.give_back(*segment),
                            _ => rest += desc.len,
                        }
                    }
                    skip(r, rest).await?;
                    return Err(FrameError::OverBudget(header.message, refusal));
                }
                (blob, None) => blob,
            },
        };
        let mut blob = blob.map_err(FrameError::Tensor)?;
        match (segments[i], link, cuda) {
            (Some(segment), Some(link), Some(device)) => {
                // SAFETY: the blob is a tensor of `blob.len()` bytes this
                // side just allocated on `device`, which no one reads
                // before `decode_tensors` below.
                unsafe { link.copy_out_cuda(segment, device, blob.address(), blob.len()) }
                    .await
                    .map_err(FrameError::Malformed)?;
            }
            (Some(segment), Some(link), None) => {
                // A long copy proves the peer alive as socket reads would.
                let progress =
                    || activity.map_or((), wasmrpc_net::liveness::Activity::read_elsewhere);
                link.copy_out(segment, blob.bytes_mut(), &progress)
                    .await
                    .map_err(FrameError::Malformed)?
            }
            _ => r.read_exact(blob.bytes_mut()).await.map(drop)?,
        }
        // A storage that lands on one CUDA device goes there whole, so the
        // tensors that share it share it there too.
        if let (None, Some(device)) = (cuda, landings.get(i).copied().flatten()) {
            blob.move_to(Device::Cuda(device).to_tch())
                .map_err(FrameError::Tensor)?;
        }
        blobs.push(blob);
    }
    let tensors =
        decode_tensors(&header.tensors, &blobs, &header.devices).map_err(FrameError::Tensor)?;
    Ok(Some((header.message, tensors)))
}

/// The segment each blob of `header` is in, if any; fails unless the shared
/// blobs are distinct, in order, and blobs of the header.
fn shared_segments(header: &Header) -> std::result::Result<Vec<Option<u64>>, FrameError> {
    let mut segments = vec![None; header.blobs.len()];
    let mut next = 0;
    for shared in &header.shared {
        let i = shared.blob as usize;
        if i < next || i >= segments.len() {
            return Err(FrameError::Malformed(format!(
                "shared blob {i} out of order or out of range"
            )));
        }
        segments[i] = Some(shared.segment);
        next = i + 1;
    }
    Ok(segments)
}

/// Reads and drops `len` bytes.
async fn skip<R: AsyncRead + Unpin>(r: &mut R, len: u64) -> io::Result<()> {
    let copied = tokio::io::copy(&mut (&mut *r).take(len), &mut tokio::io::sink()).await?;
    if copied < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
