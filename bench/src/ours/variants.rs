//! Rows that price a variant of the group of 2: mutual TLS (issue 20),
//! metrics on, and metrics with traces exported (issue 50), each measured
//! against the same calls in a plain group, in alternating rounds of one
//! run.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use tch::Device;
use wasmrpc::{CertificateAuthority, args};

use super::{Children, Config, async_128, echo, free_port, rtt_noop, worker_args};
use crate::progress::Progress;
use crate::rows::{Results, Side};
use crate::stats::Stat;
use crate::worker::{self, NOOP};

/// The environment variables that give a worker process TLS credentials:
/// removed from the bench's worker processes unless a row sets them.
pub(super) const TLS_ENV: [&str; 6] = [
    wasmrpc::transport::TLS_CA_ENV,
    wasmrpc::transport::TLS_CERT_ENV,
    wasmrpc::transport::TLS_KEY_ENV,
    wasmrpc::transport::TLS_CA_PEM_ENV,
    wasmrpc::transport::TLS_CERT_PEM_ENV,
    wasmrpc::transport::TLS_KEY_PEM_ENV,
];

/// What a variant row measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Measure {
    /// The round trip of a no-op (`rtt_noop_native`).
    RoundTrip,
    /// Async calls per second with 128 in flight (`async_128`).
    Rate,
    /// The echo of a 64 MiB tensor (`echo_64m`).
    Echo64m,
}

/// A row that prices a variant: its id, the plain row it is compared with,
/// the most the variant may cost, and what it measures.
pub(crate) struct VariantRow {
    /// The row's id.
    pub(crate) id: &'static str,
    plain: &'static str,
    target: f64,
    measure: Measure,
}

const fn row(id: &'static str, plain: &'static str, target: f64, measure: Measure) -> VariantRow {
    VariantRow {
        id,
        plain,
        target,
        measure,
    }
}

/// The TLS rows (issue 20: at most 10% on small calls, 25% on the 64 MiB
/// echo; the async row is small calls).
pub(crate) const TLS_ROWS: &[VariantRow] = &[
    row(
        "rtt_noop_native_tls",
        "rtt_noop_native",
        0.10,
        Measure::RoundTrip,
    ),
    row("async_128_tls", "async_128", 0.10, Measure::Rate),
    row("echo_64m_tls", "echo_64m", 0.25, Measure::Echo64m),
];

/// The metrics rows: both workers count every call and serve `/metrics`
/// (issue 50: at most 5% on the small-call and async rows).
pub(crate) const METRICS_ROWS: &[VariantRow] = &[
    row(
        "rtt_noop_native_metrics",
        "rtt_noop_native",
        0.05,
        Measure::RoundTrip,
    ),
    row("async_128_metrics", "async_128", 0.05, Measure::Rate),
];

/// The traced rows: metrics on, and every call's spans recorded and
/// exported to a collector on loopback (the bench's own, which takes and
/// drops them). Issue 50 asks at most 5% for metrics and tracing on.
pub(crate) const TRACED_ROWS: &[VariantRow] = &[
    row(
        "rtt_noop_native_traced",
        "rtt_noop_native",
        0.05,
        Measure::RoundTrip,
    ),
    row("async_128_traced", "async_128", 0.05, Measure::Rate),
];

/// The sampled traced row: as [`TRACED_ROWS`], with 1% of the traces
/// recorded (`--otlp-sample-ratio 0.01`), as an operator under load runs.
pub(crate) const SAMPLED_ROWS: &[VariantRow] = &[row(
    "async_128_traced_1pct",
    "async_128",
    0.05,
    Measure::Rate,
)];

