//! BUSY-8: whether a polling reader's CPU is wanted by other threads, from
//! how much of its polling time the reader spent off the CPU.
//!
//! A reader that polls holds a CPU. While the machine has a CPU for every
//! runnable thread that costs nothing but power; once it has more runnable
//! threads than CPUs (a build beside the workers, a data loader's
//! processes), the poller holds a CPU that the peer it waits for, or its
//! own process's work, needs, and the reply it polls for comes a time
//! slice later (measured on a 2-core VM, `wasmrpc-bench anatomy --call
//! noop`: a no-op's round trip 0.19-1.02 ms beside one or two CPU-bound
//! processes, against 24 µs with polling off).
//!
//! What tells such a machine apart is the scheduler's verdict on the poller
//! itself: between two of its tries, a poller on a machine with CPUs to
//! spare runs (polling, or running its thread's other tasks), and one on
//! a crowded machine waits in a run queue. So every [`SAMPLE_EVERY`]th
//! polled wait is timed twice, by the monotonic clock and by the thread's
//! CPU clock (a system call of about 0.5 µs, hence the sampling); the
//! share of the wait the thread was not running is its loss. The reader
//! stops polling for [`BACK_OFF`] once the average loss of its recent
//! samples passes [`CROWDED_LOSS`]; afterwards its next wait is polled as
//! a probe, which one sample decides.
//!
//! An earlier rule (tried 2026-12-06, reverted) backed off after a single
//! gap of 500 µs between tries, and backed off in a quiet machine's 16x16
//! autograd step too, where one preemption by a kernel thread is enough to
//! make such a gap; an average over samples needs the loss to last.
//!
//! This module owns the decision only; the reader (`super`) calls it at
//! the start and end of each polled wait, and asks it before polling.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// Back-offs of every reader of this process (BUSY-8), for the operator:
/// `get_debug_info`'s `agent.busy_poll_back_offs`, and the metrics'
/// `wasmrpc_agent_busy_poll_back_offs`.
static BACK_OFFS: AtomicU64 = AtomicU64::new(0);

/// How many times the readers of this process stopped polling for a
/// crowded CPU (BUSY-8) since it started.
pub(crate) fn busy_poll_back_offs() -> u64 {
    BACK_OFFS.load(Ordering::Relaxed)
}

/// One polled wait in this many is timed by the thread's CPU clock.
pub(crate) const SAMPLE_EVERY: u32 = 8;

/// The average share of a polled wait spent off the CPU above which a
/// reader stops polling: a fifth. On a machine with a CPU to spare the
/// samples lose next to nothing (a timer interrupt, a kernel thread's
/// turn), and beside a single CPU-bound process on two CPUs about a third.
pub(crate) const CROWDED_LOSS: f64 = 0.2;

/// The weight of the newest sample in the average loss, as a divisor: a
/// single sample that lost most of its wait (one preemption in a short
/// wait) moves it by an eighth.
const SMOOTHING: f64 = 8.0;

/// How long a reader that found its CPU crowded leaves its socket to
/// `epoll` before it polls again.
pub(crate) const BACK_OFF: Duration = Duration::from_millis(100);

/// A sample shorter than this is dropped: the two clocks' readings take a
/// microsecond between them, which would weigh too much.
const SHORTEST_SAMPLE: Duration = Duration::from_micros(10);

/// One reader's view of its CPU (BUSY-8).
#[derive(Debug)]
pub(crate) struct Crowding {
    /// The average loss above which the reader backs off:
    /// [`CROWDED_LOSS`] (the tests of the other rules raise it, so that a
    /// machine crowded by tests running beside them changes nothing).
    threshold: f64,
    /// Polled waits begun, for the sampling.
    waits: u32,
    /// The sample in progress: when it began, by the monotonic clock and
    /// by the CPU clock of the thread it began on.
    open: Option<(Instant, Duration, ThreadId)>,
    /// The average share of a sampled wait spent off the CPU.
    loss: f64,
    /// Polling is off until then.
    off_until: Option<Instant>,
    /// Times this reader stopped polling for a crowded CPU.
    pub(crate) back_offs: u64,
    /// Samples taken.
    pub(crate) samples: u64,
}

impl Default for Crowding {
    fn default() -> Self {
        Crowding {
            threshold: CROWDED_LOSS,
            waits: 0,
            open: None,
            loss: 0.0,
            off_until: None,
            back_offs: 0,
            samples: 0,
        }
    }
}

impl Crowding {
    /// A view that never finds the CPU crowded: for the tests of the
    /// other rules.
    #[cfg(test)]
    pub(crate) fn never_crowded() -> Self {
        Crowding {
            threshold: f64::INFINITY,
            ..Crowding::default()
        }
    }

