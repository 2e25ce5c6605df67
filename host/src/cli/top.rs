//! `wasmrpc top`: a live view of a running group, one row per worker, read
//! from the workers' metrics endpoints (`wasmrpc worker --metrics-addr`,
//! `wasmrpc launch --metrics-port`; `wasmrpc::metrics` exports them).
//!
//! Each refresh scrapes every endpoint and shows what changed since the
//! last one: calls served and made per second (the worker's own and its
//! features' internal calls left out of "made"), served calls that failed,
//! the median and 99th percentile of serve times (the upper bound of the
//! histogram bucket they fall in), tensor memory in use of its budget,
//! connections and calls pending; then the group's busiest functions.
//! On a terminal each frame replaces the last; otherwise frames follow each
//! other, for logs.

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::parse_seconds;

/// Flags of `wasmrpc top`.
#[derive(clap::Args, Debug)]
pub(crate) struct TopArgs {
    /// The workers' metrics endpoints: `HOST:PORT` or
    /// `http://HOST:PORT/metrics`, one per worker (a `launch --metrics-port
    /// P` group of N workers serves them on P .. P+N-1).
    #[arg(required = true, value_name = "ENDPOINT")]
    endpoints: Vec<String>,
    /// Seconds between refreshes.
    #[arg(long, default_value = "1", value_parser = parse_seconds)]
    interval: Duration,
    /// Stop after N frames (0: until interrupted).
    #[arg(long, default_value_t = 0)]
    iterations: u64,
}

/// One scrape: every sample by series (name and labels, as exported).
#[derive(Default)]
struct Scrape {
    samples: HashMap<String, f64>,
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                Some((series.to_owned(), value.trim().parse().ok()?))
            })
            .collect();
        Scrape { samples }
    }

    /// The samples of metric `name`, with their labels.
    fn of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = (Labels<'a>, f64)> + 'a {
        self.samples.iter().filter_map(move |(series, value)| {
            let rest = series.strip_prefix(name)?;
            match rest.strip_prefix('{') {
                Some(labels) => Some((Labels(labels.strip_suffix('}')?), *value)),
                None if rest.is_empty() => Some((Labels(""), *value)),
                None => None,
            }
        })
    }

    fn sum(&self, name: &str, keep: impl Fn(&Labels<'_>) -> bool) -> f64 {
        self.of(name).filter(|(l, _)| keep(l)).map(|(_, v)| v).sum()
    }

    fn value(&self, name: &str) -> Option<f64> {
        self.samples.get(name).copied()
    }
}

/// A sample's labels, `a="x",b="y"` (values are worker and function
/// names: no quotes or commas inside).
struct Labels<'a>(&'a str);

impl Labels<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.split(',').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k == key).then(|| v.trim_matches('"'))
        })
    }
}

/// Fetches `endpoint`'s metrics (plain HTTP/1.1, one request).
async fn scrape(endpoint: &str) -> Result<Scrape> {
    let rest = endpoint.strip_prefix("http://").unwrap_or(endpoint);
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{p}")),
        None => (rest, "/metrics".to_owned()),
    };
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        std::io::Result::Ok(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .with_context(|| format!("{endpoint}: no answer in 5 s"))?
        .with_context(|| format!("{endpoint}: cannot fetch the metrics"))?;
    let answer = String::from_utf8_lossy(&answer);
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        bail!("{endpoint}: not an HTTP answer");
    };
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "{endpoint}: {}",
            head.lines().next().unwrap_or("no status line")
        );
    }
    Ok(Scrape::parse(body))
}

/// The upper bound of the bucket holding quantile `q` of the serve times
/// between two scrapes, in seconds.
fn quantile(now: &Scrape, before: &Scrape, q: f64) -> Option<f64> {
    let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
    for (scrape, sign) in [(now, 1.0), (before, -1.0)] {
        for (labels, count) in scrape.of("wasmrpc_call_serve_seconds_bucket") {
            let le = match labels.get("le")? {
                "+Inf" => f64::INFINITY,
                le => le.parse().ok()?,
            };
            *buckets.entry(le.to_bits()).or_default() += sign * count;
        }
    }
    let mut bounds: Vec<(f64, f64)> = buckets
        .into_iter()
        .map(|(bits, n)| (f64::from_bits(bits), n))
        .collect();
    bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = bounds.last()?.1;
    if total <= 0.0 {
        return None;
    }
    bounds
        .into_iter()
        .find(|(_, n)| *n >= q * total)
        .map(|(le, _)| le)
}

