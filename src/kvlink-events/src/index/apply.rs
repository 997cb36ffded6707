//! How events change the index: stores, removals, clears and moves between tiers.

use super::holder::{self, Block, Entry, Holder};
use super::{chain, hash_key, HolderKey, Index};
use crate::wire::{BlockRemoved, BlockStored, BlockTransferred, DEFAULT_MEDIUM};

impl Index {
    /// The holder of `key`, made when new (`None` past [`super::IndexConfig::max_holders`]).
    fn holder_id(&mut self, key: HolderKey) -> Option<u32> {
        if let Some(id) = self.ids.get(&key) {
            return Some(*id);
        }
        let mut fresh = Holder::new(self.key);
        fresh.partial = self.lossy.contains(&key.engine);
        let id = match self.holders.iter().position(|h| !h.live) {
            Some(free) => {
                self.holders[free] = fresh;
                self.keys[free] = std::sync::Arc::new(key.clone());
                free
            }
            None if self.holders.len() >= self.config.max_holders => return None,
            None => {
                self.holders.push(fresh);
                self.keys.push(std::sync::Arc::new(key.clone()));
                self.holders.len() - 1
            }
        };
        self.ids.insert(key, id as u32);
        Some(id as u32)
    }

    fn key(engine: &str, dp: i64, medium: Option<&str>, group: Option<u32>) -> HolderKey {
        HolderKey {
            engine: engine.to_string(),
            dp_rank: dp,
            medium: medium.unwrap_or(DEFAULT_MEDIUM).to_string(),
            group: group.unwrap_or(0),
        }
    }

    /// Applies a `BlockStored`: each block chained from its parent (the event's parent for
    /// the first), with a token hash when its tokens and its parent's hash are known.
    pub(super) fn store(&mut self, engine: &str, dp: i64, s: &BlockStored) {
        let key = Self::key(engine, dp, s.medium.as_deref(), s.group_idx);
        let Some(id) = self.holder_id(key) else {
            self.stats.dropped += s.block_hashes.len() as u64;
            return;
        };
        let h = &self.holders[id as usize];
        let mut prev = match &s.parent_block_hash {
            None => Some((root(s), 0u32)),
            Some(p) => {
                let known = h.blocks.get(&hash_key(p)).map(|b| (b.local, b.end));
                if known.is_none() {
                    self.stats.unknown_parent += 1;
                }
                known.filter(|(local, _)| *local != 0)
            }
        };
        let tokens = block_tokens(s);
        self.holders[id as usize].block_size = s.block_size;
        for (i, bh) in s.block_hashes.iter().enumerate() {
            self.stats.stored += 1;
            let mine = tokens.as_ref().and_then(|t| t.get(i).copied());
            let block = match (prev, mine) {
                (Some((parent, end)), Some(t)) => Block {
                    local: chain::next(parent, t),
                    end: end.saturating_add(t.len() as u32),
                    epoch: 0,
                },
                _ => Block {
                    local: 0,
                    end: 0,
                    epoch: 0,
                },
            };
            prev = (block.local != 0).then_some((block.local, block.end));
            self.put_block(id, hash_key(bh), block);
        }
    }

    /// Files `block` under engine hash `hash` for holder `id` (in its current epoch: a block
    /// stored again is vouched for again).
    fn put_block(&mut self, id: u32, hash: u64, mut block: Block) {
        let h = &mut self.holders[id as usize];
        block.epoch = h.epoch;
        // One lookup: the block goes in, and comes out again past the limit.
        match h.blocks.insert(hash, block) {
            Some(old) => {
                h.forget(&old);
                if old.local != 0 && old.local != block.local {
                    holder::take(&mut self.by_tokens, old.local, id);
                }
            }
            None if self.blocks >= self.config.max_blocks => {
                h.blocks.remove(&hash);
                self.stats.dropped += 1;
                return;
            }
            None => self.blocks += 1,
        }
        let e = Entry {
            holder: id,
            epoch: block.epoch,
            end: block.end,
        };
        holder::put(&mut self.by_hash, hash, e);
        if block.local != 0 {
            holder::put(&mut self.by_tokens, block.local, e);
        }
    }

    /// Takes engine hash `hash` out of holder `id`; the block, if it held it.
    fn take_block(&mut self, id: u32, hash: u64) -> Option<Block> {
        let h = &mut self.holders[id as usize];
        let b = h.blocks.remove(&hash)?;
        h.forget(&b);
        self.blocks -= 1;
        holder::take(&mut self.by_hash, hash, id);
        if b.local != 0 {
            holder::take(&mut self.by_tokens, b.local, id);
        }
        Some(b)
    }

