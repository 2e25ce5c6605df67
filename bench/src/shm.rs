//! The same-host shared-memory rows (`shm_*`): echoes between two worker
//! processes of this host with shared memory on (the transport's TR-9),
//! where the main group's echo rows keep it off to measure the connection.
//!
//! The 64 MiB echo is held to at least 0.9x its bound (issue 52; the bound
//! is SHM-1's two overlapped copies each way, `limit::shared_memory_bound`),
//! measured beside it in alternating rounds as the small calls' floors are
//! (`ours::floors`): measured in the limits phase, minutes before the row,
//! the bound read 12.3 ms in one run and 16.1 ms in another of the same
//! day, and the row's share of it 0.81x and 1.18x.

use std::time::Duration;

use anyhow::{Result, bail};
use tch::Device;

use crate::ours::{Children, Config, as_printed, echo, free_port, median_round, worker_args};
use crate::progress::Progress;
use crate::report::fmt_micros;
use crate::rows::{Results, Side};
use crate::stats::Stat;
use crate::worker;

/// The row measured beside its bound, and what it is held to: its bound's
/// time over its own.
const BOUNDED_ROW: &str = "shm_echo_64m";
const HOLD: f64 = 0.9;

/// The rows: (id, bytes, runs in a quick run, runs in a full run).
pub(crate) const ROWS: &[(&str, usize, usize, usize)] = &[
    ("shm_echo_4k", 4 << 10, 500, 3000),
    ("shm_echo_1m", 1 << 20, 100, 500),
    ("shm_echo_64m", 64 << 20, 5, 20),
    ("shm_echo_1g", 1 << 30, 3, 5),
];

/// Measures the wanted `shm_*` rows in a group of two with shared memory on,
/// and checks that storages of 1 MiB and more did cross in shared memory.
pub(crate) async fn rows(cfg: &Config, res: &mut Results, progress: &Progress) -> Result<()> {
    progress.set("wasmrpc: starting a group of 2 workers with shared memory");
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let args = |r| {
        let mut args = worker_args(cfg, &method, r, 2);
        args.push("--shared-memory".into());
        args
    };
    let children = Children::spawn(cfg, args, 1..2, false)?;
    let agent = worker::join(&method, 0, 2, &[], None, true).await?;
    let measured = async {
        for &(row, size, nq, nf) in ROWS {
            if !cfg.wanted(row) {
                continue;
            }
            progress.set(&format!(
                "wasmrpc: echo of a {size} B tensor, shared memory"
            ));
            let before = shared_bytes(&agent);
            if row == BOUNDED_ROW {
                beside_its_bound(cfg, &agent, res, progress).await?;
            } else {
                let stat = echo(cfg, &agent, Device::Cpu, size, nq, nf).await?;
                res.set(Side::Ours, row, stat);
            }
            if size >= 1 << 20 && shared_bytes(&agent) == before {
                bail!("the echo of {size} bytes did not go through shared memory");
            }
        }
        Ok(())
    }
    .await;
    progress.set("wasmrpc: graceful shutdown of the group of 2");
    let shut = agent.shutdown(true, Duration::ZERO).await;
    children
        .finish(measured, shut, Duration::from_secs(30))
        .await
}

/// [`BOUNDED_ROW`] in alternating rounds with its bound: sets the row and
/// the `shm_bound_64m` limit to the median round's (by the bound's share)
/// and notes every round's share.
async fn beside_its_bound(
    cfg: &Config,
    agent: &wasmrpc::RpcAgent,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let rounds = cfg.n(3, 5);
    let mut measured = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        progress.set(&format!(
            "wasmrpc: echo of a 64 MiB tensor, shared memory, beside its bound, round {round} of \
             {rounds}"
        ));
        let n = cfg.n(5, 20);
        let bound =
            worker::off_runtime(move || crate::limit::shared_memory_bound(64 << 20, n)).await?;
        let row = echo(cfg, agent, Device::Cpu, 64 << 20, 5, 20).await?;
        measured.push((row, Stat::latencies(&bound)));
    }
    let (row, bound, note) = judge(&measured);
    res.set(Side::Ours, BOUNDED_ROW, row);
    res.set(Side::Limit, "shm_bound_64m", bound);
    res.note(Side::Ours, BOUNDED_ROW, note);
    Ok(())
}

/// The median round's row and bound (by the bound's share of the row), and
/// the row's note.
fn judge(measured: &[(Stat, Stat)]) -> (Stat, Stat, String) {
    let shares: Vec<f64> = measured
        .iter()
        .map(|(row, bound)| bound.median / row.median)
        .collect();
    let (all, i) = median_round(&shares);
    let (row, bound) = measured[i];
    let note = format!(
        "({} rounds alternating with its bound, SHM-1's two overlapped copies each way; the \
         bound's time over the echo's, per round: {all}; in the median round {} over {}, {:.2}x, \
         hold >= {HOLD:.2}x: {})",
        measured.len(),
        fmt_micros(bound.median),
        fmt_micros(row.median),
        shares[i],
        if as_printed(shares[i]) >= HOLD {
            "ok"
        } else {
            "MISS"
        },
    );
    (row, bound, note)
}

fn shared_bytes(agent: &wasmrpc::RpcAgent) -> u64 {
    agent
        .get_debug_info()
        .get("agent.shared_memory_bytes_sent")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(row: f64, bound: f64) -> (Stat, Stat) {
        (Stat::value(row, 1), Stat::value(bound, 1))
    }

    #[test]
    fn the_median_rounds_share_of_its_bound_is_held_to_the_hold() {
        let (row, bound, note) = judge(&[
            round(16_000.0, 12_000.0),
            round(14_000.0, 14_000.0),
            round(15_000.0, 12_000.0),
        ]);
        assert_eq!((row.median, bound.median), (15_000.0, 12_000.0), "{note}");
        assert!(note.contains("per round: 0.75x 1.00x 0.80x"), "{note}");
        assert!(
            note.contains("12.00 ms over 15.00 ms, 0.80x, hold >= 0.90x: MISS"),
            "{note}"
        );
        let (_, _, note) = judge(&[round(13_000.0, 12_000.0)]);
        assert!(note.contains("0.92x, hold >= 0.90x: ok"), "{note}");
        // 0.8975x reads 0.90x, and holds as it reads.
        let (_, _, note) = judge(&[round(20_000.0, 17_950.0)]);
        assert!(note.contains("0.90x, hold >= 0.90x: ok"), "{note}");
    }
}
