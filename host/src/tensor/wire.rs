//! Tensor descriptors and storage blobs: encoding a message's tensors and
//! rebuilding them from network bytes.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// libtorch's `ScalarType` number for `kind` (the one table is
/// `wasmrpc_torch_sys::kind_code`), or `None` for kinds that do not travel
/// (quantized ones).
pub(crate) fn kind_to_code(kind: Kind) -> Option<u8> {
    if matches!(kind, Kind::QInt8 | Kind::QUInt8 | Kind::QInt32) {
        return None;
    }
    u8::try_from(wasmrpc_torch_sys::kind_code(kind)).ok()
}

/// The kind for a code written by [`kind_to_code`].
pub(crate) fn kind_from_code(code: u8) -> Option<Kind> {
    wasmrpc_torch_sys::kind_of_code(i64::from(code))
        .filter(|k| !matches!(k, Kind::QInt8 | Kind::QUInt8 | Kind::QInt32))
}

/// A dense strided tensor: where its elements sit in a blob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct DenseDesc {
    dtype: u8,
    size: Vec<i64>,
    stride: Vec<i64>,
    /// Storage offset in elements, from the start of the blob.
    offset: i64,
    /// The blob holding the storage; `None` for 0-element tensors.
    blob: Option<u32>,
}

/// One entry of a message's tensor table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum WireTensor {
    /// A dense (strided) tensor.
    Dense {
        /// Its layout.
        desc: DenseDesc,
        /// Whether the tensor requires grad.
        requires_grad: bool,
    },
    /// A sparse COO tensor.
    SparseCoo {
        /// The full (sparse + dense) size.
        size: Vec<i64>,
        /// The `[sparse_dim, nnz]` int64 indices.
        indices: DenseDesc,
        /// The `[nnz, dense dims...]` values.
        values: DenseDesc,
        /// Whether the tensor is coalesced.
        coalesced: bool,
        /// Whether the tensor requires grad.
        requires_grad: bool,
    },
}

/// The header's description of one storage blob.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct BlobDesc {
    /// The storage's dtype code.
    pub(crate) dtype: u8,
    /// Its length in bytes.
    pub(crate) len: u64,
}

/// Bytes of a tensor storage to send, borrowed from the tensor's memory.
///
/// Holds a reference to the tensor, which keeps the storage alive until the
/// blob is written and dropped.
#[derive(Debug)]
pub(crate) struct Blob {
    _owner: KeepAlive,
    ptr: usize,
    len: usize,
}

