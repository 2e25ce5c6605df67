//! DDP gradient bucketing: [`compute_bucket_assignment_by_size`], PyTorch's
//! `dist._compute_bucket_assignment_by_size` (the C++ reducer's
//! `compute_bucket_assignment_by_size`).
//!
//! A pure function over tensor metadata; it owns no communication.

use tch::{Device, Kind, Tensor};

/// Groups tensors into buckets for gradient allreduce.
///
/// Tensors of one (dtype, device) share an open bucket. A bucket closes once
/// its bytes reach its limit; each (dtype, device) then moves on to the next
/// of `size_limits` (the last one repeats). Buckets still open at the end are
/// emitted too. The result is ordered by each bucket's first tensor index,
/// and comes with each bucket's size limit.
///
/// # Panics
/// Never; an empty `size_limits` means no limit (one bucket per dtype and
/// device).
pub fn compute_bucket_assignment_by_size(
    tensors: &[Tensor],
    size_limits: &[usize],
) -> (Vec<Vec<usize>>, Vec<usize>) {
    struct Open {
        key: (Kind, Device),
        indices: Vec<usize>,
        bytes: usize,
        limit_index: usize,
    }
    let limit = |i: usize| {
        size_limits
            .get(i.min(size_limits.len().saturating_sub(1)))
            .copied()
            .unwrap_or(usize::MAX)
    };
    let mut open: Vec<Open> = Vec::new();
    let mut done: Vec<(Vec<usize>, usize)> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let key = (t.kind(), t.device());
        let slot = match open.iter().position(|b| b.key == key) {
            Some(slot) => slot,
            None => {
                open.push(Open {
                    key,
                    indices: Vec::new(),
                    bytes: 0,
                    limit_index: 0,
                });
                open.len() - 1
            }
        };
        let bucket = &mut open[slot];
        bucket.indices.push(i);
        bucket.bytes += t.numel() * t.kind().elt_size_in_bytes();
        let current = limit(bucket.limit_index);
        if bucket.bytes >= current {
            done.push((std::mem::take(&mut bucket.indices), current));
            bucket.bytes = 0;
            bucket.limit_index += 1;
        }
    }
    for bucket in open {
        if !bucket.indices.is_empty() {
            done.push((bucket.indices, limit(bucket.limit_index)));
        }
    }
    done.sort_by_key(|(indices, _)| indices[0]);
    done.into_iter().unzip()
}
