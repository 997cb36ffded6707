//! The replay server: the ROUTER side, parsing `["", start_seq]` requests and answering them
//! from the ring, then with the end marker.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

use super::{ReplayFormat, Shared, REPLAY_END};

/// Parses a replay request (after the ROUTER's identity frame): `["", start]`; a bare
/// `[start]` is accepted too.
fn replay_start(frames: &[Bytes]) -> Option<u64> {
    let seq = match frames {
        [empty, seq] if empty.is_empty() => seq,
        [seq] => seq,
        _ => return None,
    };
    Some(u64::from_be_bytes(seq.as_ref().try_into().ok()?))
}

// Long: the ROUTER's one loop: take a request, check it, answer from the ring under one deadline,
//   end with the marker; the steps share the socket and the deadline.
pub(super) async fn serve_replay(
    shared: Arc<Shared>,
    mut router: RouterSocket,
    format: ReplayFormat,
    send_timeout: Duration,
) {
    let end_seq = Bytes::copy_from_slice(&REPLAY_END.to_be_bytes());
    loop {
        let msg = match router.recv().await {
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
        let Some(start) = replay_start(&frames) else {
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
        let batches: Vec<(u64, (Bytes, Bytes))> = shared
            .ring
            .lock()
            .replay_from(start)
            .map(|(s, p)| (s, p.clone()))
            .collect();
        let deadline = tokio::time::Instant::now() + send_timeout;
        let frame = |topic: Bytes, seq: Bytes, payload: Bytes| {
            let mut f = vec![id.clone(), Bytes::new()];
            if format == ReplayFormat::Current {
                f.push(topic);
            }
            f.push(seq);
            f.push(payload);
            ZmqMessage::try_from(f).expect("frames")
        };
        let mut sent_all = true;
        for (seq, (topic, payload)) in batches {
            let m = frame(topic, Bytes::copy_from_slice(&seq.to_be_bytes()), payload);
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
            let end = frame(Bytes::new(), end_seq.clone(), Bytes::new());
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
        assert_eq!(replay_start(&[b(b""), b(&7u64.to_be_bytes())]), Some(7));
        assert_eq!(replay_start(&[b(&9u64.to_be_bytes())]), Some(9));
        assert_eq!(replay_start(&[b(b"x"), b(&7u64.to_be_bytes())]), None);
        assert_eq!(replay_start(&[b(b""), b(&[1, 2, 3])]), None);
        assert_eq!(replay_start(&[]), None);
    }
}
