//! Payload buffers reused across batches. A batch is encoded on the caller's thread and its
//! payload freed on whichever thread lets go of it last once sent (a subscriber's writer, the
//! replay ring evicting it, the send loop): a
//! fresh large buffer per batch, freed elsewhere, made the allocator map and zero new pages for
//! most batches (a third of the publisher's time with mimalloc, glibc's consolidation passes
//! otherwise). Buffers now go back to a small pool when their last reference drops.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// Most buffers kept for reuse (enough for the publisher's queue at its default byte bound,
/// 64 MiB, in batches of 64 KiB).
const KEEP: usize = 1024;
/// Most bytes kept (buffer capacities).
const KEEP_BYTES: usize = 64 << 20;
/// Buffers larger than this are freed rather than kept.
const KEEP_MAX_CAPACITY: usize = 4 << 20;

/// A pool of empty buffers.
#[derive(Default)]
pub(super) struct BufferPool {
    free: Mutex<Free>,
}

#[derive(Default)]
struct Free {
    buffers: Vec<Vec<u8>>,
    /// Their capacities, summed.
    bytes: usize,
}

impl BufferPool {
    /// An empty buffer with room for at least `hint` bytes (a kept one when there is one).
    pub(super) fn take(&self, hint: usize) -> Vec<u8> {
        let mut b = {
            let mut free = self.free.lock();
            let b = free.buffers.pop().unwrap_or_default();
            free.bytes -= b.capacity();
            b
        };
        b.reserve(hint);
        b
    }

    /// Keeps `b` for reuse, if the pool has room for it.
    pub(super) fn give_back(&self, mut b: Vec<u8>) {
        if b.capacity() > KEEP_MAX_CAPACITY {
            return;
        }
        b.clear();
        let mut free = self.free.lock();
        if free.buffers.len() < KEEP && free.bytes + b.capacity() <= KEEP_BYTES {
            free.bytes += b.capacity();
            free.buffers.push(b);
        }
    }

    /// Wraps `buf` as a payload whose memory comes back to the pool when its last reference
    /// (queue, socket, replay ring) drops.
    pub(super) fn payload(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Pooled {
            buf,
            pool: self.clone(),
        })
    }
}

struct Pooled {
    buf: Vec<u8>,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_when_the_last_reference_drops() {
        let pool = Arc::new(BufferPool::default());
        let mut b = pool.take(100);
        b.extend_from_slice(b"payload");
        let ptr = b.as_ptr();
        let p = pool.payload(b);
        let q = p.clone();
        assert_eq!(&p[..], b"payload");
        drop(p);
        assert!(pool.free.lock().buffers.is_empty(), "still referenced");
        drop(q);
        let again = pool.take(10);
        assert_eq!(again.as_ptr(), ptr, "the same memory, reused");
        assert!(again.is_empty());
    }

    #[test]
    fn the_pool_is_bounded() {
        let pool = Arc::new(BufferPool::default());
        let payloads: Vec<Bytes> = (0..KEEP + 10).map(|_| pool.payload(vec![0; 8])).collect();
        drop(payloads);
        assert_eq!(pool.free.lock().buffers.len(), KEEP);
        drop(pool.payload(Vec::with_capacity(KEEP_MAX_CAPACITY + 1)));
        assert_eq!(pool.free.lock().buffers.len(), KEEP);
        // Bounded in bytes too.
        let pool = Arc::new(BufferPool::default());
        let big: Vec<Bytes> = (0..KEEP_BYTES / KEEP_MAX_CAPACITY + 2)
            .map(|_| pool.payload(Vec::with_capacity(KEEP_MAX_CAPACITY)))
            .collect();
        drop(big);
        let free = pool.free.lock();
        assert!(free.bytes <= KEEP_BYTES);
        assert_eq!(
            free.bytes,
            free.buffers.iter().map(Vec::capacity).sum::<usize>()
        );
    }
}
