//! The index's own chained hash of a block's tokens: what a router computes from a prompt to
//! ask which engines hold its prefix, whatever hash the engines use for their block ids.

use crate::keyed::{finish, mix};

/// What a block's hash depends on besides its tokens and its parent: the LoRA adapter and the
/// cache salt (blocks of another adapter or salt never match).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Salt {
    /// The LoRA adapter's id (vLLM's deprecated `lora_id`).
    pub lora_id: Option<i64>,
    /// The LoRA adapter's name.
    pub lora_name: Option<String>,
    /// The cache salt.
    pub cache_salt: Option<String>,
}

impl Salt {
    /// The hash a chain of this salt starts from (the parent of its first block).
    pub fn root(&self) -> u64 {
        let mut h = mix(
            0x6b76_6c69_6e6b_0001,
            self.lora_id.map_or(0, |v| v as u64 | 1 << 63),
        );
        for s in [&self.lora_name, &self.cache_salt] {
            h = mix(h, s.as_ref().map_or(0, |s| s.len() as u64 + 1));
            for b in s.iter().flat_map(|s| s.as_bytes().chunks(8)) {
                let mut w = [0u8; 8];
                w[..b.len()].copy_from_slice(b);
                h = mix(h, u64::from_le_bytes(w));
            }
        }
        h
    }
}

/// The hash of the block holding `tokens` after the block hashed `parent`: never 0 (which the
/// index uses for "no token hash").
pub(crate) fn next(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent, tokens.len() as u64);
    for pair in tokens.chunks(2) {
        let w = u64::from(pair[0]) | pair.get(1).map_or(0, |t| u64::from(*t) << 32);
        h = mix(h, w);
    }
    finish(h) | 1
}

/// The hashes of the full blocks of `tokens` (`block_size` tokens each, a partial tail left
/// out), chained from `salt`'s root: what [`crate::Index::overlap_tokens`] looks up.
pub fn token_blocks(tokens: &[u32], block_size: u32, salt: &Salt) -> Vec<u64> {
    let size = block_size.max(1) as usize;
    let mut parent = salt.root();
    tokens
        .chunks_exact(size)
        .map(|b| {
            parent = next(parent, b);
            parent
        })
        .collect()
}
