//! The state the publisher's callers, its send loop and its replay server share: the queue
//! toward the send loop, the replay ring with the live set, the counters, and the direct path
//! to the publisher's own PUB side.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;

use super::live::LiveDelta;
use super::replay::History;
use crate::error::EventsError;
use crate::fanout::Fanout;

/// A batch waiting to be numbered and sent: its payload, with its own topic or the publisher's.
pub(super) struct Item {
    pub(super) topic: Option<Bytes>,
    pub(super) payload: Bytes,
    /// Its changes to the live set (when the publisher keeps one).
    pub(super) delta: Option<LiveDelta>,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) published: AtomicU64,
    pub(super) dropped: AtomicU64,
    pub(super) replay_requests: AtomicU64,
    pub(super) replayed_batches: AtomicU64,
    pub(super) bad_replay_requests: AtomicU64,
    pub(super) replay_timeouts: AtomicU64,
    pub(super) subscriber_drops: AtomicU64,
    pub(super) snapshots: AtomicU64,
    pub(super) snapshots_refused: AtomicU64,
}

pub(super) struct Shared {
    pub(super) queue: Mutex<VecDeque<Item>>,
    /// Signalled when the queue has room (threads blocked in `publish_timeout`).
    pub(super) room: Condvar,
    /// Signalled when the queue has room (async waiters).
    pub(super) room_async: Notify,
    /// Signalled when the queue goes from empty to not empty, or the publisher closes.
    pub(super) work: Notify,
    pub(super) cap: usize,
    /// Payload bytes in `queue`, and their bound.
    pub(super) queued_bytes: AtomicUsize,
    pub(super) cap_bytes: usize,
    pub(super) closed: AtomicBool,
    pub(super) ring: Mutex<History>,
    pub(super) counters: Counters,
    /// The publisher's own PUB side, sent to from the caller's thread (`None` once dropped);
    /// absent for the `zeromq` crate's sockets, which the send loop serves from the queue.
    pub(super) direct: Option<Mutex<Option<Direct>>>,
    /// The topic frame of batches published without one of their own.
    pub(super) topic: Bytes,
    /// Whether sent batches are kept for replay.
    pub(super) keep_for_replay: bool,
}

/// Sending from the caller's thread to the publisher's own PUB side ([`Fanout::send`] queues
/// toward each subscriber and never waits): no queue and no hop through the send loop; a
/// subscriber's writer is woken only when its queue was empty.
pub(super) struct Direct {
    pub(super) fanout: Fanout,
    pub(super) next_seq: u64,
}

impl Shared {
    /// Whether the queue `q` (locked) has no room for a payload of `len` bytes: at its batch
    /// bound, or past its byte bound (an empty queue takes a payload of any size).
    pub(super) fn full(&self, q: &VecDeque<Item>, len: usize) -> bool {
        q.len() >= self.cap
            || (!q.is_empty() && self.queued_bytes.load(Ordering::Relaxed) + len > self.cap_bytes)
    }

    pub(super) fn queue_full(&self) -> EventsError {
        EventsError::QueueFull {
            cap: self.cap,
            cap_bytes: self.cap_bytes,
        }
    }

    /// Keeps batch `seq` for replay when configured, under its own topic frame or the
    /// configured one, which it returns, and applies its changes to the live set (the send
    /// loop and the direct path both record here, in sequence order).
    pub(super) fn record(
        &self,
        seq: u64,
        topic: Option<Bytes>,
        payload: &Bytes,
        delta: Option<LiveDelta>,
    ) -> Bytes {
        let topic = topic.unwrap_or_else(|| self.topic.clone());
        if self.keep_for_replay {
            let size = payload.len() + topic.len();
            let mut h = self.ring.lock();
            h.ring
                .push_sized(seq, (topic.clone(), payload.clone()), size);
            if let (Some(live), Some(d)) = (h.live.as_mut(), delta) {
                live.apply(d);
            }
        }
        topic
    }

    /// Counts a batch handed to the PUB side, which `lost` subscribers lost to a full queue.
    pub(super) fn count_sent(&self, lost: u64) {
        if lost > 0 {
            self.counters
                .subscriber_drops
                .fetch_add(lost, Ordering::Relaxed);
        }
        self.counters.published.fetch_add(1, Ordering::Relaxed);
    }

    /// Queues `item` (or sends it now, on the direct path); when the queue is full, hands it
    /// back (`Err(Some)`); when the publisher is closed, drops it (`Err(None)`).
    pub(super) fn try_push(&self, item: Item) -> Result<(), Option<Item>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(None);
        }
        if let Some(direct) = &self.direct {
            // Held while sending, so that sequence numbers go out in order.
            let mut d = direct.lock();
            let Some(d) = d.as_mut() else {
                return Err(None);
            };
            let seq = d.next_seq;
            d.next_seq += 1;
            let topic = self.record(seq, item.topic, &item.payload, item.delta);
            let lost = d.fanout.send(&topic, seq, item.payload);
            self.count_sent(lost);
            return Ok(());
        }
        let mut q = self.queue.lock();
        if self.full(&q, item.payload.len()) {
            return Err(Some(item));
        }
        self.queued_bytes
            .fetch_add(item.payload.len(), Ordering::Relaxed);
        let was_empty = q.is_empty();
        q.push_back(item);
        drop(q);
        // Only a queue that was empty may have the send loop waiting (or about to wait) for
        // work; pushes behind it are taken with it, without waking anything again.
        if was_empty {
            self.work.notify_one();
        }
        Ok(())
    }
}
