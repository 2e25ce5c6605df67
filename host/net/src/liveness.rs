//! Liveness: telling, within a bounded window, that the peer of a
//! connection stopped answering (a stopped process, a machine that dropped
//! off the network: anything that leaves a connection open and silent). A
//! peer that dies outright closes its connection and needs none of this.
//!
//! Both the agent's connections and the `tcp` process group's mesh use it;
//! each sends its own heartbeat frame (the agent a zero length prefix, the
//! mesh a frame of the heartbeat kind) and decides what a silent peer
//! means. This module owns the rules:
//!
//! - LIVE-1: once per tick ([`tick_interval`], a fifth of the failure
//!   window), every connection the caller sent nothing on since the
//!   previous tick gets a heartbeat ([`Observation::heartbeat_due`]). A
//!   connection that carries frames sends none: the frames are the proof.
//! - LIVE-2: a connection from which no byte was read for the whole window
//!   *and* over at least [`TICKS`] ticks in a row is silent
//!   ([`Observation::silent`]). Counting the watcher's own ticks, not only
//!   the clock, keeps a process whose threads were starved (its readers
//!   not run for a while) from blaming its peers: readers run between two
//!   ticks.
//! - LIVE-3: the data path pays one relaxed atomic add per frame sent
//!   ([`Activity::sent`]) and one per socket read that brought bytes
//!   ([`CountedRead`]); everything else runs in the caller's watchdog, once
//!   per tick.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, ReadBuf};

/// How many watchdog ticks one failure window spans (LIVE-1, LIVE-2).
pub const TICKS: u32 = 5;

/// The failure window wasmrpc uses by default: 2 s.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a watchdog with failure window `window` ticks.
pub fn tick_interval(window: Duration) -> Duration {
    (window / TICKS).max(Duration::from_millis(5))
}

/// Why a silent peer failed, as errors say it: "no heartbeat for 2.0 s".
pub fn silence_cause(window: Duration) -> String {
    format!("no heartbeat for {:.1} s", window.as_secs_f64())
}

/// What one connection did: frames queued to send, and socket reads that
/// brought bytes (LIVE-3), with the bytes of both and the frames received,
/// for the operator's traffic counters. Cheap to share between the data
/// path and the watchdog.
#[derive(Debug, Default)]
pub struct Activity {
    sent: AtomicU64,
    bytes_sent: AtomicU64,
    received: AtomicU64,
    reads: Arc<ReadCounts>,
}

/// What a [`CountedRead`] counted.
#[derive(Debug, Default)]
struct ReadCounts {
    reads: AtomicU64,
    bytes: AtomicU64,
}

impl Activity {
    /// Counts a frame queued to send (heartbeats included).
    pub fn sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `bytes` queued to send, on top of [`sent`](Self::sent)'s
    /// frames (a sender that knows its frame's size).
    pub fn sent_bytes(&self, bytes: u64) {
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts a whole frame received.
    pub fn received(&self) {
        self.received.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts progress in receiving a frame's bytes another way than the
    /// socket (a storage copied out of shared memory): to the watchdog it is
    /// a read (LIVE-3), as only a live peer's bytes arrive; the socket's
    /// byte count is left alone.
    pub fn read_elsewhere(&self) {
        self.reads.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// How many frames were counted as sent.
    pub fn frames_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// How many bytes were counted as sent.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    /// How many frames were counted as received.
    pub fn frames_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// How many bytes the counting read half read.
    pub fn bytes_read(&self) -> u64 {
        self.reads.bytes.load(Ordering::Relaxed)
    }

    /// Wraps the connection's read half so that its reads count.
    pub fn counting<R>(&self, read: R) -> CountedRead<R> {
        CountedRead {
            inner: read,
            reads: Arc::clone(&self.reads),
        }
    }
}

/// A connection's read half that counts the reads that brought bytes
/// (LIVE-3).
#[derive(Debug)]
pub struct CountedRead<R> {
    inner: R,
    reads: Arc<ReadCounts>,
}

impl<R: AsyncRead + Unpin> AsyncRead for CountedRead<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        if read > 0 {
            this.reads.reads.fetch_add(1, Ordering::Relaxed);
            this.reads.bytes.fetch_add(read as u64, Ordering::Relaxed);
        }
        polled
    }
}

/// A watchdog's view of one connection between its ticks.
#[derive(Debug)]
pub struct Watch {
    window: Duration,
    sent: Option<u64>,
    reads: u64,
    /// When `reads` last moved (or the connection was first watched).
    since: Instant,
    /// Ticks in a row with no read.
    quiet_ticks: u32,
}

/// What one tick found of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    /// Nothing was sent on it since the previous tick: send a heartbeat
    /// (LIVE-1).
    pub heartbeat_due: bool,
    /// Nothing was read from it for the window, over [`TICKS`] ticks:
    /// its peer is silent (LIVE-2).
    pub silent: bool,
}

