//! Medians and percentiles of samples.

use std::time::Duration;

/// A measured quantity: its median, its 99th percentile (latencies), and how
/// many samples it came from.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Stat {
    /// The median (or the only value).
    pub(crate) median: f64,
    /// The 99th percentile, for latencies.
    pub(crate) p99: Option<f64>,
    /// Number of samples (calls, runs).
    pub(crate) n: u64,
}

impl Stat {
    /// A single value (a rate, a size).
    pub(crate) fn value(v: f64, n: u64) -> Self {
        Stat {
            median: v,
            p99: None,
            n,
        }
    }

    /// Median and p99 of latencies, in microseconds.
    pub(crate) fn latencies(samples: &[Duration]) -> Self {
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_by(f64::total_cmp);
        Stat {
            median: percentile(&us, 0.5),
            p99: Some(percentile(&us, 0.99)),
            n: us.len() as u64,
        }
    }
}

/// The `q` quantile of sorted values (nearest rank), NaN when empty.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = (q * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The CPU time every thread of process `pid` has run so far, from the
/// scheduler's nanosecond counts (`/proc/PID/task/*/schedstat`; the tick
/// counts of `stat` are 10 ms coarse). A thread that ends between two
/// readings takes its time with it.
pub(crate) fn process_cpu(pid: u32) -> std::io::Result<Duration> {
    let mut nanos = 0u64;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(schedstat) = std::fs::read_to_string(entry?.path().join("schedstat")) else {
            continue;
        };
        nanos += schedstat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(Duration::from_nanos(nanos))
}

/// The machine's CPU time so far, all of it and the hypervisor's share
/// (`/proc/stat`'s first line, in clock ticks): on a VM whose host is busy,
/// the hypervisor keeps the virtual CPUs from running for part of their
/// time (steal), and every measurement taken then slows, its floor's too
/// but not alike (a poller loses its CPU in the middle of a wait, a
/// sleeper's wake-up comes later). Two readings say how much of the time
/// between them was stolen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CpuTicks {
    total: u64,
    steal: u64,
}

impl CpuTicks {
    /// The reading now; `None` where `/proc/stat` cannot be read.
    pub(crate) fn now() -> Option<CpuTicks> {
        CpuTicks::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The first line of `/proc/stat`: "cpu user nice system idle iowait
    /// irq softirq steal guest guest_nice" (guest time is counted in user
    /// time already, so it is left out of the total).
    fn parse(stat: &str) -> Option<CpuTicks> {
        let line = stat.lines().next()?;
        let mut fields = line.split_ascii_whitespace();
        if fields.next()? != "cpu" {
            return None;
        }
        let ticks: Vec<u64> = fields
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        if ticks.len() < 8 {
            return None;
        }
        Some(CpuTicks {
            total: ticks.iter().sum(),
            steal: ticks[7],
        })
    }

    /// The share of the CPUs' time from `earlier` to this reading that the
    /// hypervisor took, in [0, 1]; `None` if no tick passed between them.
    pub(crate) fn steal_since(&self, earlier: &CpuTicks) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let steal = self.steal.checked_sub(earlier.steal)?;
        (total > 0).then(|| (steal as f64 / total as f64).min(1.0))
    }
}

/// The hypervisor's share of the CPUs' time between two readings, `None`
/// where either reading failed or no tick passed between them.
pub(crate) fn steal_between(from: Option<CpuTicks>, to: Option<CpuTicks>) -> Option<f64> {
    from.zip(to).and_then(|(from, to)| to.steal_since(&from))
}

/// A share of the CPUs' time as printed: "12%", or "?" where unknown.
pub(crate) fn fmt_share(share: Option<f64>) -> String {
    share.map_or_else(|| "?".to_string(), |share| format!("{:.0}%", share * 100.0))
}

/// The hypervisor's share of the CPUs' time between two readings, as
/// printed: "12%", or "?" where either reading failed.
pub(crate) fn fmt_steal(from: Option<CpuTicks>, to: Option<CpuTicks>) -> String {
    fmt_share(steal_between(from, to))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hypervisors_share_between_two_readings() {
        let first = CpuTicks::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n").unwrap();
        assert_eq!(
            first,
            CpuTicks {
                total: 1000,
                steal: 35
            }
        );
        let second = CpuTicks::parse("cpu  160 0 70 900 10 0 5 55 7 0\n").unwrap();
        assert_eq!(second.steal_since(&first), Some(20.0 / 200.0));
        assert_eq!(fmt_steal(Some(first), Some(second)), "10%");
        // No tick between them, readings in the wrong order, or one missing.
        assert_eq!(first.steal_since(&first), None);
        assert_eq!(first.steal_since(&second), None);
        assert_eq!(fmt_steal(None, Some(second)), "?");
        // A kernel too old to count steal, or another file.
        assert_eq!(CpuTicks::parse("cpu  1 2 3 4\n"), None);
        assert_eq!(CpuTicks::parse("intr 1 2 3 4 5 6 7 8\n"), None);
    }

    #[test]
    fn median_and_p99_of_latencies() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let s = Stat::latencies(&samples);
        assert_eq!(s.median, 51.0);
        assert_eq!(s.p99, Some(99.0));
        assert_eq!(s.n, 100);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
