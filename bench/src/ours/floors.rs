//! The small-call rows measured beside their floors, in alternating rounds
//! of one run (issue 52): a floor measured minutes before its row misleads
//! on a machine whose speed drifts, so each round measures the floors and
//! the rows within seconds of each other, and the ratios are per round.
//!
//! - `rtt_noop_native` against a raw TCP ping-pong of the same bytes, with
//!   each side blocking in `read` (the kernel wakes it: the floor of any
//!   transport that sleeps while idle), and against the same ping-pong with
//!   both sides polling their sockets in a loop (the floor of one that
//!   never sleeps). The row's target is against the first. Beside them,
//!   the same ping-pong with both sides on tokio (current-thread runtimes,
//!   asleep in `epoll`): the least any transport on tokio can do, which
//!   puts the target out of reach in a round where it alone exceeds it.
//! - `rtt_aten_add` against no-op calls alternating with it one by one:
//!   what an op costs over a call that runs nothing. Rounds of a few
//!   thousand calls each were too coarse: the polling regime (polled
//!   through, or woken) changes within seconds, and the per-round ratios
//!   of one run spread from 0.56x to 4.62x while the op itself takes a
//!   tenth of a no-op's round trip. The row's own figure is still a block
//!   of `aten::add` calls alone: alternating slows both kinds of call.
//!   Beside it, the op alone in this process, timed in a block and right
//!   after each of a no-op's round trips: the second is the op in the
//!   regime the callee runs it in, woken with its caches cold, and is
//!   what the target is judged reachable by.

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};
use wasmrpc::{Payload, RpcAgent, args};

use super::{Config, rtt_noop, timed, timed_after};
use crate::limit::{PingPong, TokioPingPong};
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
    /// The blocking floor's ping-pong with both sides on tokio.
    on_tokio: Stat,
    /// `aten::add` in a block of its own (the row's figure).
    aten_add: Option<Stat>,
    /// `aten::add` and the no-ops that alternated with it (its ratio).
    paired_add: Option<(Stat, Stat)>,
    /// `aten::add` run in this process through the same entry point the
    /// callee uses, without the network: the op's own work.
    local_add: Option<Stat>,
    /// The same, each call right after a no-op's round trip: the op's own
    /// work with the caches a round trip leaves.
    cold_add: Option<Stat>,
}

/// The ratios of `rounds`, formatted, and the index of the round whose
/// ratio is the median.
pub(crate) fn median_round(ratios: &[f64]) -> (String, usize) {
    let mut order: Vec<usize> = (0..ratios.len()).collect();
    order.sort_by(|&a, &b| ratios[a].total_cmp(&ratios[b]));
    let all = ratios
        .iter()
        .map(|r| format!("{r:.2}x"))
        .collect::<Vec<_>>()
        .join(" ");
    (all, order[order.len() / 2])
}

/// A ratio as the notes print it, to two decimals. Verdicts and
/// out-of-reach claims judge what the reader sees: a ratio printed as
/// "1.25x" is never called above a 1.25x target (the run of 2026-12-07
/// 06:45 called a Python floor of 1.2535x, printed 1.25x, out of reach).
pub(crate) fn as_printed(ratio: f64) -> f64 {
    (ratio * 100.0).round() / 100.0
}