    /// Whether the reader may poll a wait that began at `now`: not while
    /// it backs off. When a back-off ends, the next wait is sampled, and
    /// the average set to the threshold, so that the probe's sample alone
    /// decides whether the reader backs off again.
    pub(crate) fn may_poll(&mut self, now: Instant) -> bool {
        match self.off_until {
            Some(until) if now < until => false,
            Some(_) => {
                self.off_until = None;
                self.loss = self.threshold;
                self.waits = SAMPLE_EVERY - 1;
                true
            }
            None => true,
        }
    }

    /// A polled wait begins at `now`: sampled if its turn has come.
    pub(crate) fn wait_begins(&mut self, now: Instant) {
        self.waits = self.waits.wrapping_add(1);
        if self.waits.is_multiple_of(SAMPLE_EVERY) {
            self.open = Some((now, thread_cpu_time(), std::thread::current().id()));
        }
    }

    /// The polling of the current wait ended (bytes came, or the reader
    /// gave up): a sample in progress is taken, unless the reader's task
    /// moved to another thread meanwhile (its CPU clock is another's).
    pub(crate) fn polling_ends(&mut self) {
        let Some((began, cpu_then, thread)) = self.open.take() else {
            return;
        };
        let now = Instant::now();
        let wall = now.saturating_duration_since(began);
        if wall < SHORTEST_SAMPLE || thread != std::thread::current().id() {
            return;
        }
        let ran = thread_cpu_time().saturating_sub(cpu_then);
        self.record(loss_of(wall, ran), now);
    }

    /// Adds a sample that lost `loss` of its wait, taken at `now`.
    pub(crate) fn record(&mut self, loss: f64, now: Instant) {
        self.samples += 1;
        self.loss += (loss - self.loss) / SMOOTHING;
        if self.loss > self.threshold {
            self.off_until = Some(now + BACK_OFF);
            self.back_offs += 1;
            BACK_OFFS.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether the reader backs off at `now`.
    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        self.off_until.is_some_and(|until| now < until)
    }
}

/// The share of `wall` a thread that ran for `ran` of it spent off the
/// CPU, in [0, 1].
pub(crate) fn loss_of(wall: Duration, ran: Duration) -> f64 {
    if wall.is_zero() {
        return 0.0;
    }
    (1.0 - ran.as_secs_f64() / wall.as_secs_f64()).clamp(0.0, 1.0)
}

/// The CPU time of the calling thread.
fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BUSY-8's loss: the share of a wait its thread did not run.
    #[test]
    fn a_wait_loses_what_its_thread_did_not_run() {
        let ms = Duration::from_millis;
        assert_eq!(loss_of(ms(10), ms(10)), 0.0);
        assert_eq!(loss_of(ms(10), ms(5)), 0.5);
        assert_eq!(loss_of(ms(10), ms(0)), 1.0);
        // Clocks read a little apart: never below nothing lost.
        assert_eq!(loss_of(ms(10), ms(11)), 0.0);
        assert_eq!(loss_of(Duration::ZERO, Duration::ZERO), 0.0);
    }

    /// BUSY-8's decision: a reader whose samples lose next to nothing keeps
    /// polling, and so does one that lost most of a single wait (a kernel
    /// thread's turn); one whose samples keep losing a third or more stops
    /// for `BACK_OFF`, and afterwards a single probe decides.
    #[test]
    fn a_reader_backs_off_once_its_waits_keep_losing_the_cpu() {
        let start = Instant::now();
        let mut c = Crowding::default();
        assert!(c.may_poll(start));
        for _ in 0..100 {
            c.record(0.02, start);
        }
        c.record(0.95, start);
        assert_eq!(c.back_offs, 0, "one preempted wait stopped polling");
        assert!(c.may_poll(start));

        let mut samples = 0;
        while c.back_offs == 0 {
            c.record(0.4, start);
            samples += 1;
            assert!(samples < 20, "waits losing 40% never stopped polling");
        }
        assert!(samples > 1, "a single sample at 40% stopped polling");
        assert!(c.backing_off(start + BACK_OFF / 2));
        assert!(!c.may_poll(start + BACK_OFF / 2));

        // The back-off ends; the probe's sample finds the CPU free.
        let later = start + BACK_OFF;
        assert!(!c.backing_off(later));
        assert!(c.may_poll(later));
        c.record(0.0, later);
        assert_eq!(
            c.back_offs, 1,
            "a free CPU after a back-off stopped polling"
        );
        assert!(c.may_poll(later));

        // Crowded again: at the next back-off's end, one lossy probe is enough.
        while c.back_offs == 1 {
            c.record(0.5, later);
        }
        let probe = later + BACK_OFF;
        assert!(c.may_poll(probe));
        c.record(CROWDED_LOSS * 2.0, probe);
        assert_eq!(c.back_offs, 3, "a crowded probe went on polling");
        assert!(!c.may_poll(probe));
    }
}
