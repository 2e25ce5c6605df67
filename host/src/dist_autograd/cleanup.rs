//! Telling the workers a released context reached to release theirs
//! (DA-8): the cleanup requests, batched per worker, their retries, and
//! the flush at graceful shutdown.
//!
//! Why batched: a training loop releases a context every step, and one
//! request (and one response) per step and worker was an exchange of its
//! own beside the step's forward call and its gradient request. The first
//! release after a quiet spell starts a [`BATCH_WINDOW`]; every release
//! until it ends joins the same request to its worker. PyTorch's peers
//! learn of a release only asynchronously too, and its tests wait for it
//! (`_all_contexts_cleaned_up` polls for up to 10 s).
//!
//! This module owns only the outgoing side. Releasing a context, and
//! serving a cleanup request, is `context::release_if_present`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use super::context::container;
use super::wire::AutogradMessage;
use crate::agent::RpcAgent;

/// How long the releases of a burst wait to share one request per worker.
pub(crate) const BATCH_WINDOW: Duration = Duration::from_millis(5);
/// How many times a cleanup request is sent before giving up.
const ATTEMPTS: u32 = 8;

/// The context ids released on this worker that are still to be sent, by
/// the worker to send them to.
#[derive(Default)]
pub(crate) struct Outbox {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    pending: BTreeMap<u32, Vec<i64>>,
    /// A flush is scheduled: releases until then join `pending`.
    flush_scheduled: bool,
}

impl Queue {
    /// Queues `id` for `to`; returns whether the caller must schedule the
    /// flush (none is scheduled yet).
    fn push(&mut self, to: u32, id: i64) -> bool {
        self.pending.entry(to).or_default().push(id);
        !std::mem::replace(&mut self.flush_scheduled, true)
    }

    /// Everything queued, one batch per worker; the next push schedules a
    /// new flush.
    fn take(&mut self) -> BTreeMap<u32, Vec<i64>> {
        self.flush_scheduled = false;
        std::mem::take(&mut self.pending)
    }
}

impl Outbox {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the cleanup of context `id` on worker `to`; the batch leaves
    /// within [`BATCH_WINDOW`].
    pub(crate) fn send(&self, agent: &RpcAgent, to: u32, id: i64) {
        if !agent.is_running() || !self.queue().push(to, id) {
            return;
        }
        let agent = agent.clone();
        agent.runtime_handle().spawn(async move {
            tokio::time::sleep(BATCH_WINDOW).await;
            container(&agent).cleanups.flush(&agent);
        });
    }

    /// Sends every queued batch now; returns the requests, each retried on
    /// failure in a task of its own.
    pub(crate) fn flush(&self, agent: &RpcAgent) -> Vec<crate::agent::Future> {
        let batches = self.queue().take();
        if !agent.is_running() {
            return Vec::new();
        }
        batches
            .into_iter()
            .map(|(to, ids)| send_with_retries(agent, to, ids))
            .collect()
    }
}

fn send_with_retries(agent: &RpcAgent, to: u32, context_ids: Vec<i64>) -> crate::agent::Future {
    let request = cleanup_request(agent, to, context_ids.clone());
    let agent = agent.clone();
    request.add_done_callback(move |f| {
        if let Some(Err(e)) = f.try_value() {
            tracing::debug!(worker = %agent.name(), to, ?context_ids, "cleanup request failed, retrying: {e}");
            let handle = agent.runtime_handle();
            handle.spawn(retry(agent, to, context_ids));
        }
    });
    request
}

fn cleanup_request(agent: &RpcAgent, to: u32, context_ids: Vec<i64>) -> crate::agent::Future {
    let message = AutogradMessage::CleanupAutogradContext { context_ids };
    let body = match message.encode() {
        Ok(b) => b,
        Err(e) => return crate::agent::Future::ready(Err(e)),
    };
    agent.request(i64::from(to), message.kind(), body, &[], None)
}

async fn retry(agent: RpcAgent, to: u32, context_ids: Vec<i64>) {
    let mut delay = Duration::from_millis(20);
    for _ in 1..ATTEMPTS {
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(500));
        if !agent.is_running() {
            return;
        }
        match cleanup_request(&agent, to, context_ids.clone())
            .wait()
            .await
        {
            Ok(_) => return,
            Err(e) => {
                tracing::debug!(worker = %agent.name(), to, ?context_ids, "cleanup request failed, retrying: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Queue;

    #[test]
    fn a_burst_of_releases_schedules_one_flush_and_leaves_as_one_batch_per_worker() {
        let mut q = Queue::default();
        assert!(q.push(1, 10), "the first release schedules the flush");
        assert!(!q.push(2, 11));
        assert!(!q.push(1, 12));
        let batches = q.take();
        assert_eq!(
            batches.into_iter().collect::<Vec<_>>(),
            vec![(1, vec![10, 12]), (2, vec![11])]
        );
        assert!(q.take().is_empty(), "a flush sends each id once");
        assert!(q.push(1, 13), "a release after the flush schedules another");
    }
}
