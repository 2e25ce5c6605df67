//! The Python no-op's row (`rtt_noop_py`) beside its floor, in alternating
//! rounds of one run (issue 52: at most 1.25x the Rust wasm no-op's round
//! trip).
//!
//! Each round times the Python seed plugin's `identity` in a block (the
//! row's figure), then one by one alternating with the Rust plugin's
//! `identity` (the row's ratio, as `rtt_aten_add` is judged), then the
//! dispatch floor's `identity` alternating the same way with the Rust one.
//! The dispatch floor (`plugins/python/dispatch-floor-py`) is a Python
//! plugin whose calls run none of the kit's code: what is left is what any
//! Python function served by componentize-py pays (attaching the
//! interpreter, lifting the call's name and arguments into Python objects,
//! one method call, lowering the outcome), so no kit can go under it, and
//! the target is out of reach in a round where it alone exceeds it.
//!
//! The rounds run in a group of their own: a worker that loads the floor,
//! a third plugin, holds more memory than the per-call group's memory rows
//! are about.

use std::time::Duration;

use anyhow::{Result, bail};
use wasmrpc::{RpcAgent, args};

use super::floors::{alternating, as_printed, median_round, verdict};
use super::{Children, Config, free_port, timed, worker_args_serving};
use crate::progress::Progress;
use crate::report::fmt_micros;
use crate::rows::{Results, Side};
use crate::stats::Stat;
use crate::worker::{self, PY_FLOOR_IDENTITY, PY_IDENTITY, WASM_IDENTITY};

/// The Python no-op's target over the Rust wasm no-op (issue 52).
const TARGET: f64 = 1.25;

/// One round's medians.
struct Round {
    /// The Python no-op in a block of its own (the row's figure).
    alone: Stat,
    /// The Python no-op and the wasm no-ops that alternated with it.
    python: (Stat, Stat),
    /// The dispatch floor and the wasm no-ops that alternated with it.
    floor: (Stat, Stat),
}

impl Round {
    fn ratio(&self) -> f64 {
        self.python.0.median / self.python.1.median
    }

    fn floor_ratio(&self) -> f64 {
        self.floor.0.median / self.floor.1.median
    }
}

/// Measures `rtt_noop_py` in a group of two whose callee serves the Rust
/// and Python seed plugins and the dispatch floor; sets the row and its
/// note.
pub(super) async fn python_noop(
    cfg: &Config,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    progress.set("wasmrpc: starting a group of 2 for the Python no-op and its floor");
    let method = format!("tcp://127.0.0.1:{}", free_port()?);
    let children = Children::spawn(
        cfg,
        |r| worker_args_serving(cfg, &method, r, 2, &worker::PYTHON_ROW_PLUGINS),
        1..2,
        false,
    )?;
    let agent = worker::join(&method, 0, 2, &[], None, false).await?;
    let r = rounds(cfg, &agent, progress).await;
    let s = agent.shutdown(true, Duration::ZERO).await;
    let measured = children.finish(r, s, Duration::from_secs(30)).await?;
    let (row, note) = judge(&measured);
    res.set(Side::Ours, "rtt_noop_py", row);
    res.note(Side::Ours, "rtt_noop_py", note);
    Ok(())
}

async fn rounds(cfg: &Config, agent: &RpcAgent, progress: &Progress) -> Result<Vec<Round>> {
    let dst = "worker1";
    let call = |function: &'static str| move || agent.rpc_sync(dst, function, args![1]);
    for function in [WASM_IDENTITY, PY_IDENTITY, PY_FLOOR_IDENTITY] {
        let p = call(function)().await?;
        if p.as_int()? != 1 {
            bail!("{function} returned {p:?}");
        }
    }
    let rounds = cfg.n(3, 5);
    let n = cfg.n(500, 5000);
    let mut measured = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        progress.set(&format!(
            "wasmrpc: the Python no-op beside its floor, round {round} of {rounds}"
        ));
        let alone = Stat::latencies(&timed(n, n / 10, call(PY_IDENTITY)).await?);
        let (python, wasm) = alternating(n, n / 10, call(PY_IDENTITY), call(WASM_IDENTITY)).await?;
        let (floor, floor_wasm) =
            alternating(n, n / 10, call(PY_FLOOR_IDENTITY), call(WASM_IDENTITY)).await?;
        measured.push(Round {
            alone,
            python: (Stat::latencies(&python), Stat::latencies(&wasm)),
            floor: (Stat::latencies(&floor), Stat::latencies(&floor_wasm)),
        });
    }
    Ok(measured)
}

