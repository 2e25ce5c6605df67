//! Real files written by numpy and Python's safetensors (see
//! `fixtures/make.py`), read back and checked value by value.

use std::collections::BTreeMap;

use wasmrpc_tensor_files::{
    DType, FileError, Format, TensorBytes, detect, read, read_with_metadata,
};

const LIMIT: u64 = 1 << 20;

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn f64s(data: &[u8]) -> Vec<f64> {
    data.chunks_exact(8)
        .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

fn i64s(data: &[u8]) -> Vec<i64> {
    data.chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

/// Reads a file expected to hold exactly one tensor, named `name`.
fn one(file: &str, bytes: &[u8], name: &str) -> TensorBytes {
    let mut tensors = read(file, bytes, LIMIT).expect("a valid fixture reads");
    assert_eq!(tensors.len(), 1);
    let (got, tensor) = tensors.remove(0);
    assert_eq!(got, name);
    tensor
}

#[test]
fn npy_float32() {
    let t = one("/data/f4.npy", include_bytes!("fixtures/f4.npy"), "f4");
    assert_eq!((t.dtype, t.shape.as_slice()), (DType::Float32, &[2, 3][..]));
    assert_eq!(f32s(&t.data), [1.5, -2.0, 3.25, 0.0, 1e-3, 7.0]);
}

#[test]
fn npy_float64_int64_bool_uint8() {
    let t = one("/data/f8.npy", include_bytes!("fixtures/f8.npy"), "f8");
    assert_eq!((t.dtype, t.shape.as_slice()), (DType::Float64, &[3][..]));
    assert_eq!(f64s(&t.data), [1.0, -0.5, 1e300]);

    let t = one("/data/i8.npy", include_bytes!("fixtures/i8.npy"), "i8");
    assert_eq!((t.dtype, t.shape.as_slice()), (DType::Int64, &[4][..]));
    assert_eq!(i64s(&t.data), [0, -1, 1 << 62, i64::MIN]);

    let t = one(
        "/data/bool.npy",
        include_bytes!("fixtures/bool.npy"),
        "bool",
    );
    assert_eq!(
        (t.dtype, t.shape.as_slice(), t.data.as_slice()),
        (DType::Bool, &[3][..], &[1, 0, 1][..])
    );

    let t = one("/data/u1.npy", include_bytes!("fixtures/u1.npy"), "u1");
    assert_eq!(
        (t.dtype, t.shape.as_slice(), t.data.as_slice()),
        (DType::UInt8, &[2, 2][..], &[0, 1, 254, 255][..])
    );
}

#[test]
fn npy_big_endian_is_byteswapped() {
    let t = one(
        "/data/big_endian.npy",
        include_bytes!("fixtures/big_endian.npy"),
        "big_endian",
    );
    assert_eq!(t.dtype, DType::Float32);
    assert_eq!(f32s(&t.data), [1.0, -2.5, 3.0]);
}

#[test]
fn npy_fortran_order_becomes_c_order() {
    let t = one(
        "/data/fortran.npy",
        include_bytes!("fixtures/fortran.npy"),
        "fortran",
    );
    assert_eq!((t.dtype, t.shape.as_slice()), (DType::Int32, &[2, 3][..]));
    let values: Vec<i32> = t
        .data
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(values, [0, 1, 2, 3, 4, 5]);
}

#[test]
fn npy_scalar_empty_and_version_2() {
    let t = one(
        "/data/scalar.npy",
        include_bytes!("fixtures/scalar.npy"),
        "scalar",
    );
    assert_eq!((t.dtype, t.shape.len()), (DType::Float64, 0));
    assert_eq!(f64s(&t.data), [42.0]);

    let t = one(
        "/data/empty.npy",
        include_bytes!("fixtures/empty.npy"),
        "empty",
    );
    assert_eq!(
        (t.dtype, t.shape.as_slice(), t.data.len()),
        (DType::Float32, &[0, 3][..], 0)
    );

    let t = one(
        "/data/version2.npy",
        include_bytes!("fixtures/version2.npy"),
        "version2",
    );
    assert_eq!(
        (t.dtype, t.shape.as_slice(), t.data.as_slice()),
        (DType::Int16, &[2][..], &[7, 0, 8, 0][..])
    );
}

fn check_npz(file: &str, bytes: &[u8]) {
    assert_eq!(detect(file, bytes).ok(), Some(Format::Npz));
    let tensors = read(file, bytes, LIMIT).expect("a valid npz reads");
    let names: Vec<&str> = tensors.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let (a, b) = (&tensors[0].1, &tensors[1].1);
    assert_eq!((a.dtype, a.shape.as_slice()), (DType::Float32, &[2][..]));
    assert_eq!(f32s(&a.data), [1.0, 2.0]);
    assert_eq!((b.dtype, b.shape.as_slice()), (DType::Int64, &[2, 2][..]));
    assert_eq!(i64s(&b.data), [1, 2, 3, 4]);
    // The limit counts decompressed data: a + b are 8 + 32 bytes.
    assert!(read(file, bytes, 40).is_ok());
    let error = read(file, bytes, 39).expect_err("over the limit");
    assert!(
        matches!(error, FileError::LimitExceeded { limit: 39, .. }),
        "{error}"
    );
}

#[test]
fn npz_stored_and_compressed() {
    check_npz("/data/stored.npz", include_bytes!("fixtures/stored.npz"));
    check_npz(
        "/data/compressed.npz",
        include_bytes!("fixtures/compressed.npz"),
    );
}

#[test]
fn safetensors_from_python_with_metadata() {
    let bytes = include_bytes!("fixtures/model.safetensors");
    let file = "/data/model.safetensors";
    assert_eq!(detect(file, bytes).ok(), Some(Format::SafeTensors));
    let (tensors, metadata) = read_with_metadata(file, bytes, LIMIT).expect("a valid file reads");
    let expected_metadata: BTreeMap<String, String> = [("format", "np"), ("author", "make.py")]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
    assert_eq!(metadata, expected_metadata);
    // Python's writer orders by element size, then name: the offsets'
    // order is the file's.
    let names: Vec<&str> = tensors.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["steps", "weight", "bias"]);
    let by_name: BTreeMap<&str, &TensorBytes> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let weight = by_name["weight"];
    assert_eq!(
        (weight.dtype, weight.shape.as_slice()),
        (DType::Float32, &[2, 2][..])
    );
    assert_eq!(f32s(&weight.data), [1.0, 2.0, 3.0, 4.0]);
    let bias = by_name["bias"];
    // 0.5 in IEEE half precision is 0x3800.
    assert_eq!(
        (bias.dtype, bias.shape.as_slice(), bias.data.as_slice()),
        (DType::Float16, &[1][..], &[0x00, 0x38][..])
    );
    let steps = by_name["steps"];
    assert_eq!((steps.dtype, steps.shape.len()), (DType::Int64, 0));
    assert_eq!(i64s(&steps.data), [3]);
    // The metadata is safetensors-only; `read` drops it.
    assert_eq!(read(file, bytes, LIMIT).ok().map(|t| t.len()), Some(3));
    let error = read(file, bytes, 4 + 2 + 16 - 1).expect_err("over the limit");
    assert!(matches!(error, FileError::LimitExceeded { .. }), "{error}");
}

/// The conversion advice every pickle refusal gives, for this file.
fn pickle_advice(file: &str) -> String {
    format!(
        "{file} is a Python pickle (as torch.save writes), and wasmrpc never loads pickles: \
         unpickling runs whatever code the file's author chose. Convert it once where torch \
         runs, with safetensors.torch.save_file(torch.load(\"{file}\", weights_only=True), \
         \"{file}.safetensors\"), and load the .safetensors file instead."
    )
}

#[test]
fn torch_save_archives_are_refused_as_pickles() {
    let file = "/ckpt/model.pt";
    let bytes = include_bytes!("fixtures/torch_save.pt");
    // A zip, so detection alone cannot tell; reading does.
    assert_eq!(detect(file, bytes).ok(), Some(Format::Npz));
    let error = read(file, bytes, LIMIT).expect_err("a pickle");
    assert!(matches!(error, FileError::Pickle { .. }));
    assert!(error.is_value_error());
    assert_eq!(error.to_string(), pickle_advice(file));
    // Whatever the name.
    let error = read("/ckpt/model.npz", bytes, LIMIT).expect_err("a pickle");
    assert_eq!(error.to_string(), pickle_advice("/ckpt/model.npz"));
}

#[test]
fn raw_pickles_are_refused() {
    let bytes = include_bytes!("fixtures/raw.pkl");
    for file in ["/ckpt/raw.pkl", "/ckpt/raw.safetensors", "/ckpt/raw"] {
        let error = detect(file, bytes).expect_err("a pickle");
        assert_eq!(error.to_string(), pickle_advice(file));
        let error = read(file, bytes, LIMIT).expect_err("a pickle");
        assert_eq!(error.to_string(), pickle_advice(file));
    }
}

#[test]
fn pickle_extensions_on_unknown_contents_are_refused_as_pickles() {
    // Protocol 0 pickles have no 0x80 opening; the name gives them away.
    let bytes = b"(dp0\nVweight\np1\nI1\ns.";
    for extension in ["pt", "pth", "pkl", "ckpt", "bin", "PT"] {
        let file = format!("/ckpt/model.{extension}");
        let error = read(&file, bytes, LIMIT).expect_err("a pickle");
        assert_eq!(error.to_string(), pickle_advice(&file));
    }
    let error = read("/ckpt/model.txt", bytes, LIMIT).expect_err("unknown");
    assert_eq!(
        error.to_string(),
        "/ckpt/model.txt is in a format wasmrpc does not read: it reads safetensors files, numpy \
         .npy files and numpy .npz archives."
    );
    assert!(error.is_value_error());
}

#[test]
fn object_arrays_are_refused_as_pickles() {
    let file = "/data/object.npy";
    let error = read(file, include_bytes!("fixtures/object.npy"), LIMIT).expect_err("a pickle");
    assert!(matches!(error, FileError::ObjectArray { .. }), "{error}");
    let text = error.to_string();
    assert!(
        text.starts_with(
            "/data/object.npy holds a numpy object array (descr |O), which numpy stores as a \
             Python pickle, and wasmrpc never loads pickles"
        ),
        "{text}"
    );
    assert!(text.contains("safetensors.numpy.save_file"), "{text}");
}
