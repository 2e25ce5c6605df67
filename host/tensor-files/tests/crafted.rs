//! Hand-made files that lie, as an attacker would write them, and the
//! exact sentences they are refused with.

use std::io::Write;

use wasmrpc_tensor_files::{DType, FileError, read};

const LIMIT: u64 = 1 << 20;
const ST: &str = "/m/x.safetensors";

/// A safetensors file: the header's length, the header, the data.
fn safetensors(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    bytes
}

fn refusal(file: &str, bytes: &[u8]) -> String {
    match read(file, bytes, LIMIT) {
        Ok(tensors) => panic!("{file} was read: {tensors:?}"),
        Err(error) => error.to_string(),
    }
}

fn st_refusal(header: &str, data: &[u8]) -> String {
    refusal(ST, &safetensors(header.as_bytes(), data))
}

fn malformed(reason: &str) -> String {
    format!("{ST} is not a valid safetensors file: {reason}.")
}

#[test]
fn safetensors_header_length_past_the_end() {
    let mut bytes = safetensors(b"{}", &[]);
    bytes[..8].copy_from_slice(&100u64.to_le_bytes());
    assert_eq!(
        refusal(ST, &bytes),
        malformed("its header length says 100 bytes but only 2 bytes follow")
    );
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(
        refusal(ST, &bytes),
        malformed("its header length says 18446744073709551615 bytes but only 2 bytes follow")
    );
    assert_eq!(
        refusal(ST, &[1, 2, 3]),
        malformed("it is 3 bytes long, too short for the 8-byte header length")
    );
}

#[test]
fn safetensors_offsets_past_the_end() {
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 4]),
        malformed("tensor \"a\" has data_offsets [0, 8], outside the 4 bytes of data")
    );
    // An end near usize::MAX, which the safetensors crate alone would add
    // to the header length unchecked.
    let header = r#"{"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 4]),
        malformed(
            "tensor \"a\" has data_offsets [0, 18446744073709551615], outside the 4 bytes of data"
        )
    );
    // Start after end.
    let header = r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 4]),
        malformed("tensor \"a\" has data_offsets [4, 0], outside the 4 bytes of data")
    );
}

#[test]
fn safetensors_overlapping_gapped_and_out_of_order_offsets() {
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                     "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 12]),
        malformed(
            "tensor \"b\" starts at data offset 4, which overlaps the tensor before it (the data \
             before it ends at 8)"
        )
    );
    let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                     "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 12]),
        malformed(
            "tensor \"b\" starts at data offset 8, which leaves a gap before it (the data before \
             it ends at 4)"
        )
    );
    // Data nobody claims.
    let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 5]),
        malformed("its tensors cover 4 bytes of data but the data section is 5 bytes")
    );
    // Listed out of order is fine: the order of the data is the file's.
    let header = r#"{"z":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},
                     "y":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    let tensors = read(ST, &safetensors(header.as_bytes(), &[7, 9]), LIMIT).expect("valid");
    let names: Vec<(&str, &[u8])> = tensors
        .iter()
        .map(|(n, t)| (n.as_str(), t.data.as_slice()))
        .collect();
    assert_eq!(names, [("y", &[7][..]), ("z", &[9][..])]);
}

#[test]
fn safetensors_shape_that_disagrees_with_offsets() {
    let header = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    assert_eq!(
        st_refusal(header, &[0; 8]),
        malformed("tensor \"a\" has 8 bytes of data at [0, 8], but its shape [3] of F32 needs 12")
    );
    let header =
        r#"{"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}}"#;
    assert_eq!(
        st_refusal(header, &[]),
        malformed(
            "tensor \"a\" is refused: the shape [1099511627776, 1099511627776] has more elements \
             than a tensor can hold"
        )
    );
    let header = r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}"#;
    assert_eq!(
        st_refusal(header, &[]),
        malformed("tensor \"a\" has the dimension -1, which is not a size")
    );
}

