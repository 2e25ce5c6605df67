//! Tests of `shm`: links over socket pairs, hostile records, the listener's
//! tokens, and a frame whose storage crosses in shared memory.

use super::*;
use crate::transport::MessageKind;
use crate::transport::frame::{OutFrame, read_frame, write_frame};

fn pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .unwrap()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// A frame whose message is `tensor` alone.
fn frame_of(tensor: &tch::Tensor) -> OutFrame {
    let message = crate::abi::encode(&vec![crate::abi::Value::Tensor(0)]).unwrap();
    OutFrame::encode(
        message,
        MessageKind::new("Test"),
        &[tensor.shallow_clone()],
        &[],
    )
    .unwrap()
}

/// Waits up to 5 s for `done`.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn a_storage_crosses_and_its_segment_is_reused_once_given_back() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    for round in 0..3 {
        let sent = pattern(3 << 20);
        let id = sender.share(&sent).expect("a segment");
        assert_eq!(id, 0, "round {round} reuses the first segment");
        let mut got = vec![0; sent.len()];
        receiver.copy_out(id, &mut got, &|| ()).await.unwrap();
        assert!(got == sent, "round {round}: bytes changed on the way");
        eventually("the segment is given back", || sender.lent() == 0).await;
    }
    // One segment of 4 MiB (3 MiB rounded up) on each side's books.
    assert_eq!(sender.segments(), (1, 0));
    assert_eq!(receiver.segments(), (0, 1));
    // A lent segment is not lent twice: a second storage gets another.
    let first = sender.share(&pattern(2 << 20)).unwrap();
    let second = sender.share(&pattern(2 << 20)).unwrap();
    assert_ne!(first, second);
}

/// Sends two storages of 128 MiB + 1 byte (segments of 256 MiB each) and
/// checks that once both are given back, 512 MiB idle being over the 256
/// MiB kept, one of them is given up on both sides.
async fn one_of_two_given_up(sender: &Arc<ShmLink>, receiver: &Arc<ShmLink>) {
    let big = vec![7u8; (128 << 20) + 1];
    let ids = [sender.share(&big).unwrap(), sender.share(&big).unwrap()];
    let mut out = vec![0u8; big.len()];
    for id in ids {
        receiver.copy_out(id, &mut out, &|| ()).await.unwrap();
    }
    eventually("both are given back", || sender.lent() == 0).await;
    assert_eq!(sender.segments().0, 1);
    eventually("the receiver unmaps it", || receiver.segments().1 == 1).await;
}

#[tokio::test]
async fn over_the_idle_limit_free_segments_are_given_up_on_both_sides() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    one_of_two_given_up(&sender, &receiver).await;
    // A segment larger than the limit is kept while it is the only free
    // one, for the next storage of its size.
    let huge = vec![1u8; (256 << 20) + 1];
    let id = sender.share(&huge).unwrap();
    let mut out = vec![0u8; huge.len()];
    receiver.copy_out(id, &mut out, &|| ()).await.unwrap();
    eventually("it is given back", || sender.lent() == 0).await;
    assert_eq!(sender.segments().0, 1, "the 512 MiB one stays, alone");
    assert_eq!(sender.share(&huge), Some(id), "and is reused");
}

#[tokio::test]
async fn free_segments_are_given_up_after_their_idle_life() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    let id = sender.share(&pattern(2 << 20)).unwrap();
    receiver
        .copy_out(id, &mut vec![0; 2 << 20], &|| ())
        .await
        .unwrap();
    eventually("it is given back", || sender.lent() == 0).await;
    assert_eq!(sender.segments().0, 1);
    tokio::time::sleep(IDLE_LIFE + Duration::from_secs(1)).await;
    eventually("it is given up", || sender.segments().0 == 0).await;
    eventually("the receiver unmaps it", || receiver.segments().1 == 0).await;
}

