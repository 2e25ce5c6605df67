//! [`Work`]: the handle of an issued collective (PyTorch's `Work`, what
//! `async_op=True` returns).
//!
//! A collective is issued synchronously: validation, sequence number, and
//! the backend's code up to its first pending `.await` (libtorch's engines
//! enqueue the operation there, which must happen in program order). What
//! remains runs on as a tokio task, or, for a backend whose operations
//! complete on their own ([`CollectiveBackend::completes_without_polling`]:
//! libtorch's engines), stays in the `Work` and is polled by
//! [`Work::wait`] on the caller's task, which saves the thread hop from a
//! spawned task to the waiter on every operation. Dropping a `Work` does not
//! cancel the collective: the peers still expect this rank's part.
//!
//! [`CollectiveBackend::completes_without_polling`]: crate::CollectiveBackend::completes_without_polling

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::error::{Error, Result};

type Pending = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

enum State {
    /// Nothing to wait for, or the outcome already taken by `is_completed`.
    Ready(Result<()>),
    /// Running as a tokio task.
    Task(JoinHandle<Result<()>>),
    /// Issued; completes without polling, waited for on the caller's task.
    Inline(Pending),
}

/// The handle of an issued collective or point-to-point operation.
pub struct Work {
    op: &'static str,
    state: Mutex<State>,
    timeout: Duration,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("completed", &self.is_completed())
            .finish_non_exhaustive()
    }
}

impl Work {
    /// Issues `fut` by polling it once now; then spawns the rest, or, with
    /// `inline` (the backend completes without polling), keeps it for
    /// [`Work::wait`].
    pub(crate) fn spawn(
        inline: bool,
        op: &'static str,
        timeout: Duration,
        fut: impl Future<Output = Result<()>> + Send + 'static,
    ) -> Work {
        // A waker that does nothing is enough for this first poll: a spawned
        // task is polled again by tokio, an inline future by `wait`.
        let mut fut: Pending = Box::pin(fut);
        let mut cx = Context::from_waker(Waker::noop());
        let state = match fut.as_mut().poll(&mut cx) {
            Poll::Ready(result) => State::Ready(result),
            Poll::Pending if inline => State::Inline(fut),
            Poll::Pending => State::Task(tokio::spawn(fut)),
        };
        Work {
            op,
            state: Mutex::new(state),
            timeout,
        }
    }

    /// A work that did nothing (a collective on a rank outside its group).
    pub(crate) fn completed(op: &'static str) -> Work {
        Work {
            op,
            state: Mutex::new(State::Ready(Ok(()))),
            timeout: Duration::ZERO,
        }
    }

    /// The operation this work runs.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *state {
            State::Ready(_) => true,
            State::Task(task) => task.is_finished(),
            State::Inline(fut) => {
                let mut cx = Context::from_waker(Waker::noop());
                match fut.as_mut().poll(&mut cx) {
                    Poll::Ready(result) => {
                        *state = State::Ready(result);
                        true
                    }
                    Poll::Pending => false,
                }
            }
        }
    }

    /// Waits for the operation and returns its outcome. Backends bound every
    /// wait on a peer by the group's timeout; this wait adds its own bound
    /// (twice the group timeout) so that a plugin backend that never returns
    /// cannot hang the caller.
    ///
    /// # Errors
    /// The operation's error, or [`Error::Runtime`] if it panicked or
    /// outlived the bound.
    pub async fn wait(self) -> Result<()> {
        let state = self.state.into_inner().unwrap_or_else(|e| e.into_inner());
        let bound = self.timeout.saturating_mul(2);
        let outlived = || {
            Error::Runtime(format!(
                "{} did not finish within {bound:?} (Timeout)",
                self.op
            ))
        };
        match state {
            State::Ready(result) => result,
            State::Inline(fut) => tokio::time::timeout(bound, fut)
                .await
                .unwrap_or_else(|_| Err(outlived())),
            State::Task(task) => match tokio::time::timeout(bound, task).await {
                Ok(Ok(result)) => result,
                Ok(Err(e)) => Err(Error::Runtime(format!("{} failed: {e}", self.op))),
                Err(_) => Err(outlived()),
            },
        }
    }
}
