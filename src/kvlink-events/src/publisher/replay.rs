//! The replay server: the ROUTER side, parsing `["", start_seq]` requests and answering them
//! from the ring, then with the end marker. A request `["", start_seq, "kvlink-snapshot"]`
//! (kvlink's subscriber, once it knows the publisher is kvlink's) is answered the same way
//! while the ring still holds `start_seq`; when it no longer does, with a snapshot of the live
//! set instead (`["", "kvlink-snapshot", topic, seq, payload]` messages, `seq` the last batch
//! the snapshot includes), then the end marker.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use super::live::LiveSet;
use super::{ReplayFormat, Shared, REPLAY_END, SNAPSHOT_TAG};
use crate::sequence::ReplayRing;
use crate::wire::{encode_batch, stamp, Encoding};

/// What the replay server answers from, under one lock: the ring of recent batches and, when
/// kept, the live set as of the ring's newest batch.
#[derive(Debug)]
pub(super) struct History {
    pub(super) ring: ReplayRing<(Bytes, Bytes)>,
    pub(super) live: Option<LiveSet>,
}

/// How the replay server encodes snapshots: as the publisher encodes its batches.
#[derive(Debug, Clone, Copy)]
pub(super) struct Answering {
    pub(super) format: ReplayFormat,
    pub(super) send_timeout: Duration,
    pub(super) encoding: Encoding,
    pub(super) incarnation: Option<u64>,
}

/// Parses a replay request (after the ROUTER's identity frame): `["", start]`, a bare
/// `[start]`, or `["", start, "kvlink-snapshot"]` (a snapshot welcome when `start` is gone):
/// the start, and whether a snapshot is welcome.
fn replay_start(frames: &[Bytes]) -> Option<(u64, bool)> {
    let (seq, snapshot) = match frames {
        [empty, seq] if empty.is_empty() => (seq, false),
        [seq] => (seq, false),
        [empty, seq, tag] if empty.is_empty() && tag.as_ref() == SNAPSHOT_TAG => (seq, true),
        _ => return None,
    };
    Some((u64::from_be_bytes(seq.as_ref().try_into().ok()?), snapshot))
}

/// One message of a replay answer: whether it is a snapshot part, topic, sequence, payload.
type Message = (bool, Bytes, u64, Bytes);

/// The last snapshot built: its sequence, its encoded parts, and when it was built.
pub(super) struct Built {
    seq: u64,
    parts: Arc<Vec<Bytes>>,
    at: Instant,
}

/// How often a snapshot is built at most: within it, requests get the last one followed by
/// the ring's batches since (when the ring still holds them), so that requests cannot make
/// the publisher list its live set, under the lock `publish` takes, over and over.
const REBUILD_AFTER: Duration = Duration::from_secs(1);

