//! Tensor descriptors and storage blobs: encoding a message's tensors and
//! (in [`decode`]) rebuilding them from network bytes.
//!
//! A message's tensors travel as descriptors in its header (dtype, size,
//! strides, offset, which blob) followed by the storage blobs. Tensors that
//! share a storage share one blob, so they share it again on arrival.

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

/// Bytes of a tensor storage to send, borrowed from the tensor's memory:
/// host memory, or memory of a CUDA device until the frame is placed
/// (`OutFrame::place` copies it into a CUDA segment or stages it in host
/// memory with [`into_host`](Self::into_host)).
///
/// Holds a reference to the tensor, which keeps the storage alive until the
/// blob is written and dropped.
#[derive(Debug)]
pub(crate) struct Blob {
    owner: KeepAlive,
    ptr: usize,
    len: usize,
    /// The CUDA device the bytes are on; `None`: host memory.
    cuda: Option<u32>,
}

impl Blob {
    /// The storage bytes, in host memory.
    ///
    /// # Panics
    /// For a storage on a CUDA device: frames are placed before they are
    /// written (`Connection::enqueue`), and placing stages every CUDA
    /// storage that did not go into a CUDA segment.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        assert!(
            self.cuda.is_none(),
            "a CUDA storage written as host bytes: the frame was not placed"
        );
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` is the start of the CPU storage of `owner` (the
        // assertion above: not a CUDA one) and `len`
        // bytes lie inside it: `encode_tensors` computed `len` as the end of
        // the furthest element any view of this storage in the message
        // reaches, and every such view is a valid tensor of that storage.
        // `owner` is kept alive as long as `self`, so the storage is not
        // freed. As in PyTorch RPC, the caller must not write to the tensors
        // of a message until it is sent ("storages are not copied"); that is
        // the contract `rpc_async` documents.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The byte length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The CUDA device the storage is on, `None` for host memory.
    pub(crate) fn cuda_device(&self) -> Option<u32> {
        self.cuda
    }

    /// Where the storage starts (a device address for a CUDA storage).
    pub(crate) fn address(&self) -> u64 {
        self.ptr as u64
    }

    /// The same storage bytes in host memory: a copy for a CUDA storage
    /// (waiting for the device's work on the tensor's stream), `self` for a
    /// host one.
    ///
    /// # Errors
    /// Fails if libtorch cannot make the copy.
    pub(crate) fn into_host(self) -> Result<Blob> {
        if self.cuda.is_none() || self.len == 0 {
            return Ok(self);
        }
        let owner = &self.owner.0;
        let copied = catch_unwind(AssertUnwindSafe(|| -> Result<Tensor> {
            let kind = owner.f_kind()?;
            let elements = (self.len / kind.elt_size_in_bytes()) as i64;
            // The storage from its start, as one flat tensor.
            let flat =
                owner
                    .f_detach()?
                    .f_as_strided([elements].as_slice(), [1i64].as_slice(), 0)?;
            Ok(flat.f_to_device(Device::Cpu)?)
        }));
        let host = match copied {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::runtime(
                    "libtorch refused to copy a CUDA storage to host memory",
                ));
            }
        };
        let ptr = host.data_ptr() as usize;
        Ok(Blob {
            owner: KeepAlive(host),
            ptr,
            len: self.len,
            cuda: None,
        })
    }
}

/// A tensor held only to keep its storage alive; otherwise only read to
/// stage a CUDA storage (`Blob::into_host`).
#[derive(Debug)]
struct KeepAlive(Tensor);

// SAFETY: `KeepAlive` gives no access to its tensor outside this module,
// where the tensor is only read by `Blob::into_host`, which takes the blob by
// value (so no other reference to the same `KeepAlive` exists then); sharing
// a `&KeepAlive` between threads cannot race on the tensor, and dropping it
// from another thread is allowed because `Tensor` is `Send`.
unsafe impl Sync for KeepAlive {}

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
    cuda: Option<u32>,
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
    index: &mut HashMap<(usize, u8, Option<u32>), usize>,
) -> Result<Part> {
    let cuda = match t.device() {
        Device::Cpu => None,
        Device::Cuda(i) => Some(
            u32::try_from(i)
                .map_err(|_| Error::runtime(format!("CUDA device index {i} out of range")))?,
        ),
        other => {
            return Err(Error::runtime(format!(
                "only CPU and CUDA tensors can be sent, got a tensor on {other:?}"
            )));
        }
    };
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
    let g = *index.entry((base, code, cuda)).or_insert_with(|| {
        groups.push(Group {
            owner: t.shallow_clone(),
            base,
            kind,
            end_elems: 0,
            cuda,
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
/// CUDA storages are described where they are, as host ones are (so
/// CUDA tensors that share a storage share it again on arrival);
/// `crate::device` decided beforehand that the destination maps their
/// device. Their blobs are left on the device: placing the frame
/// (`OutFrame::place`) sends each through a CUDA segment or stages it in
/// host memory.
pub(crate) fn encode_tensors(
    tensors: &[Tensor],
) -> Result<(Vec<WireTensor>, Vec<BlobDesc>, Vec<Blob>)> {
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
            owner: KeepAlive(g.owner),
            ptr: g.base,
            len,
            cuda: g.cuda,
        });
    }
    Ok((wire, descs, blobs))
}

mod decode;

pub(crate) use decode::{DecodedBlob, cuda_landings, decode_tensors, sole_shapes};

#[cfg(test)]
mod tests;
