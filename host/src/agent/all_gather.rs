//! `_all_gather`, `_barrier`, `_wait_all_workers` and the shutdown join,
//! following `rpc/api.py` (`rpc_api.md` §B–C).
//!
//! The leader is the lexicographically smallest name of the set. Followers
//! send their object to the leader (`_gather_to_leader`), the leader answers
//! everyone with the gathered map (`_broadcast_to_followers`). Each call of
//! one name set gets a sequence id (`sorted names joined` + a per-worker
//! counter), so every participant must make the same calls in the same order
//! (AG-6), and a follower's report may arrive before the leader enters.
//!
//! One deliberate change from the seed: when the wait for the leader's
//! signal times out, `_all_gather` fails with a `RuntimeError` instead of
//! silently returning what it has.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::{Dest, Future, RpcAgent};
use crate::abi::Value;
use crate::error::{
    Error, Result, all_gather_followers_timeout_message, not_expected_by_leader_message,
    reported_twice_message, signal_set_twice_message,
};
use crate::value::Payload;
use crate::{agent::registry::FunctionRegistry, args};

const GATHER_TO_LEADER: &str = "wasmrpc::_gather_to_leader";
const BROADCAST_TO_FOLLOWERS: &str = "wasmrpc::_broadcast_to_followers";

#[derive(Default)]
struct GatherState {
    gathered: BTreeMap<String, Payload>,
    proceed: bool,
    notify: Arc<Notify>,
}

/// The per-sequence-id states and counters of one agent.
#[derive(Default)]
pub(crate) struct GatherStates {
    states: Mutex<HashMap<String, GatherState>>,
    sequence: Mutex<HashMap<String, u64>>,
    /// The all-gathers under way on this agent, by sequence id: the peers
    /// each expects a message from (AG-8).
    awaited: Mutex<HashMap<String, Expected>>,
}

/// What one all-gather expects: the leader, its followers' reports; a
/// follower, the leader's signal.
struct Expected {
    from: BTreeSet<String>,
    leads: bool,
}

impl GatherStates {
    /// Whether an all-gather of this agent still expects a message from
    /// `peer` (AG-8): it is then failed when it closes its connection, even
    /// in this worker's shutdown, when peers that finished theirs close
    /// theirs. A message that arrived is expected no more: a leader that
    /// closes right after its last signal has finished, not failed.
    pub(crate) fn is_awaited(&self, peer: &str) -> bool {
        let awaited = lock(&self.awaited);
        let states = lock(&self.states);
        awaited.iter().any(|(sequence_id, expected)| {
            let state = states.get(sequence_id);
            let arrived = if expected.leads {
                state.is_some_and(|s| s.gathered.contains_key(peer))
            } else {
                state.is_some_and(|s| s.proceed)
            };
            expected.from.contains(peer) && !arrived
        })
    }

    fn expect_from(&self, sequence_id: &str, from: BTreeSet<String>, leads: bool) -> Awaiting<'_> {
        lock(&self.awaited).insert(sequence_id.to_string(), Expected { from, leads });
        Awaiting {
            states: self,
            sequence_id: sequence_id.to_string(),
        }
    }
}