/// A replay answer's messages (before the end marker): the ring from `start`, or a snapshot
/// when one is welcome and the ring no longer holds `start` (the last one built, followed by
/// the ring since, when recent enough; else a new one). When the live set cannot vouch for
/// itself, the ring, as asked.
fn answer(
    shared: &Shared,
    start: u64,
    snapshot: bool,
    how: Answering,
    cache: &mut Option<Built>,
) -> Vec<Message> {
    let h = shared.ring.lock();
    let ring = |from: u64| -> Vec<Message> {
        let msgs = h.ring.replay_from(from);
        msgs.map(|(s, (t, p))| (false, t.clone(), s, p.clone()))
            .collect()
    };
    let (first, newest) = h.ring.bounds().unwrap_or((0, 0));
    let Some(live) = h.live.as_ref().filter(|_| snapshot && first > start) else {
        return ring(start);
    };
    let tag = |seq: u64, p: &Bytes| (true, shared.topic.clone(), seq, p.clone());
    if let Some(c) = cache.as_ref() {
        // The same state, or a recent one the ring still holds every batch since.
        let fresh = c.seq == newest || (c.at.elapsed() < REBUILD_AFTER && c.seq + 1 >= first);
        if fresh {
            shared.counters.snapshots.fetch_add(1, Ordering::Relaxed);
            let mut out: Vec<Message> = c.parts.iter().map(|p| tag(c.seq, p)).collect();
            out.extend(ring(c.seq + 1));
            return out;
        }
    }
    let Some(plan) = live.plan() else {
        let refused = &shared.counters.snapshots_refused;
        refused.fetch_add(1, Ordering::Relaxed);
        return ring(start);
    };
    // The plan shares the stores it announces: built and encoded without the lock.
    drop(h);
    shared.counters.snapshots.fetch_add(1, Ordering::Relaxed);
    let encode = |b: &crate::wire::EventBatch| {
        let mut v = Vec::new();
        encode_batch(b, how.encoding, &mut v);
        if let Some(i) = how.incarnation {
            stamp(&mut v, i);
        }
        Bytes::from(v)
    };
    let parts: Vec<Bytes> = plan.batches(now_s()).iter().map(encode).collect();
    let out = parts.iter().map(|p| tag(newest, p)).collect();
    *cache = Some(Built {
        seq: newest,
        parts: Arc::new(parts),
        at: Instant::now(),
    });
    out
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// Long: the ROUTER's one loop: take a request, check it, answer from the ring under one deadline,
//   end with the marker; the steps share the socket and the deadline.
pub(super) async fn serve_replay(shared: Arc<Shared>, mut router: RouterSocket, how: Answering) {
    let Answering {
        format,
        send_timeout,
        ..
    } = how;
    let end_seq = Bytes::copy_from_slice(&REPLAY_END.to_be_bytes());
    let mut cache: Option<Built> = None;
    loop {
        let msg = match tokio::time::timeout(Duration::from_secs(10), router.recv()).await {
            // Idle: the last snapshot's memory goes.
            Err(_) => {
                cache = None;
                continue;
            }
            Ok(r) => r,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("KV-event replay socket: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let mut frames = msg.into_vec();
        if frames.is_empty() {
            continue;
        }
        let id = frames.remove(0);
        let Some((start, snapshot)) = replay_start(&frames) else {
            shared
                .counters
                .bad_replay_requests
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                frames = frames.len(),
                "malformed KV-event replay request ignored"
            );
            continue;
        };
        shared
            .counters
            .replay_requests
            .fetch_add(1, Ordering::Relaxed);
        // Off the runtime's thread (which also serves the live subscribers): a snapshot of a
        // large live set takes a while to build.
        let task = {
            let (shared, mut c) = (shared.clone(), cache.take());
            tokio::task::spawn_blocking(move || (answer(&shared, start, snapshot, how, &mut c), c))
        };
        let Ok((batches, c)) = task.await else {
            continue;
        };
        cache = c;
        let deadline = tokio::time::Instant::now() + send_timeout;
        let frame = |tag: bool, topic: Bytes, seq: Bytes, payload: Bytes| {
            let mut f = vec![id.clone(), Bytes::new()];
            if tag {
                f.push(Bytes::from_static(SNAPSHOT_TAG));
            }
            if tag || format == ReplayFormat::Current {
                f.push(topic);
            }
            f.push(seq);
            f.push(payload);
            ZmqMessage::try_from(f).expect("frames")
        };
        let mut sent_all = true;
        for (tag, topic, seq, payload) in batches {
            let m = frame(
                tag,
                topic,
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            );
            match tokio::time::timeout_at(deadline, router.send(m)).await {
                Ok(Ok(())) => {
                    shared
                        .counters
                        .replayed_batches
                        .fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => {
                    tracing::debug!("KV-event replay answer failed: {e}");
                    sent_all = false;
                    break;
                }
                Err(_) => {
                    shared
                        .counters
                        .replay_timeouts
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "KV-event replay answer not taken within {send_timeout:?}; cut short"
                    );
                    sent_all = false;
                    break;
                }
            }
        }
        if sent_all {
            let end = frame(false, Bytes::new(), end_seq.clone(), Bytes::new());
            let _ = tokio::time::timeout_at(deadline, router.send(end)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_requests_are_parsed_strictly() {
        let b = |v: &[u8]| Bytes::copy_from_slice(v);
        let seven = b(&7u64.to_be_bytes());
        assert_eq!(replay_start(&[b(b""), seven.clone()]), Some((7, false)));
        assert_eq!(replay_start(&[b(&9u64.to_be_bytes())]), Some((9, false)));
        let tag = b(SNAPSHOT_TAG);
        assert_eq!(replay_start(&[b(b""), seven.clone(), tag]), Some((7, true)));
        assert_eq!(replay_start(&[b(b""), seven, b(b"other")]), None);
        assert_eq!(replay_start(&[b(b"x"), b(&7u64.to_be_bytes())]), None);
        assert_eq!(replay_start(&[b(b""), b(&[1, 2, 3])]), None);
        assert_eq!(replay_start(&[]), None);
    }
}
