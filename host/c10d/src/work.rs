//! [`Work`]: the handle of an issued collective (PyTorch's `Work`, what
//! `async_op=True` returns).
//!
//! A collective is issued synchronously (validation, sequence number, and
//! the backend's code up to its first pending `.await`: libtorch's engines
//! enqueue the operation there, which must happen in program order) and
//! runs on as a tokio task; [`Work::wait`] joins it. Dropping a `Work` does not
//! cancel the collective: the peers still expect this rank's part.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::error::{Error, Result};

/// The handle of an issued collective or point-to-point operation.
#[derive(Debug)]
pub struct Work {
    op: &'static str,
    task: Option<JoinHandle<Result<()>>>,
    timeout: Duration,
}

impl Work {
    pub(crate) fn spawn(
        op: &'static str,
        timeout: Duration,
        fut: impl std::future::Future<Output = Result<()>> + Send + 'static,
    ) -> Work {
        // Poll once here, so that whatever the backend does before its first
        // pending await (issuing the operation) happens now, in the caller's
        // order. A waker that does nothing is enough: tokio polls the task
        // again when it is spawned.
        let mut fut = Box::pin(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let task = match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(result) => tokio::spawn(async move { result }),
            std::task::Poll::Pending => tokio::spawn(fut),
        };
        Work {
            op,
            task: Some(task),
            timeout,
        }
    }

    /// A work that did nothing (a collective on a rank outside its group).
    pub(crate) fn completed(op: &'static str) -> Work {
        Work {
            op,
            task: None,
            timeout: Duration::ZERO,
        }
    }

    /// The operation this work runs.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the operation and returns its outcome. Backends bound every
    /// wait on a peer by the group's timeout; this wait adds its own bound
    /// (twice the group timeout) so that a plugin backend that never returns
    /// cannot hang the caller.
    ///
    /// # Errors
    /// The operation's error, or [`Error::Runtime`] if it panicked or
    /// outlived the bound.
    pub async fn wait(mut self) -> Result<()> {
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        let bound = self.timeout.saturating_mul(2);
        match tokio::time::timeout(bound, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(Error::Runtime(format!("{} failed: {e}", self.op))),
            Err(_) => Err(Error::Runtime(format!(
                "{} did not finish within {bound:?} (Timeout)",
                self.op
            ))),
        }
    }
}
