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

use super::wire::{encode_event, Encoding, KvEvent};

struct Held {
    event: KvEvent,
    /// Emissions not yet used up, per rank.
    counts: Vec<u32>,
    /// Insertion number (for oldest-first eviction).
    born: u64,
}

/// Counters of one TP group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TpStats {
    /// Events emitted by every rank and handed out.
    pub forwarded: u64,
    /// Events held now, waiting for other ranks.
    pub held: u64,
    /// Events dropped unforwarded to stay within the bound (some rank never emitted them).
    pub evicted: u64,
}

/// One data-parallel rank's TP workers.
pub struct TpAggregator {
    tp_size: usize,
    max_pending: usize,
    held: HashMap<Vec<u8>, Held>,
    order: VecDeque<(u64, Vec<u8>)>,
    next: u64,
    stats: TpStats,
}

impl TpAggregator {
    /// Aggregates `tp_size` workers (at least 1), holding at most `max_pending` events.
    pub fn new(tp_size: usize, max_pending: usize) -> Self {
        TpAggregator {
            tp_size: tp_size.max(1),
            max_pending: max_pending.max(1),
            held: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            stats: TpStats::default(),
        }
    }

    /// Workers aggregated.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// Counters so far.
    pub fn stats(&self) -> TpStats {
        TpStats {
            held: self.held.len() as u64,
            ..self.stats
        }
    }

    /// Events of one batch from worker `rank`; returns those now emitted by every worker, in
    /// the batch's order. A rank out of range contributes nothing.
    pub fn add(&mut self, rank: usize, events: Vec<KvEvent>) -> Vec<KvEvent> {
        let mut done = Vec::new();
        if rank >= self.tp_size {
            return done;
        }
        for ev in events {
            let mut key = Vec::with_capacity(64);
            encode_event(&ev, Encoding::Current, &mut key);
            let h = match self.held.get_mut(&key) {
                Some(h) => h,
                None => {
                    let born = self.next;
                    self.next += 1;
                    self.order.push_back((born, key.clone()));
                    self.held.entry(key.clone()).or_insert(Held {
                        event: ev,
                        counts: vec![0; self.tp_size],
                        born,
                    })
                }
            };
            h.counts[rank] += 1;
            if h.counts.iter().all(|c| *c > 0) {
                h.counts.iter_mut().for_each(|c| *c -= 1);
                done.push(h.event.clone());
                self.stats.forwarded += 1;
                if h.counts.iter().all(|c| *c == 0) {
                    self.held.remove(&key);
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
        self.held.retain(|_, h| {
            h.counts[rank] = 0;
            h.counts.iter().any(|c| *c > 0)
        });
    }

    fn evict(&mut self) {
        while self.held.len() > self.max_pending {
            let Some((born, key)) = self.order.pop_front() else {
                break;
            };
            if self.held.get(&key).is_some_and(|h| h.born == born) {
                self.held.remove(&key);
                self.stats.evicted += 1;
            }
        }
        // The order queue keeps entries of events already forwarded or forgotten until they
        // reach its front; rebuild it from what is held before it grows past its bound.
        if self.order.len() > 2 * self.max_pending + 1024 {
            let mut live: Vec<(u64, Vec<u8>)> =
                self.held.iter().map(|(k, h)| (h.born, k.clone())).collect();
            live.sort_unstable_by_key(|x| x.0);
            self.order = live.into();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{BlockHash, BlockRemoved, BlockStored};

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
        let mut a = TpAggregator::new(2, 100);
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
        removed.extra.push(crate::events::ExtraField {
            key: crate::events::FieldKey::Name("x".into()),
            value: crate::events::Value::UInt(1),
        });
        assert!(a.add(0, vec![plain]).is_empty());
        assert!(a.add(1, vec![KvEvent::BlockRemoved(removed)]).is_empty());
    }

    #[test]
    fn held_events_are_bounded_and_a_resynced_rank_is_forgotten() {
        let mut a = TpAggregator::new(2, 3);
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
    }
}
