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
//! How long to poll is learnt per connection, from how long its reader has
//! been waiting for bytes lately (BUSY-1): a fixed window that ends just
//! before a peer's typical reply pays the CPU and the wake-up both, and
//! on a loaded machine a reply that comes late comes later still (measured
//! with `wasmrpc-bench anatomy`: a 50 µs window against 75-80 µs round trips
//! made them no faster, while the same calls polled through took 35 µs).
//!
//! The rules (BUSY-1 to BUSY-9) keep the cost bounded:
//! - BUSY-1: a reader polls a wait for at most [`SPAN`] times its typical
//!   wait (a moving average of its recent waits, polled or slept), and not
//!   at all while its typical wait is as long as its window: frames that
//!   come far apart are served by `epoll` alone, at no CPU cost, and frames
//!   that come close together cost little more CPU than they save.
//! - BUSY-2: a reader polls for at most its window per wait, then sleeps in
//!   `epoll` as usual. The window is `RpcBackendOptions::busy_poll`
//!   (zero turns polling off).
//! - BUSY-3: a polling reader tries its socket once per turn of its worker
//!   thread, after every other task that thread has ready (a caller whose
//!   reply it delivered, a call it started), and never blocks the thread.
//! - BUSY-4: a reader does not poll while more than one piece of work is in
//!   progress on its connection (TR-10's count: calls awaiting responses
//!   there, calls served from there). Their frames come without asking, and
//!   polling would only take them in smaller reads than a wake-up does,
//!   leaving less for one vectored write to answer (measured: 128 calls in
//!   flight went 10-25% slower polled).
//! - BUSY-5: a wait slept through lasts, for the typical wait, until its
//!   bytes arrived (the kernel's receive stamp, `SO_TIMESTAMPNS`), not
//!   until the reader woke. Counting the wake-up made the estimate feed on
//!   itself: an exchange slept through looked slower than the window by
//!   the wake-ups alone, so it was never polled and stayed slept through
//!   (measured: a distributed autograd step whose waits were 20-40 µs
//!   flipped between 70 µs polled and 400 µs slept for hundreds of steps
//!   with a 200 µs window; in eight alternating runs each of `wasmrpc-bench
//!   --only dist_autograd_16`, the median round went from 3.2-10.5x its
//!   floor to 2.8-4.2x, and rounds above 5x from 24 of 40 to 5 of 40).
//! - BUSY-6: after a turn that found nothing, a reader keeps trying its
//!   socket for at most [`SPIN`] (a few microseconds, within its BUSY-1
//!   limit), and stops at once when a task is woken from another thread;
//!   tasks woken by I/O or timers run at the next turn, as under BUSY-3.
//! - BUSY-7: a reader in a process that may run on one CPU only (its
//!   affinity mask, or its cgroup's CPU quota, as
//!   `std::thread::available_parallelism` reads them) gives the CPU up
//!   (`sched_yield`) before each try instead of spinning (BUSY-6): its peer
//!   on the same host may share that CPU, and could not reply while the
//!   reader held it. Measured with `taskset -c 0 wasmrpc-bench anatomy
//!   --call noop` (caller and callee on one core): spinning, a no-op's round
//!   trip took 1.02 ms, each reader polling through its window until the
//!   scheduler took the CPU from it.
//! - BUSY-8: a reader whose polled waits are spent off the CPU (a fifth of
//!   them on average, sampled by the thread's CPU clock) stops polling for
//!   a while: the machine has more runnable threads than CPUs, and its
//!   poll holds a CPU that the peer or its own process needs ([`crowding`]).
//! - BUSY-9: a wait begins, for the typical wait and for the window, at
//!   the later of the reader's first look and the moment its connection's
//!   work last ended (TR-10's count falling to zero): until then this side
//!   was serving a call, and the peer had nothing to answer yet. Counted
//!   from the first look, which comes before the call's op runs, a worker
//!   serving the 256x256 distributed autograd step (ops of 0.5-1 ms) saw
//!   waits longer than its window, never polled, and slept about twice a
//!   step; counted from the reply, it sleeps about once (measured
//!   2026-12-07 with `wasmrpc-bench anatomy --call step256`, six
//!   alternating pairs: the callee's worker thread slept 1.68-1.96 times
//!   a step before, 0.47-1.15 after, and the step's median went from
//!   1.41-1.80 ms to 1.27-1.65 ms, lower in each pair; `--call step16`
//!   and `--call aten-add` moved within the noise).
//!
//! This module owns the socket reads of plain TCP connections and of the
//! TLS record layer beneath; it does not know frames or messages.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;

