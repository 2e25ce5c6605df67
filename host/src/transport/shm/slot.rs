//! A connection's slot for its shared-memory link: none, being set up (the
//! acceptor waits for its dialer to join), or up, with the tasks that read
//! the link's records and trim its idle segments.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};

use super::{LINK_TIMEOUT, ShmLink, lock};

/// A connection's link, as far as it is set up: none, being set up (the
/// acceptor waits for its dialer to join), or up.
#[derive(Clone)]
pub(crate) struct ShmSlot(Arc<SlotInner>);

struct SlotInner {
    link: std::sync::OnceLock<Arc<ShmLink>>,
    pending: AtomicBool,
    changed: Notify,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl ShmSlot {
    fn with(pending: bool) -> Self {
        ShmSlot(Arc::new(SlotInner {
            link: std::sync::OnceLock::new(),
            pending: AtomicBool::new(pending),
            changed: Notify::new(),
            tasks: Mutex::default(),
        }))
    }

    /// No link: everything goes over the connection.
    pub(crate) fn none() -> Self {
        Self::with(false)
    }

    /// The link of a dialer that joined (`join`).
    pub(crate) fn joined(fd: OwnedFd) -> Self {
        let slot = Self::with(false);
        slot.attach(fd);
        slot
    }

    /// The link of an acceptor, once its dialer joins (`ShmListener::offer`).
    pub(crate) fn awaiting(joined: oneshot::Receiver<OwnedFd>) -> Self {
        let slot = Self::with(true);
        let inner = Arc::downgrade(&slot.0);
        let wait = tokio::spawn(async move {
            let fd = tokio::time::timeout(LINK_TIMEOUT, joined).await;
            let Some(inner) = inner.upgrade() else { return };
            let slot = ShmSlot(inner);
            match fd {
                Ok(Ok(fd)) => slot.attach(fd),
                _ => slot.settle(),
            }
        });
        lock(&slot.0.tasks).push(wait.abort_handle());
        slot
    }

    fn attach(&self, fd: OwnedFd) {
        match ShmLink::new(fd) {
            Ok(link) => {
                let reader = tokio::spawn(Arc::clone(&link).run());
                let weak = Arc::downgrade(&link);
                let trimmer = tokio::spawn(async move {
                    let mut every = tokio::time::interval(Duration::from_secs(1));
                    loop {
                        every.tick().await;
                        let Some(link) = weak.upgrade() else { return };
                        link.trim();
                    }
                });
                lock(&self.0.tasks).extend([reader.abort_handle(), trimmer.abort_handle()]);
                let _ = self.0.link.set(link);
            }
            Err(e) => tracing::debug!("no shared-memory link: {e}"),
        }
        self.settle();
    }

    fn settle(&self) {
        self.0.pending.store(false, Ordering::Release);
        self.0.changed.notify_waiters();
    }

    /// The link, when it is up and has not failed.
    pub(crate) fn get(&self) -> Option<&Arc<ShmLink>> {
        self.0.link.get().filter(|l| !l.failed())
    }

    /// The link a received frame's segments are in: waits while it is
    /// being set up (the dialer may send before the acceptor's side is up).
    pub(crate) async fn wait(&self) -> Option<&Arc<ShmLink>> {
        loop {
            let changed = self.0.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(link) = self.0.link.get() {
                return Some(link);
            }
            if !self.0.pending.load(Ordering::Acquire) {
                return None;
            }
            if tokio::time::timeout(LINK_TIMEOUT, changed).await.is_err() {
                return None;
            }
        }
    }

    /// Closes the link (the connection closed): its tasks stop, and the
    /// peer's side fails.
    pub(crate) fn close(&self) {
        for task in lock(&self.0.tasks).drain(..) {
            task.abort();
        }
        if let Some(link) = self.0.link.get() {
            link.fail("the connection closed");
        }
        self.settle();
    }
}

impl Drop for SlotInner {
    fn drop(&mut self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}
