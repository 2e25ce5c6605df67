//! The digits data set: read from [`DATA_FILE`], unzipped, parsed, and
//! split into training and held-out parts.

use wasmrpc_guest::{Error, Result, Tensor, fs};

use crate::{DATA_FILE, PIXELS};

/// One part of the data set: images (`PIXELS` floats in 0..1 each) and
/// their digits.
#[derive(Debug, Clone, Default)]
pub(crate) struct Split {
    pub(crate) images: Vec<f32>,
    pub(crate) labels: Vec<i64>,
}

impl Split {
    pub(crate) fn len(&self) -> usize {
        self.labels.len()
    }

    /// Rows `start..end` as a `(n x 64)` float tensor and an `(n)` int64
    /// tensor.
    pub(crate) fn tensors(&self, start: usize, end: usize) -> Result<(Tensor, Tensor)> {
        let end = end.min(self.len());
        let n = end.saturating_sub(start);
        let x = Tensor::from_slice(
            &[n as i64, PIXELS as i64],
            &self.images[start * PIXELS..end * PIXELS],
        )?;
        let y = Tensor::from_slice(&[n as i64], &self.labels[start..end])?;
        Ok((x, y))
    }
}

/// The gzip member's deflate stream (RFC 1952 header and trailer removed).
fn gunzip(data: &[u8]) -> Result<Vec<u8>> {
    let bad = |why: &str| Error::runtime_error(format!("{DATA_FILE}: {why}"));
    if data.len() < 18 || data[0] != 0x1f || data[1] != 0x8b || data[2] != 8 {
        return Err(bad("not a gzip stream"));
    }
    let flags = data[3];
    let mut at = 10;
    if flags & 4 != 0 {
        let extra = usize::from(u16::from_le_bytes([data[at], data[at + 1]]));
        at += 2 + extra;
    }
    for bit in [8u8, 16] {
        if flags & bit != 0 {
            let end = data[at..]
                .iter()
                .position(|&b| b == 0)
                .ok_or_else(|| bad("unterminated header field"))?;
            at += end + 1;
        }
    }
    if flags & 2 != 0 {
        at += 2;
    }
    let body = data
        .get(at..data.len() - 8)
        .ok_or_else(|| bad("truncated"))?;
    miniz_oxide::inflate::decompress_to_vec(body).map_err(|e| bad(&format!("{e:?}")))
}

/// The digits data set, split into (training, held-out test) parts.
pub(crate) fn digits() -> Result<(Split, Split)> {
    let text = gunzip(&fs::read(DATA_FILE)?)?;
    let text = core::str::from_utf8(&text)
        .map_err(|e| Error::runtime_error(format!("{DATA_FILE}: {e}")))?;
    let (mut train, mut test) = (Split::default(), Split::default());
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() != PIXELS + 1 {
            return Err(Error::runtime_error(format!(
                "{DATA_FILE}: line {} has {} fields, not {}",
                i + 1,
                fields.len(),
                PIXELS + 1
            )));
        }
        let number = |s: &str| {
            s.trim()
                .parse::<f32>()
                .map_err(|e| Error::runtime_error(format!("{DATA_FILE}: line {}: {e}", i + 1)))
        };
        let part = if i % 5 == 4 { &mut test } else { &mut train };
        for f in &fields[..PIXELS] {
            part.images.push(number(f)? / 16.0);
        }
        part.labels.push(number(fields[PIXELS])? as i64);
    }
    Ok((train, test))
}
