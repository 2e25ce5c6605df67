//! Frames: a length-prefixed postcard header, then raw storage bytes.
//!
//! A frame carries one message as opaque bytes (the agent's protocol,
//! `crate::agent::message`, encodes and decodes them) and the tensors its
//! values refer to. This module knows how tensors travel, not what a
//! message means.

use std::io::{self, IoSlice};

use serde::{Deserialize, Serialize};
use tch::Tensor;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use wasmrpc_torch_sys::{BudgetRefusal, MemoryBudget};

use super::MessageKind;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::{Blob, BlobDesc, DecodedBlob, WireTensor, decode_tensors, encode_tensors};

#[derive(Serialize, Deserialize)]
struct Header {
    /// The message, encoded by its owner (the agent).
    message: Vec<u8>,
    tensors: Vec<WireTensor>,
    /// Where each tensor lands (`crate::device::devices_for`); empty: CPU.
    devices: Vec<Device>,
    blobs: Vec<BlobDesc>,
}

/// An encoded frame waiting to be written.
#[derive(Debug)]
pub(crate) struct OutFrame {
    /// Length prefix and header.
    head: Vec<u8>,
    /// Storages, written from tensor memory.
    blobs: Vec<Blob>,
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
        };
        let mut head = vec![0u8; 4];
        let body = crate::abi::encode(&header)
            .map_err(|e| Error::runtime(format!("cannot encode message: {e}")))?;
        let len = u32::try_from(body.len())
            .map_err(|_| Error::runtime("message header larger than 4 GiB"))?;
        head[..4].copy_from_slice(&len.to_le_bytes());
        head.extend_from_slice(&body);
        Ok(OutFrame { head, blobs, kind })
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

/// Reads one frame. `Ok(None)` is a clean end of stream between frames.
/// The storage of its tensors is charged to `budget` when there is one
/// (BUDGET-1 in `crate::tensor::budget`).
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u64,
    budget: Option<&MemoryBudget>,
) -> std::result::Result<Option<(Vec<u8>, Vec<Tensor>)>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
    }
    let head_len = u64::from(u32::from_le_bytes(len));
    if head_len + 4 > max {
        return Err(FrameError::TooLarge {
            size: head_len + 4,
            max,
        });
    }
    let mut head = vec![0u8; head_len as usize];
    r.read_exact(&mut head).await?;
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
    let mut blobs = Vec::with_capacity(header.blobs.len());
    for (i, desc) in header.blobs.iter().enumerate() {
        let blob = match budget {
            None => DecodedBlob::new(*desc),
            Some(budget) => match budget.run(|| DecodedBlob::new(*desc)) {
                (_, Some(refusal)) => {
                    drop(blobs);
                    let rest = header.blobs[i..].iter().map(|b| b.len).sum();
                    skip(r, rest).await?;
                    return Err(FrameError::OverBudget(header.message, refusal));
                }
                (blob, None) => blob,
            },
        };
        let mut blob = blob.map_err(FrameError::Tensor)?;
        r.read_exact(blob.bytes_mut()).await?;
        blobs.push(blob);
    }
    let tensors =
        decode_tensors(&header.tensors, &blobs, &header.devices).map_err(FrameError::Tensor)?;
    Ok(Some((header.message, tensors)))
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
mod tests {
    use super::*;
    use crate::abi::Value;
    use tch::{Device, Kind};

    const KIND: MessageKind = MessageKind::new("Test");

    /// A message as its owner would encode it: here, the tensor indexes
    /// its values would hold.
    fn call(tensors: usize) -> Vec<u8> {
        let values: Vec<Value> = (0..tensors as u32).map(Value::Tensor).collect();
        crate::abi::encode(&values).unwrap()
    }

    fn tensor_count(message: &[u8]) -> usize {
        crate::abi::decode::<Vec<Value>>(message).unwrap().len()
    }