/// The work in progress on a connection (TR-10), shared by the connection
/// and its reader (BUSY-4, BUSY-9).
pub(crate) type InProgress = Arc<WorkInProgress>;

/// How much work is in progress on a connection (TR-10), and when it last
/// had none.
#[derive(Debug, Default)]
pub(crate) struct WorkInProgress {
    count: AtomicUsize,
    /// When the count last fell to zero, in nanoseconds after [`epoch`]
    /// (zero: never).
    idle_since: AtomicU64,
}

impl WorkInProgress {
    /// A piece of work begins.
    pub(crate) fn begin(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// A piece of work ends; the last one stamps the connection idle.
    pub(crate) fn end(&self) {
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            let nanos = epoch().elapsed().as_nanos().max(1);
            self.idle_since
                .store(u64::try_from(nanos).unwrap_or(u64::MAX), Ordering::Release);
        }
    }

    /// The pieces of work in progress.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// When the connection last became idle (its work count fell to zero).
    fn idle_since(&self) -> Option<Instant> {
        match self.idle_since.load(Ordering::Acquire) {
            0 => None,
            nanos => Some(epoch() + Duration::from_nanos(nanos)),
        }
    }
}

/// The instant [`WorkInProgress`] stamps count from.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

tokio::task_local! {
    /// The work count of the connection whose TLS handshake runs in this
    /// task: the TLS layer makes its socket reader before the connection
    /// exists, and finds the count here ([`reader_of`]).
    pub(crate) static HANDSHAKING: InProgress;
}

/// A busy-polled reader of `half`, for the connection whose TLS handshake
/// runs in this task (BUSY-4's count from [`HANDSHAKING`]), or, outside
/// one, counting no work.
pub(crate) fn reader_of(half: OwnedReadHalf, window: Duration) -> BusyPollRead {
    let in_progress = HANDSHAKING.try_with(Clone::clone).unwrap_or_default();
    BusyPollRead::new(half, window, in_progress)
}

/// A wait is polled for at most this many typical waits (BUSY-1): enough
/// to take most replies of a steady exchange, whose waits scatter around
/// their average, before giving up on one that is late.
pub(crate) const SPAN: u32 = 2;

/// How long a poll after a turn keeps trying the socket (BUSY-6): a few
/// turns' worth. A turn costs about 2 µs on the 2-core VM we measure on
/// (`epoll_wait`, the runtime's timers and clocks, the yield), so a reply
/// that came during one waited a microsecond for the next `recv`; the
/// spin takes most replies within one `recv` of their arrival. Measured
/// with `wasmrpc-bench anatomy`, three alternating runs each (2026-12-03):
/// the no-op round trip's median went from 11.4-11.9 µs to 11.0-11.3 µs,
/// the 16x16 distributed autograd step's from 76.2-78.9 µs to 74.5-77.6 µs.
const SPIN: Duration = Duration::from_micros(5);

/// Whether a reader in a process that may run on `cpus` CPUs gives the CPU
/// up between tries (BUSY-7): on one CPU only; where the count is unknown,
/// it spins as on a machine of many.
pub(crate) fn yields_cpu(cpus: Option<std::num::NonZeroUsize>) -> bool {
    cpus.is_some_and(|n| n.get() == 1)
}

/// The weight of the newest wait in the typical wait, as a divisor: the
/// average of roughly the last eight waits, so that one long wait (a peer
/// preempted, a slow call) does not stop polling, and a change of regime
/// is followed within a few calls.
const SMOOTHING: u32 = 8;

/// How long a reader polls its next wait, given its typical wait and its
/// window (BUSY-1, BUSY-2): `SPAN` typical waits, nothing once the typical
/// wait is as long as the window.
pub(crate) fn poll_limit(typical: Duration, window: Duration) -> Duration {
    if typical >= window {
        return Duration::ZERO;
    }
    (typical * SPAN).min(window)
}

/// The typical wait after one more wait of `wait`, for a reader whose
/// window is `window`: a moving average, to which one wait adds at most
/// `SPAN` windows' worth, so that one long pause (a peer preempted, a slow
/// call) stops polling for a call or two, not for dozens.
fn next_typical(typical: Duration, wait: Duration, window: Duration) -> Duration {
    let wait = wait.min(window * SPAN);
    // In nanoseconds: waits are far below the 584 years a u64 holds.
    let (t, w) = (typical.as_nanos() as u64, wait.as_nanos() as u64);
    let smoothing = u64::from(SMOOTHING);
    Duration::from_nanos(t - t / smoothing + w / smoothing)
}