/// The row's figure (the median round's block) and its note.
fn judge(measured: &[Round]) -> (Stat, String) {
    let ratios: Vec<f64> = measured.iter().map(Round::ratio).collect();
    let (all, i) = median_round(&ratios);
    let m = &measured[i];
    let floors = measured
        .iter()
        .map(|r| format!("{:.2}x", r.floor_ratio()))
        .collect::<Vec<_>>()
        .join(" ");
    let floor = as_printed(m.floor_ratio());
    let kit = m.python.0.median - m.python.1.median - (m.floor.0.median - m.floor.1.median);
    let reach = if floor > TARGET {
        format!(
            "; so the target is out of reach in that round while componentize-py serves \
             Python plugins: its dispatch alone is {floor:.2}x"
        )
    } else {
        String::new()
    };
    let note = format!(
        "(over the wasm no-op's round trips alternating with it one by one, per round: {all}; \
         in the median round {} over {}, {:.2}x, target <= {TARGET:.2}x: {}; the row: that \
         round's block of calls alone; the dispatch floor (a Python plugin whose calls run \
         none of the kit's code) over the wasm no-op the same way, per round: {floors}; in \
         that round {} over {}, {floor:.2}x, the kit's own code {} a call beyond it{reach})",
        fmt_micros(m.python.0.median),
        fmt_micros(m.python.1.median),
        ratios[i],
        verdict(ratios[i], TARGET),
        fmt_micros(m.floor.0.median),
        fmt_micros(m.floor.1.median),
        fmt_signed_micros(kit),
    );
    (m.alone, note)
}

/// A difference of medians in microseconds, signed.
fn fmt_signed_micros(micros: f64) -> String {
    if micros < 0.0 {
        format!("-{}", fmt_micros(-micros))
    } else {
        format!("+{}", fmt_micros(micros))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(median: f64) -> Stat {
        Stat::value(median, 1)
    }

    fn round(alone: f64, python: (f64, f64), floor: (f64, f64)) -> Round {
        Round {
            alone: stat(alone),
            python: (stat(python.0), stat(python.1)),
            floor: (stat(floor.0), stat(floor.1)),
        }
    }

    #[test]
    fn the_median_round_is_judged_and_a_floor_above_the_target_puts_it_out_of_reach() {
        let measured = [
            round(30.0, (30.0, 20.0), (26.0, 20.0)), // 1.50x, floor 1.30x
            round(21.0, (24.0, 20.0), (22.0, 20.0)), // 1.20x, floor 1.10x
            round(25.0, (28.0, 20.0), (27.0, 20.0)), // 1.40x, floor 1.35x
        ];
        let (row, note) = judge(&measured);
        assert_eq!(row.median, 25.0, "the median round's block: {note}");
        assert!(note.contains("per round: 1.50x 1.20x 1.40x"), "{note}");
        assert!(note.contains("1.40x, target <= 1.25x: MISS"), "{note}");
        assert!(note.contains("per round: 1.30x 1.10x 1.35x"), "{note}");
        assert!(note.contains("its dispatch alone is 1.35x"), "{note}");
        assert!(note.contains("+1.0 µs a call beyond it"), "{note}");
    }

    #[test]
    fn a_floor_that_reads_as_the_target_is_not_called_above_it() {
        // 17.8 over 14.2 is 1.2535x.
        let measured = [round(20.0, (20.0, 14.0), (17.8, 14.2))];
        let (_, note) = judge(&measured);
        assert!(note.contains("1.25x, the kit's own code"), "{note}");
        assert!(!note.contains("out of reach"), "{note}");
    }

    #[test]
    fn a_floor_within_the_target_leaves_the_miss_to_the_kit() {
        let measured = [round(27.0, (27.0, 20.0), (23.0, 20.0))]; // 1.35x, floor 1.15x
        let (_, note) = judge(&measured);
        assert!(note.contains("1.35x, target <= 1.25x: MISS"), "{note}");
        assert!(!note.contains("out of reach"), "{note}");
        assert!(note.contains("+4.0 µs a call beyond it"), "{note}");
    }
}
