//! The tensor-parallel rule of vLLM's `KVEventAggregator`, without I/O: an event is published
//! once every TP worker of a data-parallel rank has emitted it.
//!
//! Each worker's stream is fed in with its rank ([`TpAggregator::add`]); an event (compared by
//! its whole encoding, unknown fields included) is held until each rank has emitted it once,
//! then handed out once and one emission of each rank is used up, so an event a worker emits
//! again later is counted again. Held events are bounded: beyond `max_pending` the oldest is
//! dropped (a worker that never emits it, such as one that is down) and counted. A worker that
//! resynchronises ([`TpAggregator::forget`]) has its emissions forgotten.

use std::collections::{HashMap, VecDeque};

use sha2::{Digest, Sha256};

use super::wire::{encode_event, Encoding, FieldKey, KvEvent};

/// An event's identity: the first 16 bytes of the SHA-256 of its whole encoding (unknown fields
/// included), so that a held event costs its own memory once, not a second copy as its key.
type Key = [u8; 16];

struct Held {
    event: KvEvent,
    /// Emissions not yet used up, per rank.
    counts: Vec<u32>,
    /// Insertion number (for oldest-first eviction).
    born: u64,
    /// Size of its encoding (what the byte bound counts).
    bytes: usize,
}

/// Counters of one TP group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TpStats {
    /// Events emitted by every rank and handed out.
    pub forwarded: u64,
    /// Events held now, waiting for other ranks.
    pub held: u64,
    /// Events dropped unforwarded to stay within the bounds (some rank never emitted them).
    pub evicted: u64,
}

/// One data-parallel rank's TP workers.
pub struct TpAggregator {
    tp_size: usize,
    max_pending: usize,
    max_bytes: usize,
    bytes: usize,
    held: HashMap<Key, Held>,
    order: VecDeque<(u64, Key)>,
    next: u64,
    stats: TpStats,
    scratch: Vec<u8>,
}

impl TpAggregator {
    /// Aggregates `tp_size` workers (at least 1), holding at most `max_pending` events and
    /// `max_bytes` of their encodings.
    pub fn new(tp_size: usize, max_pending: usize, max_bytes: usize) -> Self {
        TpAggregator {
            tp_size: tp_size.max(1),
            max_pending: max_pending.max(1),
            max_bytes,
            bytes: 0,
            held: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            stats: TpStats::default(),
            scratch: Vec::new(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> TpStats {
        TpStats {
            held: self.held.len() as u64,
            ..self.stats
        }
    }

    /// The event's identity and encoded size. Positional unknown fields exist only in the
    /// legacy encoding, so an event carrying some is identified by that one.
    fn key(&mut self, ev: &KvEvent) -> (Key, usize) {
        let enc = if ev
            .extra()
            .iter()
            .any(|f| matches!(f.key, FieldKey::Position(_)))
        {
            Encoding::Legacy
        } else {
            Encoding::Current
        };
        self.scratch.clear();
        encode_event(ev, enc, &mut self.scratch);
        let digest = Sha256::digest(&self.scratch);
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        (key, self.scratch.len())
    }

    /// Events of one batch from worker `rank`; returns those now emitted by every worker, in
    /// the batch's order. A rank out of range contributes nothing.
    pub fn add(&mut self, rank: usize, events: Vec<KvEvent>) -> Vec<KvEvent> {
        let mut done = Vec::new();
        if rank >= self.tp_size {
            return done;
        }
        for ev in events {
            let (key, bytes) = self.key(&ev);
            let h = match self.held.get_mut(&key) {
                Some(h) => h,
                None => {
                    let born = self.next;
                    self.next += 1;
                    self.order.push_back((born, key));
                    self.bytes += bytes;
                    self.held.entry(key).or_insert(Held {
                        event: ev,
                        counts: vec![0; self.tp_size],
                        born,
                        bytes,
                    })
                }
            };
            h.counts[rank] += 1;
            if h.counts.iter().all(|c| *c > 0) {
                h.counts.iter_mut().for_each(|c| *c -= 1);
                done.push(h.event.clone());
                self.stats.forwarded += 1;
                if h.counts.iter().all(|c| *c == 0) {
                    let gone = h.bytes;
                    self.held.remove(&key);
                    self.bytes -= gone;
                }
            }
        }
        self.evict();
        done
    }

    /// Forgets worker `rank`'s emissions (it restarted or lost history).
    pub fn forget(&mut self, rank: usize) {
        if rank >= self.tp_size {
            return;
        }
        let mut freed = 0;
        self.held.retain(|_, h| {
            h.counts[rank] = 0;
            let keep = h.counts.iter().any(|c| *c > 0);
            if !keep {
                freed += h.bytes;
            }
            keep
        });
        self.bytes -= freed;
    }

    fn evict(&mut self) {
        while self.held.len() > self.max_pending
            || (self.bytes > self.max_bytes && !self.held.is_empty())
        {
            let Some((born, key)) = self.order.pop_front() else {
                break;
            };
            if self.held.get(&key).is_some_and(|h| h.born == born) {
                if let Some(h) = self.held.remove(&key) {
                    self.bytes -= h.bytes;
                }
                self.stats.evicted += 1;
            }
        }
        // The order queue keeps entries of events already forwarded or forgotten until they
        // reach its front; rebuild it from what is held before it grows past its bound.
        if self.order.len() > 2 * self.held.len() + 1024 {
            let mut live: Vec<(u64, Key)> = self.held.iter().map(|(k, h)| (h.born, *k)).collect();
            live.sort_unstable_by_key(|x| x.0);
            self.order = live.into();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockHash, BlockRemoved, BlockStored};

    fn stored(h: u64) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::U64(h)],
            token_ids: vec![1, 2],
            block_size: 2,
            ..Default::default()
        })
    }

