//! Rebuilding a message's tensors from their descriptors and the received
//! storage blobs, checking every descriptor against its blob: a hostile
//! frame cannot make a tensor read outside what it sent.

use std::panic::{AssertUnwindSafe, catch_unwind};

use tch::{Device, Kind, Tensor};

use super::{BlobDesc, DenseDesc, WireTensor, extent, kind_from_code};
use crate::error::{Error, Result};

/// The most dimensions a received tensor may have.
const MAX_DIMS: usize = 64;

impl DenseDesc {
    /// Whether the view starts at its blob's first element and is laid out
    /// contiguously, as a tensor allocated in its shape would be.
    fn is_contiguous_from_start(&self) -> bool {
        if self.offset != 0 || self.size.len() != self.stride.len() {
            return false;
        }
        let mut expected = 1i64;
        for (&size, &stride) in self.size.iter().zip(&self.stride).rev() {
            if stride != expected {
                return false;
            }
            match expected.checked_mul(size.max(1)) {
                Some(next) => expected = next,
                None => return false,
            }
        }
        true
    }
}

impl WireTensor {
    /// The dense descriptors this entry is built from.
    fn dense_descs(&self) -> impl Iterator<Item = &DenseDesc> {
        let (first, second) = match self {
            WireTensor::Dense { desc, .. } => (desc, None),
            WireTensor::SparseCoo {
                indices, values, ..
            } => (indices, Some(values)),
        };
        std::iter::once(first).chain(second)
    }
}

/// For each of `blob_count` blobs, the size of the one tensor it becomes
/// (WIRE-1), or `None`.
///
/// WIRE-1: a blob that exactly one descriptor of the message uses, as a
/// contiguous view from its first element, is allocated in that view's
/// shape ([`DecodedBlob::new`]) and becomes the tensor itself: no view is
/// made of it. Making one (`as_strided`) goes through libtorch's autograd
/// and view-tracking layers and cost more than a small call's whole op in
/// the callee's profile. A blob that several descriptors share stays one
/// 1-D storage that each of them views, so they share it as the sender's
/// tensors did.
pub(crate) fn sole_shapes(tensors: &[WireTensor], blob_count: usize) -> Vec<Option<&[i64]>> {
    let mut users: Vec<(u32, Option<&DenseDesc>)> = vec![(0, None); blob_count];
    for desc in tensors.iter().flat_map(WireTensor::dense_descs) {
        if let Some(user) = desc.blob.and_then(|i| users.get_mut(i as usize)) {
            *user = (user.0 + 1, Some(desc));
        }
    }
    users
        .into_iter()
        .map(|(count, desc)| match desc {
            Some(d) if count == 1 && d.is_contiguous_from_start() => Some(d.size.as_slice()),
            _ => None,
        })
        .collect()
}

/// For each of `blob_count` blobs, the CUDA device it lands on, when every
/// tensor of the message that uses it is dense and lands on that one device
/// (`devices`, the sender's device map's choice); `None` otherwise. Only
/// such a storage may cross through a CUDA segment (SHM-7), copied
/// straight into a tensor on that device; through host memory, it is moved
/// to that device whole. Either way every view of it is made there, so
/// tensors that share a CUDA storage share it on arrival.
pub(crate) fn cuda_landings(
    tensors: &[WireTensor],
    devices: &[crate::device::Device],
    blob_count: usize,
) -> Vec<Option<u32>> {
    #[derive(Clone, Copy)]
    enum Landing {
        Unused,
        On(u32),
        Mixed,
    }
    let mut landings = vec![Landing::Unused; blob_count];
    for (i, tensor) in tensors.iter().enumerate() {
        let cuda = match (tensor, devices.get(i)) {
            (WireTensor::Dense { .. }, Some(crate::device::Device::Cuda(d))) => Some(*d),
            _ => None,
        };
        for desc in tensor.dense_descs() {
            let Some(landing) = desc.blob.and_then(|b| landings.get_mut(b as usize)) else {
                continue;
            };
            *landing = match (*landing, cuda) {
                (Landing::Unused, Some(d)) => Landing::On(d),
                (Landing::On(e), Some(d)) if e == d => Landing::On(d),
                _ => Landing::Mixed,
            };
        }
    }
    landings
        .into_iter()
        .map(|l| match l {
            Landing::On(d) => Some(d),
            Landing::Unused | Landing::Mixed => None,
        })
        .collect()
}