/// A link whose peer end sends `records`, then whether the link failed.
async fn link_fails_on(records: impl FnOnce(&AsyncFd<OwnedFd>)) -> bool {
    let (ours, theirs) = pair();
    let slot = ShmSlot::joined(ours);
    let link = slot.get().unwrap().clone();
    let theirs = register(theirs, Interest::READABLE | Interest::WRITABLE).unwrap();
    records(&theirs);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        if slot.get().is_none() {
            // A frame naming a segment now fails at once.
            let e = link.copy_out(0, &mut [0; 8], &|| ()).await.unwrap_err();
            assert!(e.contains("failed"), "{e}");
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

fn sealed_memfd(len: u64, seals: SealFlags) -> OwnedFd {
    let fd =
        rustix::fs::memfd_create("test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    fd
}

#[tokio::test]
async fn hostile_records_fail_the_link() {
    let segment = |fd: Option<OwnedFd>, len| {
        move |s: &AsyncFd<OwnedFd>| {
            try_send(s, Record::Segment { id: 0, len }, fd.as_ref()).unwrap()
        }
    };
    let resizable = SealFlags::SEAL;
    let sealed = SealFlags::SHRINK | SealFlags::GROW;
    let device = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
    // A device, not a memfd.
    assert!(link_fails_on(segment(Some(device), 4096)).await);
    // A memfd the peer could still shrink (SIGBUS for the reader).
    assert!(link_fails_on(segment(Some(sealed_memfd(4096, resizable)), 4096)).await);
    // A size other than the memfd's.
    assert!(link_fails_on(segment(Some(sealed_memfd(4096, sealed)), 1 << 30)).await);
    // No descriptor, or one where none belongs.
    assert!(link_fails_on(segment(None, 4096)).await);
    assert!(
        link_fails_on(|s| {
            let fd = sealed_memfd(4096, sealed);
            try_send(s, Record::Release { id: 0 }, Some(&fd)).unwrap()
        })
        .await
    );
    // Giving back or giving up what was never lent.
    assert!(link_fails_on(|s| try_send(s, Record::Release { id: 3 }, None).unwrap()).await);
    assert!(link_fails_on(|s| try_send(s, Record::Forget { id: 3 }, None).unwrap()).await);
    // Records of another length or kind.
    assert!(
        link_fails_on(|s| {
            rustix::net::send(s.get_ref(), &[1, 2, 3], SendFlags::NOSIGNAL).unwrap();
        })
        .await
    );
    assert!(
        link_fails_on(|s| {
            rustix::net::send(s.get_ref(), &[9; RECORD], SendFlags::NOSIGNAL).unwrap();
        })
        .await
    );
    // The same segment twice.
    assert!(
        link_fails_on(|s| {
            for _ in 0..2 {
                let fd = sealed_memfd(4096, sealed);
                try_send(s, Record::Segment { id: 5, len: 4096 }, Some(&fd)).unwrap();
            }
        })
        .await
    );
    // An honest segment does not.
    assert!(!link_fails_on(segment(Some(sealed_memfd(4096, sealed)), 4096)).await);
}

fn cuda_segment(id: u64, len: u64, address: u64) -> Record {
    Record::CudaSegment {
        id,
        len,
        address,
        handle: [0xab; cuda::HANDLE_LEN],
    }
}

#[test]
fn a_cuda_segment_record_carries_its_address_and_handle_and_nothing_else() {
    let record = cuda_segment(7, 1 << 20, 0xdead_0000);
    let (bytes, len) = record.encode();
    assert_eq!(len, LONGEST_RECORD);
    assert_eq!(Record::decode(&bytes[..len]), Some(record));
    // Cut short, or a host segment's record with a handle after it.
    assert_eq!(Record::decode(&bytes[..len - 1]), None);
    let (mut host, _) = Record::Segment {
        id: 7,
        len: 1 << 20,
    }
    .encode();
    host[RECORD..].fill(1);
    assert_eq!(Record::decode(&host), None);
    assert_eq!(Record::decode(&bytes[..RECORD]), None);
}

#[tokio::test]
async fn hostile_cuda_segment_records_fail_the_link() {
    // (The two ends of a socket pair are one process: the kernel says so,
    // and a CUDA segment must then come with its address.)
    let send = |record: Record, fd: Option<OwnedFd>| {
        move |s: &AsyncFd<OwnedFd>| try_send(s, record, fd.as_ref()).unwrap()
    };
    // Empty.
    assert!(link_fails_on(send(cuda_segment(0, 0, 0x1000), None)).await);
    // From this process, without its address.
    assert!(link_fails_on(send(cuda_segment(0, 1 << 20, 0), None)).await);
    // With a descriptor.
    let fd = sealed_memfd(4096, SealFlags::SHRINK | SealFlags::GROW);
    assert!(link_fails_on(send(cuda_segment(0, 1 << 20, 0x1000), Some(fd))).await);
    // The same id twice, even as another kind of segment.
    let fd = sealed_memfd(1 << 20, SealFlags::SHRINK | SealFlags::GROW);
    assert!(
        link_fails_on(move |s| {
            try_send(s, cuda_segment(4, 1 << 20, 0x1000), None).unwrap();
            try_send(
                s,
                Record::Segment {
                    id: 4,
                    len: 1 << 20,
                },
                Some(&fd),
            )
            .unwrap();
        })
        .await
    );
    // An honest one does not (and opens nothing: no driver is needed).
    assert!(!link_fails_on(send(cuda_segment(0, 1 << 20, 0x1000), None)).await);
}

#[tokio::test]
async fn a_cuda_segment_named_for_a_storage_landing_in_host_memory_is_a_malformed_frame() {
    // A real frame whose 2 MiB storage its sender put in segment 0.
    let (a, a_peer) = pair();
    let (a, _a_peer) = (ShmSlot::joined(a), ShmSlot::joined(a_peer));
    let big = tch::Tensor::rand([1 << 19], (tch::Kind::Float, tch::Device::Cpu));
    let mut frame = frame_of(&big);
    assert!(frame.place(a.get()).unwrap().is_empty());
    let mut bytes = Vec::new();
    write_frame(&mut bytes, &frame, 0).await.unwrap();
    // A receiver to whom segment 0 is a CUDA segment: the storage lands on
    // the CPU (no device map), so no CUDA segment may carry it (SHM-7).
    let (ours, theirs) = pair();
    let slot = ShmSlot::joined(ours);
    let theirs = register(theirs, Interest::READABLE | Interest::WRITABLE).unwrap();
    try_send(&theirs, cuda_segment(0, 4 << 20, 0x1000), None).unwrap();
    let e = read_frame(&mut &bytes[..], 1 << 30, None, Some(&slot), None)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("CUDA segment 0 named for storage 0, which does not land on one CUDA device"),
        "{e}"
    );
}

#[tokio::test]
async fn only_the_token_of_an_offer_joins_its_link() {
    let listener = ShmListener::bind().unwrap();
    let (offer, joined) = listener.offer();
    let mut forged = offer.clone();
    forged.token[0] ^= 1;
    assert!(join(&forged).await.is_none(), "a forged token is refused");
    assert!(join(&offer).await.is_some());
    assert!(joined.await.is_ok(), "the acceptor gets the link");
    // A token works once.
    assert!(join(&offer).await.is_none());
    // Another host (no such abstract socket) is a quick `None`.
    let elsewhere = ShmOffer {
        socket: [0xee; 16],
        token: [0; 32],
    };
    assert!(join(&elsewhere).await.is_none());
}

#[tokio::test]
async fn a_frame_carries_a_large_storage_in_shared_memory_and_small_ones_inline() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let big = tch::Tensor::rand([1 << 19], (tch::Kind::Float, tch::Device::Cpu));
    let small = tch::Tensor::rand([16], (tch::Kind::Float, tch::Device::Cpu));
    let message = crate::abi::encode(&vec![
        crate::abi::Value::Tensor(0),
        crate::abi::Value::Tensor(1),
    ])
    .unwrap();
    let mut frame = OutFrame::encode(
        message.clone(),
        MessageKind::new("Test"),
        &[big.shallow_clone(), small.shallow_clone()],
        &[],
    )
    .unwrap();
    let fills = frame.place(a.get()).unwrap();
    assert!(
        fills.is_empty(),
        "2 MiB is filled before the frame is queued"
    );
    let mut bytes = Vec::new();
    write_frame(&mut bytes, &frame, 0).await.unwrap();
    // Filled after the frame is written, as a sender does.
    fills
        .into_iter()
        .for_each(crate::transport::frame::SharedFill::run);
    assert!(bytes.len() < 4096, "{} bytes went inline", bytes.len());
    let (m, tensors) = read_frame(&mut &bytes[..], 1 << 30, None, Some(&b), None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m, message);
    assert!(tensors[0].equal(&big) && tensors[1].equal(&small));
    // Without a link the same frame is refused, not misread.
    let e = read_frame(&mut &bytes[..], 1 << 30, None, Some(&ShmSlot::none()), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no link"), "{e}");
}

#[tokio::test]
async fn the_receiver_copies_out_behind_the_fill() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    let sent = pattern(5 * FILL_CHUNK + 123);
    let lent = sender.lend(sent.len()).unwrap();
    let id = lent.id();
    let reading = tokio::spawn(async move {
        let mut got = vec![0; 5 * FILL_CHUNK + 123];
        receiver.copy_out(id, &mut got, &|| ()).await.map(|()| got)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!reading.is_finished(), "nothing was filled yet");
    lent.fill(&sent);
    let got = reading.await.unwrap().unwrap();
    assert!(got == sent, "bytes changed on the way");
}

#[tokio::test]
async fn a_segment_given_back_while_filling_is_reused_only_once_filled() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    let lent = sender.lend(2 << 20).unwrap();
    // The receiver refused the frame and gave the segment back unread.
    eventually("the receiver maps it", || receiver.segments().1 == 1).await;
    receiver.give_back(lent.id());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(sender.lent(), 1, "still filling");
    let other = sender.lend(2 << 20).unwrap();
    assert_ne!(other.id(), lent.id());
    let first = lent.id();
    lent.fill(&pattern(2 << 20));
    assert_eq!(sender.lent(), 1, "only the other one now");
    assert_eq!(sender.lend(2 << 20).map(|l| l.id()), Some(first));
}

/// With a short fill timeout in place of `LINK_TIMEOUT` (10 s): real
/// time, since tokio's paused clock (`test-util`) would make the test
/// build compile tokio and everything above it a second time.
#[tokio::test]
async fn a_fill_that_never_ends_fails_the_frame_after_the_link_timeout() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    let lent = sender.lend(2 << 20).unwrap();
    let fill_timeout = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let e = receiver
        .copy_out_within(lent.id(), &mut vec![0; 2 << 20], &|| (), fill_timeout)
        .await
        .unwrap_err();
    assert!(e.contains("not filled within 300ms"), "{e}");
    assert!(
        started.elapsed() >= fill_timeout,
        "failed before its timeout"
    );
}

