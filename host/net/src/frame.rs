//! Reading frames once a connection is open, as both protocols lay them
//! out: a fixed-size prefix of the protocol's own (the agent's 4-byte head
//! length, the mesh's 26-byte tag and payload length), then a body whose
//! length the prefix gave.
//!
//! Each protocol keeps what its prefix means, its heartbeat (a prefix that
//! announces nothing) and what it does with a body (the agent decodes a
//! header and reads tensor storages into tensor memory; the mesh hands
//! payloads to its mailbox). The reads, the end-of-stream rules and the
//! memory a declared length may reserve are here, so both sides hold to
//! the same rules.
//!
//! Invariants:
//! - FRAME-1: a stream that ends between frames is a clean end
//!   ([`read_prefix`] returns `None`); one that ends inside a prefix or a
//!   body is an error that says how far the frame got.
//! - FRAME-2: a declared length reserves at most [`RESERVE_AHEAD`] bytes
//!   before they arrive: a peer that announces more than it sends costs
//!   what it sent, not what it announced.
//! - FRAME-3: a body longer than the caller's limit is refused before any
//!   byte of it is read.

use tokio::io::{AsyncRead, AsyncReadExt};

/// The most a body's buffer reserves before its bytes arrive (FRAME-2).
pub const RESERVE_AHEAD: usize = 64 << 20;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The stream ended inside a frame (FRAME-1).
    #[error("the stream ended inside a frame, after {got} of its {len} bytes")]
    Truncated {
        /// Bytes of the prefix or body that arrived.
        got: u64,
        /// Bytes the prefix or body has.
        len: u64,
    },
    /// The body is longer than the caller's limit (FRAME-3).
    #[error("a frame body of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// The declared length.
        len: u64,
        /// The caller's limit.
        max: u64,
    },
}

/// Reads a frame's `N`-byte prefix: `None` when the stream ends before
/// its first byte (a clean end between frames, FRAME-1).
///
/// # Errors
/// I/O, or [`FrameError::Truncated`] when the stream ends inside it.
pub async fn read_prefix<R: AsyncRead + Unpin, const N: usize>(
    r: &mut R,
) -> Result<Option<[u8; N]>, FrameError> {
    let mut prefix = [0u8; N];
    let mut got = 0;
    while got < N {
        let n = r.read(&mut prefix[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(FrameError::Truncated {
                got: got as u64,
                len: N as u64,
            });
        }
        got += n;
    }
    Ok(Some(prefix))
}

/// Reads a body of `len` bytes, refusing one over `max` before reading it
/// (FRAME-3) and reserving at most [`RESERVE_AHEAD`] up front (FRAME-2).
///
/// # Errors
/// I/O, [`FrameError::TooLarge`], or [`FrameError::Truncated`] when the
/// stream ends first.
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    len: u64,
    max: u64,
) -> Result<Vec<u8>, FrameError> {
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let reserve = usize::try_from(len).map_or(RESERVE_AHEAD, |l| l.min(RESERVE_AHEAD));
    let mut body = Vec::with_capacity(reserve);
    // Reads into the reserved capacity and stops at `len`: `read_to_end`
    // would grow a full buffer once more (a reallocation and a copy of the
    // body) only to find the end, on every frame.
    let mut rest = (&mut *r).take(len);
    while (body.len() as u64) < len {
        if rest.read_buf(&mut body).await? == 0 {
            return Err(FrameError::Truncated {
                got: body.len() as u64,
                len,
            });
        }
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stream_that_ends_between_frames_is_a_clean_end_and_inside_one_an_error() {
        let mut empty: &[u8] = &[];
        assert!(matches!(read_prefix::<_, 4>(&mut empty).await, Ok(None)));
        let mut short: &[u8] = &[1, 2];
        assert!(matches!(
            read_prefix::<_, 4>(&mut short).await,
            Err(FrameError::Truncated { got: 2, len: 4 })
        ));
        let mut whole: &[u8] = &[1, 2, 3, 4, 5];
        assert_eq!(
            read_prefix::<_, 4>(&mut whole).await.unwrap(),
            Some([1, 2, 3, 4])
        );
        assert_eq!(whole, &[5]);
    }

    #[tokio::test]
    async fn a_body_is_read_whole_or_refused() {
        let mut data: &[u8] = b"hello world";
        assert_eq!(read_body(&mut data, 5, 100).await.unwrap(), b"hello");
        assert_eq!(data, b" world");
        let e = read_body(&mut data, 7, 100).await.unwrap_err();
        assert!(matches!(e, FrameError::Truncated { got: 6, len: 7 }), "{e}");
        let mut untouched: &[u8] = b"abc";
        let e = read_body(&mut untouched, 3, 2).await.unwrap_err();
        assert!(matches!(e, FrameError::TooLarge { len: 3, max: 2 }), "{e}");
        assert_eq!(untouched, b"abc", "no byte is read from a refused body");
    }

    #[tokio::test]
    async fn a_body_within_the_cap_is_read_into_its_reservation_without_growing_it() {
        // Small bodies too (most heads of replies are under 32 bytes), and
        // bytes arriving in pieces, as a socket gives them.
        for len in [1u8, 20, 31, 32, 200] {
            let (mut tx, mut rx) = tokio::io::duplex(7);
            let sent: Vec<u8> = (0..len).collect();
            let writer = {
                let sent = sent.clone();
                tokio::spawn(async move {
                    tokio::io::AsyncWriteExt::write_all(&mut tx, &sent)
                        .await
                        .unwrap();
                })
            };
            let body = read_body(&mut rx, len.into(), 1000).await.unwrap();
            writer.await.unwrap();
            assert_eq!(body, sent);
            assert_eq!(
                body.capacity(),
                len.into(),
                "a body of {len} bytes: reallocated"
            );
        }
    }

    #[tokio::test]
    async fn an_announced_length_reserves_no_more_than_the_cap_before_bytes_arrive() {
        // 2^62 bytes announced, 3 sent: the read fails after 3 bytes, and
        // the buffer never reserved the announced length (this would abort
        // the process otherwise).
        let mut data: &[u8] = b"abc";
        let e = read_body(&mut data, 1 << 62, u64::MAX).await.unwrap_err();
        assert!(matches!(e, FrameError::Truncated { got: 3, .. }), "{e}");
    }
}