impl Blob {
    /// The storage bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` is the start of the CPU storage of `_owner` and `len`
        // bytes lie inside it: `encode_tensors` computed `len` as the end of
        // the furthest element any view of this storage in the message
        // reaches, and every such view is a valid tensor of that storage.
        // `_owner` is kept alive as long as `self`, so the storage is not
        // freed. As in PyTorch RPC, the caller must not write to the tensors
        // of a message until it is sent ("storages are not copied"); that is
        // the contract `rpc_async` documents.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The byte length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// A tensor held only to keep its storage alive; never used otherwise.
#[derive(Debug)]
struct KeepAlive(#[allow(dead_code, reason = "held for its destructor")] Tensor);

// SAFETY: `KeepAlive` gives no access to its tensor at all (the field is
// private and never read), so sharing a `&KeepAlive` between threads cannot
// race on the tensor; dropping it from another thread is allowed because
// `Tensor` is `Send`.
unsafe impl Sync for KeepAlive {}

/// A received storage: a 1-D tensor the frame's bytes are read into.
///
/// Storages of 1 MiB or more come from recycled memory
/// (`wasmrpc_torch_sys::recycle`), whose pages are already faulted in and
/// which holds an earlier tensor's bytes: whoever makes a `DecodedBlob`
/// fills the whole of [`bytes_mut`](Self::bytes_mut) before decoding it, or
/// drops it (REC-1).
#[derive(Debug)]
pub(crate) struct DecodedBlob {
    tensor: Tensor,
    dtype: u8,
    len: usize,
}

impl DecodedBlob {
    /// Allocates the storage for `desc`.
    ///
    /// # Errors
    /// Fails for an unknown dtype or a length that is not a whole number of
    /// elements.
    pub(crate) fn new(desc: BlobDesc) -> Result<Self> {
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
        let tensor = wasmrpc_torch_sys::recycle::for_overwrite(|| {
            Tensor::f_empty([numel], (kind, Device::Cpu))
        })?;
        Ok(DecodedBlob {
            tensor,
            dtype: desc.dtype,
            len,
        })
    }

    /// The storage bytes, to be filled from the network.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `tensor` is a contiguous CPU tensor created by `f_empty`
        // with exactly `len` bytes (checked to be non-zero, so `data_ptr` is
        // a real allocation), owned by `self` and not yet shared with anyone:
        // the exclusive borrow of `self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.tensor.data_ptr() as *mut u8, self.len) }
    }
}

struct Part {
    kind: Kind,
    size: Vec<i64>,
    stride: Vec<i64>,
    offset: i64,
    group: Option<usize>,
}

struct Group {
    owner: Tensor,
    base: usize,
    kind: Kind,
    end_elems: i64,
}

/// Elements from the storage start to one past the furthest element reached.
fn extent(size: &[i64], stride: &[i64], offset: i64) -> Option<i64> {
    let mut last = offset;
    for (&s, &st) in size.iter().zip(stride) {
        if s <= 0 {
            return Some(0);
        }
        if st < 0 {
            return None;
        }
        last = last.checked_add((s - 1).checked_mul(st)?)?;
    }
    last.checked_add(1)
}

fn dense_part(
    t: &Tensor,
    groups: &mut Vec<Group>,
    index: &mut HashMap<(usize, u8), usize>,
) -> Result<Part> {
    if t.device() != Device::Cpu {
        // `encode_tensors` has copied CUDA tensors to the CPU already.
        return Err(Error::runtime(format!(
            "only CPU and CUDA tensors can be sent, got a tensor on {:?}",
            t.device()
        )));
    }
    let kind = t.f_kind()?;
    let code = kind_to_code(kind)
        .ok_or_else(|| Error::runtime(format!("tensors of dtype {kind:?} cannot be sent")))?;
    if t.is_mkldnn() {
        return Err(Error::runtime("mkldnn tensors cannot be sent"));
    }
    let size = t.size();
    let stride = t.stride();
    let offset = t.storage_offset();
    let numel = t.numel();
    if numel == 0 {
        return Ok(Part {
            kind,
            size,
            stride,
            offset: 0,
            group: None,
        });
    }
    let end = extent(&size, &stride, offset)
        .ok_or_else(|| Error::runtime("tensor with negative strides cannot be sent"))?;
    let elsize = kind.elt_size_in_bytes();
    let data = t.data_ptr() as usize;
    let base = data - (offset as usize) * elsize;
    let g = *index.entry((base, code)).or_insert_with(|| {
        groups.push(Group {
            owner: t.shallow_clone(),
            base,
            kind,
            end_elems: 0,
        });
        groups.len() - 1
    });
    groups[g].end_elems = groups[g].end_elems.max(end);
    Ok(Part {
        kind,
        size,
        stride,
        offset,
        group: Some(g),
    })
}

fn desc_of(p: Part) -> DenseDesc {
    DenseDesc {
        dtype: kind_to_code(p.kind).unwrap_or(u8::MAX),
        size: p.size,
        stride: p.stride,
        offset: p.offset,
        blob: p.group.map(|g| g as u32),
    }
}

enum Entry {
    Dense(Part, bool),
    Sparse {
        size: Vec<i64>,
        indices: Part,
        values: Part,
        coalesced: bool,
        requires_grad: bool,
    },
}

/// Encodes a message's tensor table: descriptors, blob descriptors and the
/// blobs to write after the header.
///
/// # Errors
/// Fails for tensors that cannot travel: devices other than the CPU and
/// CUDA, quantized dtypes, layouts other than strided and sparse COO.
///
/// CUDA tensors travel through a CPU copy (the socket carries host memory;
/// `crate::device` decided beforehand that the destination maps their
/// device). Storage sharing between CUDA tensors is therefore not kept.
pub(crate) fn encode_tensors(
    tensors: &[Tensor],
) -> Result<(Vec<WireTensor>, Vec<BlobDesc>, Vec<Blob>)> {
    let host_copies;
    let tensors = if tensors.iter().any(|t| t.device().is_cuda()) {
        host_copies = tensors
            .iter()
            .map(|t| {
                if t.device().is_cuda() {
                    t.f_to_device(Device::Cpu)
                } else {
                    Ok(t.shallow_clone())
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        host_copies.as_slice()
    } else {
        tensors
    };
    // tch panics (rather than failing) on a few layout queries; a tensor the
    // caller built is not network input, but a panic must still not unwind
    // through the agent.
    let encoded = catch_unwind(AssertUnwindSafe(|| -> Result<_> {
        let mut groups = Vec::new();
        let mut index = HashMap::new();
        let mut entries = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.is_sparse() {
                let indices = t.f_internal_indices()?;
                let values = t.f_internal_values()?;
                entries.push(Entry::Sparse {
                    size: t.size(),
                    indices: dense_part(&indices, &mut groups, &mut index)?,
                    values: dense_part(&values, &mut groups, &mut index)?,
                    coalesced: t.is_coalesced(),
                    requires_grad: t.requires_grad(),
                });
            } else {
                entries.push(Entry::Dense(
                    dense_part(t, &mut groups, &mut index)?,
                    t.requires_grad(),
                ));
            }
        }
        Ok((entries, groups))
    }));
    let (entries, groups) = match encoded {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::runtime(
                "libtorch refused to describe a tensor of this message",
            ));
        }
    };
    let wire = entries
        .into_iter()
        .map(|e| match e {
            Entry::Dense(p, requires_grad) => WireTensor::Dense {
                desc: desc_of(p),
                requires_grad,
            },
            Entry::Sparse {
                size,
                indices,
                values,
                coalesced,
                requires_grad,
            } => WireTensor::SparseCoo {
                size,
                indices: desc_of(indices),
                values: desc_of(values),
                coalesced,
                requires_grad,
            },
        })
        .collect();
    let mut descs = Vec::with_capacity(groups.len());
    let mut blobs = Vec::with_capacity(groups.len());
    for g in groups {
        let len = g.end_elems as usize * g.kind.elt_size_in_bytes();
        descs.push(BlobDesc {
            dtype: kind_to_code(g.kind).unwrap_or(u8::MAX),
            len: len as u64,
        });
        blobs.push(Blob {
            _owner: KeepAlive(g.owner),
            ptr: g.base,
            len,
        });
    }
    Ok((wire, descs, blobs))
}

fn decode_dense(d: &DenseDesc, blobs: &[DecodedBlob]) -> Result<Tensor> {
    let kind = kind_from_code(d.dtype)
        .ok_or_else(|| Error::runtime(format!("unknown tensor dtype code {}", d.dtype)))?;
    if d.size.len() != d.stride.len() || d.size.len() > 64 {
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
    if nnz > 0 {
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
    let decode = || -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(wire.len());
        for (i, w) in wire.iter().enumerate() {
            let t = match w {
                WireTensor::Dense {
                    desc,
                    requires_grad,
                } => {
                    let t = place(i, decode_dense(desc, blobs)?)?;
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
                    let indices = decode_dense(indices, blobs)?;
                    let values = decode_dense(values, blobs)?;
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

#[cfg(test)]
mod tests;
