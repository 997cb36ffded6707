//! A router's index of which engine holds which KV blocks, built from the engines' event
//! streams, and the prefix-overlap query it answers; without I/O.
//!
//! Blocks are kept per **holder**: one engine's stream (the name the caller gives it), and
//! within it the DP rank, the cache tier (`medium`, `GPU` when unnamed) and the KV-cache group,
//! each apart (a block on the CPU tier, or of another group, is another holder's). A block is
//! known by the engine's hash (what `BlockRemoved` names, and what
//! [`overlap_hashes`](Index::overlap_hashes) looks up) and by the index's own chained hash of
//! its tokens and of its LoRA adapter and cache salt ([`token_blocks`], what
//! [`overlap_tokens`](Index::overlap_tokens) looks up), with the position after its last token.
//!
//! **An answer never counts a block the index cannot vouch for.** Each holder is in one of
//! three states ([`HolderState`]): *exact* (every event of its stream applied), *recovering*
//! (events were lost: the replay could not supply them, a batch was unreadable, events were
//! skipped; blocks known from before the loss may have been removed unseen and are withheld
//! until they are removed or stored again, blocks stored since count, and the answer is a
//! lower bound: lost stores are unknown; exact again once cleared or restarted), or *stale*
//! (the caller marked the stream down: nothing counts). A publisher restart drops the engine's
//! blocks (its cache is gone with the process) before anything of the new process is applied.

mod chain;
mod holder;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use crate::keyed::Keyed;
use crate::sequence::Resync;
use crate::subscriber::SubItem;
use crate::wire::{BlockHash, EventBatch, KvEvent};
use holder::{Holder, Holders};

pub use chain::{token_blocks, Salt};

/// Limits an index keeps to, whatever its streams say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Blocks held over all holders; stores past it are dropped (and counted).
    pub max_blocks: usize,
    /// Holders; stores for a holder past it are dropped (and counted).
    pub max_holders: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            max_blocks: 1 << 24,
            max_holders: 1 << 16,
        }
    }
}

/// Who holds blocks: an engine's stream, and within it a DP rank, a cache tier and a KV-cache
/// group.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderKey {
    /// The stream's name, as the caller gave it.
    pub engine: String,
    /// The batch's DP rank (0 when the publisher sends none).
    pub dp_rank: i64,
    /// The cache tier (`GPU` when the event names none).
    pub medium: String,
    /// The KV-cache group (0 when the event names none).
    pub group: u32,
}

/// How far a holder's blocks are trusted (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HolderState {
    /// Every event of the stream was applied: every block counts.
    Exact,
    /// Events were lost: blocks known from before are withheld, blocks stored since count,
    /// and answers are a lower bound (lost stores are unknown) until the holder is cleared or
    /// its publisher restarts.
    Recovering,
    /// The stream is marked down: nothing counts.
    Stale,
}

/// One holder's part of an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderMatch {
    /// The holder (shared with the index: an answer copies no names).
    pub holder: std::sync::Arc<HolderKey>,
    /// The leading blocks of the query it holds (and vouches for).
    pub blocks: usize,
    /// The tokens those blocks cover.
    pub tokens: u64,
    /// The holder's state when asked.
    pub state: HolderState,
}

/// The answer to an overlap query: every holder of at least the first block, most blocks first
/// (ties in [`HolderKey`] order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlap {
    /// The holders that matched.
    pub matches: Vec<HolderMatch>,
}

impl Overlap {
    /// The holder with the longest match, if any.
    pub fn best(&self) -> Option<&HolderMatch> {
        self.matches.first()
    }
}

/// What an index applied and refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Blocks held, over all holders.
    pub blocks: usize,
    /// Holders in use.
    pub holders: usize,
    /// Blocks stored (each block of each `BlockStored`).
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Removals of blocks the holder did not hold.
    pub unknown_removed: u64,
    /// Stores whose parent the holder did not hold (kept, without a token hash).
    pub unknown_parent: u64,
    /// Blocks dropped at the limits ([`IndexConfig`]).
    pub dropped: u64,
    /// Losses (history lost, unreadable batches, batches with skipped events).
    pub losses: u64,
    /// Publisher restarts.
    pub restarts: u64,
    /// Snapshots loaded.
    pub snapshots: u64,
}