    #[tokio::test]
    async fn frames_round_trip_and_truncations_are_errors() {
        let t = Tensor::rand([3, 4], (Kind::Float, Device::Cpu));
        let frame = OutFrame::encode(call(1), KIND, &[t.shallow_clone()], &[]).unwrap();
        let mut bytes = Vec::new();
        write_frame(&mut bytes, &frame, 0).await.unwrap();
        assert_eq!(bytes.len() as u64, frame.len());
        // Resuming at any offset writes exactly the rest.
        for offset in [1, 4, bytes.len() - 1] {
            let mut rest = Vec::new();
            write_frame(&mut rest, &frame, offset).await.unwrap();
            assert_eq!(rest, bytes[offset..], "offset {offset}");
        }
        let (m, ts) = read_frame(&mut &bytes[..], 1 << 20, None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m, call(1));
        assert!(ts[0].equal(&t));
        for cut in 1..bytes.len() {
            assert!(
                read_frame(&mut &bytes[..cut], 1 << 20, None).await.is_err(),
                "cut at {cut}"
            );
        }
        assert!(matches!(
            read_frame(&mut &bytes[..], 16, None).await,
            Err(FrameError::TooLarge { .. })
        ));
        assert!(read_frame(&mut &b""[..], 16, None).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_frame_over_the_budget_is_refused_and_the_next_one_still_reads() {
        let big = Tensor::zeros([1 << 18], (Kind::Float, Device::Cpu));
        let small = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let mut bytes = Vec::new();
        for (message, tensors) in [
            (call(2), [small.shallow_clone(), big]),
            (call(1), [small.shallow_clone(), small.shallow_clone()]),
        ] {
            let n = tensor_count(&message);
            let frame = OutFrame::encode(message, KIND, &tensors[..n], &[]).unwrap();
            write_frame(&mut bytes, &frame, 0).await.unwrap();
        }
        let budget = MemoryBudget::new(64 << 10);
        let mut r = &bytes[..];
        match read_frame(&mut r, 16 << 20, Some(&budget)).await {
            Err(FrameError::OverBudget(message, refusal)) => {
                assert_eq!(message, call(2));
                assert_eq!((refusal.asked, refusal.limit), (1 << 20, 64 << 10));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(budget.used(), 0, "the refused frame holds nothing");
        let (m, ts) = read_frame(&mut r, 16 << 20, Some(&budget))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m, call(1));
        assert!(ts[0].equal(&small));
        assert_eq!(
            budget.used(),
            16,
            "received tensors are charged while they live"
        );
        drop(ts);
        assert_eq!(budget.used(), 0);
        assert!(r.is_empty());
    }

    #[test]
    fn partial_non_blocking_writes_of_a_batch_resume_where_they_stopped() {
        let t = Tensor::rand([100], (Kind::Float, Device::Cpu));
        let frames: Vec<OutFrame> = (0..3)
            .map(|i| OutFrame::encode(call(i), KIND, &[t.shallow_clone()], &[]).unwrap())
            .collect();
        let mut out = Vec::new();
        let mut at = BatchPosition::default();
        // A socket that takes 7 bytes per attempt, every other attempt.
        let mut turn = 0;
        while at.frame < frames.len() {
            at = try_write_frames(&frames, at, |slices| {
                turn += 1;
                if turn % 2 == 0 {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                let mut n = 0;
                for s in slices {
                    let take = (7 - n).min(s.len());
                    out.extend_from_slice(&s[..take]);
                    n += take;
                }
                Ok(n)
            })
            .unwrap();
        }
        let mut whole = Vec::new();
        for frame in &frames {
            futures::executor::block_on(write_frame(&mut whole, frame, 0)).unwrap();
        }
        assert_eq!(out, whole);
    }

    #[test]
    fn a_batch_goes_in_one_write_when_the_socket_takes_it() {
        let frames: Vec<OutFrame> = (0..5)
            .map(|i| OutFrame::encode(call(i), KIND, &[], &[]).unwrap())
            .collect();
        let (mut writes, mut out) = (0, Vec::new());
        let at = try_write_frames(&frames, BatchPosition::default(), |slices| {
            writes += 1;
            slices.iter().for_each(|s| out.extend_from_slice(s));
            Ok(slices.iter().map(|s| s.len()).sum())
        })
        .unwrap();
        assert_eq!(
            (at, writes),
            (
                BatchPosition {
                    frame: 5,
                    offset: 0
                },
                1
            )
        );
        let total: u64 = frames.iter().map(OutFrame::len).sum();
        assert_eq!(out.len() as u64, total);
        // A socket that takes nothing leaves the batch where it was.
        let stuck = BatchPosition {
            frame: 2,
            offset: 3,
        };
        let at = try_write_frames(&frames, stuck, |_| Err(io::ErrorKind::WouldBlock.into()));
        assert_eq!(at.unwrap(), stuck);
    }

    #[tokio::test]
    async fn garbage_is_an_error() {
        let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(read_frame(&mut &garbage[..], 1 << 20, None).await.is_err());
    }

    use wasmrpc_mutation::{huge_numbers, mutate};

    fn mutation() -> impl proptest::strategy::Strategy<Value = wasmrpc_mutation::Mutation> {
        wasmrpc_mutation::mutation(huge_numbers(), 8)
    }

    /// The frame limit of the property tests: small, so that announced
    /// sizes over it are common.
    const MAX: u64 = 64 << 10;

    /// Valid frames: a call with tensors of several dtypes and layouts.
    fn valid_frame(shape: &[i64], tensors: usize) -> Vec<u8> {
        let float = Tensor::rand(shape, (Kind::Float, Device::Cpu));
        let all = [
            float.shallow_clone(),
            Tensor::arange(12, (Kind::Int64, Device::Cpu))
                .view([3, 4])
                .tr(),
            Tensor::ones([2], (Kind::Bool, Device::Cpu)),
            Tensor::eye(3, (Kind::Float, Device::Cpu)).to_sparse_sparse_dim(2),
        ];
        let frame = OutFrame::encode(call(tensors), KIND, &all[..tensors], &[]).unwrap();
        let mut bytes = Vec::new();
        futures::executor::block_on(write_frame(&mut bytes, &frame, 0)).unwrap();
        bytes
    }

    /// Reads one frame from `bytes` with the limit [`MAX`], on a fresh
    /// runtime, failing the case on a hang (5 s) and, when it decodes, on
    /// tensors holding more bytes than the input had (an allocation the
    /// input did not pay for).
    fn read_bounded(bytes: &[u8]) -> Result<(), proptest::test_runner::TestCaseError> {
        use proptest::test_runner::TestCaseError;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got = rt
            .block_on(async {
                tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    read_frame(&mut &bytes[..], MAX, None),
                )
                .await
            })
            .map_err(|_| TestCaseError::fail("read_frame hung"))?;
        if let Ok(Some((_, tensors))) = got {
            let held: u64 = tensors
                .iter()
                .map(|t| {
                    let t = if t.is_sparse() {
                        t.values()
                    } else {
                        t.shallow_clone()
                    };
                    (t.numel() * t.kind().elt_size_in_bytes()) as u64
                })
                .sum();
            proptest::prop_assert!(
                held <= bytes.len() as u64,
                "{held} bytes from {}",
                bytes.len()
            );
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_bytes_are_an_error_or_a_frame(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
        ) {
            read_bounded(&bytes)?;
        }

        #[test]
        fn mutated_frames_are_an_error_or_a_frame(
            shape in proptest::collection::vec(0i64..4, 0..3),
            tensors in 0usize..=4,
            ms in proptest::collection::vec(mutation(), 1..4),
        ) {
            read_bounded(&mutate(valid_frame(&shape, tensors), &ms))?;
        }

        /// A header announcing more than the limit is refused from its
        /// 4-byte prefix alone, before anything is allocated for it.
        #[test]
        fn announced_headers_over_the_limit_are_refused_at_once(len in (MAX as u32 - 3)..=u32::MAX) {
            let bytes = len.to_le_bytes();
            let got = futures::executor::block_on(read_frame(&mut &bytes[..], MAX, None));
            proptest::prop_assert!(matches!(got, Err(FrameError::TooLarge { .. })), "{got:?}");
        }

        /// A header announcing blobs whose total is over the limit is
        /// refused before any blob is allocated or read.
        #[test]
        fn announced_blobs_over_the_limit_are_refused_before_reading_them(
            lens in proptest::collection::vec(proptest::prelude::any::<u64>(), 1..4),
        ) {
            let total = lens.iter().fold(0u64, |a, l| a.saturating_add(*l));
            proptest::prop_assume!(total > MAX);
            let header = Header {
                message: call(0),
                tensors: vec![],
                devices: vec![],
                blobs: lens.iter().map(|&len| BlobDesc { dtype: 6, len }).collect(),
            };
            let body = crate::abi::encode(&header).unwrap();
            let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
            bytes.extend_from_slice(&body);
            // No blob bytes follow: reading one would be an EOF, not TooLarge.
            let got = futures::executor::block_on(read_frame(&mut &bytes[..], MAX, None));
            proptest::prop_assert!(matches!(got, Err(FrameError::TooLarge { .. })), "{got:?}");
        }
    }
}
