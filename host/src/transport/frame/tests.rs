//! Tests of `frame`: round trips, truncations, budgets, batches, and
//! property tests with arbitrary and mutated bytes.

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
    let (m, ts) = read_frame(&mut &bytes[..], 1 << 20, None, None, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m, call(1));
    assert!(ts[0].equal(&t));
    for cut in 1..bytes.len() {
        assert!(
            read_frame(&mut &bytes[..cut], 1 << 20, None, None, None)
                .await
                .is_err(),
            "cut at {cut}"
        );
    }
    assert!(matches!(
        read_frame(&mut &bytes[..], 16, None, None, None).await,
        Err(FrameError::TooLarge { .. })
    ));
    assert!(
        read_frame(&mut &b""[..], 16, None, None, None)
            .await
            .unwrap()
            .is_none()
    );
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
    match read_frame(&mut r, 16 << 20, Some(&budget), None, None).await {
        Err(FrameError::OverBudget(message, refusal)) => {
            assert_eq!(message, call(2));
            assert_eq!((refusal.asked, refusal.limit), (1 << 20, 64 << 10));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(budget.used(), 0, "the refused frame holds nothing");
    let (m, ts) = read_frame(&mut r, 16 << 20, Some(&budget), None, None)
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
    assert!(
        read_frame(&mut &garbage[..], 1 << 20, None, None, None)
            .await
            .is_err()
    );
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
                read_frame(&mut &bytes[..], MAX, None, None, None),
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
        let got = futures::executor::block_on(read_frame(&mut &bytes[..], MAX, None, None, None));
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
            shared: vec![],
        };
        let body = crate::abi::encode(&header).unwrap();
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        // No blob bytes follow: reading one would be an EOF, not TooLarge.
        let got = futures::executor::block_on(read_frame(&mut &bytes[..], MAX, None, None, None));
        proptest::prop_assert!(matches!(got, Err(FrameError::TooLarge { .. })), "{got:?}");
    }
}

/// A socket error or an end inside a frame, read by the network layer, is
/// a broken connection for the transport (`FrameError::Io`: the reader
/// reports the peer gone, and the agent declares it failed), never a bad
/// frame; over TLS a peer that dies ends its stream with such an error.
#[test]
fn the_network_layers_reading_errors_are_broken_connections() {
    use wasmrpc_net::frame::FrameError as Net;
    let reset = Net::Io(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed"));
    assert!(matches!(FrameError::from(reset), FrameError::Io(_)));
    let truncated = Net::Truncated { got: 2, len: 4 };
    assert!(matches!(
        FrameError::from(truncated),
        FrameError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof
    ));
    let large = Net::TooLarge { len: 10, max: 5 };
    assert!(matches!(
        FrameError::from(large),
        FrameError::TooLarge { size: 14, max: 9 }
    ));
}