/// A group of 2 as a variant row runs it.
#[derive(Clone, Copy)]
enum Variant<'a> {
    /// No TLS, no metrics.
    Plain,
    /// TLS 1.3 with mutual authentication, certificates issued by the CA.
    Tls(&'a CertificateAuthority),
    /// Metrics on, served on a loopback port of each worker.
    Metrics,
    /// Metrics on, and spans exported to the OTLP/HTTP collector at this
    /// URL, this share of the traces recorded.
    Traced(&'a str, f64),
}

impl Variant<'_> {
    fn describe(self) -> &'static str {
        match self {
            Variant::Plain => "plain TCP",
            Variant::Tls(_) => "over TLS",
            Variant::Metrics => "metrics on",
            Variant::Traced(_, _) => "metrics and traces on",
        }
    }

    /// What each worker tells observers in this variant.
    fn observe(self) -> worker::Observe {
        let loopback_any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        match self {
            Variant::Plain | Variant::Tls(_) => worker::Observe::default(),
            Variant::Metrics => worker::Observe {
                metrics_addr: Some(loopback_any_port),
                ..worker::Observe::default()
            },
            Variant::Traced(endpoint, ratio) => worker::Observe {
                metrics_addr: Some(loopback_any_port),
                otlp_endpoint: Some(endpoint.to_owned()),
                otlp_sample_ratio: Some(ratio),
            },
        }
    }
}

/// What one group measured: each row's stat (none for rows not wanted),
/// and, if it measured the echo, the CPU time one echo takes in both
/// processes together.
struct GroupSample {
    stats: Vec<Option<Stat>>,
    echo_cpu: Option<Duration>,
}

/// Echoes of the 64 MiB tensor whose CPU time [`echo_cpu`] counts.
const ECHO_CPU_CALLS: usize = 5;

/// The CPU time of one echo of a 64 MiB tensor, in this process and in the
/// worker `callee` together (every thread), over [`ECHO_CPU_CALLS`] echoes.
async fn echo_cpu(agent: &wasmrpc::RpcAgent, callee: u32) -> Result<Duration> {
    let (_, size, _, _) = crate::limit::ECHO[2];
    let t = crate::worker::off_runtime(move || {
        tch::Tensor::rand([(size / 4) as i64], (tch::Kind::Float, Device::Cpu))
    })
    .await?;
    let echo = || agent.rpc_sync("worker1", crate::worker::ECHO, args![t.shallow_clone()]);
    echo().await?;
    let cpu = || -> Result<Duration> {
        Ok(crate::stats::process_cpu(std::process::id())?
            + crate::stats::process_cpu(callee)
                .with_context(|| format!("reading worker1's (pid {callee}) CPU time"))?)
    };
    let before = cpu()?;
    for _ in 0..ECHO_CPU_CALLS {
        echo().await?;
    }
    Ok((cpu()? - before) / ECHO_CPU_CALLS as u32)
}

/// Starts a group of 2 (rank 0 here, rank 1 a process) as `variant` says,
/// and takes `rows`' measurements in it, in their order.
async fn group_sample(
    cfg: &Config,
    variant: Variant<'_>,
    rows: &[VariantRow],
    progress: &Progress,
) -> Result<GroupSample> {
    let what = variant.describe();
    progress.set(&format!("wasmrpc: starting a group of 2 workers, {what}"));
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let observe = variant.observe();
    let children = Children::spawn_with_env(
        cfg,
        |r| {
            let mut args = worker_args(cfg, &method, r, 2);
            if let Some(addr) = observe.metrics_addr {
                args.extend(["--metrics-addr".into(), addr.to_string()]);
            }
            if let Some(endpoint) = &observe.otlp_endpoint {
                args.extend(["--otlp-endpoint".into(), endpoint.clone()]);
            }
            if let Some(ratio) = observe.otlp_sample_ratio {
                args.extend(["--otlp-sample-ratio".into(), ratio.to_string()]);
            }
            args
        },
        1..2,
        false,
        |rank| {
            let Variant::Tls(ca) = variant else {
                return Ok(Vec::new());
            };
            let (cert, key) = ca
                .issue(&format!("worker{rank}"))
                .with_context(|| format!("issuing worker{rank}'s certificate"))?;
            Ok(vec![
                (
                    wasmrpc::transport::TLS_CA_PEM_ENV,
                    ca.cert_pem().to_string(),
                ),
                (wasmrpc::transport::TLS_CERT_PEM_ENV, cert),
                (wasmrpc::transport::TLS_KEY_PEM_ENV, key),
            ])
        },
    )?;
    let tls = match variant {
        Variant::Tls(ca) => Some(
            ca.credentials_for("worker0")
                .context("issuing worker0's certificate")?,
        ),
        _ => None,
    };
    let mut options = worker::options(tls, false);
    options.metrics_addr = observe.metrics_addr;
    options.otlp_endpoint = observe.otlp_endpoint;
    options.otlp_sample_ratio = observe.otlp_sample_ratio.unwrap_or(1.0);
    let agent = worker::join_with(&method, 0, 2, &[], options).await?;
    let r = async {
        for i in 0..50 {
            agent.rpc_sync("worker1", NOOP, args![i]).await?;
        }
        let mut sample = Vec::with_capacity(rows.len());
        let mut cpu = None;
        for row in rows {
            if !cfg.wanted(row.id) {
                sample.push(None);
                continue;
            }
            let stat = match row.measure {
                Measure::RoundTrip => {
                    progress.set(&format!("wasmrpc: round trip of a no-op, {what}"));
                    rtt_noop(cfg, &agent).await?
                }
                Measure::Rate => {
                    progress.set(&format!("wasmrpc: async calls with 128 in flight, {what}"));
                    async_128(cfg, &agent).await?
                }
                Measure::Echo64m => {
                    progress.set(&format!("wasmrpc: echo of a 64 MiB tensor, {what}"));
                    let (_, size, nq, nf) = crate::limit::ECHO[2];
                    let stat = echo(cfg, &agent, Device::Cpu, size, nq, nf).await?;
                    cpu = Some(echo_cpu(&agent, children.pids()[0]).await?);
                    stat
                }
            };
            sample.push(Some(stat));
        }
        anyhow::Ok(GroupSample {
            stats: sample,
            echo_cpu: cpu,
        })
    }
    .await;
    progress.set(&format!(
        "wasmrpc: graceful shutdown of the group of 2, {what}"
    ));
    let s = agent.shutdown(true, Duration::ZERO).await;
    children.finish(r, s, Duration::from_secs(30)).await
}

