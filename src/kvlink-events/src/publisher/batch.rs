//! Batches encoded event by event into a payload buffer of the publisher's pool: for engines
//! that hold their events' hashes and tokens in their own memory and would otherwise build a
//! [`KvEvent`] per event only to encode it.

use std::sync::Arc;

use bytes::Bytes;
use rmp::encode as w;

use super::live::LiveOp;
use super::pool::BufferPool;
use crate::wire::{encode_event, encode_stored_ref, BlockStoredRef, Encoding, KvEvent};

/// Room kept at the front of the buffer for the batch's head: the outer array's marker (1
/// byte), `ts` as a float64 (9), and the events array's header (at most 5), written once the
/// events are counted.
const HEAD: usize = 15;

/// A batch being encoded (from [`crate::Publisher::builder`]): events are written as
/// they are pushed, in the publisher's encoding, and the whole is queued by
/// [`crate::Publisher::publish_built`]. The bytes are those
/// [`crate::encode_batch`] writes for the same events.
pub struct BatchBuilder {
    buf: Vec<u8>,
    encoding: Encoding,
    ts: f64,
    events: usize,
    pool: Arc<BufferPool>,
    /// The events' changes to the publisher's live set, when it keeps one.
    ops: Option<Vec<LiveOp>>,
}

impl BatchBuilder {
    pub(super) fn new(
        pool: Arc<BufferPool>,
        hint: usize,
        encoding: Encoding,
        ts: f64,
        track: bool,
    ) -> Self {
        let mut buf = pool.take(hint.max(HEAD));
        buf.resize(HEAD, 0);
        BatchBuilder {
            buf,
            encoding,
            ts,
            events: 0,
            pool,
            ops: track.then(Vec::new),
        }
    }

    /// Appends an event.
    pub fn push(&mut self, e: &KvEvent) {
        encode_event(e, self.encoding, &mut self.buf);
        self.events += 1;
        if let Some(ops) = &mut self.ops {
            ops.push(LiveOp::of(e));
        }
    }

    /// Appends a BlockStored given by reference.
    pub fn push_stored(&mut self, e: &BlockStoredRef<'_>) {
        encode_stored_ref(e, self.encoding, &mut self.buf);
        self.events += 1;
        if let Some(ops) = &mut self.ops {
            ops.push(LiveOp::Store(e.to_owned_event()));
        }
    }

    /// Events pushed so far.
    pub fn len(&self) -> usize {
        self.events
    }

    /// Whether no event was pushed.
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// The payload `[ts, events, dp_rank]`, its size in bytes, and its events' changes to the
    /// live set (when the publisher keeps one).
    pub(super) fn finish(
        mut self,
        dp_rank: Option<i64>,
        incarnation: Option<u64>,
    ) -> (Bytes, usize, Option<Vec<LiveOp>>) {
        match dp_rank {
            Some(r) => {
                let _ = w::write_sint(&mut self.buf, r);
            }
            None => {
                let _ = w::write_nil(&mut self.buf);
            }
        }
        if let Some(i) = incarnation {
            let _ = w::write_u64(&mut self.buf, i);
        }
        let mut head = Vec::with_capacity(HEAD);
        let _ = w::write_array_len(&mut head, 3 + u32::from(incarnation.is_some()));
        let _ = w::write_f64(&mut head, self.ts);
        let _ = w::write_array_len(&mut head, self.events as u32);
        let start = HEAD - head.len();
        self.buf[start..HEAD].copy_from_slice(&head);
        let size = self.buf.len() - start;
        let buf = std::mem::take(&mut self.buf);
        let ops = self.ops.take();
        (self.pool.payload(buf).slice(start..), size, ops)
    }
}

impl Drop for BatchBuilder {
    /// A batch never published gives its buffer back.
    fn drop(&mut self) {
        if self.buf.capacity() > 0 {
            self.pool.give_back(std::mem::take(&mut self.buf));
        }
    }
}

impl std::fmt::Debug for BatchBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchBuilder")
            .field("encoding", &self.encoding)
            .field("events", &self.events)
            .field("bytes", &(self.buf.len() - HEAD))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{encode_batch, BlockHash, BlockStored, EventBatch, HashRef, HashesRef};

    /// A builder's payload is byte for byte what `encode_batch` writes for the same events,
    /// whatever the count (each form of the events array's header) and the encoding.
    #[test]
    fn built_batches_equal_encoded_batches() {
        let hashes: Vec<u64> = vec![1, u64::MAX, 1 << 40];
        let tokens: Vec<u32> = (0..48).map(|t| t * 3_001).collect();
        for enc in [Encoding::Current, Encoding::Legacy] {
            for count in [0usize, 1, 15, 16, 65_535, 65_536] {
                let pool = Arc::new(BufferPool::default());
                let mut b = BatchBuilder::new(pool, 0, enc, 1.25, false);
                let mut owned = Vec::with_capacity(count);
                for i in 0..count {
                    let r = BlockStoredRef {
                        block_hashes: HashesRef::U64(&hashes),
                        parent_block_hash: (i % 2 == 0).then_some(HashRef::U64(7)),
                        token_ids: &tokens,
                        block_size: 16,
                        lora_id: None,
                        medium: Some("GPU"),
                        lora_name: None,
                        group_idx: (i % 3 == 0).then_some(1),
                    };
                    let e = KvEvent::BlockStored(BlockStored {
                        block_hashes: hashes.iter().map(|&h| BlockHash::U64(h)).collect(),
                        parent_block_hash: r.parent_block_hash.map(|_| BlockHash::U64(7)),
                        token_ids: tokens.clone(),
                        block_size: 16,
                        medium: Some("GPU".into()),
                        group_idx: r.group_idx,
                        ..Default::default()
                    });
                    if i % 5 == 0 {
                        b.push(&e);
                    } else {
                        b.push_stored(&r);
                    }
                    owned.push(e);
                }
                assert_eq!(b.len(), count);
                let (payload, size, _) = b.finish(Some(3), None);
                let mut want = Vec::new();
                encode_batch(
                    &EventBatch {
                        ts: 1.25,
                        events: owned,
                        dp_rank: Some(3),
                    },
                    enc,
                    &mut want,
                );
                assert_eq!(size, want.len(), "{enc:?} x {count}");
                let first = payload.iter().zip(&want).position(|(a, b)| a != b);
                assert!(
                    payload[..] == want[..],
                    "{enc:?} x {count}: first difference at {first:?} of {size}"
                );
            }
        }
    }
}
