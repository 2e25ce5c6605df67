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

#[cfg(test)]
mod tests {
    use super::*;

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