fn millis(seconds: Option<f64>) -> String {
    match seconds {
        None => "-".into(),
        Some(s) if s.is_infinite() => "slow".into(),
        Some(s) if s < 1e-3 => format!("{:.0}us", s * 1e6),
        Some(s) => format!("{:.1}ms", s * 1e3),
    }
}

fn mib(bytes: f64) -> String {
    format!("{:.0}", bytes / (1024.0 * 1024.0))
}

/// One frame: the rows of every worker and the busiest functions.
fn frame(
    endpoints: &[String],
    now: &[Result<Scrape>],
    before: &[Result<Scrape>],
    dt: f64,
) -> String {
    let mut out = format!(
        "{:<16} {:>10} {:>10} {:>8} {:>8} {:>8} {:>16} {:>6} {:>8} {:>8} {:>6}\n",
        "WORKER",
        "SERVED/s",
        "MADE/s",
        "ERRORS/s",
        "P50",
        "P99",
        "TENSOR MiB",
        "CONNS",
        "PENDING",
        "OBJECTS",
        "WARM"
    );
    let mut functions: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (i, endpoint) in endpoints.iter().enumerate() {
        let (now, before) = match (&now[i], &before[i]) {
            (Ok(n), Ok(b)) => (n, b),
            (Err(e), _) | (_, Err(e)) => {
                out.push_str(&format!(
                    "{endpoint:<16} unreachable: {}\n",
                    super::error_report(e)
                ));
                continue;
            }
        };
        let name = now
            .of("wasmrpc_worker_info")
            .find_map(|(l, _)| l.get("name").map(str::to_owned))
            .unwrap_or_else(|| endpoint.clone());
        let rate = |metric: &str, keep: &dyn Fn(&Labels<'_>) -> bool| {
            (now.sum(metric, keep) - before.sum(metric, keep)) / dt
        };
        let served = rate("wasmrpc_calls_served_total", &|_| true);
        let made = rate("wasmrpc_calls_made_total", &|l| {
            l.get("kind") != Some("internal")
        });
        let errors = rate("wasmrpc_calls_served_total", &|l| {
            l.get("outcome") != Some("ok")
        });
        let memory = format!(
            "{}/{}",
            mib(now
                .value("wasmrpc_agent_tensor_memory_bytes")
                .unwrap_or(0.0)),
            mib(now
                .value("wasmrpc_agent_tensor_memory_limit_bytes")
                .unwrap_or(0.0))
        );
        out.push_str(&format!(
            "{name:<16} {served:>10.1} {made:>10.1} {errors:>8.1} {:>8} {:>8} {memory:>16} {:>6} \
             {:>8} {:>8} {:>6}\n",
            millis(quantile(now, before, 0.5)),
            millis(quantile(now, before, 0.99)),
            now.value("wasmrpc_agent_num_connections").unwrap_or(0.0),
            now.value("wasmrpc_agent_num_pending_requests")
                .unwrap_or(0.0),
            now.value("wasmrpc_agent_plugin_objects").unwrap_or(0.0),
            now.value("wasmrpc_agent_plugin_idle_instances")
                .unwrap_or(0.0),
        ));
        let mut by_function: HashMap<String, (f64, f64)> = HashMap::new();
        for (scrape, sign) in [(now, 1.0), (before, -1.0)] {
            for (labels, n) in scrape.of("wasmrpc_calls_served_total") {
                let Some(function) = labels.get("function") else {
                    continue;
                };
                let entry = by_function.entry(function.to_owned()).or_default();
                entry.0 += sign * n;
                if labels.get("outcome") != Some("ok") {
                    entry.1 += sign * n;
                }
            }
        }
        for (function, (calls, failed)) in by_function {
            let entry = functions.entry(function).or_default();
            entry.0 += calls / dt;
            entry.1 += failed / dt;
        }
    }
    let mut busiest: Vec<_> = functions
        .into_iter()
        .filter(|(_, (c, _))| *c > 0.0)
        .collect();
    busiest.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    out.push_str(&format!(
        "\n{:<48} {:>10} {:>10}\n",
        "FUNCTION (whole group)", "CALLS/s", "ERRORS/s"
    ));
    for (function, (calls, failed)) in busiest.into_iter().take(8) {
        out.push_str(&format!("{function:<48} {calls:>10.1} {failed:>10.1}\n"));
    }
    out
}

