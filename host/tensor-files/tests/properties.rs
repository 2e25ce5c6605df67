//! Properties over random and mutated inputs: reading never panics, and
//! whatever it accepts is self-consistent; writing then reading gives the
//! tensors back.

use std::collections::BTreeMap;

use proptest::prelude::*;
use wasmrpc_tensor_files::{
    DType, TensorBytes, Tensors, read, read_with_metadata, write_safetensors,
};

const DTYPES: [DType; 10] = [
    DType::Float32,
    DType::Float64,
    DType::Float16,
    DType::BFloat16,
    DType::Int64,
    DType::Int32,
    DType::Int16,
    DType::Int8,
    DType::UInt8,
    DType::Bool,
];

/// Every accepted tensor's data is exactly `numel * size` bytes, its dims
/// are sizes, and the total stays within `limit`.
fn consistent(tensors: &Tensors, limit: u64) -> bool {
    let total: u64 = tensors.iter().map(|(_, t)| t.data.len() as u64).sum();
    total <= limit
        && tensors.iter().all(|(_, t)| {
            let numel = t.shape.iter().try_fold(1u64, |n, &d| {
                u64::try_from(d).ok().and_then(|d| n.checked_mul(d))
            });
            numel.and_then(|n| n.checked_mul(t.dtype.size() as u64)) == Some(t.data.len() as u64)
        })
}

/// Openings that steer random bytes into each format's parser.
fn opening() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        Just(b"\x93NUMPY\x01\x00".to_vec()),
        Just(b"\x93NUMPY\x03\x00".to_vec()),
        Just(b"PK\x03\x04".to_vec()),
        Just(b"PK\x05\x06".to_vec()),
        any::<u8>().prop_map(|n| [&[n, 0, 0, 0, 0, 0, 0, 0][..], b"{"].concat()),
    ]
}

fn file_name() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "/d/x.npy",
        "/d/x.npz",
        "/d/x.safetensors",
        "/d/x.pt",
        "/d/x",
    ])
}

/// A small valid safetensors file to mutate.
fn sample_file() -> Vec<u8> {
    let tensors = vec![
        (
            "w".to_owned(),
            TensorBytes {
                dtype: DType::Float32,
                shape: vec![2, 2],
                data: vec![1; 16],
            },
        ),
        (
            "b".to_owned(),
            TensorBytes {
                dtype: DType::Int16,
                shape: vec![3],
                data: vec![2; 6],
            },
        ),
        (
            "e".to_owned(),
            TensorBytes {
                dtype: DType::Bool,
                shape: vec![0, 4],
                data: vec![],
            },
        ),
    ];
    let metadata = BTreeMap::from([("k".to_owned(), "v".to_owned())]);
    write_safetensors("/d/s.safetensors", &tensors, &metadata).expect("valid tensors")
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        bit: u8,
    },
    Insert {
        at: usize,
        byte: u8,
    },
    Delete {
        at: usize,
    },
    /// Replace the 8-byte header length.
    Length(u64),
    /// Nudge the 8-byte header length.
    LengthBy(i8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0..8u8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        any::<usize>().prop_map(|at| Mutation::Delete { at }),
        any::<u64>().prop_map(Mutation::Length),
        any::<i8>().prop_map(Mutation::LengthBy),
    ]
}

/// Applies a mutation within the JSON header (bytes 8..8+n).
fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    // An earlier mutation may have made the length a lie; edit only bytes
    // that exist.
    let region = usize::try_from(header_len)
        .unwrap_or(usize::MAX)
        .min(bytes.len() - 8);
    let set_length = |bytes: &mut Vec<u8>, n: u64| bytes[..8].copy_from_slice(&n.to_le_bytes());
    if region == 0
        && matches!(
            mutation,
            Mutation::Flip { .. } | Mutation::Insert { .. } | Mutation::Delete { .. }
        )
    {
        return;
    }
    let in_header = |at: usize| 8 + at % region.max(1);
    match *mutation {
        Mutation::Flip { at, bit } => bytes[in_header(at)] ^= 1 << bit,
        Mutation::Insert { at, byte } => {
            bytes.insert(in_header(at), byte);
            set_length(bytes, header_len.wrapping_add(1));
        }
        Mutation::Delete { at } => {
            bytes.remove(in_header(at));
            set_length(bytes, header_len.wrapping_sub(1));
        }
        Mutation::Length(n) => set_length(bytes, n),
        Mutation::LengthBy(delta) => {
            set_length(bytes, header_len.wrapping_add_signed(i64::from(delta)))
        }
    }
}

fn tensor(dtype: DType) -> impl Strategy<Value = TensorBytes> {
    prop::collection::vec(0..4i64, 0..4).prop_flat_map(move |shape| {
        let numel: i64 = shape.iter().product();
        let len = numel as usize * dtype.size();
        let bytes = if dtype == DType::Bool {
            prop::collection::vec(0..2u8, len).boxed()
        } else {
            prop::collection::vec(any::<u8>(), len).boxed()
        };
        bytes.prop_map(move |data| TensorBytes {
            dtype,
            shape: shape.clone(),
            data,
        })
    })
}

