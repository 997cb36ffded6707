//! Overlap queries: which holders hold how many of a prompt's leading blocks.

use std::collections::HashMap;

use super::chain::{self, Salt};
use super::holder::{Entry, Holders};
use super::{state, HolderMatch, Index, Overlap};
use crate::keyed::Keyed;

impl Index {
    /// The holders of the leading blocks named by the engines' own block hashes, in order
    /// (what a router that computes the engines' hashes asks).
    pub fn overlap_hashes(&self, hashes: &[u64]) -> Overlap {
        self.walk(&self.by_hash, hashes.iter().copied())
    }

    /// The holders of the leading full blocks of `tokens`, cut in blocks of `block_size`
    /// tokens and hashed from `salt` ([`chain::token_blocks`]): only holders that store blocks
    /// of that size match.
    pub fn overlap_tokens(&self, tokens: &[u32], block_size: u32, salt: &Salt) -> Overlap {
        let blocks = chain::token_blocks(tokens, block_size, salt);
        self.walk(&self.by_tokens, blocks.into_iter())
    }

    /// Follows `keys` through `map` while some holder vouches for every block so far; each
    /// holder's match ends at its first block missing (or withheld).
    fn walk(&self, map: &HashMap<u64, Holders, Keyed>, keys: impl Iterator<Item = u64>) -> Overlap {
        // (holder, blocks matched, position after the last one); two buffers, swapped per
        // block, so that a long prompt allocates nothing per block.
        let mut alive: Vec<(u32, usize, u32)> = Vec::new();
        let mut next: Vec<(u32, usize, u32)> = Vec::new();
        let mut done: Vec<(u32, usize, u32)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let Some(holders) = map.get(&key) else {
                break;
            };
            let counted = holders
                .as_slice()
                .iter()
                .filter(|e| self.holders[e.holder as usize].counts(e.epoch));
            if i == 0 {
                alive.extend(counted.map(|e| (e.holder, 1, e.end)));
            } else {
                next.clear();
                step(&alive, counted, &mut next, &mut done);
                std::mem::swap(&mut alive, &mut next);
            }
            if alive.is_empty() {
                break;
            }
        }
        done.append(&mut alive);
        self.answer(done)
    }

    fn answer(&self, mut found: Vec<(u32, usize, u32)>) -> Overlap {
        let key = |id: u32| &self.keys[id as usize];
        found.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| key(a.0).cmp(key(b.0))));
        let matches = found
            .into_iter()
            .map(|(id, blocks, end)| {
                let h = &self.holders[id as usize];
                let tokens = if end > 0 {
                    u64::from(end)
                } else {
                    blocks as u64 * u64::from(h.block_size)
                };
                HolderMatch {
                    holder: self.keys[id as usize].clone(),
                    blocks,
                    tokens,
                    state: state(h),
                }
            })
            .collect();
        Overlap { matches }
    }
}

/// The holders of `alive` (sorted by holder) that also vouch for the next block (`counted`,
/// sorted by holder too: one merge pass), one more block each, into `next`; the others'
/// matches end, into `done`.
fn step<'a>(
    alive: &[(u32, usize, u32)],
    counted: impl Iterator<Item = &'a Entry>,
    next: &mut Vec<(u32, usize, u32)>,
    done: &mut Vec<(u32, usize, u32)>,
) {
    let mut counted = counted.peekable();
    for &(id, n, end) in alive {
        while counted.next_if(|e| e.holder < id).is_some() {}
        match counted.next_if(|e| e.holder == id) {
            Some(e) => next.push((id, n + 1, e.end)),
            None => done.push((id, n, end)),
        }
    }
}
