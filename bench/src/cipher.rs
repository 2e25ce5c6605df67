//! The TLS rows' cipher, alone: how long sealing and opening a tensor's
//! bytes into TLS 1.3 records takes on one core, with the calls and the
//! suite our record layer uses (`wasmrpc-credentials`' `tls::record`:
//! AES-128-GCM on aws-lc-rs, 16 KiB records, sealed out of place from the
//! tensor's memory, opened out of place into the reader's).
//!
//! The echo over TLS does what the plain echo does plus two seals and two
//! opens of the tensor (each way, the sender seals and the receiver
//! opens), so on a machine of `cores` cores it cannot take less than the
//! plain echo's CPU time plus those four passes, spread over every core:
//! the bound `ours::variants` prints beside the TLS echo's cost.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use aws_lc_rs::aead::{AES_128_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

/// The content one record carries (RFC 8446's largest, which our writer
/// fills).
const RECORD: usize = 1 << 14;
/// The AEAD tag after each record's body.
const TAG: usize = 16;

/// The time to seal `bytes` into records and to open them again, each the
/// best of `tries` on this thread. The best, not the median: this is a
/// floor, and a preempted pass measures the machine's other work.
pub(crate) fn seal_and_open(bytes: usize, tries: usize) -> Result<(Duration, Duration)> {
    let key = || {
        UnboundKey::new(&AES_128_GCM, &[7u8; 16])
            .map(LessSafeKey::new)
            .map_err(|_| anyhow!("making an AES-128-GCM key"))
    };
    let (sealer, opener) = (key()?, key()?);
    let plain: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    let records = bytes.div_ceil(RECORD);
    let mut sealed = vec![0u8; records * (RECORD + 1 + TAG)];
    let mut opened = vec![0u8; records * (RECORD + 1)];
    let nonce = |seq: usize| {
        let mut n = [0u8; NONCE_LEN];
        n[NONCE_LEN - 8..].copy_from_slice(&(seq as u64).to_be_bytes());
        Nonce::assume_unique_for_key(n)
    };
    let header = |len: usize| {
        let [hi, lo] = ((len + 1 + TAG) as u16).to_be_bytes();
        [23u8, 3, 3, hi, lo]
    };
    let (mut seal, mut open) = (Duration::MAX, Duration::MAX);
    for _ in 0..tries.max(1) {
        let started = Instant::now();
        for (seq, (part, out)) in plain
            .chunks(RECORD)
            .zip(sealed.chunks_mut(RECORD + 1 + TAG))
            .enumerate()
        {
            let (content, type_and_tag) = out.split_at_mut(part.len());
            sealer
                .seal_out_of_place_scatter(
                    nonce(seq),
                    Aad::from(header(part.len())),
                    part,
                    content,
                    &[23],
                    &mut type_and_tag[..1 + TAG],
                )
                .map_err(|_| anyhow!("sealing record {seq}"))?;
        }
        seal = seal.min(started.elapsed());
        let started = Instant::now();
        for (seq, (record, out)) in sealed
            .chunks(RECORD + 1 + TAG)
            .zip(opened.chunks_mut(RECORD + 1))
            .enumerate()
        {
            let len = plain.len().min((seq + 1) * RECORD) - seq * RECORD;
            let (ciphertext, tag) = record[..len + 1 + TAG].split_at(len + 1);
            opener
                .open_separate_gather(
                    nonce(seq),
                    Aad::from(header(len)),
                    ciphertext,
                    tag,
                    &mut out[..len + 1],
                )
                .map_err(|_| anyhow!("opening record {seq}"))?;
        }
        open = open.min(started.elapsed());
        black_box(&opened);
    }
    if opened
        .chunks(RECORD + 1)
        .flat_map(|r| &r[..r.len() - 1])
        .zip(&plain)
        .any(|(a, b)| a != b)
    {
        anyhow::bail!("the opened records differ from what was sealed");
    }
    Ok((seal, open))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seals_and_opens_a_partial_last_record() {
        let (seal, open) = seal_and_open(3 * RECORD + 5, 1).unwrap();
        assert!(seal > Duration::ZERO && open > Duration::ZERO);
    }
}