fn tensors() -> impl Strategy<Value = BTreeMap<String, TensorBytes>> {
    prop::collection::btree_map(
        "[a-z.]{1,8}",
        prop::sample::select(DTYPES.to_vec()).prop_flat_map(tensor),
        0..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_never_panic(file in file_name(), opening in opening(), tail in prop::collection::vec(any::<u8>(), 0..512)) {
        let bytes = [opening, tail].concat();
        if let Ok(tensors) = read(file, &bytes, 4096) {
            prop_assert!(consistent(&tensors, 4096));
        }
    }

    #[test]
    fn mutated_safetensors_headers_are_refused_or_consistent(mutations in prop::collection::vec(mutation(), 1..4)) {
        let mut bytes = sample_file();
        for mutation in &mutations {
            mutate(&mut bytes, mutation);
        }
        if let Ok(tensors) = read("/d/s.safetensors", &bytes, 1 << 20) {
            prop_assert!(consistent(&tensors, 1 << 20));
        }
    }

    #[test]
    fn mutated_numpy_files_are_refused_or_consistent(
        which in 0..3usize,
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4),
    ) {
        let (file, original): (&str, &[u8]) = match which {
            0 => ("/d/f.npy", include_bytes!("fixtures/fortran.npy")),
            1 => ("/d/c.npz", include_bytes!("fixtures/compressed.npz")),
            _ => ("/d/s.npz", include_bytes!("fixtures/stored.npz")),
        };
        let mut bytes = original.to_vec();
        for (at, byte) in edits {
            let at = at % bytes.len();
            bytes[at] = byte;
        }
        if let Ok(tensors) = read(file, &bytes, 4096) {
            prop_assert!(consistent(&tensors, 4096));
        }
    }

    #[test]
    fn written_safetensors_read_back(
        tensors in tensors(),
        metadata in prop::collection::btree_map("[a-z]{0,6}", "\\PC{0,8}", 0..3),
    ) {
        let list: Tensors = tensors.clone().into_iter().collect();
        let bytes = write_safetensors("/d/out.safetensors", &list, &metadata).expect("valid tensors");
        let (back, back_metadata) = read_with_metadata("/d/out.safetensors", &bytes, u64::MAX).expect("reads");
        prop_assert_eq!(back.into_iter().collect::<BTreeMap<_, _>>(), tensors);
        prop_assert_eq!(back_metadata, metadata);
    }
}

#[test]
fn write_refuses_bad_arguments() {
    let file = "/d/out.safetensors";
    let ok = TensorBytes {
        dtype: DType::Float32,
        shape: vec![2],
        data: vec![0; 8],
    };
    let none = BTreeMap::new();
    let refusal = |tensors: Vec<(&str, TensorBytes)>| {
        let tensors: Tensors = tensors
            .into_iter()
            .map(|(n, t)| (n.to_owned(), t))
            .collect();
        let error = write_safetensors(file, &tensors, &none).expect_err("refused");
        assert!(error.is_value_error());
        error.to_string()
    };
    assert_eq!(
        refusal(vec![("", ok.clone())]),
        format!("{file} cannot be written: a tensor has an empty name.")
    );
    assert_eq!(
        refusal(vec![("a", ok.clone()), ("a", ok.clone())]),
        format!("{file} cannot be written: two tensors are named \"a\".")
    );
    assert_eq!(
        refusal(vec![("__metadata__", ok.clone())]),
        format!(
            "{file} cannot be written: a tensor is named \"__metadata__\", which safetensors keeps for metadata."
        )
    );
    assert_eq!(
        refusal(vec![(
            "a",
            TensorBytes {
                shape: vec![-1],
                ..ok.clone()
            }
        )]),
        format!(
            "{file} cannot be written: tensor \"a\" has the shape [-1], with a negative dimension."
        )
    );
    assert_eq!(
        refusal(vec![(
            "a",
            TensorBytes {
                data: vec![0; 7],
                ..ok.clone()
            }
        )]),
        format!(
            "{file} cannot be written: tensor \"a\" has 7 bytes of data, but its shape [2] of float32 needs 8."
        )
    );
    assert_eq!(
        refusal(vec![(
            "a",
            TensorBytes {
                dtype: DType::Bool,
                shape: vec![1],
                data: vec![7]
            }
        )]),
        format!(
            "{file} cannot be written: in tensor \"a\", bool element 0 is the byte 0x07, but a bool must be 0 or 1."
        )
    );
    // An empty metadata map writes no __metadata__ at all.
    let bytes = write_safetensors(file, &[("a".to_owned(), ok)], &none).expect("valid");
    assert!(!String::from_utf8_lossy(&bytes).contains("__metadata__"));
}
