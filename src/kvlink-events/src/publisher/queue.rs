//! The publisher's send loop for the `zeromq` crate's PUB sockets (ipc and connected
//! endpoints): drains the queue, then numbers, records for replay and sends each (already
//! encoded) batch. The publisher's own PUB side is sent to from the callers' threads instead.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use zeromq::{PubSocket, SocketSend, ZmqMessage};

use super::{Item, Shared};

pub(super) async fn publish_loop(shared: Arc<Shared>, mut socket: PubSocket) -> PubSocket {
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
            let Item {
                topic,
                payload,
                delta,
            } = item;
            let topic = shared.record(seq, topic, &payload, delta);
            let frames = vec![topic, Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
            let msg = ZmqMessage::try_from(frames).expect("three frames");
            if let Err(e) = socket.send(msg).await {
                tracing::warn!(seq, "KV-event PUB send failed: {e}");
            }
            // The crate does not say whether a subscriber lost it.
            shared.count_sent(0);
            seq += 1;
        }
    }
    socket
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::{EventBatch, EventsError, Publisher, PublisherConfig};

    /// An ipc endpoint of its own: the queue and the send loop serve the `zeromq` crate's
    /// sockets (a bound tcp endpoint is sent to from the caller's thread, with no queue).
    /// Removed when the test ends.
    fn ipc(name: &str) -> (String, Unlink) {
        let path = std::env::temp_dir().join(format!("kvlink-queue-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        (format!("ipc://{}", path.display()), Unlink(path))
    }

    /// Removes the socket file an ipc endpoint bound.
    struct Unlink(std::path::PathBuf);

    impl Drop for Unlink {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn a_full_queue_refuses_and_counts() {
        let (endpoint, _unlink) = ipc("full");
        let p = Publisher::start(PublisherConfig {
            endpoint,
            replay_endpoint: Some("tcp://*:0".into()),
            max_queue: 1,
            ..Default::default()
        })
        .unwrap();
        let b = EventBatch {
            ts: 0.0,
            events: vec![],
            dp_rank: None,
        };
        let mut refused = 0;
        {
            // Holding the ring stalls the publisher thread once it has taken the first batch.
            let _hold = p.shared.ring.lock();
            p.publish(b.clone()).unwrap();
            let t = Instant::now();
            while !p.shared.queue.lock().is_empty() {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "publisher thread never ran"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            for _ in 0..50 {
                if p.publish(b.clone()).is_err() {
                    refused += 1;
                }
            }
            assert_eq!(refused, 49, "one fits, the rest are refused");
            let t = Instant::now();
            assert!(matches!(
                p.publish_timeout(b.clone(), Duration::from_millis(50)),
                Err(EventsError::QueueFull { cap: 1, .. })
            ));
            assert!(t.elapsed() >= Duration::from_millis(50));
        }
        assert_eq!(p.stats().dropped, refused + 1);
    }

    /// The queue is bounded in bytes as well as in batches; an empty queue takes a batch of
    /// any size.
    #[test]
    fn the_queue_is_bounded_in_bytes() {
        let (endpoint, _unlink) = ipc("bytes");
        let p = Publisher::start(PublisherConfig {
            endpoint,
            replay_endpoint: Some("tcp://*:0".into()),
            max_queue_bytes: 1000,
            ..Default::default()
        })
        .unwrap();
        let (big, small) = {
            // Holding the ring stalls the publisher thread once it has taken the first batch.
            let _ring = p.shared.ring.lock();
            let t = Instant::now();
            p.publish_encoded(vec![0u8; 5000]).unwrap();
            while !p.shared.queue.lock().is_empty() {
                assert!(t.elapsed() < Duration::from_secs(10), "never drained");
                std::thread::sleep(Duration::from_millis(1));
            }
            // The thread now waits on the ring with one batch taken; the queue is empty.
            let big = p.publish_encoded(vec![0u8; 5000]).is_ok();
            let small = p.publish_encoded(vec![0u8; 10]).is_ok();
            (big, small)
        };
        assert!(big, "an empty queue takes a batch over the byte bound");
        assert!(!small, "a second batch past the bound is refused");
        assert_eq!(p.stats().dropped, 1);
    }
}
