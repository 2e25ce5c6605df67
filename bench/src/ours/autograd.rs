//! The distributed autograd rows: one step as the bench measures it, where
//! its time went (forward call, local sum, backward pass), and its floor,
//! measured beside it in alternating rounds (issue 52): the step's ops in
//! this process plus two raw TCP round trips of its bytes.
//!
//! Beside the floor, the same ops each timed right after a no-op's round
//! trip, as `aten::add`'s row times its op: the regime a worker woken for
//! each message runs them in. Those ops plus the two raw round trips are
//! the least a step can take while a round trip leaves the caches that
//! cold, and say whether the row's target is within reach.
//!
//! A blocking raw round trip on a 2-core VM has two modes: about 5 µs when
//! the scheduler puts both ends on one core (the wake-up is a switch) and
//! 60 µs or more when a sleeping core must be woken. An echo that answers
//! at once gets the first mode, which no step can: its callee runs its ops
//! between a request and the reply, and a caller that sleeps through them
//! is woken from an idle core (2026-12-03: 94 µs over 20 µs of the echo
//! server's work, against 5 µs with none). So the blocking round trip is
//! timed with an echo server that works for half the step's ops before
//! each reply (the work not counted); each round also measures the round
//! trips with both sides spinning (which no wake-up slows) and counts the
//! faster of the two; and the protocol's own least: the step's two round
//! trips as our no-op calls make them.

use std::time::{Duration, Instant};

use anyhow::Result;
use tch::{Device, Kind, Tensor};
use wasmrpc::{Payload, RpcAgent, args};

use super::floors::{as_printed, median_round, verdict};
use super::{Config, timed, timed_after};
use crate::limit::{LocalStep, PingPong, step_bytes_each_way};
use crate::progress::Progress;
use crate::report::fmt_micros;
use crate::rows::{Results, Side};
use crate::stats::{CpuTicks, Stat, fmt_share, steal_between};

/// The rows: (row, its floor's limit key, side of the matrices, steps in a
/// quick run, steps in a full run, the target over the floor).
const STEPS: [(&str, &str, i64, usize, usize, f64); 2] = [
    ("dist_autograd_16", "step_floor_16", 16, 200, 1000, 1.8),
    ("dist_autograd_256", "step_floor_256", 256, 50, 200, 1.10),
];

