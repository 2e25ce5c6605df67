//! Property tests of the decoders a peer (or a guest) can reach in this
//! crate: [`wasmrpc_abi::decode`] of [`Value`]s, and
//! [`Manifest::from_section`]. Arbitrary and mutated bytes must give an
//! error, never a panic, a hang or a stack overflow; every `Value` tree
//! round-trips.

use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;
use wasmrpc_abi::manifest::{Export, Manifest, Record};
use wasmrpc_abi::protocol::ExportKind;
use wasmrpc_abi::{MAX_VALUE_DEPTH, Value, WorkerInfo, decode, encode, encode_append};
use wasmrpc_mutation::{huge_numbers, mutate, mutation};

/// The stack of the test's decoding threads: half of a tokio worker's
/// 2 MiB, the smallest stack the host decodes on.
const STACK: usize = 1 << 20;

/// Runs `f` on a thread with a [`STACK`]-byte stack and fails if it panics
/// or takes over 5 s.
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .stack_size(STACK)
        .spawn(move || {
            let _ = tx.send(f());
        })
        .expect("spawn a decoding thread");
    rx.recv_timeout(Duration::from_secs(5))
        .expect("the decoder panicked or did not finish within 5 s")
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::None),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        // NaN != NaN would make round trips compare unequal.
        any::<f64>()
            .prop_filter("not NaN", |f| !f.is_nan())
            .prop_map(Value::Float),
        ".{0,12}".prop_map(Value::Str),
        proptest::collection::vec(any::<u8>(), 0..32).prop_map(Value::Bytes),
        (any::<u32>(), ".{0,8}").prop_map(|(id, name)| Value::WorkerInfo(WorkerInfo { id, name })),
        any::<u32>().prop_map(Value::Tensor),
        any::<u32>().prop_map(Value::RRef),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Tuple),
            proptest::collection::vec((inner.clone(), inner.clone()), 0..4).prop_map(Value::Dict),
            (
                "[a-z]{0,6}",
                proptest::collection::vec(("[a-z]{1,6}", inner), 0..4)
            )
                .prop_map(|(name, fields)| Value::Record { name, fields }),
        ]
    })
}

/// A nested `List` `depth` levels deep around `None`, as postcard bytes
/// written by hand (variant 6 = `List`, length 1), so that building it does
/// not itself recurse.
fn nested_list_bytes(depth: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(depth * 2 + 1);
    for _ in 0..depth {
        bytes.extend_from_slice(&[6, 1]);
    }
    bytes.push(0);
    bytes
}

fn nested(depth: usize) -> Value {
    let mut v = Value::None;
    for _ in 0..depth {
        v = Value::List(vec![v]);
    }
    v
}

fn manifest_section() -> Vec<u8> {
    let mut section = Vec::new();
    let plugin = Record::Plugin {
        name: "p".into(),
        version: "1.0.0".into(),
        abi: 1,
    };
    for record in [
        plugin.clone(),
        Record::Export(Export {
            name: "f".into(),
            kind: ExportKind::Function,
            class: None,
            params: vec!["a".into(), "b".into()],
        }),
        plugin,
        Record::Export(Export {
            name: "g".into(),
            kind: ExportKind::Function,
            class: Some("C".into()),
            params: vec![],
        }),
    ] {
        section.extend(record.frame().expect("records encode"));
    }
    section
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn values_round_trip(v in value()) {
        let bytes = encode(&v).expect("values encode");
        prop_assert_eq!(decode::<Value>(&bytes).expect("encoded values decode"), v);
    }

    #[test]
    fn appended_encodings_are_the_encodings_after_their_prefix(
        v in value(),
        prefix in proptest::collection::vec(any::<u8>(), 0..8),
        capacity in 0usize..256,
    ) {
        let mut out = Vec::with_capacity(capacity);
        out.extend_from_slice(&prefix);
        let out = encode_append(&v, out).expect("values encode");
        let whole = encode(&v).expect("values encode");
        prop_assert_eq!(&out[..prefix.len()], &prefix[..]);
        prop_assert_eq!(&out[prefix.len()..], &whole[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        bounded(move || { let _ = decode::<Value>(&bytes); });
    }

    #[test]
    fn mutated_values_never_panic(v in value(), ms in proptest::collection::vec(mutation(huge_numbers(), 8), 1..4)) {
        let bytes = mutate(encode(&v).expect("values encode"), &ms);
        bounded(move || { let _ = decode::<Value>(&bytes); });
    }

    #[test]
    fn arbitrary_manifest_sections_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        bounded(move || { let _ = Manifest::from_section(&bytes); });
    }

    #[test]
    fn mutated_manifest_sections_never_panic(ms in proptest::collection::vec(mutation(huge_numbers(), 8), 1..4)) {
        let bytes = mutate(manifest_section(), &ms);
        bounded(move || { let _ = Manifest::from_section(&bytes); });
    }
}

#[test]
fn the_valid_manifest_section_parses() {
    let m = Manifest::from_section(&manifest_section()).expect("a valid section");
    assert_eq!(m.name, "p");
    assert_eq!(m.exports.len(), 2);
}

/// Regression: postcard has no depth limit, and the derived decoder
/// recursed once per level, so a few KiB of `List` tags overflowed the
/// stack and aborted the process (found by `arbitrary_bytes_never_panic`'s
/// small-stack thread). Deep values are now an error.
#[test]
fn deeply_nested_values_are_an_error_not_a_stack_overflow() {
    for depth in [MAX_VALUE_DEPTH + 1, 10_000, 1_000_000] {
        let bytes = nested_list_bytes(depth);
        let got = bounded(move || decode::<Value>(&bytes).map_err(|e| e.to_string()));
        assert!(got.is_err(), "depth {depth} decoded");
    }
    // Up to the limit, nesting still decodes (and matches the encoder).
    let bytes = nested_list_bytes(MAX_VALUE_DEPTH);
    assert_eq!(encode(&nested(MAX_VALUE_DEPTH)).unwrap(), bytes);
    let v = bounded(move || decode::<Value>(&bytes).map(|v| v == nested(MAX_VALUE_DEPTH)));
    assert_eq!(v, Ok(true));
}
