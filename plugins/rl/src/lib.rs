//! Two of PyTorch's RPC tutorials in one plugin: the RL actor-learner of
//! "Getting Started with Distributed RPC Framework" and "Implementing Batch
//! RPC Processing Using Asynchronous Executions".
//!
//! worker0 is the **agent**: it holds the policy and trains it; workers
//! 1..=N are **observers**: each runs its own CartPole (the classic
//! cart-pole equations, [`CartPole`]) and asks the agent for every action by
//! RPC. [`run`] is the driver on the agent: each iteration, every observer
//! plays `steps` steps ([`run_episode`]) and sends its trajectory back; the
//! agent applies one REINFORCE update from all of them.
//!
//! - Unbatched (`batch = false`), each request is answered on its own by
//!   [`select_action`]: one `1x5 @ 5x2` product per request.
//! - Batched (`batch = true`), requests go to the `async_execution`
//!   function [`select_action_batch`]: each request parks its state and
//!   returns a `then` of the worker-wide future `"actions"`; the request
//!   that fills the batch runs the policy once on all N states and completes
//!   that future, which answers all N requests at once (the tutorial's
//!   `future_actions`).
//!
//! **The policy** is linear softmax: `pi(.|s) = softmax([s, 1] @ W)`, `W`
//! a 5x2 float64 tensor in the agent's global `"W"`. The REINFORCE gradient
//! of such a policy has a closed form, `sum_t G_t [s_t, 1]^T (onehot(a_t) -
//! pi(.|s_t))` with `G_t` the normalised discounted returns, which the
//! agent computes with tensor ops (`S^T @ ((A - P) * G)`). Gradients come
//! from this closed form rather than from autograd because guest autograd
//! did not exist when the example was written; the update is the same.
//!
//! Sampling is reproducible: each observer draws its own uniform numbers
//! (xorshift, seeded by its id) and sends one with each request; the agent
//! picks action 1 when it exceeds `pi(0|s)`.

use wasmrpc_guest::{
    Error, Future, Result, Tensor, get_worker_info, global, lock, progress, remote, rpc_async,
    rpc_sync, set_global,
};

/// The discount factor of the returns.
const GAMMA: f64 = 0.99;
/// CartPole-v1's episode cap.
const MAX_EPISODE: i64 = 200;
/// Features of a state: the 4 CartPole variables and a constant 1 (bias).
const FEATURES: usize = 5;

/// CartPole, with the classic equations and constants (Barto, Sutton and
/// Anderson 1983, as in Gym's CartPole-v1): a pole on a cart, pushed left
/// or right with 10 N; an episode ends when the pole leans more than 12
/// degrees or the cart leaves +-2.4, and every step before earns 1.
#[derive(Debug, Clone, Copy)]
struct CartPole {
    x: f64,
    x_dot: f64,
    theta: f64,
    theta_dot: f64,
}

impl CartPole {
    const GRAVITY: f64 = 9.8;
    const MASS_CART: f64 = 1.0;
    const MASS_POLE: f64 = 0.1;
    const HALF_LENGTH: f64 = 0.5;
    const FORCE: f64 = 10.0;
    const TAU: f64 = 0.02;
    const THETA_LIMIT: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
    const X_LIMIT: f64 = 2.4;

    /// A new episode: every variable uniform in [-0.05, 0.05].
    fn reset(rng: &mut Rng) -> CartPole {
        let mut u = || (rng.next() - 0.5) * 0.1;
        CartPole {
            x: u(),
            x_dot: u(),
            theta: u(),
            theta_dot: u(),
        }
    }

    fn state(&self) -> [f64; 4] {
        [self.x, self.x_dot, self.theta, self.theta_dot]
    }

    /// One Euler step of `TAU` seconds pushing right (`action` 1) or left
    /// (0); true when the episode is over.
    fn step(&mut self, action: i64) -> bool {
        let total_mass = Self::MASS_CART + Self::MASS_POLE;
        let pole_moment = Self::MASS_POLE * Self::HALF_LENGTH;
        let force = if action == 1 {
            Self::FORCE
        } else {
            -Self::FORCE
        };
        let (sin, cos) = self.theta.sin_cos();
        let temp = (force + pole_moment * self.theta_dot * self.theta_dot * sin) / total_mass;
        let theta_acc = (Self::GRAVITY * sin - cos * temp)
            / (Self::HALF_LENGTH * (4.0 / 3.0 - Self::MASS_POLE * cos * cos / total_mass));
        let x_acc = temp - pole_moment * theta_acc * cos / total_mass;
        self.x += Self::TAU * self.x_dot;
        self.x_dot += Self::TAU * x_acc;
        self.theta += Self::TAU * self.theta_dot;
        self.theta_dot += Self::TAU * theta_acc;
        self.x.abs() > Self::X_LIMIT || self.theta.abs() > Self::THETA_LIMIT
    }
}