/// The read half of a TCP connection, busy-polled per BUSY-1 to BUSY-9.
pub(crate) struct BusyPollRead {
    inner: OwnedReadHalf,
    window: Duration,
    /// When the current wait began (the first `Pending` since bytes came),
    /// by the monotonic clock and by the wall clock the kernel stamps
    /// received bytes with (BUSY-5).
    waiting_since: Option<(Instant, SystemTime)>,
    /// The kernel stamps this socket's received bytes (BUSY-5): set when
    /// `SO_TIMESTAMPNS` could be turned on.
    stamped: bool,
    /// The yield this reader waits on before its next `recv` (BUSY-3).
    turn: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The moving average of this reader's recent waits (BUSY-1).
    typical: Duration,
    /// Reads that found bytes while polling, so without a wake-up.
    polled: u64,
    /// Turns of its worker thread this reader yielded while polling.
    turns: u64,
    /// The process may run on one CPU only: a poll gives the CPU up
    /// between tries instead of spinning (BUSY-7).
    yields_cpu: bool,
    /// Times this reader gave the CPU up while polling (BUSY-7).
    cpu_yields: u64,
    /// Whether its CPU is crowded, from samples of its polled waits
    /// (BUSY-8).
    crowding: Crowding,
    /// The connection's work in progress (BUSY-4).
    in_progress: InProgress,
    /// The runtime this reader is polled on, whose queue of tasks woken
    /// from other threads ends a spin (BUSY-6); taken at the first spin.
    runtime: Option<tokio::runtime::RuntimeMetrics>,
}

impl BusyPollRead {
    /// Wraps `inner`, the read half of the connection whose work count is
    /// `in_progress`; `window` zero never polls.
    pub(crate) fn new(inner: OwnedReadHalf, window: Duration, in_progress: InProgress) -> Self {
        // Stamps serve only the polling decision: without polling, or where
        // the kernel refuses them, reads stay plain `recv`s.
        let stamped = !window.is_zero() && stamp::enable(inner.as_ref().as_fd());
        // Read per connection, not per try: it reads the affinity mask and
        // the cgroup's quota files, and connections are made rarely.
        let yields_cpu = !window.is_zero() && yields_cpu(std::thread::available_parallelism().ok());
        BusyPollRead {
            inner,
            window,
            waiting_since: None,
            stamped,
            turn: None,
            typical: Duration::ZERO,
            polled: 0,
            turns: 0,
            yields_cpu,
            cpu_yields: 0,
            crowding: Crowding::default(),
            in_progress,
            runtime: None,
        }
    }

    /// Bytes came, at `stamp` by the kernel's receive stamp when the read
    /// had one (a read after a sleep): the wait (if any) ends.
    fn arrived(&mut self, stamp: Option<SystemTime>) {
        if let Some((since, since_wall)) = self.waiting_since.take() {
            let woken = since.elapsed();
            // BUSY-5. A wall clock stepped back gives no duration, and one
            // stepped forward is capped by the monotonic one.
            let wait = stamp
                .and_then(|at| at.duration_since(since_wall).ok())
                .map_or(woken, |arrived| arrived.min(woken));
            // BUSY-9: from the later of its start and the connection's
            // last idle moment, if that came before the bytes.
            let served = self.wait_start(since).saturating_duration_since(since);
            let wait = if served < wait { wait - served } else { wait };
            self.typical = next_typical(self.typical, wait, self.window);
        }
        self.turn = None;
        // Whether or not it was polled for: a sample ends with polling.
        self.crowding.polling_ends();
    }

    /// Reads what the socket holds, or registers for its readiness: the
    /// stream's `poll_read`, with the kernel's receive stamp of the bytes
    /// read when the socket has stamps turned on (BUSY-5).
    fn poll_recv(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<Option<SystemTime>>> {
        if !self.stamped {
            return Pin::new(&mut self.inner)
                .poll_read(cx, buf)
                .map_ok(|()| None);
        }
        let tcp: &tokio::net::TcpStream = self.inner.as_ref();
        loop {
            std::task::ready!(tcp.poll_read_ready(cx))?;
            // `try_io` clears the readiness when the socket had nothing, so
            // the next `poll_read_ready` registers the waker again.
            match tcp.try_io(tokio::io::Interest::READABLE, || {
                stamp::recv(tcp.as_fd(), buf)
            }) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                result => return Poll::Ready(result),
            }
        }
    }