impl std::ops::AddAssign for IndexStats {
    /// Adds another index's counts (indexes side by side, as a service's shards).
    fn add_assign(&mut self, o: IndexStats) {
        // Taken apart whole: a counter added to the struct is a compile error here until
        // it is added up too.
        let IndexStats {
            blocks,
            holders,
            stored,
            removed,
            unknown_removed,
            unknown_parent,
            dropped,
            losses,
            restarts,
            snapshots,
        } = o;
        self.blocks += blocks;
        self.holders += holders;
        self.stored += stored;
        self.removed += removed;
        self.unknown_removed += unknown_removed;
        self.unknown_parent += unknown_parent;
        self.dropped += dropped;
        self.losses += losses;
        self.restarts += restarts;
        self.snapshots += snapshots;
    }
}

/// The index (see the module's documentation).
#[derive(Debug)]
pub struct Index {
    config: IndexConfig,
    holders: Vec<Holder>,
    keys: Vec<std::sync::Arc<HolderKey>>,
    ids: HashMap<HolderKey, u32>,
    by_hash: HashMap<u64, Holders, Keyed>,
    by_tokens: HashMap<u64, Holders, Keyed>,
    /// Blocks held, over all holders.
    blocks: usize,
    /// Engines with a loss not repaired since: their holders made later start partial.
    lossy: std::collections::HashSet<String>,
    stats: IndexStats,
    /// Token hashes a removal looks up ahead (kept for its allocation).
    scratch: Vec<u64>,
}

impl Default for Index {
    fn default() -> Self {
        Index::new(IndexConfig::default())
    }
}

mod apply;
mod query;

impl Index {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Index {
        let key = crate::wire::fresh_u64();
        Index {
            config,
            holders: Vec::new(),
            keys: Vec::new(),
            ids: HashMap::new(),
            by_hash: HashMap::with_hasher(Keyed(key)),
            by_tokens: HashMap::with_hasher(Keyed(key ^ 0x5bd1_e995)),
            blocks: 0,
            lossy: Default::default(),
            stats: IndexStats::default(),
            scratch: Vec::new(),
        }
    }

    /// Applies one item of engine `engine`'s subscriber: a batch (a loss too when some of its
    /// events were skipped), an unreadable batch (a loss), a resync (a restart or a loss), a
    /// snapshot (what the engine holds, exact again).
    pub fn apply_item(&mut self, engine: &str, item: &SubItem) {
        match item {
            SubItem::Batch { batch, skipped, .. } => {
                self.apply_batch(engine, batch);
                if !skipped.is_empty() {
                    self.lose(engine);
                }
            }
            SubItem::Malformed { .. } => self.lose(engine),
            SubItem::Resync(r) => self.resync(engine, r),
            SubItem::GapFilled { .. } => {}
            SubItem::Snapshot {
                batches, skipped, ..
            } => {
                self.load_snapshot(engine, batches);
                if !skipped.is_empty() {
                    self.lose(engine);
                }
            }
        }
    }

    /// Replaces what engine `engine`'s holders hold with its publisher's snapshot (batches
    /// of the blocks it holds, as a subscriber hands them out): every holder of the engine is
    /// exact again, holding what the snapshot says.
    pub fn load_snapshot(&mut self, engine: &str, batches: &[EventBatch]) {
        self.stats.snapshots += 1;
        self.drop_engine_blocks(engine);
        for b in batches {
            self.apply_batch(engine, b);
        }
    }

    /// Applies a resync of engine `engine`'s stream.
    pub fn resync(&mut self, engine: &str, why: &Resync) {
        match why {
            Resync::PublisherRestart { .. } => self.restart(engine),
            Resync::HistoryLost { .. } => self.lose(engine),
        }
    }