/// A received storage: a contiguous tensor the frame's bytes are read into,
/// 1-D or in the shape of its sole user (WIRE-1).
///
/// Storages of 1 MiB or more come from recycled memory
/// (`wasmrpc_torch_sys::recycle`), whose pages are already faulted in and
/// which holds an earlier tensor's bytes: whoever makes a `DecodedBlob`
/// fills the whole of [`bytes_mut`](Self::bytes_mut) before decoding it, or
/// drops it (REC-1).
#[derive(Debug)]
pub(crate) struct DecodedBlob {
    /// Visible to `wire`'s tests, which check the shape it was allocated in.
    pub(super) tensor: Tensor,
    dtype: u8,
    len: usize,
}

impl DecodedBlob {
    /// Allocates the storage for `desc` in host memory, in `shape` when it
    /// is given and holds exactly the blob's elements (WIRE-1), else as a
    /// 1-D tensor.
    ///
    /// # Errors
    /// Fails for an unknown dtype or a length that is not a whole number of
    /// elements.
    #[cfg(test)]
    pub(crate) fn new(desc: BlobDesc, shape: Option<&[i64]>) -> Result<Self> {
        Self::new_on(desc, shape, Device::Cpu)
    }

    /// Allocates the storage for `desc` on `device`, in `shape` when it is
    /// given and holds exactly the blob's elements (WIRE-1), else as a 1-D
    /// tensor. A CUDA storage is filled by a
    /// device copy ([`address`](Self::address)), never through
    /// [`bytes_mut`](Self::bytes_mut).
    ///
    /// # Errors
    /// Fails for an unknown dtype, a length that is not a whole number of
    /// elements, and when libtorch cannot allocate on `device`.
    pub(crate) fn new_on(desc: BlobDesc, shape: Option<&[i64]>, device: Device) -> Result<Self> {
        let kind = kind_from_code(desc.dtype)
            .ok_or_else(|| Error::runtime(format!("unknown tensor dtype code {}", desc.dtype)))?;
        let elsize = kind.elt_size_in_bytes() as u64;
        if desc.len == 0 || !desc.len.is_multiple_of(elsize) {
            return Err(Error::runtime(format!(
                "storage blob of {} bytes is not a whole number of {kind:?} elements",
                desc.len
            )));
        }
        let len = usize::try_from(desc.len)
            .map_err(|_| Error::runtime("storage blob larger than the address space"))?;
        let numel = (desc.len / elsize) as i64;
        let flat = [numel];
        // Sizes come from a peer's header: only a shape `decode_dense` would
        // accept anyway is given to libtorch.
        let shape = shape
            .filter(|s| s.len() <= MAX_DIMS && s.iter().all(|&d| d >= 0))
            .filter(|s| s.iter().try_fold(1i64, |n, &d| n.checked_mul(d)) == Some(numel))
            .unwrap_or(&flat);
        let tensor = if device == Device::Cpu {
            wasmrpc_torch_sys::recycle::for_overwrite(|| Tensor::f_empty(shape, (kind, device)))?
        } else {
            // tch panics on some device errors rather than failing.
            catch_unwind(|| Tensor::f_empty(shape, (kind, device)))
                .map_err(|_| Error::runtime(format!("libtorch cannot allocate on {device:?}")))??
        };
        Ok(DecodedBlob {
            tensor,
            dtype: desc.dtype,
            len,
        })
    }