pub(crate) fn verdict(ratio: f64, target: f64) -> &'static str {
    if as_printed(ratio) <= target {
        "ok"
    } else {
        "MISS"
    }
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
    let mut tokio_floor = TokioPingPong::start()?;
    let rounds = cfg.n(3, 5);
    let n = cfg.n(500, 5000);
    let mut measured = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        progress.set(&format!(
            "wasmrpc: small calls beside their floors, round {round} of {rounds}"
        ));
        // The floors are blocking code: off the runtime.
        let (ping_pong, floor) = crate::worker::off_runtime(move || {
            let floor = blocking.round_trips(n, n / 10);
            (blocking, floor)
        })
        .await?;
        blocking = ping_pong;
        let floor = floor?;
        let (ping_pong, on_tokio) = crate::worker::off_runtime(move || {
            let on_tokio = tokio_floor.round_trips(n, n / 10);
            (tokio_floor, on_tokio)
        })
        .await?;
        tokio_floor = ping_pong;
        let on_tokio = on_tokio?;
        let noop = rtt_noop(cfg, agent).await?;
        let (aten_add, paired_add) = if with_add {
            let alone = Stat::latencies(&timed(n, n / 10, add).await?);
            let noop = || agent.rpc_sync(dst, crate::worker::NOOP, args![1]);
            let (adds, noops) = alternating(n, n / 10, add, noop).await?;
            (
                Some(alone),
                Some((Stat::latencies(&adds), Stat::latencies(&noops))),
            )
        } else {
            (None, None)
        };
        let (local_add, cold_add) = if with_add {
            let policy = agent.options().op_policy.clone();
            let local = || {
                wasmrpc::call_builtin(
                    &policy,
                    agent.name(),
                    "aten::add",
                    args![a.shallow_clone(), b.shallow_clone()],
                )
            };
            let noop = || agent.rpc_sync(dst, crate::worker::NOOP, args![1]);
            (
                Some(Stat::latencies(&timed(n, n / 10, local).await?)),
                Some(Stat::latencies(&timed_after(n, n / 10, noop, local).await?)),
            )
        } else {
            (None, None)
        };
        // A spinning server keeps a core busy for as long as it is
        // connected, which would change every other measurement (a machine
        // with a busy core wakes sleepers faster): it lives for its phase
        // only.
        let spin = crate::worker::off_runtime(move || {
            PingPong::start(true).and_then(|mut spinning| spinning.round_trips(n, n / 10))
        })
        .await??;
        measured.push(Round {
            blocking: Stat::latencies(&floor),
            noop,
            spinning: Stat::latencies(&spin),
            on_tokio: Stat::latencies(&on_tokio),
            aten_add,
            paired_add,
            local_add,
            cold_add,
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
    let tokio_ratios = measured
        .iter()
        .map(|r| format!("{:.2}x", r.on_tokio.median / r.blocking.median))
        .collect::<Vec<_>>()
        .join(" ");
    let least = m.on_tokio.median / m.blocking.median;
    let reach = if as_printed(least) > SMALL_CALL_TARGET {
        format!(
            "; so in the median round the target is out of reach on tokio: its ping-pong \
             alone is {least:.2}x"
        )
    } else {
        String::new()
    };
    res.set(Side::Ours, "rtt_noop_native", m.noop);
    res.set(Side::Limit, "raw_rtt", m.blocking);
    res.note(
        Side::Ours,
        "rtt_noop_native",
        format!(
            "({rounds} alternating rounds; over raw TCP, blocking, per round: {all}; in the \
             median round {} over {}, {:.2}x, target <= {SMALL_CALL_TARGET:.2}x: {}; over raw \
             TCP, both sides spinning, per round: {spin_ratios}; that round's {}; the blocking \
             ping-pong with both sides on tokio, over the blocking one, per round: \
             {tokio_ratios}; that round's {}{reach})",
            fmt_micros(m.noop.median),
            fmt_micros(m.blocking.median),
            ratios[i],
            verdict(ratios[i], SMALL_CALL_TARGET),
            fmt_micros(m.spinning.median),
            fmt_micros(m.on_tokio.median),
        ),
    );

    if with_add {
        let add_ratios: Vec<f64> = measured
            .iter()
            .filter_map(|r| Some(r.paired_add?.0.median / r.paired_add?.1.median))
            .collect();
        let (all, i) = median_round(&add_ratios);
        let m = &measured[i];
        let (Some(alone), Some((add, paired_noop))) = (m.aten_add, m.paired_add) else {
            bail!("round {i} has no aten::add sample");
        };
        res.set(Side::Ours, "rtt_aten_add", alone);
        // What the op itself costs, as a share of the no-op's round trip:
        // the target is out of reach while it alone exceeds the margin in
        // the regime the callee runs it in (right after a round trip).
        let share = |own: fn(&Round) -> Option<Stat>| {
            measured
                .iter()
                .filter_map(|r| Some(format!("{:.2}x", own(r)?.median / r.paired_add?.1.median)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let micros = |s: Option<Stat>| s.map_or_else(|| "-".into(), |s| fmt_micros(s.median));
        let reach = match m.cold_add {
            Some(cold) if as_printed(1.0 + cold.median / paired_noop.median) > ATEN_ADD_TARGET => {
                format!(
                    "; so the op's own work alone, right after a round trip, puts the ratio at \
                 {:.2}x at least: out of reach while a round trip leaves the caches this cold",
                    1.0 + cold.median / paired_noop.median
                )
            }
            _ => String::new(),
        };
        res.note(
            Side::Ours,
            "rtt_aten_add",
            format!(
                "(over no-op calls alternating with it one by one, per round: {all}; in the \
                 median round {} over {}, {:.2}x, target <= {ATEN_ADD_TARGET:.2}x: {}; the row: \
                 that round's block of calls alone; the op alone, in this process without the \
                 wire, in that round: {} in a block, {} right after each of a no-op's round \
                 trips; of the no-op per round, in a block: {}, right after a round trip: {}{reach})",
                fmt_micros(add.median),
                fmt_micros(paired_noop.median),
                add_ratios[i],
                verdict(add_ratios[i], ATEN_ADD_TARGET),
                micros(m.local_add),
                micros(m.cold_add),
                share(|r| r.local_add),
                share(|r| r.cold_add),
            ),
        );
    }
    Ok(())
}

/// `n` calls of `row` and `n` of `floor` (after `warmup` of each),
/// alternating one by one, the order within each pair alternating too: both
/// see the same phases of the machine, however fast those change. Returns
/// the samples of `row` and of `floor`.
pub(super) async fn alternating<R, F, RFut, FFut>(
    n: usize,
    warmup: usize,
    mut row: R,
    mut floor: F,
) -> Result<(Vec<std::time::Duration>, Vec<std::time::Duration>)>
where
    R: FnMut() -> RFut,
    F: FnMut() -> FFut,
    RFut: std::future::Future<Output = wasmrpc::Result<Payload>>,
    FFut: std::future::Future<Output = wasmrpc::Result<Payload>>,
{
    for _ in 0..warmup {
        row().await?;
        floor().await?;
    }
    let (mut rows, mut floors) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        for row_first in [i % 2 == 0, i % 2 == 1] {
            let t = std::time::Instant::now();
            if row_first {
                row().await?;
                rows.push(t.elapsed());
            } else {
                floor().await?;
                floors.push(t.elapsed());
            }
        }
    }
    Ok((rows, floors))
}

/// `aten::add` of two tensors of ones must give twos.
fn check_sum(p: &Payload) -> Result<()> {
    let sum = p.as_tensor()?;
    if sum.double_value(&[0]) != 2.0 {
        bail!("aten::add returned {sum}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use wasmrpc::Payload;

    use super::{alternating, verdict};

    #[test]
    fn a_ratio_is_judged_as_it_is_printed() {
        assert_eq!(verdict(1.2535, 1.25), "ok", "printed 1.25x");
        assert_eq!(verdict(1.2551, 1.25), "MISS", "printed 1.26x");
        assert_eq!(verdict(1.10, 1.10), "ok");
    }

    #[test]
    fn calls_alternate_one_by_one_and_each_pair_swaps_its_order() {
        let order = RefCell::new(String::new());
        let call = |c: char| {
            let order = &order;
            move || {
                order.borrow_mut().push(c);
                std::future::ready(Ok(Payload::none()))
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let (rows, floors) = runtime
            .block_on(alternating(4, 1, call('r'), call('f')))
            .expect("no call fails");
        assert_eq!((rows.len(), floors.len()), (4, 4));
        // One warm-up pair, then row first, floor first, row first, ...
        assert_eq!(order.into_inner(), "rf".to_owned() + "rffrrffr");
    }

    #[test]
    fn a_call_timed_after_another_is_timed_alone_and_each_time_right_after_it() {
        let order = RefCell::new(String::new());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        let before = || {
            order.borrow_mut().push('b');
            // Long enough that a sample that included it could not pass
            // for the call alone, even on a busy machine.
            async {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                Ok(Payload::none())
            }
        };
        let call = || {
            order.borrow_mut().push('c');
            std::future::ready(Ok(Payload::none()))
        };
        let samples = runtime
            .block_on(super::super::timed_after(3, 2, before, call))
            .expect("no call fails");
        assert_eq!(samples.len(), 3, "the warm-up's calls are not samples");
        assert!(
            samples
                .iter()
                .all(|s| *s < std::time::Duration::from_millis(100)),
            "{samples:?}"
        );
        assert_eq!(order.into_inner(), "bc".repeat(5));
    }
}