/// An all-gather under way, for as long as it waits.
struct Awaiting<'a> {
    states: &'a GatherStates,
    sequence_id: String,
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        lock(&self.states.awaited).remove(&self.sequence_id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn names_of(p: &Payload) -> Result<Option<BTreeSet<String>>> {
    if p.is_none() {
        return Ok(None);
    }
    p.items()?
        .iter()
        .map(|n| n.as_str().map(str::to_string))
        .collect::<Result<_>>()
        .map(Some)
}

fn gather_to_leader(
    agent: &RpcAgent,
    sequence_id: &str,
    worker: &str,
    obj: Payload,
    names: Option<BTreeSet<String>>,
) -> Result<()> {
    let names = match names.filter(|n| !n.is_empty()) {
        Some(n) => n,
        None => {
            let all: BTreeSet<String> = agent.workers().into_iter().map(|m| m.info.name).collect();
            if !all.contains(worker) {
                return Err(Error::new(
                    crate::abi::ErrorKind::AssertionError,
                    not_expected_by_leader_message(worker),
                ));
            }
            all
        }
    };
    let mut states = lock(&agent.inner.gather.states);
    let st = states.entry(sequence_id.to_string()).or_default();
    if st.gathered.contains_key(worker) {
        return Err(Error::new(
            crate::abi::ErrorKind::AssertionError,
            reported_twice_message(worker, sequence_id),
        ));
    }
    st.gathered.insert(worker.to_string(), obj);
    if st.gathered.keys().cloned().collect::<BTreeSet<_>>() == names {
        st.proceed = true;
        st.notify.notify_waiters();
    }
    Ok(())
}

/// Registers the two all-gather handlers.
pub(crate) fn register(r: &FunctionRegistry) {
    r.register_native(GATHER_TO_LEADER, |ctx, args| async move {
        let seq = args.get(0)?.as_str()?.to_string();
        let worker = args.get(1)?.as_str()?.to_string();
        let names = names_of(&args.get(3)?)?;
        gather_to_leader(ctx.agent(), &seq, &worker, args.get(2)?, names)?;
        Ok(Payload::none())
    });
    r.register_native(BROADCAST_TO_FOLLOWERS, |ctx, args| async move {
        let seq = args.get(0)?.as_str()?.to_string();
        let map = args.get(1)?;
        let mut gathered = BTreeMap::new();
        for (k, v) in map.entries()? {
            gathered.insert(k.as_str()?.to_string(), v);
        }
        let mut states = lock(&ctx.agent().inner.gather.states);
        let st = states.entry(seq.clone()).or_default();
        if st.proceed {
            return Err(Error::new(
                crate::abi::ErrorKind::AssertionError,
                signal_set_twice_message(&seq),
            ));
        }
        st.gathered = gathered;
        st.proceed = true;
        st.notify.notify_waiters();
        Ok(Payload::none())
    });
}

fn map_payload(m: &BTreeMap<String, Payload>) -> Payload {
    Payload::dict(
        m.iter()
            .map(|(k, v)| (Payload::from(k.as_str()), v.clone())),
    )
}

impl RpcAgent {
    /// Gathers `obj` from every worker of `worker_names` (all workers with
    /// `None`) on every one of them (`_all_gather`).
    ///
    /// `timeout`: `None` uses the default RPC timeout for the calls and waits
    /// for the leader's signal without limit; zero makes both unlimited;
    /// otherwise both use it.
    ///
    /// # Errors
    /// A follower's call to the leader failing or timing out ("RPC ran for
    /// more than ..."); on the leader, "Followers [...] timed out in
    /// _all_gather after ... seconds. The first exception is ..."; a signal
    /// wait that outlives `timeout`; "RPC has not been initialized ..." when
    /// the agent does not run.
    pub async fn all_gather(
        &self,
        obj: Payload,
        worker_names: Option<&BTreeSet<String>>,
        timeout: Option<Duration>,
    ) -> Result<BTreeMap<String, Payload>> {
        if self.inner.state.load(std::sync::atomic::Ordering::Acquire) == super::STOPPED {
            return Err(Error::not_initialized());
        }
        let names: BTreeSet<String> = match worker_names.filter(|n| !n.is_empty()) {
            Some(n) => n.clone(),
            None => self.workers().into_iter().map(|m| m.info.name).collect(),
        };
        let Some(leader) = names.iter().next().cloned() else {
            return Ok(BTreeMap::new());
        };
        let me = self.name().to_string();
        let sequence_id = {
            let concat: String = names.iter().map(String::as_str).collect();
            let mut seq = lock(&self.inner.gather.sequence);
            let n = seq.entry(concat.clone()).or_insert(0);
            let id = format!("{concat}{n}");
            *n += 1;
            id
        };
        let (rpc_timeout, signal_timeout) = match timeout {
            None => (self.get_rpc_timeout(), None),
            Some(t) if t.is_zero() => (Duration::ZERO, None),
            Some(t) => (t, Some(t)),
        };
        let names_payload = Payload::list(names.iter().map(|n| Payload::from(n.as_str())));
        // AG-8: the leader expects its followers' reports, a follower the
        // leader's signal, from the start (a leader that dies right after
        // taking a report is not missed); one of them failing ends the wait.
        let expected: BTreeSet<String> = if me == leader {
            names.iter().filter(|n| **n != me).cloned().collect()
        } else {
            BTreeSet::from([leader.clone()])
        };
        let awaiting = self
            .inner
            .gather
            .expect_from(&sequence_id, expected.clone(), me == leader);
        if me == leader {
            gather_to_leader(self, &sequence_id, &me, obj, Some(names.clone()))?;
        } else {
            self.call(
                Dest::Name(leader.clone()),
                GATHER_TO_LEADER,
                args![sequence_id.as_str(), me.as_str(), obj, names_payload],
                crate::agent::CallOptions {
                    timeout: Some(rpc_timeout),
                    ..crate::agent::CallOptions::new(crate::agent::CallKind::Internal)
                },
            )
            .wait()
            .await?;
        }
        tokio::select! {
            biased;
            r = self.wait_signal(&sequence_id, signal_timeout) => r?,
            failure = self.failure_among(&expected) => {
                lock(&self.inner.gather.states).remove(&sequence_id);
                return Err(Error::runtime(format!(
                    "{me} gave up in _all_gather waiting for sequence id {sequence_id} to \
                     complete: {failure}"
                )));
            }
            // FAIL-6: a peer that died before it connected is declared
            // failed by a dial, which ends the wait above.
            () = self.probe_unconnected(&expected, |peer| self.inner.gather.is_awaited(peer)) => {}
        }
        drop(awaiting);
        if me == leader {
            let gathered = lock(&self.inner.gather.states)
                .get(&sequence_id)
                .map(|s| map_payload(&s.gathered))
                .unwrap_or_else(|| map_payload(&BTreeMap::new()));
            let followers: Vec<String> = names.iter().filter(|n| **n != leader).cloned().collect();
            let futures: Vec<(String, Future)> = followers
                .iter()
                .map(|f| {
                    let fut = self.call(
                        Dest::Name(f.clone()),
                        BROADCAST_TO_FOLLOWERS,
                        args![sequence_id.as_str(), gathered.clone()],
                        crate::agent::CallOptions {
                            timeout: Some(rpc_timeout),
                            ..crate::agent::CallOptions::new(crate::agent::CallKind::Internal)
                        },
                    );
                    (f.clone(), fut)
                })
                .collect();
            let mut errors = Vec::new();
            for (name, fut) in futures {
                if let Err(e) = fut.wait().await {
                    errors.push((name, e));
                }
            }
            if let Some((_, first)) = errors.first() {
                let failed: Vec<String> = errors.iter().map(|(n, _)| n.clone()).collect();
                lock(&self.inner.gather.states).remove(&sequence_id);
                return Err(Error::runtime(all_gather_followers_timeout_message(
                    &failed,
                    rpc_timeout.as_secs_f64(),
                    first,
                )));
            }
        }
        let state = lock(&self.inner.gather.states).remove(&sequence_id);
        Ok(state.map(|s| s.gathered).unwrap_or_default())
    }

    /// The first failure declared of one of `peers`, at once if one of them
    /// failed already.
    async fn failure_among(&self, peers: &BTreeSet<String>) -> super::WorkerFailure {
        let mut failures = self.watch_failures();
        loop {
            let found = failures
                .borrow_and_update()
                .iter()
                .find(|f| peers.contains(&f.worker))
                .cloned();
            if let Some(failure) = found {
                return failure;
            }
            if failures.changed().await.is_err() {
                // The agent is gone: nothing more will be declared.
                std::future::pending::<()>().await;
            }
        }
    }

    async fn wait_signal(&self, sequence_id: &str, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        loop {
            let notify = {
                let mut states = lock(&self.inner.gather.states);
                let st = states.entry(sequence_id.to_string()).or_default();
                if st.proceed {
                    return Ok(());
                }
                st.notify.clone()
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if lock(&self.inner.gather.states)
                .get(sequence_id)
                .is_some_and(|s| s.proceed)
            {
                return Ok(());
            }
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d, notified).await.is_err() {
                        lock(&self.inner.gather.states).remove(sequence_id);
                        return Err(Error::runtime(format!(
                            "{} timed out in _all_gather after {:.2} seconds waiting for sequence id {sequence_id} to complete",
                            self.name(),
                            timeout.unwrap_or_default().as_secs_f64()
                        )));
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Waits until every worker of `worker_names` reaches the barrier
    /// (`_barrier`). As in the seed, a failure is logged, not returned.
    pub async fn barrier(&self, worker_names: &[&str]) {
        let names: BTreeSet<String> = worker_names.iter().map(|s| s.to_string()).collect();
        if let Err(e) = self.all_gather(Payload::none(), Some(&names), None).await {
            tracing::error!(worker = %self.name(), "Failed to complete barrier, got error {e}");
        }
    }

    /// Waits until every worker of the group calls it (`_wait_all_workers`);
    /// re-entrant. `timeout` zero means none.
    ///
    /// # Errors
    /// The all-gather's error, also logged.
    pub async fn wait_all_workers(&self, timeout: Duration) -> Result<()> {
        if !self.is_running() {
            return Err(Error::not_initialized());
        }
        self.wait_all_workers_inner(timeout).await
    }

    pub(super) async fn wait_all_workers_inner(&self, timeout: Duration) -> Result<()> {
        if let Err(e) = self.all_gather(Payload::none(), None, Some(timeout)).await {
            tracing::error!(worker = %self.name(), "Failed to respond to 'Shutdown Proceed' in time, got error {e}");
            return Err(e);
        }
        Ok(())
    }

    /// Waits until no worker of the group has user calls in flight (AG-5).
    ///
    /// Each round, every worker reports whether it is idle (no pending user
    /// call, no running user function) and its activity count (user calls
    /// made plus user calls received). The join ends after two consecutive
    /// rounds in which every worker was idle with the same activity count.
    /// Rounds are separated by an all-gather, so there is an instant between
    /// them after every first report and before every second one; a call in
    /// flight at that instant is either reported pending in the first round
    /// or changes its caller's activity count before the second. Calls that
    /// fail (timeouts, dead peers) still end, so failures cannot stall it.
    pub(super) async fn join(&self, timeout: Duration) -> Result<()> {
        let deadline = (!timeout.is_zero()).then(|| tokio::time::Instant::now() + timeout);
        let mut previous: Option<BTreeMap<String, (bool, i64)>> = None;
        loop {
            self.wait_quiet(deadline).await?;
            let idle = self
                .inner
                .user_pending
                .load(std::sync::atomic::Ordering::Acquire)
                == 0
                && self
                    .inner
                    .user_active
                    .load(std::sync::atomic::Ordering::Acquire)
                    == 0;
            let activity = (self
                .inner
                .user_sent
                .load(std::sync::atomic::Ordering::Acquire)
                + self
                    .inner
                    .user_received
                    .load(std::sync::atomic::Ordering::Acquire)) as i64;
            let all = self
                .all_gather(
                    Payload::tuple(vec![idle.into(), activity.into()]),
                    None,
                    Some(timeout),
                )
                .await?;
            let mut round = BTreeMap::new();
            for (name, p) in &all {
                if let Value::Tuple(v) = &p.value
                    && let [Value::Bool(i), Value::Int(a)] = v.as_slice()
                {
                    round.insert(name.clone(), (*i, *a));
                }
            }
            let all_idle = round.len() == all.len() && round.values().all(|(i, _)| *i);
            if all_idle && previous.as_ref() == Some(&round) {
                return Ok(());
            }
            previous = all_idle.then_some(round);
        }
    }
}
