//! The publisher's live set, without I/O: the blocks it announced stored and has not announced
//! removed, per tier (DP rank, medium, KV-cache group), from which a snapshot announces them
//! again to a subscriber whose history the replay ring no longer holds.
//!
//! Each `BlockStored` is kept whole (a "run"), with which of its blocks are still live and in
//! which tier; a snapshot re-announces every run in the order it was stored (a parent before
//! its children), as the original event when all its blocks are live in their first tier, else
//! as the consecutive stretches that are. Memory is bounded by a number of blocks; past it the
//! set stops vouching for itself and snapshots are refused until a clear empties it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::keyed::Keyed;
use crate::wire::{BlockStored, EventBatch, KvEvent, Value, DEFAULT_MEDIUM};

/// Events per snapshot batch: each batch is one replay message.
const PART_EVENTS: usize = 1024;

/// A change to the live set, taken from a published event in the publishing thread (where its
/// memory is), applied under the replay ring's lock.
#[derive(Debug, Clone)]
// Store, the large variant, is by far the most common op (as `KvEvent::BlockStored`): boxing it
// would cost an allocation per event to shrink the rare ones.
#[allow(clippy::large_enum_variant)]
pub(crate) enum LiveOp {
    /// Blocks stored.
    Store(BlockStored),
    /// Blocks removed from a tier.
    Remove {
        medium: Option<String>,
        group: Option<u32>,
        hashes: Vec<u64>,
    },
    /// Every block of the rank's tiers (of one medium, when named) dropped.
    Clear { medium: Option<String> },
    /// Blocks moved between media (ATOM).
    Move {
        from: Option<String>,
        to: Option<String>,
        group: Option<u32>,
        hashes: Vec<u64>,
    },
    /// A payload or event the publisher could not read: the set no longer knows.
    Unknown,
}

impl LiveOp {
    /// The change an event makes, taking its memory.
    pub(crate) fn take(e: KvEvent) -> LiveOp {
        match e {
            KvEvent::BlockStored(s) => LiveOp::Store(s),
            other => LiveOp::of(&other),
        }
    }

    /// The change an event makes.
    pub(crate) fn of(e: &KvEvent) -> LiveOp {
        let keys = |v: &[crate::wire::BlockHash]| v.iter().map(|h| h.as_u64()).collect();
        match e {
            KvEvent::BlockStored(s) => LiveOp::Store(s.clone()),
            KvEvent::BlockRemoved(r) => LiveOp::Remove {
                medium: r.medium.clone(),
                group: r.group_idx,
                hashes: keys(&r.block_hashes),
            },
            KvEvent::AllBlocksCleared { medium, .. } => LiveOp::Clear {
                medium: medium.clone(),
            },
            KvEvent::BlockTransferred(t) => LiveOp::Move {
                from: t.from_medium.clone(),
                to: t.to_medium.clone(),
                group: t.group_idx,
                hashes: keys(&t.block_hashes),
            },
        }
    }
}

/// One batch's changes.
#[derive(Debug, Clone, Default)]
pub(crate) struct LiveDelta {
    /// The batch's DP rank.
    pub(crate) dp_rank: Option<i64>,
    /// Its events' changes, in order.
    pub(crate) ops: Vec<LiveOp>,
}

impl LiveDelta {
    /// The changes of `batch`, taking its events.
    pub(crate) fn take(batch: EventBatch) -> LiveDelta {
        LiveDelta {
            dp_rank: batch.dp_rank,
            ops: batch.events.into_iter().map(LiveOp::take).collect(),
        }
    }

    /// The changes of `batch`.
    pub(crate) fn of(batch: &EventBatch) -> LiveDelta {
        LiveDelta {
            dp_rank: batch.dp_rank,
            ops: batch.events.iter().map(LiveOp::of).collect(),
        }
    }

    /// The changes of an encoded payload (one the caller encoded itself); an unreadable
    /// payload, or one with events the decoder skipped, is [`LiveOp::Unknown`].
    pub(crate) fn of_payload(payload: &[u8]) -> LiveDelta {
        match crate::wire::decode_batch(payload) {
            Ok(d) if d.skipped.is_empty() => LiveDelta::take(d.batch),
            _ => LiveDelta {
                dp_rank: None,
                ops: vec![LiveOp::Unknown],
            },
        }
    }
}

