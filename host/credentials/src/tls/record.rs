//! The TLS 1.3 record layer (RFC 8446 §5) of an established connection, on
//! the traffic keys rustls's handshake derived: sealing plaintext into
//! records, and opening records in place or into the reader's buffer.
//!
//! This module owns the record format, the per-record nonce and the
//! sequence numbers, and nothing else: which bytes go where, and when keys
//! change, is `stream`'s; the handshake and every key derivation are
//! rustls's (`handshake`, and `rustls::kernel` for key updates).
//!
//! Invariants:
//! - REC-TLS-1: a nonce is never used twice under one key: each direction
//!   counts its records, the count is part of every nonce (§5.3), and a
//!   direction refuses to seal once its count reaches the suite's
//!   confidentiality limit (the stream updates the key before that).
//! - REC-TLS-2: nothing is handed out of a record before its tag verified;
//!   a record that does not verify, or does not parse, fails the
//!   connection, and no byte a peer sends can make this module panic or
//!   allocate (records are opened inside buffers the caller gives).

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;

/// The bytes before a record's body: type, legacy version, length.
pub(crate) const HEADER: usize = 5;
/// The AEAD tag after a record's body.
pub(crate) const TAG: usize = 16;
/// The largest plaintext one record carries (§5.1).
pub(crate) const MAX_FRAGMENT: usize = 1 << 14;
/// The largest record body a peer may send (§5.2).
pub(crate) const MAX_BODY: usize = MAX_FRAGMENT + 256;

/// Record content types (§5.1).
pub(crate) const ALERT: u8 = 21;
pub(crate) const HANDSHAKE: u8 = 22;
pub(crate) const APPLICATION_DATA: u8 = 23;

/// Post-handshake message types (§4).
pub(crate) const NEW_SESSION_TICKET: u8 = 4;
pub(crate) const KEY_UPDATE: u8 = 24;

/// Records sealed under one key before the stream must update it: the
/// AES-GCM limit rustls uses (2^24), which ChaCha20-Poly1305 does not need
/// but shares, so every suite updates its keys alike.
pub(crate) const RECORDS_PER_KEY: u64 = 1 << 24;

/// Why a record could not be opened or sealed. Shown to the operator as
/// the connection's error; never holds key material.
pub(crate) type RecordError = String;

/// One direction's key, IV and record count.
pub(crate) struct Direction {
    key: LessSafeKey,
    iv: [u8; aead::NONCE_LEN],
    seq: u64,
    limit: u64,
}

impl Direction {
    /// The direction that continues at record `seq` under `secrets`.
    pub(crate) fn new(
        (seq, secrets): (u64, ConnectionTrafficSecrets),
        limit: u64,
    ) -> Result<Self, RecordError> {
        let (algorithm, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            _ => return Err("the negotiated TLS cipher suite is not supported".into()),
        };
        let key = UnboundKey::new(algorithm, key.as_ref())
            .map_err(|_| RecordError::from("TLS traffic key of the wrong length"))?;
        let iv = iv
            .as_ref()
            .try_into()
            .map_err(|_| RecordError::from("TLS traffic IV of the wrong length"))?;
        Ok(Direction {
            key: LessSafeKey::new(key),
            iv,
            seq,
            limit,
        })
    }

    /// Whether the key must be updated now: one record is left, for the
    /// key update message itself.
    pub(crate) fn update_due(&self) -> bool {
        self.seq.saturating_add(1) >= self.limit
    }

    /// The nonce of the next record, which takes its number (REC-TLS-1).
    fn next_nonce(&mut self) -> Result<Nonce, RecordError> {
        if self.seq == u64::MAX {
            return Err("TLS record sequence number exhausted".into());
        }
        let mut nonce = self.iv;
        for (byte, seq) in nonce[aead::NONCE_LEN - 8..]
            .iter_mut()
            .zip(self.seq.to_be_bytes())
        {
            *byte ^= seq;
        }
        self.seq += 1;
        Ok(Nonce::assume_unique_for_key(nonce))
    }

