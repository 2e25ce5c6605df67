//! Tests of `wire`.

use super::*;

fn round_trip(ts: &[Tensor]) -> Vec<Tensor> {
    let (wire, descs, blobs) = encode_tensors(ts).unwrap();
    let bytes: Vec<u8> = crate::abi::encode(&wire).unwrap();
    let wire: Vec<WireTensor> = crate::abi::decode(&bytes).unwrap();
    let shapes = sole_shapes(&wire, descs.len());
    let mut decoded: Vec<DecodedBlob> = descs
        .iter()
        .zip(shapes)
        .map(|(d, shape)| DecodedBlob::new(*d, shape).unwrap())
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
    let blob = DecodedBlob::new(BlobDesc { dtype: 6, len: 16 }, None).unwrap();
    let wire = [WireTensor::Dense {
        desc: d,
        requires_grad: false,
    }];
    assert!(decode_tensors(&wire, &[blob], &[]).is_err());
    assert!(DecodedBlob::new(BlobDesc { dtype: 6, len: 3 }, None).is_err());
    assert!(DecodedBlob::new(BlobDesc { dtype: 99, len: 4 }, None).is_err());
}

/// The descriptors `ts` are sent as, and their blobs' [`sole_shapes`].
fn shapes_of(ts: &[Tensor]) -> Vec<Option<Vec<i64>>> {
    let (wire, descs, _) = encode_tensors(ts).unwrap();
    sole_shapes(&wire, descs.len())
        .into_iter()
        .map(|s| s.map(<[i64]>::to_vec))
        .collect()
}

#[test]
fn only_a_blob_with_one_contiguous_user_from_its_start_arrives_in_its_shape() {
    let t = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
    let scalar = Tensor::from(7.0f64);
    assert_eq!(
        shapes_of(&[t.shallow_clone(), scalar]),
        vec![Some(vec![2, 3]), Some(vec![])]
    );
    // A transposed view, a view from an offset, and a blob two tensors
    // share are all views of a 1-D storage.
    assert_eq!(shapes_of(&[t.tr()]), vec![None]);
    assert_eq!(shapes_of(&[t.narrow(0, 1, 1)]), vec![None]);
    assert_eq!(
        shapes_of(&[t.shallow_clone(), t.shallow_clone()]),
        vec![None]
    );
    let i = Tensor::from_slice2(&[[0i64, 1]]);
    let v = Tensor::from_slice(&[3.0f32, 4.0]);
    let sparse =
        Tensor::sparse_coo_tensor_indices_size(&i, &v, [2], (Kind::Float, Device::Cpu), false);
    assert_eq!(shapes_of(&[sparse]), vec![Some(vec![1, 2]), Some(vec![2])]);
}

