use proptest::prelude::*;
use rustls::ConnectionTrafficSecrets;
use rustls::crypto::cipher::{AeadKey, Iv};

use super::*;

fn secrets(byte: u8) -> ConnectionTrafficSecrets {
    ConnectionTrafficSecrets::Aes256Gcm {
        key: AeadKey::from([byte; 32]),
        iv: Iv::from([byte; 12]),
    }
}

/// Seals one record onto the end of `out`.
fn seal_onto(
    tx: &mut Direction,
    out: &mut Vec<u8>,
    content_type: u8,
    parts: &[&[u8]],
) -> Result<(), RecordError> {
    let at = out.len();
    out.resize(at + record_len(parts.iter().map(|p| p.len()).sum()), 0);
    let len = tx.seal(&mut out[at..], content_type, parts)?;
    assert_eq!(at + len, out.len());
    Ok(())
}

/// Opens the record at the front of `buf` in place, once it is whole:
/// its length, content type and content.
fn open_first(rx: &mut Direction, buf: &mut [u8]) -> Result<Option<Opened>, RecordError> {
    let Some(len) = record_length(buf)? else {
        return Ok(None);
    };
    let (content_type, n) = rx.open_in_place(&mut buf[..len])?;
    Ok(Some((len, content_type, buf[HEADER..HEADER + n].to_vec())))
}

/// As [`open_first`], but into a separate buffer, as a large read does.
fn open_first_into(rx: &mut Direction, buf: &[u8]) -> Result<Option<Opened>, RecordError> {
    let Some(len) = record_length(buf)? else {
        return Ok(None);
    };
    let mut out = vec![0xAA; len - HEADER - TAG];
    let (content_type, n) = rx.open_into(&buf[..len], &mut out)?;
    Ok(Some((len, content_type, out[..n].to_vec())))
}

type Opened = (usize, u8, Vec<u8>);

/// A sending and a receiving direction that agree, from record `seq`.
fn pair(seq: u64, limit: u64) -> (Direction, Direction) {
    (
        Direction::new((seq, secrets(7)), limit).unwrap(),
        Direction::new((seq, secrets(7)), u64::MAX).unwrap(),
    )
}

#[test]
fn a_sealed_record_opens_to_its_content() {
    let (mut tx, mut rx) = pair(0, u64::MAX);
    let mut out = Vec::new();
    seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[b"hello ", b"world"]).unwrap();
    seal_onto(&mut tx, &mut out, ALERT, &[&CLOSE_NOTIFY]).unwrap();
    assert_eq!(out.len(), 2 * (HEADER + TAG + 1) + 11 + 2);
    let (len, kind, content) = open_first(&mut rx, &mut out).unwrap().unwrap();
    assert_eq!(
        (kind, &content[..]),
        (APPLICATION_DATA, &b"hello world"[..])
    );
    // The second record opens into a buffer of its own.
    let (second, kind, content) = open_first_into(&mut rx, &out[len..]).unwrap().unwrap();
    assert_eq!(len + second, out.len());
    assert_eq!(kind, ALERT);
    assert_eq!(alert(&content), Ok(()));
}

#[test]
fn one_part_sealed_from_where_it_lies_equals_parts_gathered() {
    // The two ways `seal` encrypts (out of place for one part, gathered
    // and in place for several) make the same record.
    let content: Vec<u8> = (0..MAX_FRAGMENT).map(|i| i as u8).collect();
    let (mut one, _) = pair(9, u64::MAX);
    let (mut gathered, mut rx) = pair(9, u64::MAX);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    seal_onto(&mut one, &mut a, APPLICATION_DATA, &[&content]).unwrap();
    let (head, tail) = content.split_at(1000);
    seal_onto(&mut gathered, &mut b, APPLICATION_DATA, &[head, tail]).unwrap();
    assert!(a == b);
    let (_, kind, opened) = open_first_into(&mut rx, &a).unwrap().unwrap();
    assert_eq!(kind, APPLICATION_DATA);
    assert!(opened == content);
}