/// Rounds of the variant rows: each a plain group, then the variant's.
const ROUNDS: usize = 5;

/// The TLS rows (`*_tls`), see [`variant_rows`].
pub(crate) async fn tls_rows(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    let ca = CertificateAuthority::generate().context("generating an ephemeral CA")?;
    variant_rows(cfg, res, progress, TLS_ROWS, Variant::Tls(&ca), "TLS").await
}

/// The metrics rows (`*_metrics`), see [`variant_rows`].
pub(crate) async fn metrics_rows(
    cfg: &Config,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    variant_rows(
        cfg,
        res,
        progress,
        METRICS_ROWS,
        Variant::Metrics,
        "metrics",
    )
    .await
}

/// The traced rows (`*_traced`), see [`variant_rows`]: the workers export
/// to a collector this process runs.
pub(crate) async fn traced_rows(
    cfg: &Config,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the bench's collector")?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let collector = tokio::spawn(collect_and_drop(listener));
    let mut r = variant_rows(
        cfg,
        res,
        progress,
        TRACED_ROWS,
        Variant::Traced(&endpoint, 1.0),
        "metrics and traces",
    )
    .await;
    if r.is_ok() && SAMPLED_ROWS.iter().any(|row| cfg.wanted(row.id)) {
        r = variant_rows(
            cfg,
            res,
            progress,
            SAMPLED_ROWS,
            Variant::Traced(&endpoint, 0.01),
            "metrics and 1% of traces",
        )
        .await;
    }
    collector.abort();
    r
}

/// A collector that answers every OTLP/HTTP post `200 OK` and drops what
/// it was sent: the exporters' whole path runs, and nothing is kept.
async fn collect_and_drop(listener: tokio::net::TcpListener) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut reader = BufReader::new(stream);
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).await.unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).await.is_ok() {
                let _ = reader
                    .get_mut()
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
    }
}