    /// Applies one batch of engine `engine`'s stream, event by event.
    pub fn apply_batch(&mut self, engine: &str, batch: &EventBatch) {
        let dp = batch.dp_rank.unwrap_or(0);
        for e in &batch.events {
            match e {
                KvEvent::BlockStored(s) => self.store(engine, dp, s),
                KvEvent::BlockRemoved(r) => self.remove(engine, dp, r),
                KvEvent::AllBlocksCleared { medium, .. } => {
                    self.clear(engine, Some(dp), medium.as_deref())
                }
                KvEvent::BlockTransferred(t) => self.transfer(engine, dp, t),
            }
        }
    }

    /// Events of engine `engine` were lost: its blocks known now are withheld.
    pub fn lose(&mut self, engine: &str) {
        self.stats.losses += 1;
        self.lossy.insert(engine.to_string());
        for id in self.ids_of(engine) {
            self.holders[id as usize].lose();
        }
    }

    /// Engine `engine`'s publisher restarted: its blocks are dropped.
    pub fn restart(&mut self, engine: &str) {
        self.stats.restarts += 1;
        self.drop_engine_blocks(engine);
    }

    /// Drops every block of engine `engine`: its holders are empty and exact (its losses
    /// forgotten).
    fn drop_engine_blocks(&mut self, engine: &str) {
        self.clear(engine, None, None);
        self.lossy.remove(engine);
    }

    /// Marks engine `engine`'s stream down (`true`: nothing of it counts) or up again
    /// (`false`: what it held before is withheld, as after a loss, since events may have been
    /// missed meanwhile).
    pub fn set_stale(&mut self, engine: &str, stale: bool) {
        for id in self.ids_of(engine) {
            let h = &mut self.holders[id as usize];
            if h.stale && !stale {
                h.lose();
            }
            h.stale = stale;
        }
    }

    /// Forgets engine `engine` (its holders are freed).
    pub fn remove_engine(&mut self, engine: &str) {
        self.drop_engine_blocks(engine);
        for id in self.ids_of(engine) {
            self.holders[id as usize].live = false;
            let key = HolderKey::clone(&self.keys[id as usize]);
            self.ids.remove(&key);
        }
    }

    /// Counters.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks,
            holders: self.holders.iter().filter(|h| h.live).count(),
            ..self.stats
        }
    }

    /// Every holder in use, with its state, blocks held and blocks withheld.
    pub fn holders(&self) -> Vec<(HolderKey, HolderState, usize, usize)> {
        let mut out: Vec<_> = self
            .ids
            .iter()
            .map(|(k, id)| {
                let h = &self.holders[*id as usize];
                (k.clone(), state(h), h.held, h.withheld)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every holder in use with its state and the engine hashes of the blocks it holds
    /// (withheld ones too), for dumps.
    pub fn dump(&self) -> Vec<(HolderKey, HolderState, Vec<u64>)> {
        let mut per: Vec<Vec<u64>> = vec![Vec::new(); self.holders.len()];
        for (hash, hs) in &self.by_hash {
            for e in hs.as_slice() {
                per[e.holder as usize].push(*hash);
            }
        }
        let mut out: Vec<_> = self
            .ids
            .iter()
            .map(|(k, id)| {
                let mut blocks = std::mem::take(&mut per[*id as usize]);
                blocks.sort_unstable();
                (k.clone(), state(&self.holders[*id as usize]), blocks)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The holders of engine `engine`.
    fn ids_of(&self, engine: &str) -> Vec<u32> {
        self.ids
            .iter()
            .filter(|(k, _)| k.engine == engine)
            .map(|(_, id)| *id)
            .collect()
    }
}

/// A holder's state.
fn state(h: &Holder) -> HolderState {
    if h.stale {
        HolderState::Stale
    } else if h.partial || h.withheld > 0 {
        HolderState::Recovering
    } else {
        HolderState::Exact
    }
}

/// The key the index files a wire hash under.
fn hash_key(h: &BlockHash) -> u64 {
    h.as_u64()
}
