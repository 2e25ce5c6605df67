//! The busy-polled reader's rules (BUSY-1 to BUSY-9), each against a real
//! loopback socket.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::io::AsyncReadExt;

use super::*;

/// A connected pair: the std end the test writes, and our reader.
async fn pair(window: Duration) -> (std::net::TcpStream, BusyPollRead) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let writer = std::net::TcpStream::connect(addr).unwrap();
    writer.set_nodelay(true).unwrap();
    let (stream, _) = listener.accept().await.unwrap();
    let (read, _write) = stream.into_split();
    let mut reader = BusyPollRead::new(read, window, InProgress::default());
    // Each test checks its own rule: a machine crowded by the tests
    // beside it must not stop the polling they look for (BUSY-8 has its
    // own tests).
    reader.crowding = crowding::Crowding::never_crowded();
    (writer, reader)
}

/// Serializes this module's socket tests: one of them keeps a CPU busy
/// (BUSY-8's), and the others count polled frames, which a crowded CPU
/// changes.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Bytes in several writes, some while the reader polls and some after
/// it gave up, arrive whole and in order, and the end of the stream is
/// seen, whatever the window.
#[test]
fn every_byte_arrives_in_order_polled_or_not() {
    let _alone = alone();
    for window in [
        Duration::ZERO,
        Duration::from_micros(50),
        Duration::from_secs(1),
    ] {
        current_thread().block_on(async {
            let (mut writer, mut reader) = pair(window).await;
            let sender = std::thread::spawn(move || {
                for i in 0..200u32 {
                    writer.write_all(&i.to_le_bytes()).unwrap();
                    if i % 50 == 0 {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            });
            let mut got = Vec::new();
            reader.read_to_end(&mut got).await.unwrap();
            sender.join().unwrap();
            let expected: Vec<u8> = (0..200u32).flat_map(u32::to_le_bytes).collect();
            assert_eq!(got, expected, "window {window:?}");
        });
    }
}

/// Polls a reader until bytes come, while `other` runs on the same
/// single-threaded runtime; the bytes are sent once `done` holds, or after
/// 10 s if it never does. Returns whether `done` held before they were
/// sent: it can only while `other` gets the thread.
async fn poll_beside(
    other: impl std::future::Future<Output = ()> + Send + 'static,
    done: impl Fn() -> bool + Send + 'static,
) -> bool {
    let (mut writer, mut reader) = pair(Duration::from_secs(30)).await;
    // A typical wait of 15 s: this wait is polled for up to 30 s (BUSY-1),
    // longer than the sender ever waits.
    reader.typical = Duration::from_secs(15);
    let other = tokio::spawn(other);
    let sender = std::thread::spawn(move || {
        let give_up = Instant::now() + Duration::from_secs(10);
        while !done() && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
        let held = done();
        writer.write_all(b"late").unwrap();
        held
    });
    let mut got = [0; 4];
    reader.read_exact(&mut got).await.unwrap();
    let held = sender.join().unwrap();
    other.abort();
    assert_eq!(&got, b"late");
    assert!(reader.turns >= 1, "the reader did not poll");
    held
}

/// BUSY-3: a reader polling for a long time never blocks its thread: a
/// task on the same single-threaded runtime, woken by its timer, keeps
/// running meanwhile.
#[test]
fn a_polling_reader_leaves_its_thread_to_other_tasks() {
    let _alone = alone();
    let ticks = Arc::new(AtomicU32::new(0));
    let ticker = {
        let ticks = ticks.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    let counted = ticks.clone();
    let done = move || counted.load(Ordering::Relaxed) >= 10;
    let held = current_thread().block_on(poll_beside(ticker, done));
    let ticks = ticks.load(Ordering::Relaxed);
    assert!(
        held,
        "the other task ran {ticks} times while the reader polled"
    );
}

/// BUSY-6: a task woken from another thread (as a blocking op's caller is)
/// runs while the reader polls: it takes all 40 messages another thread
/// sends it.
#[test]
fn a_polling_reader_leaves_its_thread_to_tasks_woken_from_other_threads() {
    let _alone = alone();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
    let taken = Arc::new(AtomicU32::new(0));
    let taker = {
        let taken = taken.clone();
        async move {
            while rx.recv().await.is_some() {
                taken.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    let messages = std::thread::spawn(move || {
        for i in 0..40 {
            std::thread::sleep(Duration::from_millis(1));
            if tx.send(i).is_err() {
                return;
            }
        }
    });
    let counted = taken.clone();
    let done = move || counted.load(Ordering::Relaxed) == 40;
    let held = current_thread().block_on(poll_beside(taker, done));
    messages.join().unwrap();
    let taken = taken.load(Ordering::Relaxed);
    assert!(
        held,
        "the woken task took {taken} of 40 messages while the reader polled"
    );
}

/// BUSY-2: a reader polls for at most its window, then sleeps until
/// bytes come: with a typical wait of 15 ms (so a poll of up to 30 ms)
/// and a 20 ms window, waiting 300 ms costs its thread about 20 ms of
/// CPU, not 300 (and more than nothing: it did poll). A zero window
/// costs none.
#[test]
fn polling_stops_at_the_end_of_the_window() {
    let _alone = alone();
    for (window, least, most) in [
        (
            Duration::from_millis(20),
            Duration::from_millis(2),
            Duration::from_millis(150),
        ),
        (Duration::ZERO, Duration::ZERO, Duration::from_millis(15)),
    ] {
        current_thread().block_on(async {
            let (mut writer, mut reader) = pair(window).await;
            reader.typical = Duration::from_millis(15);
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                writer.write_all(b"x").unwrap();
            });
            let before = thread_cpu_time();
            let mut got = [0; 1];
            reader.read_exact(&mut got).await.unwrap();
            let spent = thread_cpu_time() - before;
            sender.join().unwrap();
            assert!(
                spent >= least && spent < most,
                "window {window:?}: waiting 300 ms took {spent:?} of CPU"
            );
            assert_eq!(reader.polled, 0, "the byte came after the poll ended");
        });
    }
}

/// BUSY-1: a new reader does not poll; one whose waits are short polls
/// for twice its typical wait, capped by its window; one whose typical
/// wait reaches its window does not poll.
#[test]
fn the_poll_follows_the_typical_wait_within_the_window() {
    let _alone = alone();
    let us = Duration::from_micros;
    let window = us(200);
    assert_eq!(poll_limit(Duration::ZERO, window), Duration::ZERO);
    assert_eq!(poll_limit(us(30), window), us(60));
    assert_eq!(poll_limit(us(150), window), window);
    assert_eq!(poll_limit(us(200), window), Duration::ZERO);
    assert_eq!(poll_limit(us(30), Duration::ZERO), Duration::ZERO);

    // Steady waits of 30 µs: the typical wait comes within a
    // microsecond of them in a few dozen waits.
    let mut typical = Duration::ZERO;
    for _ in 0..60 {
        typical = next_typical(typical, us(30), window);
    }
    assert!(typical > us(29) && typical <= us(30), "{typical:?}");
    // One pause of 10 ms counts as at most SPAN windows: polling goes on.
    let after_pause = next_typical(typical, Duration::from_millis(10), window);
    assert!(after_pause < window, "{after_pause:?}");
    assert!(!poll_limit(after_pause, window).is_zero());
    // Waits as long as the window stop it.
    for _ in 0..40 {
        typical = next_typical(typical, Duration::from_millis(10), window);
    }
    assert!(poll_limit(typical, window).is_zero(), "{typical:?}");
}

/// BUSY-1: frames that come far apart are not polled: once a few waits
/// of 100 ms have made the typical wait as long as the 20 ms window, a
/// wait costs its thread no CPU.
#[test]
fn a_reader_whose_frames_come_far_apart_does_not_poll() {
    let _alone = alone();
    current_thread().block_on(async {
        let window = Duration::from_millis(20);
        let (mut writer, mut reader) = pair(window).await;
        let sender = std::thread::spawn(move || {
            for _ in 0..7 {
                std::thread::sleep(Duration::from_millis(100));
                writer.write_all(b"x").unwrap();
            }
        });
        let mut got = [0; 1];
        for _ in 0..6 {
            reader.read_exact(&mut got).await.unwrap();
        }
        assert!(
            poll_limit(reader.typical, window).is_zero(),
            "typical wait {:?}",
            reader.typical
        );
        let polled = reader.polled;
        let before = thread_cpu_time();
        reader.read_exact(&mut got).await.unwrap();
        let spent = thread_cpu_time() - before;
        sender.join().unwrap();
        assert!(
            spent < Duration::from_millis(15),
            "the last wait took {spent:?} of CPU"
        );
        assert_eq!(reader.polled, polled);
    });
}

/// BUSY-5: a wait slept through counts, for the typical wait, until
/// its bytes arrived, not until the reader's thread got to them: here
/// the byte comes 5 ms into the wait and the thread is busy for 200 ms.
#[test]
fn a_slept_wait_lasts_until_its_bytes_arrived_not_until_the_reader_woke() {
    let _alone = alone();
    current_thread().block_on(async {
        // A window far above the waits, and no typical wait yet: the
        // reader sleeps through the wait, and the wait counts whole.
        let (mut writer, mut reader) = pair(Duration::from_secs(10)).await;
        assert!(reader.stamped, "the kernel refused receive stamps");
        let mut got = [0; 1];
        let began = Instant::now();
        {
            let read = reader.read_exact(&mut got);
            tokio::pin!(read);
            assert!(futures::poll!(read.as_mut()).is_pending());
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                writer.write_all(&[7]).unwrap();
            });
            std::thread::sleep(Duration::from_millis(200));
            read.await.unwrap();
            sender.join().unwrap();
        }
        assert_eq!(got, [7]);
        assert!(began.elapsed() >= Duration::from_millis(200));
        assert_eq!(reader.polled, 0, "the wait was polled");
        // The typical wait is an eighth of the one wait seen.
        let counted = reader.typical * SMOOTHING;
        assert!(
            counted < Duration::from_millis(150),
            "the wait counted {counted:?}: the wake-up, not the arrival"
        );
    });
}

/// BUSY-4: while two pieces of work are in progress on the connection,
/// frames that come close together (5 ms apart, a 200 ms window) are
/// not polled; once one ends, they are.
#[test]
fn a_reader_does_not_poll_while_several_calls_are_in_progress() {
    let _alone = alone();
    current_thread().block_on(async {
        let window = Duration::from_millis(200);
        let (mut writer, mut reader) = pair(window).await;
        let in_progress = reader.in_progress.clone();
        in_progress.begin();
        in_progress.begin();
        reader.typical = Duration::from_millis(5);
        // The second 20 frames wait for the first 20 to be read, so
        // that a reader slowed by a loaded machine finds none queued.
        let (next, go) = std::sync::mpsc::channel::<()>();
        let sender = std::thread::spawn(move || {
            for i in 0..40u8 {
                if i == 20 {
                    go.recv().unwrap();
                }
                std::thread::sleep(Duration::from_millis(5));
                writer.write_all(&[i]).unwrap();
            }
        });
        let mut got = [0; 1];
        for _ in 0..20 {
            reader.read_exact(&mut got).await.unwrap();
        }
        assert_eq!(reader.polled, 0, "polled with two calls in progress");
        in_progress.end();
        next.send(()).unwrap();
        for _ in 0..20 {
            // Each wait polled for up to 30 ms: a sender that a loaded
            // machine delays past the 5 ms still comes within the poll.
            reader.typical = Duration::from_millis(15);
            reader.read_exact(&mut got).await.unwrap();
        }
        sender.join().unwrap();
        assert!(
            reader.polled >= 3,
            "{} of 20 frames were polled",
            reader.polled
        );
    });
}

/// BUSY-9's stamp: a connection becomes idle when its last piece of work
/// ends, not before.
#[test]
fn a_connection_is_idle_from_the_end_of_its_last_work() {
    let work = WorkInProgress::default();
    assert_eq!(work.idle_since(), None);
    work.begin();
    work.begin();
    work.end();
    assert_eq!(
        work.idle_since(),
        None,
        "one piece of work is still in progress"
    );
    let before = Instant::now();
    work.end();
    let idle = work.idle_since().expect("idle once the last work ended");
    // The stamp keeps nanoseconds: it reads back within one of the clock.
    assert!(
        idle + Duration::from_micros(1) >= before,
        "{idle:?} before {before:?}"
    );
    assert!(idle <= Instant::now());
    assert_eq!(work.count(), 0);
}

/// BUSY-9 against a socket: a reader whose side serves a 30 ms call
/// (its thread busy, as an op run inline keeps it) after each frame, and
/// whose peer answers each reply 5 ms later. The waits count from each
/// reply, so they are typically 5 ms, within the 20 ms window, and the
/// answers are polled for after the call; counted from the reader's first
/// look, before the call, they would be 35 ms, and never polled.
#[test]
fn a_wait_begins_when_the_connection_has_served_its_call() {
    let _alone = alone();
    current_thread().block_on(async {
        let window = Duration::from_millis(20);
        let (mut writer, mut reader) = pair(window).await;
        let work = reader.in_progress.clone();
        let (reply, replied) = std::sync::mpsc::channel::<()>();
        let sender = std::thread::spawn(move || {
            for i in 0..30u8 {
                if replied.recv().is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
                writer.write_all(&[i]).unwrap();
            }
        });
        work.begin();
        let mut after = Vec::new();
        for i in 0..30u8 {
            let mut got = [0; 1];
            let read = reader.read_exact(&mut got);
            tokio::pin!(read);
            // The reader starts waiting, then its thread serves the call.
            assert!(futures::poll!(&mut read).is_pending());
            std::thread::sleep(Duration::from_millis(30));
            work.end();
            reply.send(()).unwrap();
            let cpu = thread_cpu_time();
            read.await.unwrap();
            if i >= 15 {
                after.push(thread_cpu_time() - cpu);
            }
            assert_eq!(got[0], i);
            work.begin();
        }
        sender.join().unwrap();
        assert!(reader.typical < window, "typical wait {:?}", reader.typical);
        // Polled: the thread ran for much of each 5 ms answer (asleep, it
        // would have spent microseconds). The `polled` count would miss
        // answers whose readiness the runtime saw before the poll's `recv`.
        after.sort();
        assert!(
            after[after.len() / 2] > Duration::from_millis(1),
            "CPU from each reply to its answer: {after:?}"
        );
    });
}

/// BUSY-1: frames that come close together are taken by polling, without
/// a wake-up: of 40 frames 5 ms apart, with a 200 ms window, many are
/// read by a poll (a reader that never polls reads none). The spacing is
/// well above a loaded machine's scheduling delays, which count against
/// a poll's time (1 ms spacing gave 22 of 60 in a loaded CI run; 5 ms gave
/// 12 of 40 with a busy process on each core, about 35 on a quiet machine).
#[test]
fn a_reader_whose_frames_come_close_together_polls_them() {
    let _alone = alone();
    current_thread().block_on(async {
        let window = Duration::from_millis(200);
        let (mut writer, mut reader) = pair(window).await;
        let sender = std::thread::spawn(move || {
            for i in 0..40u8 {
                std::thread::sleep(Duration::from_millis(5));
                writer.write_all(&[i]).unwrap();
            }
        });
        for i in 0..40u8 {
            let mut got = [0; 1];
            reader.read_exact(&mut got).await.unwrap();
            assert_eq!(got[0], i);
        }
        sender.join().unwrap();
        assert!(
            reader.polled >= 5,
            "{} of 40 frames were polled (typical wait {:?})",
            reader.polled,
            reader.typical
        );
    });
}

/// Pins the calling thread, and the threads it starts from then on, to the
/// CPU it runs on.
fn pin_to_one_cpu() {
    // SAFETY: `cpu_set_t` is plain bits, and both calls only read or
    // write the set they are given.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0, "sched_getcpu: {}", io::Error::last_os_error());
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        let pinned = libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
        assert_eq!(
            pinned,
            0,
            "sched_setaffinity: {}",
            io::Error::last_os_error()
        );
    }
}

/// Reads 20 frames a peer thread writes 2 ms apart, each wait polled (a
/// typical wait of 15 ms and a 200 ms window), on a thread pinned to one
/// CPU with its peer when `pinned`: the reader's CPU yields and polled
/// reads.
fn polled_exchange(pinned: bool) -> (u64, u64) {
    std::thread::spawn(move || {
        if pinned {
            pin_to_one_cpu();
        }
        current_thread().block_on(async {
            let (mut writer, mut reader) = pair(Duration::from_millis(200)).await;
            let sender = std::thread::spawn(move || {
                for i in 0..20u8 {
                    std::thread::sleep(Duration::from_millis(2));
                    writer.write_all(&[i]).unwrap();
                }
            });
            for i in 0..20u8 {
                reader.typical = Duration::from_millis(15);
                let mut got = [0; 1];
                reader.read_exact(&mut got).await.unwrap();
                assert_eq!(got[0], i);
            }
            sender.join().unwrap();
            assert!(reader.turns > 0, "the reader never polled");
            (reader.cpu_yields, reader.polled)
        })
    })
    .join()
    .unwrap()
}

/// BUSY-7: a reader whose process may run on one CPU only gives the CPU up
/// between its tries, so that a peer sharing that CPU can reply, and still
/// takes every frame; with several CPUs it spins (BUSY-6) and never does.
/// (`available_parallelism` reads the mask of the thread that asks, so a
/// pinned test thread stands for a pinned process.)
#[test]
fn a_reader_on_one_cpu_gives_the_cpu_up_while_polling() {
    let _alone = alone();
    use std::num::NonZeroUsize;
    assert!(yields_cpu(NonZeroUsize::new(1)));
    assert!(!yields_cpu(NonZeroUsize::new(2)));
    assert!(!yields_cpu(None));

    let (yields, polled) = polled_exchange(true);
    assert!(
        yields > 0,
        "pinned to one CPU, the reader never gave it up ({polled} of 20 polled)"
    );
    if std::thread::available_parallelism().is_ok_and(|n| n.get() > 1) {
        let (yields, _) = polled_exchange(false);
        assert_eq!(yields, 0, "with several CPUs the reader gave the CPU up");
    }
}

/// BUSY-8 on a real socket: a reader that shares its CPU with a thread
/// that never sleeps stops polling, and still reads every byte in order.
/// The reader is made before its thread is pinned, so it spins between
/// tries (BUSY-6) rather than yielding (BUSY-7), as on a machine of many
/// CPUs all busy.
#[test]
fn a_reader_sharing_its_cpu_with_a_busy_thread_stops_polling() {
    let _alone = alone();
    // A 2 ms wait beside a busy thread loses either nearly all or nearly
    // none of its time (the scheduler's slices are that long), so the
    // average needs a few dozen samples.
    const FRAMES: u8 = 240;
    let outcome = std::thread::spawn(|| {
        current_thread().block_on(async {
            let (mut writer, mut reader) = pair(Duration::from_millis(200)).await;
            reader.crowding = crowding::Crowding::default();
            assert!(!reader.yields_cpu || num_cpus_is_one());
            let sender = std::thread::spawn(move || {
                for i in 0..FRAMES {
                    std::thread::sleep(Duration::from_millis(2));
                    writer.write_all(&[i]).unwrap();
                }
            });
            pin_to_one_cpu();
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let hog = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            };
            let mut read_backing_off = 0;
            for i in 0..FRAMES {
                reader.typical = Duration::from_millis(15);
                // Backing off still a little later: the whole wait is.
                let off = reader
                    .crowding
                    .backing_off(Instant::now() + Duration::from_millis(5));
                let polled = reader.polled;
                let mut got = [0; 1];
                reader.read_exact(&mut got).await.unwrap();
                assert_eq!(got[0], i);
                if off {
                    assert_eq!(reader.polled, polled, "frame {i} polled while backing off");
                    read_backing_off += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            hog.join().unwrap();
            sender.join().unwrap();
            (
                reader.crowding.back_offs,
                reader.crowding.samples,
                read_backing_off,
            )
        })
    })
    .join()
    .unwrap();
    let (back_offs, samples, read_backing_off) = outcome;
    assert!(
        back_offs > 0 && read_backing_off > 0,
        "sharing its CPU with a busy thread, the reader never stopped polling \
         ({back_offs} back-offs, {samples} waits sampled, {read_backing_off} frames read \
         while backing off)"
    );
}

fn num_cpus_is_one() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() == 1)
}