#[test]
fn every_suite_seals_and_opens_both_ways() {
    // AES-128-GCM, the suite our ends prefer, runs in the stream tests:
    // rustls makes its 16-byte keys, which nothing outside it can.
    let chacha = |byte| ConnectionTrafficSecrets::Chacha20Poly1305 {
        key: AeadKey::from([byte; 32]),
        iv: Iv::from([byte; 12]),
    };
    let suites: [(&str, &dyn Fn(u8) -> ConnectionTrafficSecrets); 2] =
        [("AES-256-GCM", &secrets), ("ChaCha20-Poly1305", &chacha)];
    for (name, suite) in suites {
        let direction = || Direction::new((0, suite(4)), u64::MAX).unwrap();
        let (mut tx, mut rx, mut rx_into) = (direction(), direction(), direction());
        for len in [0, 1, 100, MAX_FRAGMENT] {
            let mut out = Vec::new();
            seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[&vec![7; len]]).unwrap();
            let (_, _, into) = open_first_into(&mut rx_into, &out).unwrap().unwrap();
            let (_, _, in_place) = open_first(&mut rx, &mut out).unwrap().unwrap();
            assert!(
                into == vec![7; len] && in_place == into,
                "{name}, {len} bytes"
            );
        }
    }
}

#[test]
fn a_partial_record_waits_for_more() {
    let (mut tx, mut rx) = pair(0, u64::MAX);
    let mut out = Vec::new();
    seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[&[1; 100]]).unwrap();
    for cut in [0, 3, HEADER, out.len() - 1] {
        assert_eq!(record_length(&out[..cut]), Ok(None), "cut at {cut}");
    }
    assert!(open_first(&mut rx, &mut out).unwrap().is_some());
}

#[test]
fn every_flipped_bit_is_refused() {
    let (mut tx, _) = pair(0, u64::MAX);
    let mut out = Vec::new();
    seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[b"tensor bytes"]).unwrap();
    for bit in 0..out.len() * 8 {
        let mut bad = out.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        let (_, mut rx) = pair(0, u64::MAX);
        if let Ok(Some(_)) = open_first_into(&mut rx, &bad) {
            panic!("a record with bit {bit} flipped opened into a buffer");
        }
        let (_, mut rx) = pair(0, u64::MAX);
        if let Ok(Some(_)) = open_first(&mut rx, &mut bad) {
            panic!("a record with bit {bit} flipped opened in place");
        }
    }
}

#[test]
fn a_replayed_or_reordered_record_is_refused() {
    let (mut tx, mut rx) = pair(5, u64::MAX);
    let (mut first, mut second) = (Vec::new(), Vec::new());
    seal_onto(&mut tx, &mut first, APPLICATION_DATA, &[b"one"]).unwrap();
    seal_onto(&mut tx, &mut second, APPLICATION_DATA, &[b"two"]).unwrap();
    assert!(open_first(&mut rx, &mut second.clone()).is_err());
    let (_, mut rx) = pair(5, u64::MAX);
    open_first_into(&mut rx, &first).unwrap().unwrap();
    assert!(open_first_into(&mut rx, &first).is_err(), "a replay opened");
}

#[test]
fn the_writer_stops_at_its_limit() {
    let (mut tx, _) = pair(0, 3);
    let mut out = Vec::new();
    assert!(!tx.update_due());
    seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[b"a"]).unwrap();
    seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[b"b"]).unwrap();
    assert!(tx.update_due(), "one record is left for the key update");
    seal_onto(&mut tx, &mut out, HANDSHAKE, &[&KEY_UPDATE_MESSAGE]).unwrap();
    assert!(seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[b"c"]).is_err());
    // A buffer too small for the record is refused, not overrun.
    let (mut tx, _) = pair(0, 3);
    assert!(tx.seal(&mut [0; 30], APPLICATION_DATA, &[&[1; 9]]).is_err());
}

