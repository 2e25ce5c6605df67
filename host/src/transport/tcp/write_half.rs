//! A connection's write half, whichever stream it is on, and the
//! non-waiting writes that let a sender write its own frame (TR-5): the
//! connection's send path, from its backlog to the socket or the writer
//! task.

use std::sync::Arc;

use wasmrpc_credentials::TlsWriteHalf;

use super::{Connection, WriterCmd, lock};
use crate::error::{Error, Result};
use crate::transport::frame::{BatchPosition, OutFrame, try_write_frames};

/// A connection's write half: a TCP socket's or a TLS stream's. Either is
/// written by a sender directly while the writer task has nothing queued
/// (TR-5), else by the writer task.
pub(super) enum WriteHalf {
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    Tls(Box<TlsWriteHalf>),
}

impl WriteHalf {
    /// Writes what the connection takes now, without waiting: `WouldBlock`
    /// when it takes nothing. TLS seals records into its write buffer (up
    /// to its size, writing a full buffer first), which reach the socket
    /// with [`try_flush`].
    ///
    /// [`try_flush`]: Self::try_flush
    pub(super) fn try_write_vectored(
        &mut self,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write_vectored(bufs),
            WriteHalf::Tls(w) => {
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                match tokio::io::AsyncWrite::poll_write_vectored(
                    std::pin::Pin::new(w),
                    &mut cx,
                    bufs,
                ) {
                    std::task::Poll::Ready(result) => result,
                    std::task::Poll::Pending => Err(std::io::ErrorKind::WouldBlock.into()),
                }
            }
        }
    }

    /// Whether everything written has reached the socket, pushing what it
    /// takes now (sealed TLS records still buffered) without waiting.
    pub(super) fn try_flush(&mut self) -> std::io::Result<bool> {
        match self {
            WriteHalf::Tcp(_) => Ok(true),
            WriteHalf::Tls(w) => {
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                match tokio::io::AsyncWrite::poll_flush(std::pin::Pin::new(w), &mut cx) {
                    std::task::Poll::Ready(result) => result.map(|()| true),
                    std::task::Poll::Pending => Ok(false),
                }
            }
        }
    }
}

impl tokio::io::AsyncWrite for WriteHalf {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => std::pin::Pin::new(w).poll_write(cx, buf),
            WriteHalf::Tls(w) => std::pin::Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => std::pin::Pin::new(w).poll_write_vectored(cx, bufs),
            WriteHalf::Tls(w) => std::pin::Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WriteHalf::Tcp(w) => w.is_write_vectored(),
            WriteHalf::Tls(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => std::pin::Pin::new(w).poll_flush(cx),
            WriteHalf::Tls(w) => std::pin::Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(w) => std::pin::Pin::new(w).poll_shutdown(cx),
            WriteHalf::Tls(w) => std::pin::Pin::new(w).poll_shutdown(cx),
        }
    }
}

impl Connection {
    /// Sends `frame` after every frame sent before it (TR-3): left for a
    /// flush task while other work is in progress (TR-10); else written at
    /// once, with whatever else is in the backlog, when nothing is queued
    /// for the writer task and the socket takes it, or queued for the
    /// writer task (TR-5). A sender that finds another writing leaves its
    /// frame to that one and returns at once.
    pub(super) fn enqueue(self: &Arc<Self>, mut frame: OutFrame) -> Result<()> {
        let closed = || Error::runtime(format!("connection to {} is closed", self.peer));
        if self.is_closed() {
            return Err(closed());
        }
        // LIVE-3: the watchdog sends no heartbeat after this frame.
        self.activity.sent();
        let fills = frame.place(self.shm.get())?;
        // What goes over the socket, shared storages left out (TRAFFIC).
        self.activity.sent_bytes(frame.len());
        // Shared storages are filled right after queueing (SHM-5): their
        // frames never wait.
        if fills.is_empty() && self.coalesces() {
            self.defer(frame);
            return Ok(());
        }
        lock(&self.backlog).push(frame);
        let sent = self.drain_backlog();
        // The peer copies each storage out behind these copies (SHM-5).
        fills
            .into_iter()
            .for_each(crate::transport::frame::SharedFill::run);
        sent.map_err(|_| closed())
    }

    /// Writes the backlog, unless another thread holds `direct`: that one
    /// writes it. Whoever lets go of `direct` looks at the backlog again,
    /// so no frame is left behind by a sender that found `direct` held.
    pub(super) fn drain_backlog(&self) -> std::result::Result<(), ()> {
        loop {
            let mut direct = match self.direct.try_lock() {
                Ok(guard) => guard,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
            };
            let frames = std::mem::take(&mut *lock(&self.backlog));
            if frames.is_empty() {
                return Ok(());
            }
            self.write_or_queue(&mut direct, frames)?;
            drop(direct);
            if lock(&self.backlog).is_empty() {
                return Ok(());
            }
        }
    }

    /// Writes `frames` (not empty) in one go on the half in `direct`, as
    /// far as the socket takes them now; the half and the rest go to the
    /// writer task, as do all frames while the writer holds the half.
    pub(super) fn write_or_queue(
        &self,
        direct: &mut Option<WriteHalf>,
        frames: Vec<OutFrame>,
    ) -> std::result::Result<(), ()> {
        let send = |cmd| self.tx.send(cmd).map_err(|_| ());
        let Some(mut half) = direct.take() else {
            return frames
                .into_iter()
                .try_for_each(|frame| send(WriterCmd::Frame(frame)));
        };
        // A failed write or flush is left to the writer, which closes the
        // connection with the error.
        let at = try_write_frames(&frames, BatchPosition::default(), |bufs| {
            half.try_write_vectored(bufs)
        })
        .unwrap_or_default();
        let all = at.frame == frames.len();
        if all && half.try_flush().unwrap_or(false) {
            *direct = Some(half);
            return Ok(());
        }
        // Written but not flushed (TLS records): the last frame, at its end.
        let (first, offset) = match all {
            true => (frames.len() - 1, frames[frames.len() - 1].len() as usize),
            false => (at.frame, at.offset),
        };
        let mut rest = frames.into_iter().skip(first);
        let resume = rest.next().expect("the frame where writing stopped");
        send(WriterCmd::Resume(half, resume, offset))?;
        rest.try_for_each(|frame| send(WriterCmd::Frame(frame)))
    }
}
