//! Random bytes for nonces, tokens and generated secrets.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};

/// `N` random bytes from the OS (`/dev/urandom`), falling back to hashed
/// clock and counter values if it cannot be read. Every nonce of the
/// handshake, the agent's shared-memory tokens and generated secrets come
/// from here.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .is_ok()
    {
        return out;
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    use std::hash::{BuildHasher, Hasher};
    for chunk in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
    }
    out
}

/// A fresh random cluster secret: 32 bytes from [`random_bytes`] as 64 hex
/// digits (`wasmrpc launch` hands one to its workers; test clusters get one
/// each).
pub fn generate_secret() -> String {
    random_bytes::<32>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