    /// Applies a `BlockRemoved`.
    pub(super) fn remove(&mut self, engine: &str, dp: i64, r: &BlockRemoved) {
        let key = Self::key(engine, dp, r.medium.as_deref(), r.group_idx);
        let id = self.ids.get(&key).copied();
        for bh in &r.block_hashes {
            match id.and_then(|id| self.take_block(id, hash_key(bh))) {
                Some(_) => self.stats.removed += 1,
                None => self.stats.unknown_removed += 1,
            }
        }
    }

    /// Drops every block of engine `engine`'s holders of DP rank `dp` (all ranks: `None`) and
    /// tier `medium` (all tiers: `None`): they are exact again (empty, as the engine's cache).
    pub(super) fn clear(&mut self, engine: &str, dp: Option<i64>, medium: Option<&str>) {
        let ids: Vec<u32> = self
            .ids
            .iter()
            .filter(|(k, _)| {
                k.engine == engine
                    && dp.is_none_or(|d| d == k.dp_rank)
                    && medium.is_none_or(|m| m == k.medium)
            })
            .map(|(_, id)| *id)
            .collect();
        for id in ids {
            let hashes: Vec<u64> = self.holders[id as usize].blocks.keys().copied().collect();
            for hash in hashes {
                self.take_block(id, hash);
            }
            let h = &mut self.holders[id as usize];
            h.withheld = 0;
            h.partial = false;
        }
    }

    /// Applies ATOM's `BlockTransferred`: each block moves from one tier's holder to the
    /// other's, withheld there if it was withheld here.
    pub(super) fn transfer(&mut self, engine: &str, dp: i64, t: &BlockTransferred) {
        let from = Self::key(engine, dp, t.from_medium.as_deref(), t.group_idx);
        let Some(from) = self.ids.get(&from).copied() else {
            self.stats.unknown_removed += t.block_hashes.len() as u64;
            return;
        };
        let to_key = Self::key(engine, dp, t.to_medium.as_deref(), t.group_idx);
        for bh in &t.block_hashes {
            let hash = hash_key(bh);
            let trusted = self.holders[from as usize]
                .blocks
                .get(&hash)
                .is_some_and(|b| b.epoch == self.holders[from as usize].epoch);
            let Some(block) = self.take_block(from, hash) else {
                self.stats.unknown_removed += 1;
                continue;
            };
            let Some(to) = self.holder_id(to_key.clone()) else {
                self.stats.dropped += 1;
                continue;
            };
            self.put_block(to, hash, block);
            if !trusted {
                self.withhold(to, hash);
            }
        }
    }

    /// Marks holder `id`'s block `hash` withheld (of an older epoch than the holder's).
    fn withhold(&mut self, id: u32, hash: u64) {
        let h = &mut self.holders[id as usize];
        let old = h.epoch.wrapping_sub(1);
        let Some(b) = h.blocks.get_mut(&hash) else {
            return;
        };
        b.epoch = old;
        h.withheld += 1;
        let e = Entry {
            holder: id,
            epoch: old,
            end: b.end,
        };
        let local = b.local;
        holder::put(&mut self.by_hash, hash, e);
        if local != 0 {
            holder::put(&mut self.by_tokens, local, e);
        }
    }
}

/// The root a store's chain starts from: its LoRA adapter and cache salt.
fn root(s: &BlockStored) -> u64 {
    chain::Salt {
        lora_id: s.lora_id,
        lora_name: s.lora_name.clone(),
        cache_salt: s.cache_salt.clone(),
    }
    .root()
}

/// Each block's tokens, when the store carries them block by block (`block_size` each, the
/// last one possibly shorter) and no block has extra keys (multimodal inputs, whose hash the
/// tokens do not determine): `None` otherwise, and its blocks get no token hash.
fn block_tokens(s: &BlockStored) -> Option<Vec<&[u32]>> {
    if !s.tokens_fit_blocks() || has_extra_keys(s) {
        return None;
    }
    Some(s.token_ids.chunks(s.block_size as usize).collect())
}

fn has_extra_keys(s: &BlockStored) -> bool {
    use crate::wire::Value;
    match &s.extra_keys {
        None | Some(Value::Nil) => false,
        Some(Value::Array(v)) => v.iter().any(|k| !matches!(k, Value::Nil)),
        Some(_) => true,
    }
}
