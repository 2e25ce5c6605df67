//! The small-call rows measured beside their floors, in alternating rounds
//! of one run (issue 52): a floor measured minutes before its row misleads
//! on a machine whose speed drifts, so each round measures the floors and
//! the rows within seconds of each other, and the ratios are per round.
//!
//! - `rtt_noop_native` against a raw TCP ping-pong of the same bytes, with
//!   each side blocking in `read` (the kernel wakes it: the floor of any
//!   transport that sleeps while idle), and against the same ping-pong with
//!   both sides polling their sockets in a loop (the floor of one that
//!   never sleeps). The row's target is against the first.
//! - `rtt_aten_add` against `rtt_noop_native` of the same round: what an op
//!   costs over a call that runs nothing.

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};
use wasmrpc::{Payload, RpcAgent, args};

use super::{Config, rtt_noop, timed};
use crate::limit::PingPong;
use crate::progress::Progress;
use crate::report::fmt_micros;
use crate::rows::{Results, Side};
use crate::stats::Stat;

/// The small call's target over the blocking floor (issue 52).
const SMALL_CALL_TARGET: f64 = 1.15;
/// `aten::add`'s target over the no-op.
const ATEN_ADD_TARGET: f64 = 1.10;

/// One round's medians.
struct Round {
    blocking: Stat,
    noop: Stat,
    spinning: Stat,
    aten_add: Option<Stat>,
    /// `aten::add` run in this process through the same entry point the
    /// callee uses, without the network: the op's own work.
    local_add: Option<Stat>,
}

/// The ratios of `rounds`, formatted, and the index of the round whose
/// ratio is the median.
pub(super) fn median_round(ratios: &[f64]) -> (String, usize) {
    let mut order: Vec<usize> = (0..ratios.len()).collect();
    order.sort_by(|&a, &b| ratios[a].total_cmp(&ratios[b]));
    let all = ratios
        .iter()
        .map(|r| format!("{r:.2}x"))
        .collect::<Vec<_>>()
        .join(" ");
    (all, order[order.len() / 2])
}

pub(super) fn verdict(ratio: f64, target: f64) -> &'static str {
    if ratio <= target { "ok" } else { "MISS" }
}

/// Measures `rtt_noop_native` (and `rtt_aten_add`, when wanted and the
/// callee has it) beside the two raw TCP floors, in alternating rounds;
/// sets both rows, the `raw_rtt` limit (the blocking floor of the median
/// round) and notes with every round's ratio.
pub(super) async fn small_calls(
    cfg: &Config,
    agent: &RpcAgent,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let dst = "worker1";
    let (a, b) = (
        Tensor::ones([4], (Kind::Float, Device::Cpu)),
        Tensor::ones([4], (Kind::Float, Device::Cpu)),
    );
    let add = || {
        agent.rpc_sync(
            dst,
            "aten::add",
            args![a.shallow_clone(), b.shallow_clone()],
        )
    };
    let mut with_add = cfg.wanted("rtt_aten_add");
    if with_add {
        match add().await {
            Err(e) => {
                with_add = false;
                res.na(
                    Side::Ours,
                    "rtt_aten_add",
                    format!("n/a (not yet available: {})", e.message()),
                );
            }
            Ok(p) => check_sum(&p)?,
        }
    }
    let mut blocking = PingPong::start(false)?;
    let rounds = cfg.n(3, 5);
    let n = cfg.n(500, 5000);
    let mut measured = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        progress.set(&format!(
            "wasmrpc: small calls beside their floors, round {round} of {rounds}"
        ));
        // The floors are blocking code: off the runtime's threads.
        let floor = tokio::task::block_in_place(|| blocking.round_trips(n, n / 10))?;
        let noop = rtt_noop(cfg, agent).await?;
        let aten_add = if with_add {
            Some(Stat::latencies(&timed(n, n / 10, add).await?))
        } else {
            None
        };
        let local_add = if with_add {
            let policy = agent.options().op_policy.clone();
            let local = || {
                wasmrpc::call_builtin(
                    &policy,
                    agent.name(),
                    "aten::add",
                    args![a.shallow_clone(), b.shallow_clone()],
                )
            };
            Some(Stat::latencies(&timed(n, n / 10, local).await?))
        } else {
            None
        };
        // A spinning server keeps a core busy for as long as it is
        // connected, which would change every other measurement (a machine
        // with a busy core wakes sleepers faster): it lives for its phase
        // only.
        let spin = tokio::task::block_in_place(|| {
            PingPong::start(true).and_then(|mut spinning| spinning.round_trips(n, n / 10))
        })?;
        measured.push(Round {
            blocking: Stat::latencies(&floor),
            noop,
            spinning: Stat::latencies(&spin),
            aten_add,
            local_add,
        });
    }

    let ratios: Vec<f64> = measured
        .iter()
        .map(|r| r.noop.median / r.blocking.median)
        .collect();
    let (all, i) = median_round(&ratios);
    let m = &measured[i];
    let spin_ratios = measured
        .iter()
        .map(|r| format!("{:.2}x", r.noop.median / r.spinning.median))
        .collect::<Vec<_>>()
        .join(" ");
    res.set(Side::Ours, "rtt_noop_native", m.noop);
    res.set(Side::Limit, "raw_rtt", m.blocking);
    res.note(
        Side::Ours,
        "rtt_noop_native",
        format!(
            "({rounds} alternating rounds; over raw TCP, blocking, per round: {all}; in the \
             median round {} over {}, {:.2}x, target <= {SMALL_CALL_TARGET:.2}x: {}; over raw \
             TCP, both sides spinning, per round: {spin_ratios}; that round's {})",
            fmt_micros(m.noop.median),
            fmt_micros(m.blocking.median),
            ratios[i],
            verdict(ratios[i], SMALL_CALL_TARGET),
            fmt_micros(m.spinning.median),
        ),
    );

    if with_add {
        let add_ratios: Vec<f64> = measured
            .iter()
            .filter_map(|r| Some(r.aten_add?.median / r.noop.median))
            .collect();
        let (all, i) = median_round(&add_ratios);
        let m = &measured[i];
        let Some(add) = m.aten_add else {
            bail!("round {i} has no aten::add sample");
        };
        res.set(Side::Ours, "rtt_aten_add", add);
        // What the op itself costs, as a share of the no-op's round trip:
        // the target is out of reach while it alone exceeds the margin.
        let own_work = measured
            .iter()
            .filter_map(|r| Some(format!("{:.2}x", r.local_add?.median / r.noop.median)))
            .collect::<Vec<_>>()
            .join(" ");
        let local = m
            .local_add
            .map_or_else(|| "-".into(), |l| fmt_micros(l.median));
        res.note(
            Side::Ours,
            "rtt_aten_add",
            format!(
                "(over the no-op of the same round: {all}; in the median round {} over {}, \
                 {:.2}x, target <= {ATEN_ADD_TARGET:.2}x: {}; the op alone, in this process \
                 without the wire: {local} in that round, of the no-op per round: {own_work})",
                fmt_micros(add.median),
                fmt_micros(m.noop.median),
                add_ratios[i],
                verdict(add_ratios[i], ATEN_ADD_TARGET),
            ),
        );
    }
    Ok(())
}

/// `aten::add` of two tensors of ones must give twos.
fn check_sum(p: &Payload) -> Result<()> {
    let sum = p.as_tensor()?;
    if sum.double_value(&[0]) != 2.0 {
        bail!("aten::add returned {sum}");
    }
    Ok(())
}