/// Runs the view until interrupted or `--iterations` frames.
pub(crate) async fn run(args: TopArgs) -> Result<std::process::ExitCode> {
    let terminal = std::io::stdout().is_terminal();
    let scrape_all = |endpoints: &[String]| {
        let endpoints = endpoints.to_vec();
        async move { futures::future::join_all(endpoints.iter().map(|e| scrape(e))).await }
    };
    let mut before = scrape_all(&args.endpoints).await;
    if before.iter().all(Result::is_err) {
        let why: Vec<String> = before
            .iter()
            .filter_map(|r| r.as_ref().err().map(super::error_report))
            .collect();
        bail!("no worker's metrics could be read: {}", why.join("; "));
    }
    let mut taken = Instant::now();
    let mut frames = 0;
    loop {
        tokio::time::sleep(args.interval).await;
        let now = scrape_all(&args.endpoints).await;
        let dt = taken.elapsed().as_secs_f64().max(1e-3);
        taken = Instant::now();
        let text = frame(&args.endpoints, &now, &before, dt);
        if terminal {
            print!("\x1b[2J\x1b[H");
        } else if frames > 0 {
            println!();
        }
        print!("{text}");
        before = now;
        frames += 1;
        if args.iterations > 0 && frames >= args.iterations {
            return Ok(std::process::ExitCode::SUCCESS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_buckets_that_changed() {
        let before = Scrape::parse(
            "wasmrpc_call_serve_seconds_bucket{le=\"0.001\",caller=\"a\",function=\"f\"} 5\n\
             wasmrpc_call_serve_seconds_bucket{le=\"0.01\",caller=\"a\",function=\"f\"} 5\n\
             wasmrpc_call_serve_seconds_bucket{le=\"+Inf\",caller=\"a\",function=\"f\"} 5\n",
        );
        let now = Scrape::parse(
            "wasmrpc_call_serve_seconds_bucket{le=\"0.001\",caller=\"a\",function=\"f\"} 95\n\
             wasmrpc_call_serve_seconds_bucket{le=\"0.01\",caller=\"a\",function=\"f\"} 104\n\
             wasmrpc_call_serve_seconds_bucket{le=\"+Inf\",caller=\"a\",function=\"f\"} 105\n",
        );
        // 100 new calls: 90 under 1 ms, 9 under 10 ms, 1 slower.
        assert_eq!(quantile(&now, &before, 0.5), Some(0.001));
        assert_eq!(quantile(&now, &before, 0.95), Some(0.01));
        assert_eq!(quantile(&now, &before, 1.0), Some(f64::INFINITY));
        assert_eq!(quantile(&before, &before, 0.5), None);
    }

    #[test]
    fn a_frame_shows_rates_per_worker_and_the_busiest_functions() {
        let before = Scrape::parse(
            "wasmrpc_worker_info{name=\"ps\",rank=\"0\"} 1\n\
             wasmrpc_calls_served_total{caller=\"t1\",function=\"ps::get\",outcome=\"ok\"} 10\n",
        );
        let now = Scrape::parse(
            "wasmrpc_worker_info{name=\"ps\",rank=\"0\"} 1\n\
             wasmrpc_calls_served_total{caller=\"t1\",function=\"ps::get\",outcome=\"ok\"} 30\n\
             wasmrpc_calls_served_total{caller=\"t1\",function=\"ps::get\",outcome=\"ValueError\"} 2\n\
             wasmrpc_agent_num_connections 3\n\
             wasmrpc_agent_plugin_objects 4\n\
             wasmrpc_agent_plugin_idle_instances 2\n",
        );
        let text = frame(
            &["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            &[Ok(now), Err(anyhow::anyhow!("refused"))],
            &[Ok(before), Ok(Scrape::default())],
            2.0,
        );
        let ps = text
            .lines()
            .find(|l| l.starts_with("ps "))
            .expect("a row for ps");
        let cells: Vec<&str> = ps.split_whitespace().collect();
        assert_eq!(cells[1], "11.0", "{text}");
        assert_eq!(cells[3], "1.0", "{text}");
        // Plugin objects alive and warm instances, the last two columns.
        assert_eq!(cells[cells.len() - 2..], ["4", "2"], "{text}");
        assert!(
            text.contains("127.0.0.1:2      unreachable: refused"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("ps::get") && l.ends_with("11.0        1.0")),
            "{text}"
        );
    }
}
