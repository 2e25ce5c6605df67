//! Tests of `wire`.

use super::*;

fn round_trip(ts: &[Tensor]) -> Vec<Tensor> {
    let (wire, descs, blobs) = encode_tensors(ts).unwrap();
    let bytes: Vec<u8> = crate::abi::encode(&wire).unwrap();
    let wire: Vec<WireTensor> = crate::abi::decode(&bytes).unwrap();
    let mut decoded: Vec<DecodedBlob> = descs
        .iter()
        .map(|d| DecodedBlob::new(*d).unwrap())
        .collect();
    for (d, b) in decoded.iter_mut().zip(&blobs) {
        d.bytes_mut().copy_from_slice(b.as_bytes());
    }
    decode_tensors(&wire, &decoded, &[]).unwrap()
}

#[test]
fn non_contiguous_view_keeps_strides_and_offset() {
    let t = Tensor::rand([5, 5], (Kind::Float, Device::Cpu));
    let view = t.narrow(1, 2, 2);
    let got = round_trip(&[view.shallow_clone()]);
    assert!(!got[0].is_contiguous());
    assert_eq!(got[0].stride(), view.stride());
    assert_eq!(got[0].storage_offset(), view.storage_offset());
    assert!(got[0].equal(&view));
}

#[test]
fn shared_storage_is_shared_again() {
    let t = Tensor::arange(10, (Kind::Int64, Device::Cpu));
    let a = t.narrow(0, 0, 4);
    let b = t.narrow(0, 5, 5);
    let (_, descs, _) = encode_tensors(&[a.shallow_clone(), b.shallow_clone()]).unwrap();
    assert_eq!(descs.len(), 1);
    let got = round_trip(&[a, b]);
    let _ = got[0].narrow(0, 0, 1).fill_(42);
    // Element 0 of the shared storage is visible through the other view's
    // storage base: both views index the same blob.
    let base = got[1].as_strided([10], [1], 0);
    assert_eq!(base.int64_value(&[0]), 42);
    assert_eq!(got[1].int64_value(&[0]), 5);
}

#[test]
fn empty_sparse_and_grad_tensors_round_trip() {
    let empty = Tensor::ones([0, 3], (Kind::Float, Device::Cpu));
    let i = Tensor::from_slice2(&[[0i64, 1, 1], [2, 0, 2]]);
    let v = Tensor::from_slice(&[3.0f32, 4.0, 5.0]);
    let sparse =
        Tensor::sparse_coo_tensor_indices_size(&i, &v, [2, 3], (Kind::Float, Device::Cpu), false);
    let grad = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let got = round_trip(&[empty, sparse.shallow_clone(), grad]);
    assert_eq!(got[0].size(), vec![0, 3]);
    assert!(got[1].is_sparse());
    assert!(
        got[1]
            .to_dense(None, false)
            .equal(&sparse.to_dense(None, false))
    );
    assert!(got[2].requires_grad());
}

#[test]
fn views_outside_the_blob_are_rejected() {
    let d = DenseDesc {
        dtype: 6,
        size: vec![4],
        stride: vec![1],
        offset: 1,
        blob: Some(0),
    };
    let blob = DecodedBlob::new(BlobDesc { dtype: 6, len: 16 }).unwrap();
    let wire = [WireTensor::Dense {
        desc: d,
        requires_grad: false,
    }];
    assert!(decode_tensors(&wire, &[blob], &[]).is_err());
    assert!(DecodedBlob::new(BlobDesc { dtype: 6, len: 3 }).is_err());
    assert!(DecodedBlob::new(BlobDesc { dtype: 99, len: 4 }).is_err());
}