impl Watch {
    /// Starts watching `activity` at `now`, with failure window `window`.
    pub fn new(activity: &Activity, window: Duration, now: Instant) -> Watch {
        Watch {
            window,
            sent: None,
            reads: activity.reads.reads.load(Ordering::Relaxed),
            since: now,
            quiet_ticks: 0,
        }
    }

    /// One tick at `now`. A heartbeat the caller sends on
    /// [`Observation::heartbeat_due`] must be counted
    /// ([`Activity::sent`]) before the next tick.
    pub fn tick(&mut self, activity: &Activity, now: Instant) -> Observation {
        let sent = activity.sent.load(Ordering::Relaxed);
        let heartbeat_due = self.sent == Some(sent);
        // After a heartbeat, the next tick sees it as this tick's send.
        self.sent = Some(sent + u64::from(heartbeat_due));
        let reads = activity.reads.reads.load(Ordering::Relaxed);
        if reads != self.reads {
            (self.reads, self.since, self.quiet_ticks) = (reads, now, 0);
            return Observation {
                heartbeat_due,
                silent: false,
            };
        }
        self.quiet_ticks += 1;
        Observation {
            heartbeat_due,
            silent: self.quiet_ticks >= TICKS && now - self.since >= self.window,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_that_sends_needs_no_heartbeat_and_an_idle_one_gets_one_per_tick() {
        let activity = Activity::default();
        let t0 = Instant::now();
        let mut watch = Watch::new(&activity, Duration::from_secs(2), t0);
        // The first tick only learns where the counters stand.
        assert!(!watch.tick(&activity, t0).heartbeat_due);
        activity.sent();
        assert!(!watch.tick(&activity, t0).heartbeat_due, "a frame went out");
        let due = watch.tick(&activity, t0).heartbeat_due;
        assert!(due, "nothing went out");
        activity.sent(); // the heartbeat
        assert!(watch.tick(&activity, t0).heartbeat_due, "idle again");
    }

    #[test]
    fn silence_needs_both_the_window_and_the_ticks() {
        let activity = Activity::default();
        let window = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut watch = Watch::new(&activity, window, t0);
        // A starved watchdog that wakes once, long after: not silent yet.
        assert!(!watch.tick(&activity, t0 + window * 10).silent);
        for i in 2..TICKS {
            assert!(!watch.tick(&activity, t0 + window * 10).silent, "tick {i}");
        }
        assert!(watch.tick(&activity, t0 + window * 10).silent);
        // Enough ticks but not the window: not silent.
        let mut watch = Watch::new(&activity, window, t0);
        for _ in 0..TICKS * 3 {
            assert!(!watch.tick(&activity, t0 + window / 2).silent);
        }
    }

    #[tokio::test]
    async fn the_bytes_and_frames_of_both_directions_are_counted() {
        let activity = Activity::default();
        activity.sent();
        activity.sent_bytes(40);
        activity.received();
        let mut read = activity.counting(&b"twelve bytes"[..]);
        let mut buf = [0u8; 5];
        let mut total = 0;
        loop {
            let n = tokio::io::AsyncReadExt::read(&mut read, &mut buf)
                .await
                .unwrap();
            if n == 0 {
                break;
            }
            total += n;
        }
        assert_eq!(total, 12);
        assert_eq!(
            (
                activity.frames_sent(),
                activity.bytes_sent(),
                activity.frames_received(),
                activity.bytes_read()
            ),
            (1, 40, 1, 12)
        );
    }

    #[tokio::test]
    async fn a_read_that_brings_bytes_restarts_the_window() {
        let activity = Activity::default();
        let window = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut watch = Watch::new(&activity, window, t0);
        for _ in 0..TICKS - 1 {
            watch.tick(&activity, t0 + window);
        }
        let mut read = activity.counting(&b"x"[..]);
        let mut byte = [0u8; 1];
        tokio::io::AsyncReadExt::read(&mut read, &mut byte)
            .await
            .unwrap();
        assert!(!watch.tick(&activity, t0 + window * 2).silent);
        // An empty read (the end) is no sign of life.
        tokio::io::AsyncReadExt::read(&mut read, &mut byte)
            .await
            .unwrap();
        for _ in 0..TICKS - 1 {
            assert!(!watch.tick(&activity, t0 + window * 4).silent);
        }
        assert!(watch.tick(&activity, t0 + window * 4).silent);
        assert_eq!(silence_cause(window), "no heartbeat for 2.0 s");
    }
}