/// Measures the wanted step rows beside their floors: each of the rounds
/// (three with `--quick`, else five) times the floor and then a share of
/// the steps; the row keeps every step, its limit the floor of the median
/// round, and the note every round's ratio.
pub(super) async fn steps(
    cfg: &Config,
    agent: &RpcAgent,
    res: &mut Results,
    progress: &Progress,
) -> Result<()> {
    for (row, floor_key, side, nq, nf, target) in STEPS {
        if !cfg.wanted(row) {
            continue;
        }
        let leaf =
            || Tensor::rand([side, side], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (a, b) = (leaf(), leaf());
        let rounds = cfg.n(3, 5);
        let per_round = (cfg.n(nq, nf) / rounds).max(1);
        let warmup = (per_round / 10).max(1);
        let bytes = step_bytes_each_way(side);
        let mut local = LocalStep::new(side);
        let phases = std::cell::RefCell::new(Vec::new());
        let mut all = Vec::new();
        let mut measured: Vec<Round> = Vec::new();
        for round in 1..=rounds {
            progress.set(&format!(
                "wasmrpc: distributed autograd step, {side}x{side} matmul, beside its floor, \
                 round {round} of {rounds}"
            ));
            // The floor is blocking code: off the runtime.
            let (step, floor) = crate::worker::off_runtime(move || {
                let floor = (|| -> Result<(f64, f64, f64)> {
                    let ops = Stat::latencies(&local.timed(per_round, warmup)?).median;
                    // The callee runs most of the ops, between a request and
                    // its reply: the echo server works for their share.
                    let work = ops / STEP_ROUND_TRIPS;
                    let mut raw =
                        PingPong::start_working(false, Duration::from_secs_f64(work / 1e6))?;
                    let trip =
                        Stat::latencies(&raw.round_trips_of(bytes, per_round, warmup)?).median;
                    Ok((ops, (trip - work).max(0.0), work))
                })();
                (local, floor)
            })
            .await?;
            local = step;
            let (ops, blocking_trip, echo_work) = floor?;
            let before = CpuTicks::now();
            let steps = timed(per_round, warmup, || {
                autograd_step(agent, "worker1", &a, &b, &phases)
            })
            .await?;
            let steal = steal_between(before, CpuTicks::now());
            let noop = || agent.rpc_sync("worker1", crate::worker::NOOP, args![1]);
            let local_step = || std::future::ready(local_run(&local));
            let cold = timed_after(per_round, warmup, noop, local_step).await?;
            let call = Stat::latencies(&timed(per_round, warmup, noop).await?).median;
            // As the small call's second floor, a spinning server lives for
            // its phase only (a busy core changes every other measurement).
            let spinning = crate::worker::off_runtime(move || {
                PingPong::start(true)
                    .and_then(|mut spinning| spinning.round_trips_of(bytes, per_round, warmup))
            })
            .await??;
            measured.push(Round {
                step: Stat::latencies(&steps).median,
                ops,
                cold_ops: Stat::latencies(&cold).median,
                blocking_trip,
                echo_work,
                spinning_trip: Stat::latencies(&spinning).median,
                call,
                steal,
            });
            all.extend(steps);
        }
        let ratios: Vec<f64> = measured.iter().map(|r| r.step / r.floor()).collect();
        let (per_round_ratios, i) = median_round(&ratios);
        let m = &measured[i];
        res.set(Side::Ours, row, Stat::latencies(&all));
        res.set(
            Side::Limit,
            floor_key,
            Stat::value(m.floor(), all.len() as u64),
        );
        res.note(
            Side::Limit,
            floor_key,
            format!(
                "(its ops in one process + 2 raw TCP round trips of {} each way, the faster of \
                 a blocking one, whose echo server works for half the ops before each reply, \
                 and a spinning one, in the median round of the row's)",
                crate::report::fmt_bytes(bytes)
            ),
        );
        let per_round = |show: &dyn Fn(&Round) -> String| {
            measured.iter().map(show).collect::<Vec<_>>().join(" ")
        };
        let blocking = per_round(&|r| fmt_micros(r.blocking_trip));
        let echo_work = per_round(&|r| fmt_micros(r.echo_work));
        let spinning = per_round(&|r| fmt_micros(r.spinning_trip));
        let steal = per_round(&|r| fmt_share(r.steal));
        let least = per_round(&|r| format!("{:.2}x", r.least() / r.floor()));
        let protocol = per_round(&|r| format!("{:.2}x", r.protocol() / r.floor()));
        let reach = if as_printed(m.least() / m.floor()) > target {
            "; so the step's ops alone, right after a round trip, and its two round trips put \
             it above the target: out of reach while a round trip leaves the caches this cold"
        } else {
            ""
        };
        let phases = phases.into_inner();
        res.note(
            Side::Ours,
            row,
            format!(
                "({rounds} rounds alternating with its floor; its raw round trips per round, \
                 blocking: {blocking} (the echo server working {echo_work} before each reply, \
                 as the callee runs its ops, which the trip does not count), both sides \
                 spinning: {spinning}, the floor counting the faster; over it per round: {per_round_ratios} \
                 (the hypervisor's steal of the CPUs' time while the steps ran, per round: \
                 {steal}); in the median round {} over {}, \
                 {:.2}x, target <= {target:.2}x: {}; its ops in that round: {} in a block, {} \
                 each right after a no-op's round trip; those and 2 raw round trips over the \
                 floor, per round: {least}{reach}; the step makes {STEP_ROUND_TRIPS} \
                 round trips (the forward call, and the backward request whose answer carries \
                 the leaves' gradients): its ops right after a no-op's round \
                 trip and {STEP_ROUND_TRIPS} of our no-op round trips ({} each) over the \
                 floor, per round: {protocol}) {}",
                fmt_micros(m.step),
                fmt_micros(m.floor()),
                ratios[i],
                verdict(ratios[i], target),
                fmt_micros(m.ops),
                fmt_micros(m.cold_ops),
                fmt_micros(m.call),
                StepPhases::medians(&phases[phases.len().saturating_sub(all.len())..]),
            ),
        );
    }
    Ok(())
}

/// One round's medians, in microseconds.
struct Round {
    /// The distributed step.
    step: f64,
    /// Its ops in this process, in a block.
    ops: f64,
    /// The same ops, each right after a no-op's round trip.
    cold_ops: f64,
    /// A raw TCP round trip of the step's bytes, both sides blocking, the
    /// echo server working `echo_work` before its reply (not counted).
    blocking_trip: f64,
    /// How long the blocking echo server worked before each reply: half of
    /// `ops`, the callee's share of one round trip.
    echo_work: f64,
    /// The same with both sides spinning (no wake-up paid).
    spinning_trip: f64,
    /// Our no-op call's round trip.
    call: f64,
    /// The hypervisor's share of the CPUs' time while the steps ran.
    steal: Option<f64>,
}

/// The round trips one step makes between the two workers: the forward
/// call, and the backward pass's request to the callee, whose answer
/// carries the gradients of the caller's leaves.
const STEP_ROUND_TRIPS: f64 = 2.0;

impl Round {
    /// The faster raw round trip of the round: blocking or spinning.
    /// A blocking one is fast only when both ends share a core (module
    /// docs), so neither kind alone is the floor in every round.
    fn trip(&self) -> f64 {
        self.blocking_trip.min(self.spinning_trip)
    }

    /// The row's floor: its ops in a block and two raw round trips.
    fn floor(&self) -> f64 {
        self.ops + 2.0 * self.trip()
    }

    /// The least a step can take in the regime it runs in: its ops with
    /// the caches a round trip leaves, and two raw round trips.
    fn least(&self) -> f64 {
        self.cold_ops + 2.0 * self.trip()
    }

    /// What the step's protocol costs at least with our calls as they are:
    /// its ops with the caches a round trip leaves, and one no-op round
    /// trip per round trip it makes.
    fn protocol(&self) -> f64 {
        self.cold_ops + STEP_ROUND_TRIPS * self.call
    }
}

/// One local step, as the call [`timed_after`] times.
fn local_run(step: &LocalStep) -> wasmrpc::Result<Payload> {
    step.run()
        .map(|()| Payload::none())
        .map_err(|e| wasmrpc::Error::runtime(format!("the local step failed: {e:#}")))
}

/// Where one distributed autograd step's time went, as its row's note:
/// the remote matmul (the forward call), the local sum, and the backward
/// pass across both workers. A profile of the step starts here.
pub(crate) struct StepPhases {
    forward: Duration,
    loss: Duration,
    backward: Duration,
}

impl StepPhases {
    /// The median of each phase over `steps`.
    pub(crate) fn medians(steps: &[StepPhases]) -> String {
        let median = |phase: fn(&StepPhases) -> Duration| {
            let samples: Vec<Duration> = steps.iter().map(phase).collect();
            crate::report::fmt_micros(Stat::latencies(&samples).median)
        };
        format!(
            "(phase medians: remote matmul {}, local sum {}, backward {})",
            median(|p| p.forward),
            median(|p| p.loss),
            median(|p| p.backward)
        )
    }
}

/// The step's forward call alone, in a fresh context released after it
/// (`wasmrpc-bench anatomy --call forward16`): what a call inside a
/// context costs beside the same op called outside one.
pub(crate) async fn forward_in_context(
    agent: &RpcAgent,
    dst: &str,
    a: &Tensor,
    b: &Tensor,
) -> wasmrpc::Result<Payload> {
    let (a, b) = (a.shallow_clone(), b.shallow_clone());
    wasmrpc::dist_autograd::context(agent, |_| async move {
        agent.rpc_sync(dst, "aten::matmul", args![a, b]).await
    })
    .await?
}

/// One step as the torch side does it: in a fresh context, a remote matmul,
/// a local sum, backward across both workers, and the context's gradients
/// (both leaves must have one). Its phases go to `phases`.
pub(crate) async fn autograd_step(
    agent: &RpcAgent,
    dst: &str,
    a: &Tensor,
    b: &Tensor,
    phases: &std::cell::RefCell<Vec<StepPhases>>,
) -> wasmrpc::Result<Payload> {
    let (a, b) = (a.shallow_clone(), b.shallow_clone());
    wasmrpc::dist_autograd::context(agent, |ctx| async move {
        let started = Instant::now();
        let product = agent
            .rpc_sync(
                dst,
                "aten::matmul",
                args![a.shallow_clone(), b.shallow_clone()],
            )
            .await?
            .as_tensor()?;
        let returned = Instant::now();
        let loss = product.sum(None);
        let summed = Instant::now();
        wasmrpc::dist_autograd::backward(agent, ctx, &[loss], false).await?;
        phases.borrow_mut().push(StepPhases {
            forward: returned - started,
            loss: summed - returned,
            backward: summed.elapsed(),
        });
        let grads = wasmrpc::dist_autograd::get_gradients(agent, ctx)?;
        if !(grads.contains(&a) && grads.contains(&b)) {
            return Err(wasmrpc::Error::runtime(format!(
                "context {ctx} has gradients for {} of the 2 leaves",
                grads.len()
            )));
        }
        Ok(Payload::none())
    })
    .await?
}