    /// Where the storage starts (a device address on a CUDA device).
    pub(crate) fn address(&self) -> u64 {
        self.tensor.data_ptr() as u64
    }

    /// The storage's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Moves the filled storage to `device` (one copy), where every view
    /// of it is then made.
    ///
    /// # Errors
    /// Fails when libtorch cannot copy it there.
    pub(crate) fn move_to(&mut self, device: Device) -> Result<()> {
        let tensor = &self.tensor;
        self.tensor =
            catch_unwind(AssertUnwindSafe(|| tensor.f_to_device(device))).map_err(|_| {
                Error::runtime(format!("libtorch cannot move a tensor to {device:?}"))
            })??;
        Ok(())
    }

    /// The storage bytes, to be filled from the network (contiguous, in
    /// whatever shape the blob was allocated).
    ///
    /// # Panics
    /// For a storage allocated on a CUDA device.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(
            self.tensor.device() == Device::Cpu,
            "host bytes of a CUDA storage"
        );
        // SAFETY: `tensor` is a contiguous CPU tensor created by `f_empty`
        // with exactly `len` bytes (checked to be non-zero, so `data_ptr` is
        // a real allocation), owned by `self` and not yet shared with anyone:
        // the exclusive borrow of `self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.tensor.data_ptr() as *mut u8, self.len) }
    }
}

/// The tensor `d` describes; `sole`: [`sole_shapes`] of the message.
fn decode_dense(d: &DenseDesc, blobs: &[DecodedBlob], sole: &[Option<&[i64]>]) -> Result<Tensor> {
    let kind = kind_from_code(d.dtype)
        .ok_or_else(|| Error::runtime(format!("unknown tensor dtype code {}", d.dtype)))?;
    if d.size.len() != d.stride.len() || d.size.len() > MAX_DIMS {
        return Err(Error::runtime(
            "tensor descriptor with mismatched size and strides",
        ));
    }
    if d.size.iter().any(|&s| s < 0) || d.stride.iter().any(|&s| s < 0) || d.offset < 0 {
        return Err(Error::runtime(
            "tensor descriptor with negative sizes, strides or offset",
        ));
    }
    let numel = d.size.iter().try_fold(1i64, |acc, &s| acc.checked_mul(s));
    match d.blob {
        None => {
            if numel != Some(0) {
                return Err(Error::runtime("non-empty tensor without a storage blob"));
            }
            Ok(Tensor::f_empty_strided(
                &d.size,
                &d.stride,
                (kind, Device::Cpu),
            )?)
        }
        Some(i) => {
            let blob = blobs
                .get(i as usize)
                .ok_or_else(|| Error::runtime(format!("tensor refers to missing blob {i}")))?;
            if blob.dtype != d.dtype {
                return Err(Error::runtime(
                    "tensor dtype differs from its storage blob's",
                ));
            }
            let available = (blob.len / kind.elt_size_in_bytes()) as i64;
            match (numel, extent(&d.size, &d.stride, d.offset)) {
                (Some(n), Some(end)) if n > 0 && end <= available => {}
                _ => {
                    return Err(Error::runtime(
                        "tensor view reaches outside its storage blob",
                    ));
                }
            }
            let is_the_blob =
                sole.get(i as usize).copied().flatten().is_some() && blob.tensor.size() == d.size;
            if is_the_blob {
                // WIRE-1: `d` is the blob's only user and the blob was
                // allocated in its shape, so the storage's tensor is `d`.
                return Ok(blob.tensor.shallow_clone());
            }
            Ok(blob.tensor.f_as_strided(&d.size, &d.stride, d.offset)?)
        }
    }
}

