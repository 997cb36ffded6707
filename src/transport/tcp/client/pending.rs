//! A stream's queue of batches awaiting their responses, shared by whoever sends a request
//! (the stream's writer task, or a read on its own task) and the stream's reader task.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::{Batch, PIPELINE};

/// The batches whose requests went out (or are going out) on a stream, oldest first, for its
/// reader task. Queueing one wakes nobody: the reader task waits for the socket only, and a
/// response implies its batch is here, as a batch is queued before its request is written.
/// (A reader task woken by each queued batch cost a small read a runtime thread's wake-up, on
/// the CPU the serving engine needs at that moment.)
pub(super) struct Pending {
    /// Each batch with when it was queued (a response `io_timeout` late breaks the stream).
    queue: Mutex<VecDeque<(Instant, Batch)>>,
    /// `PIPELINE` permits, one taken per queued batch (bounds the requests in flight).
    room: Semaphore,
    /// Set by the reader task when it stops: nothing is queued after that.
    closed: AtomicBool,
}

impl Pending {
    pub(super) fn new() -> Pending {
        Pending {
            queue: Mutex::new(VecDeque::with_capacity(PIPELINE)),
            room: Semaphore::new(PIPELINE),
            closed: AtomicBool::new(false),
        }
    }

    /// Queues `batch` under a permit taken for it; gives it back if the reader task stopped.
    pub(super) fn push(&self, batch: Batch) -> std::result::Result<(), Batch> {
        let mut q = self.queue.lock();
        if self.closed.load(Ordering::Acquire) {
            drop(q);
            self.room.add_permits(1);
            return Err(batch);
        }
        q.push_back((Instant::now(), batch));
        Ok(())
    }

    /// Queues `batch` if a permit is free now; gives it back otherwise.
    pub(super) fn try_push(&self, batch: Batch) -> std::result::Result<(), Batch> {
        match self.room.try_acquire() {
            Ok(permit) => permit.forget(),
            Err(_) => return Err(batch),
        }
        self.push(batch)
    }

    /// Queues `batch`, waiting for a permit; gives it back if the reader task stopped.
    pub(super) async fn push_waiting(&self, batch: Batch) -> std::result::Result<(), Batch> {
        match self.room.acquire().await {
            Ok(permit) => permit.forget(),
            Err(_) => return Err(batch),
        }
        self.push(batch)
    }

    /// The oldest batch, taken off the queue (its permit is returned by [`Pending::done`]).
    pub(super) fn pop(&self) -> Option<Batch> {
        self.queue.lock().pop_front().map(|(_, b)| b)
    }

    /// The oldest batch with what `f` made of it, taken off the queue when `f` made something
    /// of it (its permit is returned by [`Pending::done`]).
    pub(super) fn pop_with<R>(&self, f: impl FnOnce(&Batch) -> Option<R>) -> Option<(Batch, R)> {
        let mut q = self.queue.lock();
        let r = f(&q.front()?.1)?;
        q.pop_front().map(|(_, b)| (b, r))
    }

    /// Whether no batch is queued.
    pub(super) fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Returns the permit of a batch the reader task finished.
    pub(super) fn done(&self) {
        self.room.add_permits(1);
    }

    /// How long the reader task may wait for the socket: until the oldest batch's response is
    /// `limit` late, or `limit` with none queued (a batch queued meanwhile is then found
    /// overdue within twice `limit`). Zero once it is late.
    pub(super) fn patience(&self, limit: Duration) -> Duration {
        self.queue
            .lock()
            .front()
            .map_or(limit, |(queued, _)| limit.saturating_sub(queued.elapsed()))
    }

    /// Stops queueing and hands back every batch still queued.
    pub(super) fn close(&self) -> Vec<Batch> {
        let mut q = self.queue.lock();
        self.closed.store(true, Ordering::Release);
        self.room.close();
        q.drain(..).map(|(_, b)| b).collect()
    }
}