#[test]
fn tensors_decoded_whole_keep_their_values_strides_and_grad() {
    let t = Tensor::arange(24, (Kind::Int64, Device::Cpu)).view([2, 3, 4]);
    let grad = Tensor::ones([3, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let got = round_trip(&[t.shallow_clone(), grad, Tensor::from(7.0f64)]);
    assert!(got[0].equal(&t));
    assert_eq!(got[0].stride(), t.stride());
    assert!(got[1].requires_grad() && got[1].is_leaf());
    assert_eq!(got[1].size(), vec![3, 2]);
    assert_eq!(got[2].size(), Vec::<i64>::new());
    assert_eq!(got[2].double_value(&[]), 7.0);
}

#[test]
fn tensors_sharing_a_whole_blob_stay_distinct_tensors_of_one_storage() {
    let t = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    let got = round_trip(&[t.shallow_clone(), t]);
    let first = got[0].set_requires_grad(true);
    assert!(first.requires_grad());
    assert!(
        !got[1].requires_grad(),
        "the two tensors share one TensorImpl"
    );
    let _ = got[1].view([4]).narrow(0, 0, 1).fill_(5.0);
    assert_eq!(
        got[0].double_value(&[0, 0]),
        5.0,
        "the storage is not shared"
    );
}

#[test]
fn a_blob_allocated_flat_still_decodes_its_sole_user() {
    let (wire, descs, blobs) =
        encode_tensors(&[Tensor::arange(6, (Kind::Float, Device::Cpu)).view([3, 2])]).unwrap();
    for shape in [None, Some([5i64].as_slice())] {
        // No shape, or one that does not hold the blob's 6 elements.
        let mut blob = DecodedBlob::new(descs[0], shape).unwrap();
        blob.bytes_mut().copy_from_slice(blobs[0].as_bytes());
        let got = decode_tensors(&wire, &[blob], &[]).unwrap();
        assert_eq!(got[0].size(), vec![3, 2]);
        assert_eq!(got[0].double_value(&[2, 1]), 5.0);
    }
}

#[test]
fn a_hostile_sole_shape_is_never_allocated_and_its_descriptor_is_rejected() {
    // Sizes whose product is the blob's 4 elements, but negative, or in
    // more dimensions than any tensor may have.
    let negative = vec![-1i64, -4];
    let too_many = vec![1i64; 65];
    for (size, why) in [
        (
            negative,
            "tensor descriptor with negative sizes, strides or offset",
        ),
        (
            too_many,
            "tensor descriptor with mismatched size and strides",
        ),
    ] {
        let wire = [WireTensor::Dense {
            desc: DenseDesc {
                dtype: 6,
                // Strides that make it a contiguous view from the start.
                stride: vec![1; size.len()],
                size,
                offset: 0,
                blob: Some(0),
            },
            requires_grad: false,
        }];
        let shapes = sole_shapes(&wire, 1);
        assert!(shapes[0].is_some(), "the header offers its shape");
        let blob = DecodedBlob::new(BlobDesc { dtype: 6, len: 16 }, shapes[0]).unwrap();
        assert_eq!(blob.tensor.size(), vec![4], "allocated flat");
        let err = decode_tensors(&wire, &[blob], &[]).unwrap_err();
        assert!(err.message().contains(why), "{}", err.message());
    }
}

#[test]
fn only_a_storage_every_user_reads_densely_on_one_cuda_device_lands_there() {
    use crate::device::Device::{Cpu, Cuda};
    // Descriptors as a CPU sender makes them; the landing devices are what
    // a device map would choose.
    let base = Tensor::arange(16, (Kind::Float, Device::Cpu));
    let other = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let sparse = Tensor::eye(3, (Kind::Float, Device::Cpu)).to_sparse_sparse_dim(2);
    let tensors = [
        base.narrow(0, 0, 8),
        base.narrow(0, 8, 8),
        other.shallow_clone(),
        sparse,
    ];
    let (wire, descs, _) = encode_tensors(&tensors).unwrap();
    // Blobs: 0 = base's storage (two views), 1 = other's, then the sparse
    // tensor's indices and values.
    assert_eq!(descs.len(), 4);
    let landings = |devices: &[crate::device::Device]| cuda_landings(&wire, devices, descs.len());
    assert_eq!(
        landings(&[Cuda(1), Cuda(1), Cuda(0), Cuda(0)]),
        [Some(1), Some(0), None, None],
        "a sparse tensor's parts never land in CUDA segments"
    );
    assert_eq!(
        landings(&[Cuda(1), Cuda(0), Cpu, Cuda(0)]),
        [None, None, None, None],
        "views of one storage on two devices, and a storage landing on the CPU"
    );
    assert_eq!(
        landings(&[]),
        [None, None, None, None],
        "no device map: all on the CPU"
    );
}

/// A sparse tensor with no sparse dimension (indices of shape `(0, nnz)`,
/// which ops make of a sparse input reduced to its dense part) has no
/// index to check: it travels, where the bounds check once took the
/// minimum of an empty tensor and refused the whole frame (found by the op
/// fuzzer: the receiver then closed the connection).
#[test]
fn a_sparse_tensor_without_sparse_dimensions_round_trips() {
    let dense = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
    let indices = Tensor::zeros([0, 1], (Kind::Int64, Device::Cpu));
    let sparse = Tensor::sparse_coo_tensor_indices_size(
        &indices,
        &dense.unsqueeze(0),
        [3],
        (Kind::Float, Device::Cpu),
        false,
    );
    assert_eq!(sparse.sparse_dim(), 0);
    let got = round_trip(&[sparse]);
    assert!(got[0].is_sparse());
    assert!(got[0].to_dense(None, false).equal(&dense));
}