    /// Seals one record of `content_type` carrying `parts` (at most
    /// [`MAX_FRAGMENT`] bytes in all) into the front of `out`, which must
    /// hold [`record_len`] of them; returns the record's length. A single
    /// part, a slice of a tensor, is encrypted straight from where it
    /// lies into `out`; several small parts are gathered first.
    pub(crate) fn seal(
        &mut self,
        out: &mut [u8],
        content_type: u8,
        parts: &[&[u8]],
    ) -> Result<usize, RecordError> {
        if self.seq >= self.limit {
            return Err("TLS key used for as many records as it may be".into());
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        debug_assert!(len <= MAX_FRAGMENT);
        let body =
            u16::try_from(len + 1 + TAG).map_err(|_| RecordError::from("record too large"))?;
        let record = out
            .get_mut(..record_len(len))
            .ok_or_else(|| RecordError::from("TLS record buffer too small"))?;
        let [hi, lo] = body.to_be_bytes();
        let header = [APPLICATION_DATA, 3, 3, hi, lo];
        record[..HEADER].copy_from_slice(&header);
        let (content, type_and_tag) = record[HEADER..].split_at_mut(len);
        let nonce = self.next_nonce()?;
        let sealed = if let [part] = parts {
            self.key.seal_out_of_place_scatter(
                nonce,
                Aad::from(header),
                part,
                content,
                &[content_type],
                type_and_tag,
            )
        } else {
            let mut at = 0;
            for part in parts {
                content[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            self.key.seal_in_place_scatter(
                nonce,
                Aad::from(header),
                content,
                &[content_type],
                type_and_tag,
            )
        };
        sealed.map_err(|_| RecordError::from("TLS record encryption failed"))?;
        Ok(record.len())
    }

    /// Opens `record`, one whole record as [`record_length`] measured it,
    /// in place: its content is left at `record[HEADER..][..n]`. Returns
    /// the content type and `n`.
    pub(crate) fn open_in_place(&mut self, record: &mut [u8]) -> Result<(u8, usize), RecordError> {
        let header = header_of(record)?;
        let nonce = self.next_nonce()?;
        let inner = self
            .key
            .open_in_place(nonce, Aad::from(header), &mut record[HEADER..])
            .map_err(|_| undecryptable())?;
        inner_content(inner)
    }

    /// Opens `record`, one whole record as [`record_length`] measured it,
    /// into `out`, which must hold its ciphertext (`record.len() - HEADER -
    /// TAG` bytes: content, type and padding); the content is left at
    /// `out[..n]`. Returns the content type and `n`. A record that does
    /// not verify may have written anything to `out`.
    pub(crate) fn open_into(
        &mut self,
        record: &[u8],
        out: &mut [u8],
    ) -> Result<(u8, usize), RecordError> {
        let header = header_of(record)?;
        let (ciphertext, tag) = record[HEADER..].split_at(record.len() - HEADER - TAG);
        let out = out
            .get_mut(..ciphertext.len())
            .ok_or_else(|| RecordError::from("TLS plaintext buffer too small"))?;
        let nonce = self.next_nonce()?;
        self.key
            .open_separate_gather(nonce, Aad::from(header), ciphertext, tag, out)
            .map_err(|_| undecryptable())?;
        inner_content(out)
    }
}

/// The length of the record that carries `len` bytes of content.
pub(crate) const fn record_len(len: usize) -> usize {
    HEADER + len + 1 + TAG
}

/// The length of the record at the front of `buf` once `buf` holds all of
/// it; `Ok(None)` while it does not. A header no peer of ours sends is an
/// error.
pub(crate) fn record_length(buf: &[u8]) -> Result<Option<usize>, RecordError> {
    let Some(header) = buf.first_chunk::<HEADER>() else {
        return Ok(None);
    };
    if header[0] != APPLICATION_DATA {
        return Err(format!(
            "received a TLS record of type {} after the handshake",
            header[0]
        ));
    }
    let body = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if !(TAG + 1..=MAX_BODY).contains(&body) {
        return Err(format!("received a TLS record of invalid length {body}"));
    }
    Ok((buf.len() >= HEADER + body).then_some(HEADER + body))
}

/// The header of a whole record, which is its additional data.
fn header_of(record: &[u8]) -> Result<[u8; HEADER], RecordError> {
    match record_length(record)? {
        Some(len) if len == record.len() => Ok(*record.first_chunk().expect("a whole record")),
        _ => Err("not one whole TLS record".into()),
    }
}

fn undecryptable() -> RecordError {
    "received a TLS record that does not decrypt".into()
}

/// The content type and content length of an opened record's inner
/// plaintext: the type is its last non-zero byte; zeros after it pad.
fn inner_content(inner: &[u8]) -> Result<(u8, usize), RecordError> {
    let Some(type_at) = inner.iter().rposition(|&b| b != 0) else {
        return Err("received a TLS record without content type".into());
    };
    if type_at > MAX_FRAGMENT {
        return Err("received a TLS record with too much content".into());
    }
    Ok((inner[type_at], type_at))
}

/// What a peer's alert means: `Ok(())` for `close_notify` (end of stream),
/// else the error it reports, in rustls's words.
pub(crate) fn alert(content: &[u8]) -> Result<(), RecordError> {
    match content {
        [_, 0] => Ok(()),
        [_, description] => Err(format!(
            "received fatal alert: {:?}",
            rustls::AlertDescription::from(*description)
        )),
        _ => Err("received a malformed TLS alert".into()),
    }
}

/// A post-handshake message the stream acts on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PostHandshake {
    /// The peer changed its sending key; `true` if it asks for ours too.
    KeyUpdate { requested: bool },
    /// A session ticket (servers may send them; ours do not, and clients
    /// do not resume, so it is dropped).
    Ticket,
}

/// The post-handshake messages in one handshake record. A message that
/// spans records, or a key update that is not the record's last message
/// (§5.1: messages must not span key changes), is an error.
pub(crate) fn post_handshake(mut content: &[u8]) -> Result<Vec<PostHandshake>, RecordError> {
    let mut messages = Vec::new();
    while !content.is_empty() {
        let Some((&[kind, a, b, c], rest)) = content.split_first_chunk::<4>() else {
            return Err("received a truncated TLS handshake message".into());
        };
        let len = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
        let body = rest.get(..len).ok_or_else(|| {
            RecordError::from("received a TLS handshake message that spans records")
        })?;
        content = &rest[len..];
        messages.push(match (kind, body) {
            (KEY_UPDATE, [request @ (0 | 1)]) if content.is_empty() => PostHandshake::KeyUpdate {
                requested: *request == 1,
            },
            (KEY_UPDATE, _) => return Err("received a malformed TLS key update".into()),
            (NEW_SESSION_TICKET, _) => PostHandshake::Ticket,
            (other, _) => {
                return Err(format!(
                    "received TLS handshake message {other} after the handshake"
                ));
            }
        });
    }
    Ok(messages)
}

/// The key update message this side sends (never asking the peer to
/// update in turn).
pub(crate) const KEY_UPDATE_MESSAGE: [u8; 5] = [KEY_UPDATE, 0, 0, 1, 0];

/// The `close_notify` alert.
pub(crate) const CLOSE_NOTIFY: [u8; 2] = [1, 0];

#[cfg(test)]
mod tests;