fn check_sparse(size: &[i64], indices: &Tensor, values: &Tensor) -> Result<()> {
    if indices.f_kind()? != Kind::Int64 || indices.dim() != 2 {
        return Err(Error::runtime("sparse indices must be a 2-D int64 tensor"));
    }
    let isz = indices.size();
    let (sparse_dim, nnz) = (isz[0], isz[1]);
    let vsz = values.size();
    if vsz.is_empty() || vsz[0] != nnz || sparse_dim as usize + vsz.len() - 1 != size.len() {
        return Err(Error::runtime(
            "sparse values do not match the indices and size",
        ));
    }
    if vsz[1..] != size[sparse_dim as usize..] || size.iter().any(|&s| s < 0) {
        return Err(Error::runtime(
            "sparse values' dense dimensions do not match the size",
        ));
    }
    if nnz > 0 && sparse_dim > 0 {
        let min = indices.f_min()?.f_int64_value(&[])?;
        let max_per_dim = indices.f_amax([1i64].as_slice(), false)?;
        let mut in_range = min >= 0;
        for (d, &bound) in size.iter().enumerate().take(sparse_dim as usize) {
            in_range &= max_per_dim.f_int64_value(&[d as i64])? < bound;
        }
        if !in_range {
            return Err(Error::runtime(
                "sparse indices out of bounds of the tensor's size",
            ));
        }
    }
    Ok(())
}

/// Rebuilds a message's tensors from their descriptors and received blobs.
///
/// Views of one blob share its storage. Every descriptor is checked against
/// its blob, so a hostile frame cannot make a view read outside it.
///
/// # Errors
/// Fails on any inconsistent descriptor.
///
/// `devices`: where each tensor lands (the sender's device map chose it);
/// empty: all on the CPU. A tensor moved to a CUDA device is moved before
/// `requires_grad` is set, so it arrives as a leaf as CPU tensors do.
pub(crate) fn decode_tensors(
    wire: &[WireTensor],
    blobs: &[DecodedBlob],
    devices: &[crate::device::Device],
) -> Result<Vec<Tensor>> {
    if !devices.is_empty() && devices.len() != wire.len() {
        return Err(Error::runtime(format!(
            "malformed frame: {} tensors but {} target devices",
            wire.len(),
            devices.len()
        )));
    }
    let place = |i: usize, t: Tensor| -> Result<Tensor> {
        match devices.get(i) {
            Some(d) if d.is_cuda() => Ok(t.f_to_device(d.to_tch())?),
            _ => Ok(t),
        }
    };
    // Worked out here again, not taken from whoever allocated the blobs:
    // handing a blob's own tensor out is safe only if this message's
    // descriptors give it one user (WIRE-1).
    let sole = sole_shapes(wire, blobs.len());
    let decode = || -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(wire.len());
        for (i, w) in wire.iter().enumerate() {
            let t = match w {
                WireTensor::Dense {
                    desc,
                    requires_grad,
                } => {
                    let t = place(i, decode_dense(desc, blobs, &sole)?)?;
                    if *requires_grad {
                        t.f_set_requires_grad(true)?
                    } else {
                        t
                    }
                }
                WireTensor::SparseCoo {
                    size,
                    indices,
                    values,
                    coalesced,
                    requires_grad,
                } => {
                    let indices = decode_dense(indices, blobs, &sole)?;
                    let values = decode_dense(values, blobs, &sole)?;
                    check_sparse(size, &indices, &values)?;
                    let kind = values.f_kind()?;
                    let t = Tensor::f_sparse_coo_tensor_indices_size(
                        &indices,
                        &values,
                        size.as_slice(),
                        (kind, Device::Cpu),
                        *coalesced,
                    )?;
                    let t = place(i, t)?;
                    if *requires_grad {
                        t.f_set_requires_grad(true)?
                    } else {
                        t
                    }
                }
            };
            out.push(t);
        }
        Ok(out)
    };
    match catch_unwind(AssertUnwindSafe(decode)) {
        Ok(r) => r,
        Err(_) => Err(Error::runtime("libtorch rejected a received tensor")),
    }
}
