//! Length-prefixed messages: a `u16` little-endian length, then that many
//! bytes, under a size limit and a timeout.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Refusal, RefusalKind};

/// The largest handshake message, in bytes (after its length prefix).
pub const MAX_HANDSHAKE: usize = 1024;

/// How long a whole handshake may take, unless its caller says otherwise.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The limits one message is read or written under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest body, in bytes; at most `u16::MAX` (the prefix's range).
    pub max_len: usize,
    /// How long reading or writing one message may take.
    pub timeout: Duration,
}

impl Limits {
    /// The limits of a handshake message: [`MAX_HANDSHAKE`] bytes within
    /// [`HANDSHAKE_TIMEOUT`].
    pub const HANDSHAKE: Limits = Limits {
        max_len: MAX_HANDSHAKE,
        timeout: HANDSHAKE_TIMEOUT,
    };
}

fn timed_out(what: &str, timeout: Duration) -> Refusal {
    Refusal::new(
        RefusalKind::TimedOut,
        format!("no complete {what} within {timeout:?}"),
    )
}

/// Writes `body` with its length prefix.
///
/// # Errors
/// [`RefusalKind::Oversized`] for a body over `limits.max_len` (nothing is
/// written), [`RefusalKind::Io`] when writing fails, and
/// [`RefusalKind::TimedOut`] when the peer does not take it within
/// `limits.timeout`.
pub async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &[u8],
    limits: Limits,
) -> Result<(), Refusal> {
    let framed = frame(body, limits.max_len, "message")?;
    tokio::time::timeout(limits.timeout, write_all(w, &framed, "message"))
        .await
        .unwrap_or_else(|_| Err(timed_out("message write", limits.timeout)))
}

/// Reads one message's body.
///
/// # Errors
/// [`RefusalKind::Oversized`] when the prefix announces more than
/// `limits.max_len` bytes (refused before reading them),
/// [`RefusalKind::Io`] when reading fails or the peer closes before the
/// whole message, and [`RefusalKind::TimedOut`] when it does not arrive
/// within `limits.timeout`.
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: Limits,
) -> Result<Vec<u8>, Refusal> {
    tokio::time::timeout(limits.timeout, read_body(r, limits.max_len, "message"))
        .await
        .unwrap_or_else(|_| Err(timed_out("message", limits.timeout)))
}

/// `body` behind its `u16` length prefix, if it is at most `max` bytes.
pub(crate) fn frame(body: &[u8], max: usize, what: &str) -> Result<Vec<u8>, Refusal> {
    let len = u16::try_from(body.len())
        .ok()
        .filter(|_| body.len() <= max)
        .ok_or_else(|| {
            Refusal::new(
                RefusalKind::Oversized,
                format!(
                    "a {what} of {} bytes is over the limit of {max} bytes",
                    body.len()
                ),
            )
        })?;
    let mut out = Vec::with_capacity(2 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

pub(crate) fn io(what: &str, e: &std::io::Error) -> Refusal {
    let message = if e.kind() == std::io::ErrorKind::UnexpectedEof {
        format!("the peer closed the connection before its whole {what}")
    } else {
        format!("{what}: {e}")
    };
    Refusal::new(RefusalKind::Io, message)
}

pub(crate) async fn write_all<W: AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
    what: &str,
) -> Result<(), Refusal> {
    let write = |e: std::io::Error| {
        Refusal::new(RefusalKind::Io, format!("writing the {what} failed: {e}"))
    };
    w.write_all(bytes).await.map_err(write)?;
    w.flush().await.map_err(write)
}

pub(crate) async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    what: &str,
) -> Result<Vec<u8>, Refusal> {
    let mut len = [0u8; 2];
    r.read_exact(&mut len).await.map_err(|e| io(what, &e))?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > max {
        return Err(Refusal::new(
            RefusalKind::Oversized,
            format!("a {what} of {len} bytes is over the limit of {max} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| io(what, &e))?;
    Ok(body)
}