    #[test]
    fn an_event_is_forwarded_once_every_rank_emitted_it() {
        let mut a = TpAggregator::new(2, 100, usize::MAX);
        assert!(a.add(0, vec![stored(1), stored(2)]).is_empty());
        assert_eq!(a.add(1, vec![stored(2)]), vec![stored(2)]);
        assert_eq!(a.stats().held, 1);
        assert!(a.add(0, vec![stored(1)]).is_empty(), "rank 0 twice");
        assert_eq!(a.add(1, vec![stored(1)]), vec![stored(1)]);
        assert_eq!(
            a.add(1, vec![stored(1)]),
            vec![stored(1)],
            "rank 0's second one"
        );
        assert_eq!(a.stats().held, 0);
        assert_eq!(a.stats().forwarded, 3);
        // Events differing in any field (here a field kvlink does not model) are distinct.
        let mut removed = BlockRemoved {
            block_hashes: vec![BlockHash::U64(1)],
            ..Default::default()
        };
        let plain = KvEvent::BlockRemoved(removed.clone());
        removed.extra.push(crate::ExtraField {
            key: crate::FieldKey::Name("x".into()),
            value: crate::Value::UInt(1),
        });
        assert!(a.add(0, vec![plain]).is_empty());
        assert!(a.add(1, vec![KvEvent::BlockRemoved(removed)]).is_empty());
    }

    #[test]
    fn held_events_are_bounded_and_a_resynced_rank_is_forgotten() {
        let mut a = TpAggregator::new(2, 3, usize::MAX);
        for h in 0..10 {
            a.add(0, vec![stored(h)]);
        }
        assert_eq!(a.stats().held, 3);
        assert_eq!(a.stats().evicted, 7);
        assert_eq!(a.add(1, vec![stored(9)]), vec![stored(9)]);
        assert!(
            a.add(1, vec![stored(0)]).is_empty(),
            "evicted: waits for rank 0 again"
        );
        a.forget(1);
        assert!(
            a.add(0, vec![stored(0)]).is_empty(),
            "rank 1's emission forgotten"
        );
        assert!(a.add(7, vec![stored(0)]).is_empty(), "no such rank");
        // The byte bound: each of these events encodes to well over 100 bytes.
        let mut b = TpAggregator::new(2, 1000, 1000);
        for h in 0..50 {
            b.add(0, vec![stored(h)]);
        }
        assert!(
            b.stats().held < 20 && b.stats().evicted > 30,
            "{:?}",
            b.stats()
        );
        assert!(b.bytes <= 1000);
    }
}
