//! The TLS rows: what mutual TLS costs a group, measured against the same
//! group without it.

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

/// The TLS rows: each TLS row, the plain row it is compared with, and the
/// most TLS may cost (issue 20: 10% on small calls, 25% on the 64 MiB
/// echo; the async row is small calls).
pub(crate) const TLS_ROWS: &[(&str, &str, f64)] = &[
    ("rtt_noop_native_tls", "rtt_noop_native", 0.10),
    ("async_128_tls", "async_128", 0.10),
    ("echo_64m_tls", "echo_64m", 0.25),
];

/// The three measurements of the TLS rows, in one group.
struct TlsSample {
    rtt: Option<Stat>,
    rate: Option<Stat>,
    echo: Option<Stat>,
}

/// Starts a group of 2 (rank 0 here, rank 1 a process), with TLS 1.3 and
/// mutual authentication when `ca` is given (certificates for `worker0` and
/// `worker1` issued by it, the process's passed in its environment), and
/// takes the TLS rows' measurements in it.
async fn tls_sample(
    cfg: &Config,
    ca: Option<&CertificateAuthority>,
    progress: &Progress,
) -> Result<TlsSample> {
    let what = if ca.is_some() {
        "over TLS"
    } else {
        "plain TCP"
    };
    progress.set(&format!("wasmrpc: starting a group of 2 workers, {what}"));
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let children = Children::spawn_with_env(
        cfg,
        |r| worker_args(cfg, &method, r, 2),
        1..2,
        false,
        |rank| {
            let Some(ca) = ca else {
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
    let tls = ca
        .map(|ca| ca.credentials_for("worker0"))
        .transpose()
        .context("issuing worker0's certificate")?;
    let agent = worker::join(&method, 0, 2, &[], tls, false).await?;
    let r = async {
        for i in 0..50 {
            agent.rpc_sync("worker1", NOOP, args![i]).await?;
        }
        let mut sample = TlsSample {
            rtt: None,
            rate: None,
            echo: None,
        };
        if cfg.wanted("rtt_noop_native_tls") {
            progress.set(&format!("wasmrpc: round trip of a no-op, {what}"));
            sample.rtt = Some(rtt_noop(cfg, &agent).await?);
        }
        if cfg.wanted("async_128_tls") {
            progress.set(&format!("wasmrpc: async calls with 128 in flight, {what}"));
            sample.rate = Some(async_128(cfg, &agent).await?);
        }
        if cfg.wanted("echo_64m_tls") {
            progress.set(&format!("wasmrpc: echo of a 64 MiB tensor, {what}"));
            let (_, size, nq, nf) = crate::limit::ECHO[2];
            sample.echo = Some(echo(cfg, &agent, Device::Cpu, size, nq, nf).await?);
        }
        anyhow::Ok(sample)
    }
    .await;
    progress.set(&format!(
        "wasmrpc: graceful shutdown of the group of 2, {what}"
    ));
    let s = agent.shutdown(true, Duration::ZERO).await;
    children.wait(Duration::from_secs(30)).await?;
    let sample = r?;
    s?;
    Ok(sample)
}

/// Rounds of the TLS rows: each a plain group, then a TLS group.
const TLS_ROUNDS: usize = 3;

/// The TLS rows (`*_tls`): the same calls in a plain group and in a TLS
/// group, in [`TLS_ROUNDS`] alternating rounds of this run, so that a
/// loaded machine's slow and quick phases fall on both sides alike. Each
/// row shows the round whose cost of TLS is the median; its note gives the
/// plain number of that round, the cost, and whether it is within the
/// issue's target (ok/MISS).
pub(crate) async fn tls_rows(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    let ca = CertificateAuthority::generate().context("generating an ephemeral CA")?;
    let mut rounds = Vec::with_capacity(TLS_ROUNDS);
    for _ in 0..TLS_ROUNDS {
        let plain = tls_sample(cfg, None, progress).await?;
        let tls = tls_sample(cfg, Some(&ca), progress).await?;
        rounds.push([
            (plain.rtt, tls.rtt),
            (plain.rate, tls.rate),
            (plain.echo, tls.echo),
        ]);
    }
    for (i, &(row, plain_row, target)) in TLS_ROWS.iter().enumerate() {
        let is_rate = row == "async_128_tls";
        // The cost: how much longer a call takes, or how much lower the
        // rate is, over TLS.
        let mut costs: Vec<(f64, Stat, Stat)> = rounds
            .iter_mut()
            .filter_map(|round| {
                let (p, t) = (round[i].0.take()?, round[i].1.take()?);
                let cost = if is_rate {
                    p.median / t.median - 1.0
                } else {
                    t.median / p.median - 1.0
                };
                Some((cost, p, t))
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
        let (cost, p, t) = costs.swap_remove(costs.len() / 2);
        res.set(Side::Ours, row, t);
        let verdict = if cost <= target { "ok" } else { "MISS" };
        let plain_cell = if is_rate {
            format!("{:.0} calls/s", p.median)
        } else {
            format!("{:.1} us", p.median)
        };
        res.note(
            Side::Ours,
            row,
            format!(
                "(median of {} alternating rounds, costs {}; plain {plain_row} in that round: \
                 {plain_cell}; TLS costs {:+.1}%, target <= {:.0}%: {verdict})",
                all.len(),
                all.join(" "),
                cost * 100.0,
                target * 100.0
            ),
        );
    }
    Ok(())
}
