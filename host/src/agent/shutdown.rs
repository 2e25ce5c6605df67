//! Stopping an agent: graceful shutdown (AG-5: all-gather, the features'
//! shutdown steps, join), the stop itself (AG-4: running callees queue
//! their responses first), and abort.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{RUNNING, RpcAgent, STOPPED, STOPPING, ShutdownHook, current, rendezvous};
use crate::error::{Error, Result};

impl RpcAgent {
    /// Adds a step to graceful shutdown of a static group, run after the
    /// all-gather and the features' own steps and before the join, in the
    /// order added. An error stops the shutdown's waiting (the agent still
    /// stops) and is returned by [`shutdown`](Self::shutdown).
    pub fn add_shutdown_hook(&self, hook: ShutdownHook) {
        self.inner
            .shutdown_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// The features' shutdown steps, then the hooks added.
    async fn run_shutdown_steps(&self) -> Result<()> {
        let extensions: Vec<_> = self.inner.extensions.iter().cloned().collect();
        for extension in extensions {
            if let Some(step) = extension.shutdown(self) {
                step.await?;
            }
        }
        let hooks: Vec<ShutdownHook> = self
            .inner
            .shutdown_hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for hook in hooks {
            hook(self.clone()).await?;
        }
        Ok(())
    }

    /// Waits until this worker has no pending user calls and runs no user
    /// function, or until `deadline`.
    pub(super) async fn wait_quiet(&self, deadline: Option<tokio::time::Instant>) -> Result<()> {
        loop {
            let notified = self.inner.quiet.notified();
            if self.inner.user_pending.load(Ordering::Acquire) == 0
                && self.inner.user_active.load(Ordering::Acquire) == 0
            {
                return Ok(());
            }
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d, notified).await.is_err() {
                        return Err(Error::runtime(format!(
                            "worker {} still had {} pending calls and {} running functions at the join deadline",
                            self.name(),
                            self.inner.user_pending.load(Ordering::Acquire),
                            self.inner.user_active.load(Ordering::Acquire)
                        )));
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Shuts the worker down (`shutdown`). Graceful: waits for every worker
    /// of a static group (all-gather) and for all outstanding work in the
    /// group, including fire-and-forget chains (join); in a dynamic group,
    /// leaves the group after its own work is done. Not graceful: stops at
    /// once. Either way the agent then stops, pending calls fail, and the
    /// current agent is reset if it was this one. `timeout` zero means none.
    ///
    /// # Errors
    /// "RPC has not been initialized ..." if already shut down; a failed or
    /// timed-out all-gather or join (the agent stops anyway); a feature's
    /// last check after the stop (RRef leaks).
    pub async fn shutdown(&self, graceful: bool, timeout: Duration) -> Result<()> {
        if self
            .inner
            .state
            .compare_exchange(RUNNING, STOPPING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::not_initialized());
        }
        let r = if graceful {
            let steps = async {
                if self.inner.static_group {
                    match self.wait_all_workers_inner(timeout).await {
                        Ok(()) => match self.run_shutdown_steps().await {
                            Ok(()) => self.join(timeout).await,
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(e),
                    }
                } else {
                    rendezvous::leave(self, timeout).await
                }
            };
            // FAIL-3: a failed worker would never join the group's
            // shutdown; waiting for it would never end.
            let failed = async {
                let failure = self.next_failure(&[]).await;
                Err(Error::runtime(format!(
                    "graceful shutdown of {} gave up: {failure}",
                    self.name()
                )))
            };
            tokio::select! {
                biased;
                r = failed => (r, false),
                r = steps => (r, true),
            }
        } else {
            (Ok(()), false)
        };
        let (r, graceful) = r;
        self.finalize(graceful).await;
        // The features' last checks (RREF-5: the leak check) run after the
        // agent stopped.
        let checks = self
            .inner
            .extensions
            .iter()
            .map(|e| e.stopped(self))
            .fold(Ok(()), Result::and);
        r.and(checks)
    }

    async fn finalize(&self, graceful: bool) {
        if graceful {
            // AG-4: let running callees queue their responses.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while self.inner.active.load(Ordering::Acquire) > 0
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        self.inner.state.store(STOPPED, Ordering::Release);
        if let Some(t) = self.inner.transport.get() {
            t.shutdown().await;
        }
        let name = self.name().to_string();
        self.fail_pending_where(
            |_| true,
            |p| {
                Error::runtime(format!(
                    "RPC agent of {name} shut down while a call of {} to {} was pending",
                    p.function, p.peer
                ))
            },
        );
        current::reset_if(self);
    }

    /// Stops the worker at once without telling anyone, as if its process
    /// died: connections are cut, pending calls fail. For failure tests.
    pub fn abort(&self) {
        self.inner.state.store(STOPPED, Ordering::Release);
        self.set_ready();
        if let Some(t) = self.inner.transport.get() {
            t.abort();
        }
        let name = self.name().to_string();
        self.fail_pending_where(
            |_| true,
            |p| {
                Error::runtime(format!(
                    "RPC agent of {name} aborted with a call to {} pending",
                    p.peer
                ))
            },
        );
        current::reset_if(self);
    }
}