/// A tier: one DP rank's blocks of one medium and KV-cache group, by engine hash.
#[derive(Debug)]
struct Tier {
    dp: i64,
    /// Whether the batches that stored here named their DP rank (snapshots name it then).
    dp_given: bool,
    medium: String,
    group: u32,
    blocks: HashMap<u64, Slot, Keyed>,
}

/// Where a live block's store is kept: its run and its place in it.
#[derive(Debug, Clone, Copy)]
struct Slot {
    run: u32,
    idx: u32,
}

/// A stored event, with the tier each of its blocks is live in.
#[derive(Debug)]
struct Run {
    /// Shared with snapshots in the making, which read it without the lock.
    event: Arc<BlockStored>,
    /// When it was stored: snapshots announce runs in this order (parents first).
    order: u64,
    /// The tier (index into `tiers`) of each block, `None` once removed or stored again.
    live: Vec<Option<u32>>,
    count: u32,
}

/// The blocks a publisher's stream has stored and not removed.
#[derive(Debug)]
pub(crate) struct LiveSet {
    tiers: Vec<Tier>,
    /// Runs by id (a slot per run, reused once its blocks are all gone).
    runs: Vec<Option<Run>>,
    free: Vec<u32>,
    next_order: u64,
    blocks: usize,
    max_blocks: usize,
    /// Whether the set does not vouch for itself now (past its bound, or an unreadable batch).
    unsure: bool,
    key: u64,
}

/// Blocks `start..end` of a store, live in tier `.2`.
type Stretch = (usize, usize, u32);

/// What a snapshot announces, taken under the lock: each live run's event (shared) and its
/// live stretches, in store order; built into batches without the lock.
#[derive(Debug)]
pub(crate) struct Plan {
    /// Each tier's DP rank, whether batches named it, and medium.
    tiers: Vec<(i64, bool, String)>,
    runs: Vec<(Arc<BlockStored>, Vec<Stretch>)>,
}

impl LiveSet {
    /// An empty set holding at most `max_blocks` blocks.
    pub(crate) fn new(max_blocks: usize) -> Self {
        LiveSet {
            tiers: Vec::new(),
            runs: Vec::new(),
            free: Vec::new(),
            next_order: 0,
            blocks: 0,
            max_blocks,
            unsure: false,
            key: crate::wire::fresh_u64(),
        }
    }

    /// Live blocks.
    pub(crate) fn len(&self) -> usize {
        self.blocks
    }

    /// Applies one batch's changes.
    pub(crate) fn apply(&mut self, delta: LiveDelta) {
        let dp = delta.dp_rank;
        for op in delta.ops {
            match op {
                LiveOp::Store(s) => self.store(dp, s),
                LiveOp::Remove {
                    medium,
                    group,
                    hashes,
                } => {
                    if let Some(t) = self.find(dp, medium.as_deref(), group) {
                        for h in hashes {
                            self.remove(t, h);
                        }
                    }
                }
                LiveOp::Clear { medium } => self.clear(dp, medium.as_deref()),
                LiveOp::Move {
                    from,
                    to,
                    group,
                    hashes,
                } => self.move_blocks(dp, from.as_deref(), to.as_deref(), group, &hashes),
                LiveOp::Unknown => self.unsure = true,
            }
        }
    }

    fn find(&self, dp: Option<i64>, medium: Option<&str>, group: Option<u32>) -> Option<u32> {
        let (dp, medium, group) = (
            dp.unwrap_or(0),
            medium.unwrap_or(DEFAULT_MEDIUM),
            group.unwrap_or(0),
        );
        let found = self
            .tiers
            .iter()
            .position(|t| t.dp == dp && t.group == group && t.medium == medium);
        found.map(|i| i as u32)
    }

    fn tier(&mut self, dp: Option<i64>, medium: Option<&str>, group: Option<u32>) -> u32 {
        if let Some(t) = self.find(dp, medium, group) {
            return t;
        }
        self.tiers.push(Tier {
            dp: dp.unwrap_or(0),
            dp_given: dp.is_some(),
            medium: medium.unwrap_or(DEFAULT_MEDIUM).to_string(),
            group: group.unwrap_or(0),
            blocks: HashMap::with_hasher(Keyed(self.key)),
        });
        (self.tiers.len() - 1) as u32
    }

