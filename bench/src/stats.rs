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
    let mut total = Duration::ZERO;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        total += run_time(&entry?.path().join("schedstat")).unwrap_or_default();
    }
    Ok(total)
}

/// The CPU time the calling thread has run so far
/// (`/proc/thread-self/schedstat`), counting none of the process's other
/// threads.
pub(crate) fn thread_cpu() -> std::io::Result<Duration> {
    run_time(std::path::Path::new("/proc/thread-self/schedstat"))
}

/// The time on CPU a `schedstat` file reports (its first field, in ns).
fn run_time(schedstat: &std::path::Path) -> std::io::Result<Duration> {
    let text = std::fs::read_to_string(schedstat)?;
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .ok_or_else(|| std::io::Error::other(format!("{}: {text:?}", schedstat.display())))
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

    #[test]
    fn a_threads_cpu_counts_its_own_work_not_its_siblings() {
        let spin = |for_how_long: Duration| {
            let start = std::time::Instant::now();
            let mut x = 0u64;
            while start.elapsed() < for_how_long {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        };
        let before = thread_cpu().unwrap();
        std::thread::spawn(move || spin(Duration::from_millis(200)))
            .join()
            .unwrap();
        let while_sibling_ran = thread_cpu().unwrap() - before;
        spin(Duration::from_millis(50));
        let own = thread_cpu().unwrap() - before - while_sibling_ran;
        assert!(
            while_sibling_ran < Duration::from_millis(100),
            "{while_sibling_ran:?} counted while only a sibling thread spun"
        );
        assert!(
            own >= Duration::from_millis(10),
            "{own:?} for 50 ms of spinning"
        );
        assert!(process_cpu(std::process::id()).unwrap() >= own);
    }
}
