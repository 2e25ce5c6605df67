//! tch glue: the wire form of tensors.
//!
//! A message's tensors travel as a table of [`WireTensor`] descriptors in the
//! frame header plus one raw byte blob per storage. The module owns:
//!
//! - dtype codes (libtorch's `ScalarType` numbers);
//! - dense tensors with their shape, strides, storage offset and
//!   `requires_grad`: a non-contiguous view arrives as a view with the same
//!   strides and offset, not as a contiguous copy;
//! - storage sharing: tensors of one message that share a storage share one
//!   blob, and share one storage again on arrival;
//! - sparse COO tensors (indices, values, size, coalesced flag);
//! - 0-element tensors, which have no blob.
//!
//! Storage bytes are written straight from tensor memory and read straight
//! into fresh tensor memory; this is the only module of the agent with
//! `unsafe` code. CUDA tensors travel as CPU copies and are placed on the
//! device `crate::device` chose for them (the device maps) on arrival.
//!
//! It leaves framing and sockets to `transport`. [`budget`] holds a worker's
//! tensor memory budgets.

pub(crate) mod budget;
mod wire;

/// The identity of a tensor object (its `TensorImpl`): equal for every
/// `tch` handle of one tensor (`shallow_clone`s, what an autograd node
/// returns as its variable), different for views and copies. Used to key
/// gradients by tensor, as Python keys them by object.
pub(crate) fn impl_id(t: &tch::Tensor) -> usize {
    // SAFETY: `as_ptr` is the live `at::Tensor*` behind `t`, borrowed for the
    // read. An `at::Tensor` is exactly one `c10::intrusive_ptr<TensorImpl>`,
    // whose only field is the `TensorImpl*`, so the first word is the impl.
    unsafe { *(t.as_ptr().cast::<usize>()) }
}

pub(crate) use wire::{
    Blob, BlobDesc, DecodedBlob, WireTensor, cuda_landings, decode_tensors, encode_tensors,
    sole_shapes,
};