    fn store(&mut self, dp: Option<i64>, event: BlockStored) {
        let tier = self.tier(dp, event.medium.as_deref(), event.group_idx);
        let keys: Vec<u64> = event.block_hashes.iter().map(|h| h.as_u64()).collect();
        let run = Run {
            event: Arc::new(event),
            order: self.next_order,
            live: vec![None; keys.len()],
            count: 0,
        };
        self.next_order += 1;
        let id = match self.free.pop() {
            Some(id) => {
                self.runs[id as usize] = Some(run);
                id
            }
            None => {
                self.runs.push(Some(run));
                (self.runs.len() - 1) as u32
            }
        };
        for (i, key) in keys.into_iter().enumerate() {
            self.put(tier, key, id, i as u32);
        }
        self.release_if_empty(id);
    }

    /// Files block `key` of run `run` at `idx` in `tier` (what it replaces there is no longer
    /// live); past the bound, the set stops vouching for itself.
    fn put(&mut self, tier: u32, key: u64, run: u32, idx: u32) {
        let blocks = &mut self.tiers[tier as usize].blocks;
        if self.blocks >= self.max_blocks && !blocks.contains_key(&key) {
            self.unsure = true;
            return;
        }
        let old = blocks.insert(key, Slot { run, idx });
        // Linked before the old slot is let go: the same hash twice in one event must not
        // empty its own run.
        if let Some(r) = self.runs[run as usize].as_mut() {
            r.live[idx as usize] = Some(tier);
            r.count += 1;
        }
        match old {
            Some(old) => self.unlink(old),
            None => self.blocks += 1,
        }
    }

    /// Takes block `key` out of `tier`, when there.
    fn remove(&mut self, tier: u32, key: u64) {
        if let Some(slot) = self.tiers[tier as usize].blocks.remove(&key) {
            self.blocks -= 1;
            self.unlink(slot);
        }
    }

    /// The block at `slot` is no longer live where its run said.
    fn unlink(&mut self, slot: Slot) {
        if let Some(r) = self.runs[slot.run as usize].as_mut() {
            if r.live[slot.idx as usize].take().is_some() {
                r.count -= 1;
            }
        }
        self.release_if_empty(slot.run);
    }

    /// Frees run `id`'s place once none of its blocks is live.
    fn release_if_empty(&mut self, id: u32) {
        let place = &mut self.runs[id as usize];
        if place.as_ref().is_some_and(|r| r.count == 0) {
            *place = None;
            self.free.push(id);
        }
    }

    fn clear(&mut self, dp: Option<i64>, medium: Option<&str>) {
        let dp = dp.unwrap_or(0);
        for t in 0..self.tiers.len() {
            let tier = &mut self.tiers[t];
            if tier.dp != dp || medium.is_some_and(|m| m != tier.medium) {
                continue;
            }
            let slots: Vec<Slot> = tier.blocks.drain().map(|(_, s)| s).collect();
            self.blocks -= slots.len();
            for s in slots {
                self.unlink(s);
            }
        }
        if self.blocks == 0 {
            // Empty as the engine's cache: nothing it does not know of can be left.
            self.unsure = false;
        }
    }

    fn move_blocks(
        &mut self,
        dp: Option<i64>,
        from: Option<&str>,
        to: Option<&str>,
        group: Option<u32>,
        hashes: &[u64],
    ) {
        let Some(src) = self.find(dp, from, group) else {
            return;
        };
        let dst = self.tier(dp, to, group);
        for &h in hashes {
            let Some(slot) = self.tiers[src as usize].blocks.remove(&h) else {
                continue;
            };
            if let Some(r) = self.runs[slot.run as usize].as_mut() {
                r.live[slot.idx as usize] = Some(dst);
            }
            // What the destination held under that hash is replaced.
            if let Some(old) = self.tiers[dst as usize].blocks.insert(h, slot) {
                self.blocks -= 1;
                self.unlink(old);
            }
        }
    }

    /// What a snapshot announces (`None` when the set does not vouch for itself): cheap to
    /// take under the lock, built into batches by [`Plan::batches`] after.
    pub(crate) fn plan(&self) -> Option<Plan> {
        if self.unsure {
            return None;
        }
        let mut runs: Vec<&Run> = self.runs.iter().flatten().collect();
        runs.sort_unstable_by_key(|r| r.order);
        let runs = runs
            .into_iter()
            .map(|run| (run.event.clone(), stretches(&run.live)))
            .collect();
        let tiers = self.tiers.iter();
        let tiers = tiers
            .map(|t| (t.dp, t.dp_given, t.medium.clone()))
            .collect();
        Some(Plan { tiers, runs })
    }

