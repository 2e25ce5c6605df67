//! A connection's write half, whichever stream it is on, and the
//! non-waiting writes that let a sender write its own frame (TR-5).

use wasmrpc_credentials::TlsWriteHalf;

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