/// LIVE-3: a long copy out reports progress and lets its thread's other
/// tasks run after each `COPY_STRETCH`, so that the watchdog sees a live
/// peer while the connection's reader is busy copying, and the reader's
/// own side keeps sending heartbeats (a GiB into fresh memory took longer
/// than the 2 s failure window on a loaded 2-core VM, and the peer was
/// declared failed; at 16 MiB a stretch, a stretch took a third of a second).
#[tokio::test]
async fn a_long_copy_out_reports_progress_as_it_goes() {
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
    let sent = pattern(3 * COPY_STRETCH + 5);
    let id = sender.share(&sent).expect("a segment");
    let stretches = std::sync::atomic::AtomicUsize::new(0);
    let progress = || {
        stretches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    };
    let mut got = vec![0; sent.len()];
    receiver.copy_out(id, &mut got, &progress).await.unwrap();
    assert!(got == sent, "bytes changed on the way");
    assert_eq!(stretches.into_inner(), 3);
}

/// A long fill runs off its caller's thread (`SharedFill::run`, LIVE-2):
/// on a runtime of one thread, the other tasks (the connections' readers,
/// the heartbeats) run while the segment fills. Before, a fill of a fresh
/// GiB held such a runtime for seconds, and its peers declared it failed.
#[tokio::test]
async fn a_long_fill_leaves_its_callers_runtime_thread_free() {
    use crate::transport::frame::SharedFill;
    let (a, b) = pair();
    let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
    let numel = i64::try_from(LONG_COPY / 4).unwrap();
    let big = tch::Tensor::rand([numel], (tch::Kind::Float, tch::Device::Cpu));
    let mut frame = frame_of(&big);
    let fills = frame.place(a.get()).unwrap();
    assert_eq!(fills.len(), 1, "a long storage is filled after queueing");
    let mut bytes = Vec::new();
    write_frame(&mut bytes, &frame, 0).await.unwrap();
    // Fills wait while this is held: one run on the caller's thread would
    // hold that thread too.
    let held = BULK_WORK_GATE.write().unwrap_or_else(|p| p.into_inner());
    let (returned, waiting) = std::sync::mpsc::channel();
    let caller = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async { fills.into_iter().for_each(SharedFill::run) });
        returned.send(()).unwrap();
        // Dropping the runtime waits for the fill.
    });
    let free = waiting.recv_timeout(Duration::from_secs(10));
    drop(held);
    assert!(free.is_ok(), "the fill held its caller's runtime thread");
    let (_, tensors) = read_frame(&mut &bytes[..], 1 << 30, None, Some(&b), None)
        .await
        .unwrap()
        .unwrap();
    assert!(tensors[0].equal(&big), "bytes changed on the way");
    caller.join().unwrap();
}

/// A segment given up is unmapped off the thread that gives it up, on both
/// sides (`let_go`, LIVE-2): the last side to let go frees the pages, which
/// took 0.38 s for a GiB, and a runtime of one thread missed its heartbeats.
#[tokio::test]
async fn a_segment_given_up_is_unmapped_off_the_runtime_thread() {
    // Unmapping waits while this is held.
    let held = BULK_WORK_GATE.write().unwrap_or_else(|p| p.into_inner());
    let (returned, waiting) = std::sync::mpsc::channel();
    let caller = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (a, b) = pair();
            let (a, b) = (ShmSlot::joined(a), ShmSlot::joined(b));
            let (sender, receiver) = (a.get().unwrap().clone(), b.get().unwrap().clone());
            one_of_two_given_up(&sender, &receiver).await;
        });
        returned.send(()).unwrap();
        // Dropping the runtime waits for the unmapping.
    });
    let free = waiting.recv_timeout(Duration::from_secs(20));
    drop(held);
    assert!(
        free.is_ok(),
        "unmapping a segment held the runtime's thread"
    );
    caller.join().unwrap();
}
