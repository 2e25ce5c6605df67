//! Byte mutations of valid inputs, for the property tests of the decoders a
//! peer can reach (frames, the handshake, the store protocol, `Value`s,
//! manifests): take bytes a correct encoder wrote, [`mutate`] them with a
//! list drawn from [`mutation`], and check the decoder answers with an
//! error or a value, never a panic, a hang or a huge allocation.
//!
//! One place for it, so every decoder's test mutates the same way; each
//! test chooses the numbers worth planting ([`mutation`]'s `huge`), such as
//! its protocol's own length limits.

use proptest::prelude::*;

/// One change to a valid input.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// XOR the byte at this offset (modulo the length) with a non-zero mask.
    Flip(usize, u8),
    /// Cut the input at this offset (modulo the length).
    Truncate(usize),
    /// Write `value` as a little-endian number of `width` bytes at this
    /// offset (modulo the length), as far as the input reaches: a huge
    /// announced length or count where a decoder reads one.
    Huge {
        /// Where.
        at: usize,
        /// The number.
        value: u64,
        /// Its width in bytes (2 for a `u16` field, 8 for a `u64`).
        width: usize,
    },
}

/// Mutations whose planted numbers are `width` bytes wide and drawn from
/// `huge` (e.g. `prop_oneof![Just(u64::MAX), Just(LIMIT + 1), any::<u64>()]`).
pub fn mutation(
    huge: impl Strategy<Value = u64> + Clone + 'static,
    width: usize,
) -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(at, x)| Mutation::Flip(at, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), huge).prop_map(move |(at, value)| Mutation::Huge { at, value, width }),
    ]
}

/// The planted numbers most tests want: the extremes of a `u64` and a
/// `u32` length, and anything else.
pub fn huge_numbers() -> impl Strategy<Value = u64> + Clone {
    prop_oneof![Just(u64::MAX), Just(u64::from(u32::MAX)), any::<u64>()]
}

/// `bytes` with `mutations` applied in order; an input cut to nothing
/// stays empty.
pub fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        if bytes.is_empty() {
            break;
        }
        let len = bytes.len();
        match *m {
            Mutation::Flip(at, x) => bytes[at % len] ^= x,
            Mutation::Truncate(at) => bytes.truncate(at % len),
            Mutation::Huge { at, value, width } => {
                let le = value.to_le_bytes();
                for (i, b) in le.iter().take(width.min(8)).enumerate() {
                    if let Some(slot) = bytes.get_mut(at % len + i) {
                        *slot = *b;
                    }
                }
            }
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mutation_does_what_it_says() {
        let bytes = vec![0u8; 8];
        assert_eq!(mutate(bytes.clone(), &[Mutation::Flip(9, 0xff)])[1], 0xff);
        assert_eq!(mutate(bytes.clone(), &[Mutation::Truncate(11)]).len(), 3);
        let planted = mutate(
            bytes.clone(),
            &[Mutation::Huge {
                at: 6,
                value: 0x0102_0304,
                width: 4,
            }],
        );
        assert_eq!(planted, [0, 0, 0, 0, 0, 0, 4, 3]);
        assert!(mutate(Vec::new(), &[Mutation::Flip(0, 1)]).is_empty());
    }
}
