//! Fast keyed hashing for maps keyed by 64-bit block hashes (the index's tables, the
//! publisher's live set), and the mixing steps the index's chained token hash is built from.

/// One mixing step: a multiply and a rotation.
pub(crate) fn mix(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)
}

/// splitmix64's finaliser: every input bit reaches every output bit.
pub(crate) fn finish(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A hasher for maps keyed by hashes the streams chose: one multiply with a key drawn per map
/// owner (an index, a live set), so a stream cannot pick block hashes that collide in them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Keyed(pub(crate) u64);

impl std::hash::BuildHasher for Keyed {
    type Hasher = KeyedHasher;
    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher(self.0)
    }
}

/// See [`Keyed`].
#[derive(Debug)]
pub(crate) struct KeyedHasher(u64);

impl std::hash::Hasher for KeyedHasher {
    fn finish(&self) -> u64 {
        finish(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..b.len()].copy_from_slice(b);
            self.0 = mix(self.0, u64::from_le_bytes(w));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = mix(self.0, v);
    }
}
