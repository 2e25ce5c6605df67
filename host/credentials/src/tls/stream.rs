//! [`TlsStream`]: an established TLS 1.3 connection over TCP, split into
//! halves that need no lock between them.
//!
//! rustls drives the handshake (`handshake`) and then hands over the
//! traffic keys (its `kernel` API, made for kernel TLS); this module runs
//! the record layer (`record`) the way kernel TLS would: each half owns
//! its direction's key and sequence number, and reads or writes the socket
//! in large batches. A tensor's bytes are encrypted straight from its
//! storage into the write buffer, and decrypted straight from the read
//! buffer into the caller's: past the kernel's copies, the cipher is the
//! only pass over them, where a buffered TLS stream copies them several
//! times. Only reads too small for a whole record open it in place in the
//! read buffer and copy its content out.
//!
//! Invariants (with REC-TLS-1 and REC-TLS-2 of `record`):
//! - STREAM-1: a key update, either side's, goes through rustls's key
//!   schedule (`KernelConnection`), shared by the halves under a mutex
//!   that is taken only for an update. The writer updates its key before
//!   it reaches the record limit, and answers a peer that asks for an
//!   update before its next record (RFC 8446 §4.6.3).
//! - STREAM-2: after an error, a half keeps failing with it: no byte
//!   after a bad record is handed out.
//! - STREAM-3: the end of the stream is the peer's `close_notify`; a TCP
//!   close without one is an error (a truncation), as rustls reports it.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use rustls::ConnectionTrafficSecrets;
use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::pki_types::CertificateDer;
use rustls::server::ServerConnectionData;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::OwnedWriteHalf;

use super::SocketReader;

use super::record::{self, Direction, HEADER, KEY_UPDATE_MESSAGE, MAX_BODY, MAX_FRAGMENT, TAG};
use super::record::{PostHandshake, record_len};

/// Ciphertext read from the socket at once (at most).
const READ_BUFFER: usize = 256 << 10;
/// Sealed records held before a write waits for the socket.
const WRITE_BUFFER: usize = 256 << 10;

/// rustls's key schedule after the handshake, on either side.
pub(crate) enum Kernel {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Kernel {
    fn update(&mut self, transmit: bool) -> Result<(u64, ConnectionTrafficSecrets), String> {
        let updated = match (self, transmit) {
            (Kernel::Client(k), true) => k.update_tx_secret(),
            (Kernel::Client(k), false) => k.update_rx_secret(),
            (Kernel::Server(k), true) => k.update_tx_secret(),
            (Kernel::Server(k), false) => k.update_rx_secret(),
        };
        updated.map_err(|e| format!("TLS key update failed: {e}"))
    }
}

/// What the halves share: the key schedule, and the peer's request for a
/// key update (STREAM-1).
pub(crate) struct KeySchedule {
    kernel: Mutex<Kernel>,
    update_requested: AtomicBool,
    /// Records per key before the writer updates it.
    records_per_key: u64,
}

impl KeySchedule {
    pub(crate) fn new(kernel: Kernel, records_per_key: u64) -> Arc<Self> {
        Arc::new(KeySchedule {
            kernel: Mutex::new(kernel),
            update_requested: AtomicBool::new(false),
            records_per_key,
        })
    }

    fn next(&self, transmit: bool) -> Result<Direction, String> {
        let mut kernel = self.kernel.lock().unwrap_or_else(|p| p.into_inner());
        Direction::new(kernel.update(transmit)?, self.limit(transmit))
    }

    /// The writer's record limit per key; the reader's is the sequence
    /// number space (the peer updates its own key).
    pub(crate) fn limit(&self, transmit: bool) -> u64 {
        if transmit {
            self.records_per_key
        } else {
            u64::MAX
        }
    }
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// An established TLS connection: both halves, and the certificates the
/// peer presented.
pub struct TlsStream {
    read: TlsReadHalf,
    write: TlsWriteHalf,
    peer_certificates: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream").finish_non_exhaustive()
    }
}

impl TlsStream {
    /// The stream that continues a handshake: `secrets` and `keys` from
    /// rustls, `ciphertext` read past the handshake, `plaintext` rustls
    /// already opened from it.
    pub(crate) fn new(
        (read, write): (SocketReader, OwnedWriteHalf),
        rx: Direction,
        tx: Direction,
        keys: Arc<KeySchedule>,
        (ciphertext, plaintext): (&[u8], Vec<u8>),
        peer_certificates: Vec<CertificateDer<'static>>,
    ) -> Self {
        let mut buf = vec![0; READ_BUFFER + HEADER + MAX_BODY].into_boxed_slice();
        buf[..ciphertext.len()].copy_from_slice(ciphertext);
        TlsStream {
            read: TlsReadHalf {
                tcp: read,
                rx,
                keys: keys.clone(),
                buf,
                start: 0,
                end: ciphertext.len(),
                plain: 0..0,
                early: plaintext,
                early_at: 0,
                state: ReadState::Open,
            },
            write: TlsWriteHalf {
                tcp: write,
                tx,
                keys,
                out: Vec::new(),
                filled: 0,
                sent: 0,
                closed: false,
            },
            peer_certificates,
        }
    }

