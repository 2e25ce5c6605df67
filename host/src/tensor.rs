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
//! `unsafe` code. CPU tensors only: device maps come later, and a CUDA tensor
//! is refused with an error.
//!
//! It leaves framing and sockets to `transport`.

mod wire;

pub(crate) use wire::{Blob, BlobDesc, DecodedBlob, WireTensor, decode_tensors, encode_tensors};