/// xorshift64: small, reproducible uniform numbers in [0, 1).
#[derive(Debug, Clone, Copy)]
struct Rng(u64);

impl Rng {
    fn seeded(seed: i64) -> Rng {
        Rng((seed as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(1)
            | 1)
    }

    fn next(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `[s, 1]` for each state of `states` (flattened 4 per state), as a
/// `len x 5` float64 tensor.
fn features(states: &[f64]) -> Result<Tensor> {
    let rows = states.len() / 4;
    let mut data = Vec::with_capacity(rows * FEATURES);
    for s in states.chunks_exact(4) {
        data.extend_from_slice(s);
        data.push(1.0);
    }
    Tensor::from_slice(&[rows as i64, FEATURES as i64], &data)
}

/// The policy `W` held by this worker (the agent).
fn policy() -> Result<Tensor> {
    global::<Tensor>("W")?
        .ok_or_else(|| Error::runtime_error("the agent has no policy: call rl::run"))
}

/// `pi(.|s)` for each row of `features`: a `rows x 2` tensor.
fn probabilities(features: &Tensor) -> Result<Tensor> {
    Tensor::call("aten::softmax", (features.matmul(&policy()?)?, 1i64))
}

/// Actions for `states` (flattened 4 per state), one uniform number each:
/// 1 when `u > pi(0|s)`.
fn act(states: &[f64], uniforms: &[f64]) -> Result<Vec<i64>> {
    let p = probabilities(&features(states)?)?.to_vec::<f64>()?;
    Ok(uniforms
        .iter()
        .zip(p.chunks_exact(2))
        .map(|(u, p)| i64::from(*u > p[0]))
        .collect())
}

/// Counts one answered batch of `size` requests in the agent's statistics.
fn count_batch(size: i64) -> Result<()> {
    let batches = global::<i64>("batches")?.unwrap_or(0);
    let requests = global::<i64>("requests")?.unwrap_or(0);
    set_global("batches", batches + 1)?;
    set_global("requests", requests + size)
}

/// On the agent: one action for one observer's `state` (unbatched).
#[remote]
fn select_action(state: Vec<f64>, u: f64) -> Result<i64> {
    let actions = act(&state, &[u])?;
    {
        let _stats = lock("stats")?;
        count_batch(1)?;
    }
    actions
        .first()
        .copied()
        .ok_or_else(|| Error::runtime_error("the policy returned no action"))
}

/// On the agent: observer `observer`'s request, answered when the batch of
/// all observers' requests is full (PyTorch's `select_action_batch`).
#[remote(async_execution)]
fn select_action_batch(observer: i64, state: Vec<f64>, u: f64) -> Result<Future> {
    let size: i64 = global("batch_size")?
        .ok_or_else(|| Error::runtime_error("the agent has no batch size: call rl::run"))?;
    let guard = lock("batch")?;
    set_global(&format!("state{observer}"), state)?;
    set_global(&format!("u{observer}"), u)?;
    let pending = global::<i64>("pending")?.unwrap_or(0) + 1;
    let actions = if pending == size {
        // This request fills the batch: one forward pass for all of them,
        // then one `set_result` answers every parked request.
        set_global("pending", 0i64)?;
        let mut states = Vec::with_capacity(4 * size as usize);
        let mut uniforms = Vec::with_capacity(size as usize);
        for ob in 0..size {
            let s: Vec<f64> = global(&format!("state{ob}"))?
                .ok_or_else(|| Error::runtime_error(format!("observer {ob} sent no state")))?;
            states.extend(s);
            uniforms.push(
                global::<f64>(&format!("u{ob}"))?
                    .ok_or_else(|| Error::runtime_error(format!("observer {ob} sent no draw")))?,
            );
        }
        let chosen = act(&states, &uniforms)?;
        count_batch(size)?;
        let future = Future::take_shared("actions")?;
        future.set_result(chosen)?;
        future
    } else {
        set_global("pending", pending)?;
        Future::shared("actions")?
    };
    drop(guard);
    actions.then("pick", (observer,))
}

/// The `then` callback of a batched request: this observer's action.
#[remote]
fn pick(actions: Vec<i64>, observer: i64) -> Result<i64> {
    usize::try_from(observer)
        .ok()
        .and_then(|i| actions.get(i).copied())
        .ok_or_else(|| Error::index_error(format!("no action for observer {observer}")))
}

/// What an observer sends back after a round: the states (4 numbers
/// each), the actions, the normalised discounted returns, and the lengths
/// of the episodes that ended.
type Trajectory = (Vec<f64>, Vec<i64>, Vec<f64>, Vec<i64>);

/// On an observer: plays `steps` steps of CartPole from a fresh episode,
/// asking `agent` for every action, and returns the trajectory: the states
/// (4 numbers each), the actions, the normalised discounted returns, and
/// the lengths of the episodes that ended (an episode also ends at 200
/// steps; the last, unfinished one is not counted).
#[remote]
fn run_episode(agent: String, observer: i64, steps: i64, batch: bool) -> Result<Trajectory> {
    let mut rng = match global::<i64>("rng")? {
        Some(bits) => Rng(bits as u64),
        None => Rng::seeded(observer + 1),
    };
    let mut env = CartPole::reset(&mut rng);
    let (mut states, mut actions, mut returns, mut finished) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut length = 0i64;
    let mut segment = 0usize;
    for t in 0..steps {
        let state = env.state();
        let u = rng.next();
        let action: i64 = if batch {
            rpc_sync(
                &agent,
                "rl::select_action_batch",
                (observer, state.to_vec(), u),
            )?
        } else {
            rpc_sync(&agent, "rl::select_action", (state.to_vec(), u))?
        };
        states.extend_from_slice(&state);
        actions.push(action);
        length += 1;
        segment += 1;
        let done = env.step(action) || length >= MAX_EPISODE;
        if done || t + 1 == steps {
            // Discounted returns of this episode's steps (reward 1 each).
            let mut r = 0.0;
            let mut seg = vec![0.0; segment];
            for g in seg.iter_mut().rev() {
                r = 1.0 + GAMMA * r;
                *g = r;
            }
            returns.extend(seg);
            segment = 0;
        }
        if done {
            finished.push(length);
            length = 0;
            env = CartPole::reset(&mut rng);
        }
    }
    set_global("rng", rng.0 as i64)?;
    let n = returns.len().max(1) as f64;
    let mean = returns.iter().sum::<f64>() / n;
    let std = (returns.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / n).sqrt();
    for g in &mut returns {
        *g = (*g - mean) / (std + 1e-8);
    }
    Ok((states, actions, returns, finished))
}

/// The driver, on the agent (worker0): `iterations` rounds in which each
/// of `observers` observers (worker1..) plays `steps` steps, followed by
/// one REINFORCE step of size `lr`. Returns the average return of the
/// episodes finished in each round, the number of answered action batches
/// and the number of action requests.
#[remote]
fn run(
    observers: i64,
    iterations: i64,
    steps: i64,
    lr: f64,
    batch: bool,
) -> Result<(Vec<f64>, i64, i64)> {
    if observers < 1 || iterations < 1 || steps < 1 {
        return Err(Error::value_error(format!(
            "run needs observers, iterations and steps >= 1, got {observers}, {iterations}, {steps}"
        )));
    }
    let agent = get_worker_info()?.name;
    set_global(
        "W",
        Tensor::from_slice(&[FEATURES as i64, 2], &[0.0f64; FEATURES * 2])?,
    )?;
    set_global("batch_size", observers)?;
    set_global("pending", 0i64)?;
    set_global("batches", 0i64)?;
    set_global("requests", 0i64)?;
    let mut averages = Vec::new();
    for iteration in 0..iterations {
        let mut calls = Vec::new();
        for ob in 0..observers {
            let to = format!("worker{}", ob + 1);
            calls.push(rpc_async(
                &to,
                "rl::run_episode",
                (agent.clone(), ob, steps, batch),
            )?);
        }
        let mut states = Vec::new();
        let mut actions = Vec::new();
        let mut returns = Vec::new();
        let mut finished = Vec::new();
        for call in calls {
            let (s, a, g, f): Trajectory = call.wait()?;
            states.extend(s);
            actions.extend(a);
            returns.extend(g);
            finished.extend(f);
        }
        // REINFORCE for a linear softmax policy, in closed form:
        // grad = S^T @ ((onehot(A) - P) * G).
        let rows = actions.len() as i64;
        let s = features(&states)?;
        let p = probabilities(&s)?;
        let onehot: Vec<f64> = actions
            .iter()
            .flat_map(|&a| if a == 1 { [0.0, 1.0] } else { [1.0, 0.0] })
            .collect();
        let a = Tensor::from_slice(&[rows, 2], &onehot)?;
        let g = Tensor::from_slice(&[rows, 1], &returns)?;
        let grad = Tensor::call("aten::t", (s,))?.matmul(&a.sub(&p)?.mul(&g)?)?;
        let w = policy()?.add(&grad.mul(lr)?)?;
        set_global("W", w)?;
        let average = if finished.is_empty() {
            steps as f64
        } else {
            finished.iter().sum::<i64>() as f64 / finished.len() as f64
        };
        progress::report(
            "round",
            iteration as u64 + 1,
            iterations as u64,
            &format!(
                "average return {average:.1} over {} episodes",
                finished.len()
            ),
        );
        averages.push(average);
    }
    let batches = global::<i64>("batches")?.unwrap_or(0);
    let requests = global::<i64>("requests")?.unwrap_or(0);
    Ok((averages, batches, requests))
}
