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
    tx.seal(&mut out, APPLICATION_DATA, &[b"hello ", b"world"])
        .unwrap();
    tx.seal(&mut out, ALERT, &[&CLOSE_NOTIFY]).unwrap();
    assert_eq!(out.len(), 2 * (HEADER + TAG + 1) + 11 + 2);
    let (len, kind, content) = rx.open(&mut out, 0, HEADER).unwrap().unwrap();
    assert_eq!(
        (kind, &out[content]),
        (APPLICATION_DATA, &b"hello world"[..])
    );
    // The second record's content moves to the front as it opens.
    let (second, kind, content) = rx.open(&mut out, len, 0).unwrap().unwrap();
    assert_eq!(content, 0..2);
    assert_eq!(len + second, out.len());
    assert_eq!(kind, ALERT);
    assert_eq!(alert(&out[content]), Ok(()));
}

#[test]
fn a_partial_record_waits_for_more() {
    let (mut tx, mut rx) = pair(0, u64::MAX);
    let mut out = Vec::new();
    tx.seal(&mut out, APPLICATION_DATA, &[&[1; 100]]).unwrap();
    for cut in [0, 3, HEADER, out.len() - 1] {
        assert_eq!(
            rx.open(&mut out.clone()[..cut], 0, 0),
            Ok(None),
            "cut at {cut}"
        );
    }
    assert!(rx.open(&mut out, 0, 0).unwrap().is_some());
}

#[test]
fn every_flipped_bit_is_refused() {
    let (mut tx, _) = pair(0, u64::MAX);
    let mut out = Vec::new();
    tx.seal(&mut out, APPLICATION_DATA, &[b"tensor bytes"])
        .unwrap();
    for bit in 0..out.len() * 8 {
        let mut bad = out.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        let (_, mut rx) = pair(0, u64::MAX);
        match rx.open(&mut bad, 0, HEADER) {
            Err(_) | Ok(None) => {}
            Ok(Some(_)) => panic!("a record with bit {bit} flipped opened"),
        }
    }
}

#[test]
fn a_replayed_or_reordered_record_is_refused() {
    let (mut tx, mut rx) = pair(5, u64::MAX);
    let (mut first, mut second) = (Vec::new(), Vec::new());
    tx.seal(&mut first, APPLICATION_DATA, &[b"one"]).unwrap();
    tx.seal(&mut second, APPLICATION_DATA, &[b"two"]).unwrap();
    assert!(rx.open(&mut second.clone(), 0, 0).is_err());
    let (_, mut rx) = pair(5, u64::MAX);
    rx.open(&mut first.clone(), 0, 0).unwrap().unwrap();
    assert!(rx.open(&mut first, 0, 0).is_err(), "a replay opened");
}

#[test]
fn the_writer_stops_at_its_limit() {
    let (mut tx, _) = pair(0, 3);
    let mut out = Vec::new();
    assert!(!tx.update_due());
    tx.seal(&mut out, APPLICATION_DATA, &[b"a"]).unwrap();
    tx.seal(&mut out, APPLICATION_DATA, &[b"b"]).unwrap();
    assert!(tx.update_due(), "one record is left for the key update");
    tx.seal(&mut out, HANDSHAKE, &[&KEY_UPDATE_MESSAGE])
        .unwrap();
    assert!(tx.seal(&mut out, APPLICATION_DATA, &[b"c"]).is_err());
}

#[test]
fn padding_is_stripped_and_content_type_found() {
    // A peer may pad (RFC 8446 §5.4): content, type, zeros.
    let (mut tx, mut rx) = pair(0, u64::MAX);
    let mut out = Vec::new();
    tx.seal(&mut out, 0, &[b"abc", &[APPLICATION_DATA], &[0; 40]])
        .unwrap();
    // `seal` appended its own type byte 0 last: all-zero after the real
    // type, so the real type is the last non-zero byte.
    let (_, kind, content) = rx.open(&mut out, 0, 0).unwrap().unwrap();
    assert_eq!((kind, &out[content]), (APPLICATION_DATA, &b"abc"[..]));
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
        prop_assert!(!matches!(rx.open(&mut bytes, 0, 0), Ok(Some(_))));
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
        tx.seal(&mut out, APPLICATION_DATA, &[&vec![3; len]]).unwrap();
        let original = out.clone();
        for (at, byte) in edits {
            let at = at % out.len();
            out[at] = byte;
        }
        out.truncate(cut % (out.len() + 1));
        let opened = matches!(rx.open(&mut out, 0, 0), Ok(Some(_)));
        prop_assert!(!opened || out == original);
    }

    /// Arbitrary post-handshake content never panics.
    #[test]
    fn arbitrary_post_handshake_content(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = post_handshake(&bytes);
    }
}