#[test]
fn safetensors_header_that_is_not_json() {
    assert_eq!(
        refusal(ST, &safetensors(b"{\xff}", &[])),
        malformed("its header is not UTF-8 text (bad byte at offset 9)")
    );
    assert!(st_refusal("{nope}", &[]).starts_with(&format!(
        "{ST} is not a valid safetensors file: its header is not JSON ("
    )));
    assert_eq!(
        st_refusal("{\"a\": 1}", &[]),
        malformed("tensor \"a\" has no dtype string")
    );
    assert_eq!(
        st_refusal(r#"{"__metadata__":{"a":1}}"#, &[]),
        malformed("its __metadata__ is not a map of strings to strings")
    );
}

#[test]
fn safetensors_unknown_dtypes_are_named() {
    for dtype in ["F8_E4M3", "U32", "C64"] {
        let header = format!(r#"{{"w":{{"dtype":"{dtype}","shape":[1],"data_offsets":[0,4]}}}}"#);
        let error =
            read(ST, &safetensors(header.as_bytes(), &[0; 4]), LIMIT).expect_err("unsupported");
        assert!(error.is_value_error());
        assert_eq!(
            error.to_string(),
            format!(
                "{ST} uses the dtype {dtype} for tensor \"w\", which wasmrpc does not read; it \
                 reads the safetensors dtypes F32, F64, F16, BF16, I64, I32, I16, I8, U8 and BOOL."
            )
        );
    }
}

#[test]
fn safetensors_repeated_names_and_bad_bools() {
    // JSON keeps the last of a repeated key; neither reading may panic on
    // the huge first one.
    let header = r#"{"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]},
                     "a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    let tensors = read(ST, &safetensors(header.as_bytes(), &[5]), LIMIT).expect("the last a");
    assert_eq!(tensors[0].1.data, [5]);
    let header = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                     "a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}}"#;
    assert!(read(ST, &safetensors(header.as_bytes(), &[5]), LIMIT).is_err());

    let header = r#"{"b":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}}"#;
    assert_eq!(
        st_refusal(header, &[1, 2]),
        malformed("in tensor \"b\", bool element 1 is the byte 0x02, but a bool must be 0 or 1")
    );
}

/// A version 1.0 `.npy` file with this header dict and data.
fn npy(dict: &str, data: &[u8]) -> Vec<u8> {
    let mut header = dict.as_bytes().to_vec();
    // Pad as numpy does: the data starts on a multiple of 64.
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(data);
    bytes
}

fn dict(descr: &str, shape: &str) -> String {
    format!("{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}")
}

const NPY: &str = "/d/a.npy";

fn npy_malformed(reason: &str) -> String {
    format!("{NPY} is not a valid .npy file: {reason}.")
}

#[test]
fn npy_unsupported_descrs_are_named() {
    for descr in ["<c8", "<U3", "<u4", "<u2", ">u8", "|S5", "<M8[ns]", "f4"] {
        let text = refusal(NPY, &npy(&dict(&format!("'{descr}'"), "(1,)"), &[0; 8]));
        assert_eq!(
            text,
            format!(
                "{NPY} uses the dtype '{descr}', which wasmrpc does not read; it reads the numpy \
                 dtypes f2, f4, f8, i1, i2, i4, i8, u1 and b1 (bool), little- or big-endian."
            )
        );
    }
    let text = refusal(
        NPY,
        &npy(&dict("[('a', '<f4'), ('b', '<i8')]", "(1,)"), &[0; 12]),
    );
    assert!(
        text.starts_with(&format!(
            "{NPY} uses the structured dtype [('a', '<f4'), ('b', '<i8')], which"
        )),
        "{text}"
    );
}

#[test]
fn npy_lengths_are_checked() {
    let with_data = |data: &[u8]| refusal(NPY, &npy(&dict("'<f4'", "(2,)"), data));
    assert_eq!(
        with_data(&[0; 7]),
        npy_malformed("its header promises 8 bytes of data (float32 [2]) but only 7 bytes follow")
    );
    assert_eq!(
        with_data(&[0; 9]),
        npy_malformed("there are bytes after the 8 bytes of data its header promises")
    );
    let mut bytes = npy(&dict("'<f4'", "(2,)"), &[0; 8]);
    bytes[8..10].copy_from_slice(&60000u16.to_le_bytes());
    assert_eq!(
        refusal(NPY, &bytes),
        npy_malformed("its header length is 60000 bytes but only 126 bytes follow")
    );
    assert_eq!(
        refusal(
            NPY,
            &npy(&dict("'<f4'", "(1099511627776, 1099511627776)"), &[])
        ),
        npy_malformed(
            "the shape [1099511627776, 1099511627776] has more elements than a tensor can hold"
        )
    );
    assert_eq!(
        refusal(NPY, &npy(&dict("'<f4'", "(-1,)"), &[])),
        npy_malformed("its shape has the negative dimension -1")
    );
    let mut bytes = npy(&dict("'<f4'", "(2,)"), &[0; 8]);
    bytes[6] = 9;
    assert_eq!(
        refusal(NPY, &bytes),
        npy_malformed("its format version 9.0 is not 1.0, 2.0 or 3.0")
    );
    assert_eq!(
        refusal(NPY, b"\x93NUMPY\x01"),
        npy_malformed("it ends inside the magic and version")
    );
    assert_eq!(
        refusal(NPY, &npy("{'descr': '<f4'}", &[])),
        npy_malformed("its header has no 'fortran_order'")
    );
    assert_eq!(
        refusal(NPY, &npy("{'descr': '<f4', 'descr': '<f4'}", &[])),
        npy_malformed("its header has the key 'descr' twice")
    );
}

#[test]
fn npy_big_endian_integers_are_swapped() {
    let tensors = read(
        NPY,
        &npy(&dict("'>i2'", "(2,)"), &[0x01, 0x02, 0xff, 0xfe]),
        LIMIT,
    )
    .expect("valid");
    let t = &tensors[0].1;
    assert_eq!(
        (t.dtype, t.data.as_slice()),
        (DType::Int16, &[0x02, 0x01, 0xfe, 0xff][..])
    );
}

/// A zip of `(name, contents, deflated)` members.
fn zip(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for &(name, contents, deflated) in members {
        let method = if deflated {
            zip::CompressionMethod::Deflated
        } else {
            zip::CompressionMethod::Stored
        };
        let options = zip::write::FileOptions::default().compression_method(method);
        writer.start_file(name, options).expect("start");
        writer.write_all(contents).expect("write");
    }
    writer.finish().expect("finish").into_inner()
}

const NPZ: &str = "/d/b.npz";

#[test]
fn npz_bomb_is_refused_without_inflating_it() {
    // 64 MiB of zeros, which deflate to about 64 KiB.
    let big = npy(&dict("'|u1'", "(67108864,)"), &vec![0; 1 << 26]);
    let bytes = zip(&[("big.npy", &big, true)]);
    assert!(bytes.len() < 1 << 20);
    let started = std::time::Instant::now();
    let error = read(NPZ, &bytes, LIMIT).expect_err("a bomb");
    assert_eq!(
        error.to_string(),
        format!(
            "{NPZ} holds more than 1048576 bytes of tensor data, the most this load may produce; \
             load a smaller file or split it."
        )
    );
    assert!(!error.is_value_error());
    assert!(started.elapsed() < std::time::Duration::from_secs(2));

    // A header that understates its data: inflating stops one byte past it.
    let mut liar = npy(&dict("'|u1'", "(4,)"), &[0; 4]);
    liar.resize(1 << 24, 0);
    let bytes = zip(&[("liar.npy", &liar, true)]);
    assert_eq!(
        refusal(NPZ, &bytes),
        format!(
            "{NPZ} member \"liar.npy\" is not a valid .npy file: there are bytes after the 4 bytes \
             of data its header promises."
        )
    );

    // Members under the limit one by one but not together.
    let half = npy(&dict("'|u1'", "(600000,)"), &vec![0; 600_000]);
    let bytes = zip(&[("a.npy", &half, true), ("b.npy", &half, true)]);
    assert!(matches!(
        read(NPZ, &bytes, LIMIT),
        Err(FileError::LimitExceeded { .. })
    ));
    assert_eq!(read(NPZ, &bytes, 1_200_000).map(|t| t.len()).ok(), Some(2));
}

#[test]
fn npz_members_must_be_npy() {
    let one = npy(&dict("'|u1'", "(1,)"), &[3]);
    assert_eq!(
        refusal(
            NPZ,
            &zip(&[("a.npy", &one, false), ("notes.txt", b"hi", false)])
        ),
        format!(
            "{NPZ} uses the member \"notes.txt\" (not a .npy file), which wasmrpc does not read; an .npz archive holds only .npy members, stored or deflated, unencrypted."
        )
    );
    // Under a checkpoint's name, a zip that is not an .npz is a pickle.
    let text = refusal("/d/m.pth", &zip(&[("weights/x", b"...", false)]));
    assert!(text.starts_with("/d/m.pth is a Python pickle"), "{text}");
    // An object array inside an archive.
    let object = npy(&dict("'|O'", "(1,)"), b"\x80\x02N.");
    let text = refusal(NPZ, &zip(&[("o.npy", &object, false)]));
    assert!(
        text.starts_with(&format!(
            "{NPZ} member \"o.npy\" holds a numpy object array (descr |O)"
        )),
        "{text}"
    );
}

#[test]
fn npz_encrypted_members_are_refused() {
    let one = npy(&dict("'|u1'", "(1,)"), &[3]);
    let mut bytes = zip(&[("a.npy", &one, false)]);
    // Set the "encrypted" flag bit in the local and central headers.
    for (signature, flags_at) in [(&b"PK\x03\x04"[..], 6), (&b"PK\x01\x02"[..], 8)] {
        let at = bytes
            .windows(4)
            .position(|w| w == signature)
            .expect("header");
        bytes[at + flags_at] |= 1;
    }
    assert_eq!(
        refusal(NPZ, &bytes),
        format!(
            "{NPZ} uses an encrypted member (number 0), which wasmrpc does not read; an .npz \
             archive holds only .npy members, stored or deflated, unencrypted."
        )
    );
}

#[test]
fn npz_empty_archive_has_no_tensors() {
    assert_eq!(read(NPZ, &zip(&[]), LIMIT).map(|t| t.len()).ok(), Some(0));
}