    /// The certificate chain the peer presented, its own first.
    pub fn peer_certificates(&self) -> &[CertificateDer<'static>] {
        &self.peer_certificates
    }

    /// The two halves, which read and write concurrently without a lock.
    pub fn into_split(self) -> (TlsReadHalf, TlsWriteHalf) {
        (self.read, self.write)
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().read).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_shutdown(cx)
    }
}

enum ReadState {
    Open,
    /// The peer sent `close_notify`: end of stream.
    Closed,
    /// STREAM-2.
    Failed(io::ErrorKind, String),
}

/// The reading half of a [`TlsStream`].
pub struct TlsReadHalf {
    tcp: SocketReader,
    rx: Direction,
    keys: Arc<KeySchedule>,
    /// Ciphertext from the socket. Records open from here into the
    /// caller's buffer, or in place when it is too small.
    buf: Box<[u8]>,
    /// `buf[start..end]`: bytes not yet opened.
    start: usize,
    end: usize,
    /// Opened content not yet handed out, inside `buf`.
    plain: Range<usize>,
    /// Content rustls opened during the handshake, handed out first.
    early: Vec<u8>,
    early_at: usize,
    state: ReadState,
}

impl TlsReadHalf {
    fn fail(&mut self, kind: io::ErrorKind, message: String) -> io::Error {
        self.state = ReadState::Failed(kind, message.clone());
        io::Error::new(kind, message)
    }

    /// Opens the next whole record in the read buffer, if there is one
    /// (`Ok(false)` when more bytes are needed): into `out` when it has
    /// room for the record's ciphertext, else in place, its content left
    /// in `plain`.
    fn open_next(&mut self, out: &mut ReadBuf<'_>) -> Result<bool, String> {
        let Some(len) = record::record_length(&self.buf[self.start..self.end])? else {
            return Ok(false);
        };
        let at = self.start;
        self.start += len;
        let record = &mut self.buf[at..at + len];
        let ciphertext = len - HEADER - TAG;
        let (content_type, control) = if out.remaining() >= ciphertext {
            let dest = out.initialize_unfilled_to(ciphertext);
            let (content_type, n) = self.rx.open_into(record, dest)?;
            if content_type == record::APPLICATION_DATA {
                out.advance(n);
                return Ok(true);
            }
            (content_type, dest[..n].to_vec())
        } else {
            let (content_type, n) = self.rx.open_in_place(record)?;
            let content = at + HEADER..at + HEADER + n;
            if content_type == record::APPLICATION_DATA {
                self.plain = content;
                return Ok(true);
            }
            (content_type, self.buf[content].to_vec())
        };
        self.control(content_type, &control)?;
        Ok(true)
    }

    /// Acts on a record that is not application data: an alert ends the
    /// stream (`close_notify`) or fails it; a key update changes the
    /// receiving key, and asks the writer for an update if the peer asked
    /// for one (STREAM-1).
    fn control(&mut self, content_type: u8, content: &[u8]) -> Result<(), String> {
        match content_type {
            record::ALERT => {
                record::alert(content)?;
                self.state = ReadState::Closed;
            }
            record::HANDSHAKE => {
                for message in record::post_handshake(content)? {
                    if let PostHandshake::KeyUpdate { requested } = message {
                        self.rx = self.keys.next(false)?;
                        if requested {
                            self.keys.update_requested.store(true, Ordering::Release);
                        }
                    }
                }
            }
            other => return Err(format!("received a TLS record of content type {other}")),
        }
        Ok(())
    }

    /// The error of a TCP close without `close_notify` (STREAM-3).
    fn eof(&mut self) -> io::Error {
        let message = if self.start == self.end {
            "peer closed connection without sending TLS close_notify"
        } else {
            "peer closed connection in the middle of a TLS record"
        };
        self.fail(io::ErrorKind::UnexpectedEof, message.into())
    }
}