/// `rows`: the same calls in a plain group and in `variant`'s, in
/// [`ROUNDS`] alternating rounds of this run, so that a loaded machine's
/// slow and quick phases fall on both sides alike. Each row shows the
/// round whose cost of the variant is the median; its note gives the plain
/// number of that round, the cost, and whether it is within the target
/// (ok/MISS).
async fn variant_rows(
    cfg: &Config,
    res: &mut Results,
    progress: &Progress,
    rows: &[VariantRow],
    variant: Variant<'_>,
    name: &str,
) -> Result<()> {
    let mut rounds = Vec::with_capacity(ROUNDS);
    let mut echo_cpus = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let plain = group_sample(cfg, Variant::Plain, rows, progress).await?;
        let varied = group_sample(cfg, variant, rows, progress).await?;
        echo_cpus.push((plain.echo_cpu, varied.echo_cpu));
        rounds.push(
            plain
                .stats
                .into_iter()
                .zip(varied.stats)
                .collect::<Vec<_>>(),
        );
    }
    for (i, row) in rows.iter().enumerate() {
        let is_rate = row.measure == Measure::Rate;
        // The cost: how much longer a call takes, or how much lower the
        // rate is, in the variant.
        let mut costs: Vec<(f64, Stat, Stat, EchoCpu)> = rounds
            .iter_mut()
            .zip(&echo_cpus)
            .filter_map(|(round, cpu)| {
                let (p, v) = (round[i].0.take()?, round[i].1.take()?);
                let cost = if is_rate {
                    p.median / v.median - 1.0
                } else {
                    v.median / p.median - 1.0
                };
                Some((cost, p, v, *cpu))
            })
            .collect();
        if costs.is_empty() {
            continue;
        }
        costs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let all: Vec<String> = costs
            .iter()
            .map(|c| format!("{:+.1}%", c.0 * 100.0))
            .collect();
        let (cost, p, v, cpu) = costs.swap_remove(costs.len() / 2);
        res.set(Side::Ours, row.id, v);
        let verdict = if cost <= row.target { "ok" } else { "MISS" };
        let plain_cell = if is_rate {
            format!("{:.0} calls/s", p.median)
        } else {
            format!("{:.1} us", p.median)
        };
        let mut note = format!(
            "(median of {} alternating rounds, costs {}; plain {} in that round: \
                 {plain_cell}; {name} costs {:+.1}%, target <= {:.0}%: {verdict})",
            all.len(),
            all.join(" "),
            row.plain,
            cost * 100.0,
            row.target * 100.0
        );
        if let (Variant::Tls(_), Measure::Echo64m, (Some(plain_cpu), Some(tls_cpu))) =
            (variant, row.measure, cpu)
        {
            note.push(' ');
            note.push_str(
                &cipher_cost((p.median, plain_cpu), (v.median, tls_cpu), row.target).await?,
            );
        }
        res.note(Side::Ours, row.id, note);
    }
    Ok(())
}

/// The CPU time of one echo in a plain group and in a variant's, where
/// measured.
type EchoCpu = (Option<Duration>, Option<Duration>);

/// Where TLS's cost on the 64 MiB echo goes, as a note: the CPU it adds
/// (`plain` and `tls`: each echo's median time in µs and its CPU time in
/// both processes) beside the cipher's four passes (a seal and an open
/// each way, timed alone on one core: `crate::cipher`), how busy the cores
/// are during the TLS echo, and how much faster the cipher would have to
/// be for the target if the echo stays CPU-bound.
async fn cipher_cost(plain: (f64, Duration), tls: (f64, Duration), target: f64) -> Result<String> {
    let (_, size, _, _) = crate::limit::ECHO[2];
    let (seal, open) =
        crate::worker::off_runtime(move || crate::cipher::seal_and_open(size, 3)).await??;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
    let cipher = 2 * (seal + open);
    let added = tls.1.saturating_sub(plain.1);
    let busy = tls.1.as_secs_f64() * 1e6 / (tls.0 * cores);
    // CPU-bound, the TLS echo takes (plain CPU + cipher) / cores; within
    // the target it takes at most (1 + target) x the plain echo.
    let room = (1.0 + target) * plain.0 * 1e-6 * cores - plain.1.as_secs_f64();
    let needed = if room > 0.0 {
        format!(
            "the target needs a cipher {:.1}x faster than this machine's",
            cipher.as_secs_f64() / room
        )
    } else {
        "no cipher meets the target: the plain echo's CPU alone fills the cores".to_string()
    };
    let rate = 2.0 * size as f64 / (seal + open).as_secs_f64() / 1e9;
    Ok(format!(
        "(where TLS's cost goes, in that round: the TLS echo takes {} of CPU in both processes, \
         the plain one {}, so TLS adds {}; the cipher's four passes (a seal and an open each \
         way; AES-128-GCM alone on one core, {rate:.2} GB/s here) take {}; the {cores} cores are \
         {:.0}% busy during the TLS echo; if it stays CPU-bound, {needed})",
        ms(tls.1),
        ms(plain.1),
        ms(added),
        ms(cipher),
        busy * 100.0,
    ))
}
