//! Busy polling: a connection's reader that keeps asking its socket for
//! bytes, for a bounded time, when frames have been arriving close together.
//!
//! Why: on the machines we run on, waking a thread that sleeps in `epoll`
//! costs more than everything else in a small call (35 µs per wake-up on a
//! 2-core VM, measured with a futex ping-pong between two processes, against
//! 0.3 µs when both sides spin). A call's round trip has two such wake-ups,
//! one per direction. A reader that is still polling when the next frame
//! arrives takes it without one.
//!
//! The rules (BUSY-1 to BUSY-3) keep the cost bounded:
//! - BUSY-1: a reader polls only when its previous wait for bytes was shorter
//!   than [`REENGAGE`] times its window: frames that come further apart
//!   than that are served by `epoll` alone, at no CPU cost.
//! - BUSY-2: a reader polls for at most its window per wait, then sleeps in
//!   `epoll` as usual. The window is `RpcBackendOptions::busy_poll`
//!   (zero turns polling off).
//! - BUSY-3: a polling reader tries its socket once per turn of its worker
//!   thread, after every other task that thread has ready (a caller whose
//!   reply it delivered, a call it started), and never blocks the thread.
//!
//! This module owns the socket reads of plain TCP connections and of the
//! TLS record layer beneath; it does not know frames or messages.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;

/// A reader polls again only if its previous wait was shorter than this
/// many windows (BUSY-1).
pub(crate) const REENGAGE: u32 = 2;

/// The read half of a TCP connection, busy-polled per BUSY-1 to BUSY-3.
pub(crate) struct BusyPollRead {
    inner: OwnedReadHalf,
    window: Duration,
    /// When the current wait began (the first `Pending` since bytes came).
    waiting_since: Option<Instant>,
    /// The yield this reader waits on before its next `recv` (BUSY-3).
    turn: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// How long the previous wait lasted.
    last_wait: Duration,
}

impl BusyPollRead {
    /// Wraps `inner`; `window` zero never polls.
    pub(crate) fn new(inner: OwnedReadHalf, window: Duration) -> Self {
        BusyPollRead {
            inner,
            window,
            waiting_since: None,
            turn: None,
            last_wait: Duration::ZERO,
        }
    }

    /// Bytes came: the wait (if any) ends.
    fn arrived(&mut self) {
        if let Some(since) = self.waiting_since.take() {
            self.last_wait = since.elapsed();
        }
        self.turn = None;
    }

    fn fd(&self) -> RawFd {
        let tcp: &tokio::net::TcpStream = self.inner.as_ref();
        tcp.as_raw_fd()
    }
}

impl AsyncRead for BusyPollRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Poll::Ready(r) = Pin::new(&mut this.inner).poll_read(cx, buf) {
            this.arrived();
            return Poll::Ready(r);
        }
        // Pending: tokio has registered the waker, so giving up below is
        // always safe.
        let since = *this.waiting_since.get_or_insert_with(Instant::now);
        if this.window.is_zero() || this.last_wait >= this.window * REENGAGE {
            this.turn = None;
            return Poll::Pending;
        }
        // BUSY-3: one `recv` per turn of the worker thread, after every task
        // it had ready (`yield_now` defers this task behind them, and lets
        // the worker poll its I/O driver, without waking another worker).
        if let Some(turn) = this.turn.as_mut() {
            if turn.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.turn = None;
            // SAFETY: the fd is the socket `inner` owns, open while `this` is.
            let fd = unsafe { BorrowedFd::borrow_raw(this.fd()) };
            match recv_now(fd, buf) {
                Ok(true) => {
                    this.arrived();
                    return Poll::Ready(Ok(()));
                }
                Ok(false) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        if since.elapsed() >= this.window {
            return Poll::Pending;
        }
        let mut turn: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(tokio::task::yield_now());
        // The first poll of `yield_now` only defers the waker: Pending.
        let _ = turn.as_mut().poll(cx);
        this.turn = Some(turn);
        Poll::Pending
    }
}

/// One non-blocking `recv` into `buf`: `Ok(true)` if it read bytes or saw
/// the end of the stream, `Ok(false)` if none were there.
fn recv_now(fd: BorrowedFd<'_>, buf: &mut ReadBuf<'_>) -> io::Result<bool> {
    // SAFETY: `recv` only writes the bytes it reports, and only those are
    // marked initialized and filled.
    let unfilled = unsafe { buf.unfilled_mut() };
    match rustix::net::recv(fd.as_fd(), unfilled, rustix::net::RecvFlags::DONTWAIT) {
        Ok(((filled, _), _)) => {
            let n = filled.len();
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            Ok(true)
        }
        Err(rustix::io::Errno::AGAIN) => Ok(false),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
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
        (writer, BusyPollRead::new(read, window))
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

    /// BUSY-3: a reader polling for a long time never blocks its thread: a
    /// task on the same single-threaded runtime keeps running meanwhile.
    #[test]
    fn a_polling_reader_leaves_its_thread_to_other_tasks() {
        current_thread().block_on(async {
            let (mut writer, mut reader) = pair(Duration::from_secs(10)).await;
            let ticks = Arc::new(AtomicU32::new(0));
            let ticker = tokio::spawn({
                let ticks = ticks.clone();
                async move {
                    loop {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        ticks.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                writer.write_all(b"late").unwrap();
            });
            let mut got = [0; 4];
            reader.read_exact(&mut got).await.unwrap();
            sender.join().unwrap();
            ticker.abort();
            assert_eq!(&got, b"late");
            let ticks = ticks.load(Ordering::Relaxed);
            assert!(ticks >= 10, "the other task ran {ticks} times in 200 ms");
        });
    }

    /// BUSY-2: a reader polls for its window, then sleeps until bytes come:
    /// waiting 300 ms with a 20 ms window costs its thread about 20 ms of
    /// CPU, not 300. A zero window costs none (BUSY-2).
    #[test]
    fn polling_stops_at_the_end_of_the_window() {
        for (window, most) in [
            (Duration::from_millis(20), Duration::from_millis(150)),
            (Duration::ZERO, Duration::from_millis(15)),
        ] {
            current_thread().block_on(async {
                let (mut writer, mut reader) = pair(window).await;
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
                    spent < most,
                    "window {window:?}: waiting 300 ms took {spent:?} of CPU"
                );
            });
        }
    }

    /// BUSY-1: after a wait longer than `REENGAGE` windows, the next wait
    /// is not polled at all.
    #[test]
    fn a_reader_whose_frames_come_far_apart_does_not_poll() {
        current_thread().block_on(async {
            let window = Duration::from_millis(20);
            let (mut writer, mut reader) = pair(window).await;
            let sender = std::thread::spawn(move || {
                for _ in 0..2 {
                    std::thread::sleep(Duration::from_millis(200));
                    writer.write_all(b"x").unwrap();
                }
            });
            let mut got = [0; 1];
            reader.read_exact(&mut got).await.unwrap();
            assert!(reader.last_wait >= window * REENGAGE);
            let before = thread_cpu_time();
            reader.read_exact(&mut got).await.unwrap();
            let spent = thread_cpu_time() - before;
            sender.join().unwrap();
            assert!(
                spent < Duration::from_millis(15),
                "the second wait took {spent:?} of CPU"
            );
        });
    }
}