impl AsyncRead for TlsReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if out.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.early_at < this.early.len() {
            let n = out.remaining().min(this.early.len() - this.early_at);
            out.put_slice(&this.early[this.early_at..this.early_at + n]);
            this.early_at += n;
            if this.early_at == this.early.len() {
                this.early = Vec::new();
                this.early_at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        // Content already in `out`: what comes after (an error, the end of
        // the stream, an empty socket) waits for the next read.
        let before = out.filled().len();
        let given = |out: &ReadBuf<'_>| out.filled().len() > before;
        loop {
            if !this.plain.is_empty() {
                let n = out.remaining().min(this.plain.len());
                out.put_slice(&this.buf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                return Poll::Ready(Ok(()));
            }
            match &this.state {
                ReadState::Open => {}
                ReadState::Closed => return Poll::Ready(Ok(())),
                ReadState::Failed(_, _) if given(out) => return Poll::Ready(Ok(())),
                ReadState::Failed(kind, message) => {
                    return Poll::Ready(Err(io::Error::new(*kind, message.clone())));
                }
            }
            match this.open_next(out) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    let e = this.fail(io::ErrorKind::InvalidData, e);
                    return Poll::Ready(if given(out) { Ok(()) } else { Err(e) });
                }
            }
            // Content given and no whole record left: the socket waits for
            // the next read. Looking now would find it empty, and a socket
            // reader that busy-polls would count its wait from here, while
            // the caller is still busy with what it got.
            if given(out) {
                return Poll::Ready(Ok(()));
            }
            if this.start == this.end {
                (this.start, this.end) = (0, 0);
            }
            // Room for a whole record after the bytes kept.
            if this.buf.len() - this.end < HEADER + MAX_BODY {
                this.buf.copy_within(this.start..this.end, 0);
                this.end -= this.start;
                this.start = 0;
            }
            let mut free = ReadBuf::new(&mut this.buf[this.end..]);
            match Pin::new(&mut this.tcp).poll_read(cx, &mut free) {
                Poll::Ready(Ok(())) if free.filled().is_empty() => {
                    if given(out) {
                        return Poll::Ready(Ok(()));
                    }
                    return Poll::Ready(Err(this.eof()));
                }
                Poll::Ready(Ok(())) => this.end += free.filled().len(),
                Poll::Ready(Err(e)) if given(out) => {
                    this.fail(e.kind(), e.to_string());
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if given(out) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The writing half of a [`TlsStream`].
pub struct TlsWriteHalf {
    tcp: OwnedWriteHalf,
    tx: Direction,
    keys: Arc<KeySchedule>,
    /// Sealed records in `out[..filled]`, of which `out[..sent]` already
    /// went to the socket. `out` keeps its largest length, so sealing
    /// writes over old bytes rather than zeroing new ones.
    out: Vec<u8>,
    filled: usize,
    sent: usize,
    /// `close_notify` is sealed.
    closed: bool,
}

impl TlsWriteHalf {
    /// Writes sealed records until all went out or the socket is full.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.filled {
            let pending = &self.out[self.sent..self.filled];
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, pending))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        (self.filled, self.sent) = (0, 0);
        Poll::Ready(Ok(()))
    }

    /// Seals one record of `content_type`, updating the key first when it
    /// is due (STREAM-1).
    fn seal(&mut self, content_type: u8, parts: &[&[u8]]) -> io::Result<()> {
        let len = parts.iter().map(|p| p.len()).sum();
        let room = self.filled + record_len(KEY_UPDATE_MESSAGE.len()) + record_len(len);
        if self.out.len() < room {
            self.out.resize(room, 0);
        }
        let asked = self.keys.update_requested.swap(false, Ordering::AcqRel);
        if asked || self.tx.update_due() {
            // The update message is the last record under the old key.
            let out = &mut self.out[self.filled..];
            self.filled += self
                .tx
                .seal(out, record::HANDSHAKE, &[&KEY_UPDATE_MESSAGE])
                .map_err(invalid)?;
            self.tx = self.keys.next(true).map_err(invalid)?;
        }
        let out = &mut self.out[self.filled..];
        self.filled += self.tx.seal(out, content_type, parts).map_err(invalid)?;
        Ok(())
    }
}

impl AsyncWrite for TlsWriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if this.filled - this.sent >= WRITE_BUFFER {
            ready!(this.poll_send(cx))?;
        } else if this.sent > 0 && this.sent * 2 >= this.filled {
            this.out.copy_within(this.sent..this.filled, 0);
            this.filled -= this.sent;
            this.sent = 0;
        }
        // Small slices share a record; a large one fills records whole.
        let room = WRITE_BUFFER - (this.filled - this.sent);
        let (mut taken, mut parts, mut in_record) = (0, Vec::with_capacity(bufs.len()), 0);
        for buf in bufs.iter().map(|b| &b[..]) {
            let mut buf = &buf[..buf.len().min(room - taken)];
            while !buf.is_empty() {
                let (part, rest) = buf.split_at(buf.len().min(MAX_FRAGMENT - in_record));
                parts.push(part);
                in_record += part.len();
                taken += part.len();
                buf = rest;
                if in_record == MAX_FRAGMENT {
                    this.seal(record::APPLICATION_DATA, &parts)?;
                    parts.clear();
                    in_record = 0;
                }
            }
            if taken == room {
                break;
            }
        }
        if in_record > 0 {
            this.seal(record::APPLICATION_DATA, &parts)?;
        }
        // Sent at once, as much as the socket takes, as a TCP write would
        // be: callers that write a request and then wait for the answer
        // need not flush. What the socket does not take waits for the next
        // write or a flush.
        if let Poll::Ready(Err(e)) = this.poll_send(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.closed {
            this.seal(record::ALERT, &[&record::CLOSE_NOTIFY])?;
            this.closed = true;
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