    /// The live set as batches (see [`Plan::batches`]), or `None`.
    #[cfg(test)]
    pub(crate) fn snapshot(&self, ts: f64) -> Option<Vec<EventBatch>> {
        self.plan().map(|p| p.batches(ts))
    }
}

/// The stretches of consecutive blocks live in one tier: `(start, end, tier)`.
fn stretches(live: &[Option<u32>]) -> Vec<Stretch> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < live.len() {
        let Some(t) = live[i] else {
            i += 1;
            continue;
        };
        let end = (i..live.len())
            .find(|&j| live[j] != Some(t))
            .unwrap_or(live.len());
        out.push((i, end, t));
        i = end;
    }
    out
}

impl Plan {
    /// Batches of `BlockStored` events (one DP rank each, at most [`PART_EVENTS`] events
    /// each; one empty batch when nothing is live).
    pub(crate) fn batches(&self, ts: f64) -> Vec<EventBatch> {
        let mut by_dp: BTreeMap<i64, (bool, Vec<KvEvent>)> = BTreeMap::new();
        for (event, parts) in &self.runs {
            for &(a, b, t) in parts {
                let (dp, given, medium) = &self.tiers[t as usize];
                let slot = by_dp.entry(*dp).or_default();
                slot.0 |= *given;
                slot.1
                    .push(KvEvent::BlockStored(stretch(event, a, b, medium)));
            }
        }
        let mut out = Vec::new();
        for (dp, (given, events)) in by_dp {
            // Moved into parts, not copied.
            let mut events = events.into_iter().peekable();
            while events.peek().is_some() {
                out.push(EventBatch {
                    ts,
                    events: events.by_ref().take(PART_EVENTS).collect(),
                    dp_rank: given.then_some(dp),
                });
            }
        }
        if out.is_empty() {
            out.push(EventBatch {
                ts,
                events: Vec::new(),
                dp_rank: None,
            });
        }
        out
    }
}

/// Blocks `a..b` of stored event `ev`, now live in `medium`: the event itself when that is all
/// of it in its own tier, else the stretch (tokens, extra keys and lookahead cut to it; its
/// parent the block before it).
fn stretch(ev: &BlockStored, a: usize, b: usize, medium: &str) -> BlockStored {
    let n = ev.block_hashes.len();
    let same_medium = ev.medium.as_deref().unwrap_or(DEFAULT_MEDIUM) == medium;
    if a == 0 && b == n && same_medium {
        return ev.clone();
    }
    let size = ev.block_size as usize;
    let len = ev.token_ids.len();
    let token_ids = if ev.tokens_fit_blocks() {
        ev.token_ids[a * size..(b * size).min(len)].to_vec()
    } else {
        Vec::new()
    };
    let extra_keys = match &ev.extra_keys {
        Some(Value::Array(v)) if v.len() == n => Some(Value::Array(v[a..b].to_vec())),
        other => other.clone(),
    };
    BlockStored {
        block_hashes: ev.block_hashes[a..b].to_vec(),
        parent_block_hash: match a {
            0 => ev.parent_block_hash.clone(),
            _ => Some(ev.block_hashes[a - 1].clone()),
        },
        token_ids,
        block_size: ev.block_size,
        lora_id: ev.lora_id,
        medium: if same_medium {
            ev.medium.clone()
        } else {
            Some(medium.to_string())
        },
        lora_name: ev.lora_name.clone(),
        group_idx: ev.group_idx,
        kv_cache_spec_kind: ev.kv_cache_spec_kind.clone(),
        kv_cache_spec_sliding_window: ev.kv_cache_spec_sliding_window,
        token_offset: ev.token_offset.map(|o| o + (a * size) as u64),
        extra_keys,
        locality: ev.locality.clone(),
        ownership: ev.ownership.clone(),
        session_id: ev.session_id.clone(),
        lookahead_token_ids: ev
            .lookahead_token_ids
            .as_ref()
            .map(|l| l.get(a..b).map(<[_]>::to_vec).unwrap_or_default()),
        cache_salt: ev.cache_salt.clone(),
        extra: ev.extra.clone(),
    }
}

#[cfg(test)]
mod tests;
