//! One holder's blocks (an engine's DP rank, tier and KV-cache group), and the small lists the
//! index keeps per hash of who holds that block.

use std::collections::HashMap;

use crate::keyed::Keyed;

/// One block a holder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    /// Its token hash (`chain::next`), 0 when its tokens or its parent's are unknown.
    pub(crate) local: u64,
    /// The position after its last token, 0 when unknown.
    pub(crate) end: u32,
    /// The holder's epoch it was stored (or last confirmed) in: it counts only in the current
    /// one.
    pub(crate) epoch: u32,
}

/// One holder's blocks, by the engine's block hash.
#[derive(Debug)]
pub(crate) struct Holder {
    pub(crate) blocks: HashMap<u64, Block, Keyed>,
    /// Bumped on every loss: blocks of an older epoch are withheld.
    pub(crate) epoch: u32,
    /// Blocks of an older epoch still held.
    pub(crate) withheld: usize,
    /// Events of its stream were lost (stores among them, maybe): what it holds is a lower
    /// bound until it is cleared, its publisher restarts, or a snapshot replaces it.
    pub(crate) partial: bool,
    /// The caller said the stream is down: nothing counts.
    pub(crate) stale: bool,
    /// Tokens per block, from its last store.
    pub(crate) block_size: u32,
    /// Whether the holder is in use (a removed engine's holders are kept for reuse).
    pub(crate) live: bool,
}

impl Holder {
    pub(crate) fn new(key: u64) -> Holder {
        Holder {
            blocks: HashMap::with_hasher(Keyed(key)),
            epoch: 0,
            withheld: 0,
            partial: false,
            stale: false,
            block_size: 0,
            live: true,
        }
    }

    /// Whether a block stored in `epoch` counts in answers now.
    pub(crate) fn counts(&self, epoch: u32) -> bool {
        self.live && !self.stale && epoch == self.epoch
    }

    /// Events were lost: every block held now is withheld until removed or confirmed.
    pub(crate) fn lose(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        self.withheld = self.blocks.len();
        self.partial = true;
    }

    /// Accounts for block `b` leaving the holder.
    pub(crate) fn forget(&mut self, b: &Block) {
        if b.epoch != self.epoch {
            self.withheld = self.withheld.saturating_sub(1);
        }
    }
}

/// Who holds one block: usually one holder, so without an allocation then.
#[derive(Debug, Clone)]
pub(crate) enum Holders {
    One(Entry),
    Many(Vec<Entry>),
}

/// One holder of a block, with what the walk of a query needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) holder: u32,
    pub(crate) epoch: u32,
    pub(crate) end: u32,
}

impl Holders {
    pub(crate) fn as_slice(&self) -> &[Entry] {
        match self {
            Holders::One(e) => std::slice::from_ref(e),
            Holders::Many(v) => v,
        }
    }

    /// Adds or replaces `e`'s holder's entry (entries stay sorted by holder, so that a query
    /// intersects them with its own sorted list in one pass).
    pub(crate) fn put(&mut self, e: Entry) {
        match self {
            Holders::One(one) if one.holder == e.holder => *one = e,
            Holders::One(one) => {
                let pair = if one.holder < e.holder {
                    [*one, e]
                } else {
                    [e, *one]
                };
                *self = Holders::Many(pair.to_vec());
            }
            Holders::Many(v) => match v.binary_search_by_key(&e.holder, |x| x.holder) {
                Ok(i) => v[i] = e,
                Err(i) => v.insert(i, e),
            },
        }
    }

    /// Removes `holder`'s entry; whether none is left.
    pub(crate) fn drop_holder(&mut self, holder: u32) -> bool {
        match self {
            Holders::One(one) => one.holder == holder,
            Holders::Many(v) => {
                v.retain(|x| x.holder != holder);
                match v.as_slice() {
                    [] => true,
                    [one] => {
                        *self = Holders::One(*one);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

/// Puts `e` in `map` under `key`.
pub(crate) fn put(map: &mut HashMap<u64, Holders, Keyed>, key: u64, e: Entry) {
    map.entry(key)
        .and_modify(|h| h.put(e))
        .or_insert(Holders::One(e));
}

/// Takes `holder` out of `map` under `key` (one lookup).
pub(crate) fn take(map: &mut HashMap<u64, Holders, Keyed>, key: u64, holder: u32) {
    if let std::collections::hash_map::Entry::Occupied(mut o) = map.entry(key) {
        if o.get_mut().drop_holder(holder) {
            o.remove();
        }
    }
}