#[test]
fn padding_is_stripped_and_content_type_found() {
    // A peer may pad (RFC 8446 §5.4): content, type, zeros.
    let (mut tx, mut rx) = pair(0, u64::MAX);
    let mut out = Vec::new();
    seal_onto(
        &mut tx,
        &mut out,
        0,
        &[b"abc", &[APPLICATION_DATA], &[0; 40]],
    )
    .unwrap();
    // `seal` appended its own type byte 0 last: all-zero after the real
    // type, so the real type is the last non-zero byte.
    let (_, kind, content) = open_first(&mut rx, &mut out.clone()).unwrap().unwrap();
    assert_eq!((kind, &content[..]), (APPLICATION_DATA, &b"abc"[..]));
    let (_, mut rx) = pair(0, u64::MAX);
    let (_, kind, content) = open_first_into(&mut rx, &out).unwrap().unwrap();
    assert_eq!((kind, &content[..]), (APPLICATION_DATA, &b"abc"[..]));
}

#[test]
fn alerts_name_their_cause() {
    assert_eq!(alert(&[1, 0]), Ok(()));
    assert_eq!(
        alert(&[2, 116]).unwrap_err(),
        "received fatal alert: CertificateRequired"
    );
    assert!(alert(&[2]).is_err());
}

#[test]
fn post_handshake_messages_parse() {
    assert_eq!(
        post_handshake(&KEY_UPDATE_MESSAGE),
        Ok(vec![PostHandshake::KeyUpdate { requested: false }])
    );
    assert_eq!(
        post_handshake(&[NEW_SESSION_TICKET, 0, 0, 2, 9, 9, KEY_UPDATE, 0, 0, 1, 1]),
        Ok(vec![
            PostHandshake::Ticket,
            PostHandshake::KeyUpdate { requested: true }
        ])
    );
    // A key update must end its record; a message must not span records.
    assert!(post_handshake(&[KEY_UPDATE, 0, 0, 1, 0, NEW_SESSION_TICKET, 0, 0, 0]).is_err());
    assert!(post_handshake(&[KEY_UPDATE, 0, 0, 1, 2]).is_err());
    assert!(post_handshake(&[NEW_SESSION_TICKET, 0, 1, 0, 1]).is_err());
    assert!(post_handshake(&[1, 0, 0, 0]).is_err());
}

proptest! {
    /// Arbitrary bytes never panic the opener, and never open: a record
    /// needs the key.
    #[test]
    fn arbitrary_bytes_never_open(mut bytes in proptest::collection::vec(any::<u8>(), 0..20_000)) {
        let (_, mut rx) = pair(0, u64::MAX);
        prop_assert!(!matches!(open_first_into(&mut rx, &bytes), Ok(Some(_))));
        let (_, mut rx) = pair(0, u64::MAX);
        prop_assert!(!matches!(open_first(&mut rx, &mut bytes), Ok(Some(_))));
    }

    /// A real record with any bytes changed, or cut, is refused or waits.
    #[test]
    fn mutated_records_never_open(
        len in 0usize..3000,
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let (mut tx, mut rx) = pair(0, u64::MAX);
        let mut out = Vec::new();
        seal_onto(&mut tx, &mut out, APPLICATION_DATA, &[&vec![3; len]]).unwrap();
        let original = out.clone();
        for (at, byte) in edits {
            let at = at % out.len();
            out[at] = byte;
        }
        out.truncate(cut % (out.len() + 1));
        let into = matches!(open_first_into(&mut rx, &out), Ok(Some(_)));
        prop_assert!(!into || out == original);
        let (_, mut rx) = pair(0, u64::MAX);
        let in_place = matches!(open_first(&mut rx, &mut out.clone()), Ok(Some(_)));
        prop_assert!(!in_place || out == original);
    }

    /// Arbitrary post-handshake content never panics.
    #[test]
    fn arbitrary_post_handshake_content(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = post_handshake(&bytes);
    }
}
