//! How events change the index: stores, removals, clears and moves between tiers.

use super::holder::{self, Entry, Holder, Put};
use super::{chain, hash_key, HolderKey, Index};
use crate::wire::{BlockRemoved, BlockStored, BlockTransferred, DEFAULT_MEDIUM};

impl Index {
    /// The holder of `key`, made when new (`None` past [`super::IndexConfig::max_holders`]).
    fn holder_id(&mut self, key: HolderKey) -> Option<u32> {
        if let Some(id) = self.ids.get(&key) {
            return Some(*id);
        }
        let mut fresh = Holder::new();
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
        let mut prev = match &s.parent_block_hash {
            None => Some((root(s), 0u32)),
            Some(p) => {
                let known = self
                    .by_hash
                    .get(&hash_key(p))
                    .and_then(|hs| hs.of(id))
                    .map(|e| (e.local, e.end));
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
            let (local, end) = match (prev, mine) {
                (Some((parent, end)), Some(t)) => {
                    (chain::next(parent, t), end.saturating_add(t.len() as u32))
                }
                _ => (0, 0),
            };
            prev = (local != 0).then_some((local, end));
            self.put_block(id, hash_key(bh), local, end, true);
        }
    }

    /// Files a block under engine hash `hash` for holder `id`, with its token hash `local` and
    /// the position `end` after its tokens: in the holder's current epoch when `trusted` (a
    /// block stored again is vouched for again), else withheld (of the epoch before).
    fn put_block(&mut self, id: u32, hash: u64, local: u64, end: u32, trusted: bool) {
        let h = &self.holders[id as usize];
        let e = Entry {
            local,
            holder: id,
            epoch: if trusted {
                h.epoch
            } else {
                h.epoch.wrapping_sub(1)
            },
            end,
        };
        let full = self.blocks >= self.config.max_blocks;
        match holder::put(&mut self.by_hash, hash, e, full) {
            Put::Full => {
                self.stats.dropped += 1;
                return;
            }
            Put::Added => self.blocks += 1,
            Put::Replaced(old) => {
                self.holders[id as usize].forget(&old);
                if old.local != 0 && old.local != local {
                    holder::take(&mut self.by_tokens, old.local, id);
                }
            }
        }
        let h = &mut self.holders[id as usize];
        h.held += 1;
        if !trusted {
            h.withheld += 1;
        }
        if local != 0 {
            holder::put(&mut self.by_tokens, local, e, false);
        }
    }

    /// Takes engine hash `hash` out of holder `id`; its entry, if it held it.
    fn take_block(&mut self, id: u32, hash: u64) -> Option<Entry> {
        let e = holder::take(&mut self.by_hash, hash, id)?;
        self.holders[id as usize].forget(&e);
        self.blocks -= 1;
        if e.local != 0 {
            holder::take(&mut self.by_tokens, e.local, id);
        }
        Some(e)
    }

    /// Applies a `BlockRemoved`.
    pub(super) fn remove(&mut self, engine: &str, dp: i64, r: &BlockRemoved) {
        let key = Self::key(engine, dp, r.medium.as_deref(), r.group_idx);
        let id = self.ids.get(&key).copied();
        if let Some(id) = id {
            self.warm(id, &r.block_hashes);
        }
        for bh in &r.block_hashes {
            match id.and_then(|id| self.take_block(id, hash_key(bh))) {
                Some(_) => self.stats.removed += 1,
                None => self.stats.unknown_removed += 1,
            }
        }
    }

    /// Looks up every block of a removal, and then its token hash, before anything changes:
    /// no lookup depends on another, so their cache misses overlap, and the removals that
    /// follow find their table slots in the cache (they would otherwise wait for each miss
    /// in turn; the tables are far larger than a core's cache).
    fn warm(&mut self, id: u32, hashes: &[crate::wire::BlockHash]) {
        let mut locals = std::mem::take(&mut self.scratch);
        locals.clear();
        for bh in hashes {
            let e = self.by_hash.get(&hash_key(bh)).and_then(|hs| hs.of(id));
            if let Some(e) = e.filter(|e| e.local != 0) {
                locals.push(e.local);
            }
        }
        for local in &locals {
            std::hint::black_box(self.by_tokens.get(local));
        }
        self.scratch = locals;
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
        let mut doomed = vec![false; self.holders.len()];
        let mut held = 0;
        for &id in &ids {
            let h = &mut self.holders[id as usize];
            doomed[id as usize] = true;
            held += h.held;
            h.held = 0;
            h.withheld = 0;
            h.partial = false;
        }
        if held == self.blocks {
            self.by_hash.clear();
            self.by_tokens.clear();
        } else if held > 0 {
            // One pass over every block held: holders keep no list of their own (one map
            // lookup less per store and removal), and clears are rare.
            let by_tokens = &mut self.by_tokens;
            self.by_hash.retain(|_, hs| {
                !hs.drop_marked(&doomed, |e| {
                    if e.local != 0 {
                        holder::take(by_tokens, e.local, e.holder);
                    }
                })
            });
        }
        self.blocks -= held;
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
            let Some(e) = self.take_block(from, hash) else {
                self.stats.unknown_removed += 1;
                continue;
            };
            let trusted = e.epoch == self.holders[from as usize].epoch;
            let Some(to) = self.holder_id(to_key.clone()) else {
                self.stats.dropped += 1;
                continue;
            };
            self.put_block(to, hash, e.local, e.end, trusted);
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
