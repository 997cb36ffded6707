//! The publisher's send loop for the `zeromq` crate's PUB sockets (ipc and connected
//! endpoints): drains the queue, then numbers, records for replay and sends each (already
//! encoded) batch. The publisher's own PUB side is sent to from the callers' threads instead.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::sockets::PubSink;
use super::{Item, Shared};

pub(super) async fn publish_loop(shared: Arc<Shared>, mut socket: PubSink) -> PubSink {
    let mut local = VecDeque::new();
    let mut seq = 0u64;
    loop {
        {
            let mut q = shared.queue.lock();
            std::mem::swap(&mut *q, &mut local);
            // Updated under the queue's lock, as `try_push` does.
            shared.queued_bytes.store(0, Ordering::Relaxed);
        }
        if local.is_empty() {
            if shared.closed.load(Ordering::Acquire) {
                break;
            }
            shared.work.notified().await;
            continue;
        }
        shared.room.notify_all();
        shared.room_async.notify_waiters();
        for item in local.drain(..) {
            let Item { topic, payload } = item;
            let topic = shared.record(seq, topic, &payload);
            let lost = socket.send(topic, seq, payload).await;
            shared.count_sent(lost);
            seq += 1;
        }
    }
    socket
}