    /// One poll of the socket after a turn of the worker thread (BUSY-3),
    /// kept up for at most [`SPIN`] (and not past `deadline`) while no task
    /// was woken from another thread (BUSY-6), or, on one CPU, tried once
    /// more after giving the CPU up (BUSY-7): `Ok(true)` if it read bytes or
    /// saw the end of the stream.
    fn poll_after_turn(
        &mut self,
        fd: BorrowedFd<'_>,
        buf: &mut ReadBuf<'_>,
        deadline: Instant,
    ) -> io::Result<bool> {
        if recv_now(fd, buf)? {
            return Ok(true);
        }
        if self.yields_cpu {
            // SAFETY: `sched_yield` takes nothing and cannot fail on Linux.
            unsafe { libc::sched_yield() };
            self.cpu_yields += 1;
            return recv_now(fd, buf);
        }
        let runtime = match &self.runtime {
            Some(r) => r,
            None => match tokio::runtime::Handle::try_current() {
                Ok(h) => self.runtime.insert(h.metrics()),
                Err(_) => return Ok(false),
            },
        };
        let until = (Instant::now() + SPIN).min(deadline);
        // Tasks woken by I/O or timers wait for the next turn; those woken
        // from other threads (a blocking op's caller) are in the runtime's
        // global queue, and end the spin at once.
        while runtime.global_queue_depth() == 0 && Instant::now() < until {
            if recv_now(fd, buf)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// When the current wait, which the reader saw begin at `since`,
    /// began for the peer (BUSY-9): when the connection's work last ended,
    /// if later. Until then this side was still serving a call, and the
    /// peer had nothing to answer.
    fn wait_start(&self, since: Instant) -> Instant {
        self.in_progress
            .idle_since()
            .map_or(since, |idle| idle.max(since))
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
        if let Poll::Ready(r) = this.poll_recv(cx, buf) {
            let stamp = r.as_ref().ok().copied().flatten();
            this.arrived(stamp);
            return Poll::Ready(r.map(|_| ()));
        }
        // Pending: tokio has registered the waker, so giving up below is
        // always safe.
        let begins = this.waiting_since.is_none();
        let (since, _) = *this
            .waiting_since
            .get_or_insert_with(|| (Instant::now(), SystemTime::now()));
        // BUSY-8: a back-off's end is seen at the start of a wait, and a
        // back-off covers the whole of each wait begun within it.
        let crowded = if begins {
            !this.crowding.may_poll(since)
        } else {
            this.crowding.backing_off(since)
        };
        let limit = match this.in_progress.count() {
            0 | 1 if !crowded => poll_limit(this.typical, this.window),
            _ => Duration::ZERO,
        };
        if limit.is_zero() {
            this.turn = None;
            return Poll::Pending;
        }
        if begins {
            this.crowding.wait_begins(since);
        }
        // BUSY-3: one `recv` per turn of the worker thread, after every task
        // it had ready (`yield_now` defers this task behind them, and lets
        // the worker poll its I/O driver, without waking another worker).
        let start = this.wait_start(since);
        if let Some(turn) = this.turn.as_mut() {
            if turn.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.turn = None;
            // SAFETY: the fd is the socket `inner` owns, open while `this` is.
            let fd = unsafe { BorrowedFd::borrow_raw(this.fd()) };
            match this.poll_after_turn(fd, buf, start + limit) {
                Ok(true) => {
                    this.polled += 1;
                    // Polled: the monotonic clock saw the bytes come.
                    this.arrived(None);
                    return Poll::Ready(Ok(()));
                }
                Ok(false) => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        if start.elapsed() >= limit {
            this.crowding.polling_ends();
            return Poll::Pending;
        }
        let mut turn: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(tokio::task::yield_now());
        // The first poll of `yield_now` only defers the waker: Pending.
        let _ = turn.as_mut().poll(cx);
        this.turn = Some(turn);
        this.turns += 1;
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

mod crowding;
mod stamp;

use crowding::Crowding;
pub(crate) use crowding::busy_poll_back_offs;

#[cfg(test)]
mod tests;
