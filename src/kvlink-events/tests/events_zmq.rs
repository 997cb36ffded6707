//! KV events over ZeroMQ on tcp loopback: kvlink's publisher to kvlink's subscriber (both
//! encodings, in order, replay from any sequence, drops recovered by replay, restarts and
//! history loss reported) and hostile peers against the publisher's sockets. The merger's tests
//! are in `events_merger.rs`.

mod events_common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use bytes::Bytes;
use events_common::*;
use kvlink_events::{Encoding, ReplayFormat, Resync, SubItem, Subscriber, SubscriberConfig};

#[test]
fn every_batch_arrives_in_order_in_both_encodings() {
    let rt = rt();
    for encoding in [Encoding::Current, Encoding::Legacy] {
        let p = publisher(|c| c.encoding = encoding);
        let mut sub = rt.block_on(Subscriber::connect(sub_config(&p))).unwrap();
        wait_subscribed(&p, 1);
        let n = 1500u64;
        for i in 0..n {
            p.publish_timeout(batch(i), LIMIT).unwrap();
        }
        // Each batch is handed back once checked, so the next is decoded into its allocations
        // (the batches differ in their events' number, types and sizes).
        let end = Instant::now() + LIMIT;
        let mut next = 0;
        while next < n {
            assert!(
                Instant::now() < end,
                "{encoding:?}: timed out at batch {next}"
            );
            let Some(item) = rt.block_on(sub.next(Duration::from_millis(200))).unwrap() else {
                continue;
            };
            let SubItem::Batch {
                seq: Some(s),
                batch: b,
                skipped,
                ..
            } = item
            else {
                panic!("{encoding:?}: {item:?}");
            };
            assert_eq!(s, next, "{encoding:?}");
            assert!(skipped.is_empty());
            assert_eq!(b, batch(s), "{encoding:?} batch {s}");
            sub.recycle(b);
            next += 1;
        }
        let st = p.stats();
        assert_eq!((st.published, st.dropped, st.next_seq), (n, 0, n));
    }
}

#[test]
fn replay_from_any_sequence_then_live() {
    let rt = rt();
    let p = publisher(|_| {});
    publish_all(&p, 0..50);
    let mut sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            start_from: Some(20),
            ..sub_config(&p)
        }))
        .unwrap();
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 30));
    assert_eq!(seqs(&got), (20..50).collect::<Vec<_>>());
    assert!(resyncs(&got).is_empty());
    wait_subscribed(&p, 1);
    for i in 50..60 {
        p.publish(batch(i)).unwrap();
    }
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 10));
    assert_eq!(seqs(&got), (50..60).collect::<Vec<_>>());
    assert_eq!(p.stats().replay_requests, 1);
    assert_eq!(p.stats().replayed_batches, 30);
}

#[test]
fn a_late_subscriber_bootstraps_from_zero_and_legacy_replay_framing_works() {
    let rt = rt();
    let p = publisher(|c| c.replay_format = ReplayFormat::Legacy);
    for i in 0..10 {
        p.publish(batch(i)).unwrap();
    }
    let mut sub = rt.block_on(Subscriber::connect(sub_config(&p))).unwrap();
    wait_subscribed(&p, 1);
    // The first live batch this subscriber sees is 10: it replays 0..10 first.
    for i in 10..15 {
        p.publish(batch(i)).unwrap();
    }
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 15));
    assert_eq!(seqs(&got), (0..15).collect::<Vec<_>>());
    assert!(resyncs(&got).is_empty(), "{:?}", summary(&got));
}

fn drops(seq: u64) -> bool {
    matches!(seq, 5..=7 | 20 | 41)
}

#[test]
fn dropped_live_batches_are_recovered_by_replay() {
    let rt = rt();
    let p = publisher(|_| {});
    let mut sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            drop_live: Some(drops),
            ..sub_config(&p)
        }))
        .unwrap();
    wait_subscribed(&p, 1);
    for i in 0..60 {
        p.publish(batch(i)).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 60));
    assert_eq!(seqs(&got), (0..60).collect::<Vec<_>>());
    assert!(resyncs(&got).is_empty(), "{:?}", summary(&got));
    let st = sub.stats();
    assert!(st.replays >= 1, "{st:?}");
    assert_eq!(st.replay_failures, 0);
    // Every replay that filled a gap says so, after the batches it recovered (the last one
    // when its end marker arrives, which may be after the 60th batch).
    let mut got = got;
    let end = Instant::now() + Duration::from_secs(5);
    while got
        .iter()
        .filter(|i| matches!(i, SubItem::GapFilled { .. }))
        .count()
        < st.replays as usize
        && Instant::now() < end
    {
        if let Some(i) = rt.block_on(sub.next(Duration::from_millis(200))).unwrap() {
            got.push(i);
        }
    }
    let filled: Vec<(u64, u64)> = got
        .iter()
        .filter_map(|i| match i {
            SubItem::GapFilled { from, through } => Some((*from, *through)),
            _ => None,
        })
        .collect();
    assert_eq!(filled.len() as u64, st.replays, "{:?}", summary(&got));
    assert!(filled.iter().any(|(f, t)| *f <= 5 && *t >= 7), "{filled:?}");
}

#[test]
fn without_replay_a_gap_is_reported_lost() {
    let rt = rt();
    let p = publisher(|c| c.replay_endpoint = None);
    let mut sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            drop_live: Some(drops),
            ..sub_config(&p)
        }))
        .unwrap();
    wait_subscribed(&p, 1);
    for i in 0..10 {
        p.publish(batch(i)).unwrap();
    }
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 7));
    assert_eq!(seqs(&got), vec![0, 1, 2, 3, 4, 8, 9]);
    assert_eq!(
        resyncs(&got),
        vec![Resync::HistoryLost {
            from: 5,
            resumed: 8
        }]
    );
}

#[test]
fn replay_past_the_ring_is_reported() {
    let rt = rt();
    let p = publisher(|c| c.buffer_steps = 5);
    publish_all(&p, 0..20);
    let mut sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            start_from: Some(0),
            ..sub_config(&p)
        }))
        .unwrap();
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 5));
    assert_eq!(
        resyncs(&got),
        vec![Resync::HistoryLost {
            from: 0,
            resumed: 15
        }]
    );
    assert_eq!(seqs(&got), (15..20).collect::<Vec<_>>());
}

#[test]
fn a_publisher_restart_is_reported() {
    let rt = rt();
    let first = publisher(|_| {});
    let ports = (
        port(first.endpoint()),
        port(first.replay_endpoint().unwrap()),
    );
    let mut sub = rt
        .block_on(Subscriber::connect(sub_config(&first)))
        .unwrap();
    wait_subscribed(&first, 1);
    for i in 0..10 {
        first.publish(batch(i)).unwrap();
    }
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 10));
    assert_eq!(seqs(&got), (0..10).collect::<Vec<_>>());
    drop(first);
    let second = publisher_at(ports);
    // The subscriber reconnects on its own; the new publisher's numbering starts again at 0.
    // Publishing slowly keeps its sequence below the old one until the subscriber is back.
    let got = rt.block_on(async {
        let end = Instant::now() + LIMIT;
        let mut got = Vec::new();
        let mut next = 0;
        while resyncs(&got).is_empty() || batches(&got) < next as usize {
            assert!(Instant::now() < end, "{:?}", summary(&got));
            if next < 9 && resyncs(&got).is_empty() {
                second.publish(batch(next)).unwrap();
                next += 1;
            }
            if let Some(i) = sub.next(Duration::from_millis(150)).await.unwrap() {
                got.push(i);
            }
        }
        got
    });
    match &resyncs(&got)[..] {
        [Resync::PublisherRestart { last: 9, now }] => assert!(*now < 9),
        r => panic!("expected one restart, got {r:?}"),
    }
    let s = seqs(&got);
    assert_eq!(
        s,
        (0..s.len() as u64).collect::<Vec<_>>(),
        "{:?}",
        summary(&got)
    );
}

// Long: one publisher and subscriber pair fed each hostile input in turn, so that the last check
//   sees that nothing before it was lost.
#[test]
fn malformed_payloads_and_hostile_peers_lose_nothing() {
    let rt = rt();
    let p = publisher(|_| {});
    let mut sub = rt.block_on(Subscriber::connect(sub_config(&p))).unwrap();
    wait_subscribed(&p, 1);

    // Hostile network peers: a frame header announcing 1 TiB, reserved flag bits, garbage, and
    // a replay request of the wrong shape. Each is cut off or ignored; the publisher goes on.
    let addr = |ep: &str| {
        ep.trim_start_matches("tcp://")
            .replace("0.0.0.0", "127.0.0.1")
    };
    let mut greeting = vec![0u8; 64];
    greeting[0] = 0xFF;
    greeting[9] = 0x7F;
    for (ep, tail) in [
        (p.endpoint(), {
            let mut t = vec![0x02];
            t.extend((1u64 << 40).to_be_bytes());
            t
        }),
        (p.replay_endpoint().unwrap(), {
            let mut t = vec![0x02];
            t.extend(u64::MAX.to_be_bytes());
            t
        }),
        (p.endpoint(), vec![0xF0, 1, 2]),
    ] {
        let mut s = std::net::TcpStream::connect(addr(ep)).unwrap();
        s.set_read_timeout(Some(LIMIT)).unwrap();
        s.write_all(&greeting).unwrap();
        s.write_all(&tail).unwrap();
        let mut buf = [0u8; 4096];
        // The relay closes the connection: reads end (after whatever greeting came back).
        let end = Instant::now() + LIMIT;
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            assert!(Instant::now() < end, "connection never closed");
        }
    }
    let mut junk = std::net::TcpStream::connect(addr(p.endpoint())).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();

    p.publish(batch(0)).unwrap();
    p.publish_encoded(Bytes::from_static(b"\xc1\xff")).unwrap();
    p.publish_encoded(Bytes::from_static(&[0x93, 0xcb]))
        .unwrap(); // truncated float
    p.publish(batch(3)).unwrap();
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 4));
    assert_eq!(seqs(&got), vec![0, 1, 2, 3]);
    assert!(matches!(got[1], SubItem::Malformed { seq: Some(1), .. }));
    assert!(matches!(got[2], SubItem::Malformed { seq: Some(2), .. }));
    assert!(matches!(&got[3], SubItem::Batch { batch: b, .. } if *b == batch(3)));
    assert_eq!(sub.stats().malformed_batches, 2);

    // A malformed replay request is ignored (vLLM does the same); a good one still works.
    rt.block_on(async {
        use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};
        let mut d = DealerSocket::new();
        d.connect(&local(p.replay_endpoint().unwrap()))
            .await
            .unwrap();
        let bad = ZmqMessage::try_from(vec![Bytes::new(), Bytes::from_static(b"xyz")]).unwrap();
        d.send(bad).await.unwrap();
        let good = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&3u64.to_be_bytes()),
        ])
        .unwrap();
        d.send(good).await.unwrap();
        let m = tokio::time::timeout(LIMIT, d.recv())
            .await
            .unwrap()
            .unwrap();
        let frames = m.into_vec();
        assert_eq!(
            frames.len(),
            4,
            "current replay framing: [\"\", topic, seq, payload]"
        );
        assert_eq!(frames[2].as_ref(), 3u64.to_be_bytes());
        let end = tokio::time::timeout(LIMIT, d.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(end.into_vec()[2].as_ref(), [0xFF; 8], "end marker");
    });
    let st = p.stats();
    assert_eq!((st.bad_replay_requests, st.replay_requests), (1, 1));
}

/// A raw ZMTP peer for the publisher's own PUB side: writes frames and commands, reads them
/// back one at a time.
struct RawPeer(std::net::TcpStream);

impl RawPeer {
    fn connect(ep: &str, socket_type: &str) -> RawPeer {
        let addr = ep
            .trim_start_matches("tcp://")
            .replace("0.0.0.0", "127.0.0.1");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let mut greeting = vec![0u8; 64];
        greeting[0] = 0xFF;
        greeting[9] = 0x7F;
        greeting[10] = 3;
        greeting[11] = 1; // ZMTP 3.1: subscriptions as commands
        greeting[12..16].copy_from_slice(b"NULL");
        s.write_all(&greeting).unwrap();
        let mut props = vec![11];
        props.extend_from_slice(b"Socket-Type");
        props.extend((socket_type.len() as u32).to_be_bytes());
        props.extend_from_slice(socket_type.as_bytes());
        let mut p = RawPeer(s);
        p.command(b"READY", &props);
        let mut theirs = [0u8; 64];
        p.0.read_exact(&mut theirs).unwrap();
        assert_eq!((theirs[0], theirs[9], theirs[10]), (0xFF, 0x7F, 3));
        assert_eq!(&theirs[12..16], b"NULL");
        p
    }

    fn command(&mut self, name: &[u8], data: &[u8]) {
        let mut body = vec![name.len() as u8];
        body.extend_from_slice(name);
        body.extend_from_slice(data);
        let mut f = vec![0x04, body.len() as u8];
        f.extend(body);
        self.0.write_all(&f).unwrap();
    }

    /// The next frame: (flags, body); `None` when the connection closed.
    fn frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut flags = [0u8; 1];
        if self.0.read(&mut flags).ok()? == 0 {
            return None;
        }
        let len = if flags[0] & 0x02 != 0 {
            let mut b = [0u8; 8];
            self.0.read_exact(&mut b).ok()?;
            u64::from_be_bytes(b) as usize
        } else {
            let mut b = [0u8; 1];
            self.0.read_exact(&mut b).ok()?;
            usize::from(b[0])
        };
        let mut body = vec![0u8; len];
        self.0.read_exact(&mut body).ok()?;
        Some((flags[0], body))
    }
}

/// The publisher's own PUB side serves any ZMTP 3 subscriber: its READY names it a PUB, ZMTP
/// 3.1 SUBSCRIBE commands select topics, a PING gets its PONG, messages arrive as three frames
/// (topic, sequence, payload); a socket of another type is refused.
#[test]
fn raw_zmtp_subscribers_are_served_and_other_sockets_refused() {
    let p = publisher(|c| c.topic = "kv@pod@model".into());
    let mut peer = RawPeer::connect(p.endpoint(), "SUB");
    let (flags, ready) = peer.frame().unwrap();
    assert_eq!(flags, 0x04, "a command");
    assert!(ready.starts_with(b"\x05READY"));
    assert!(ready.windows(3).any(|w| w == b"PUB"), "{ready:?}");
    peer.command(b"SUBSCRIBE", b"kv@");
    peer.command(b"PING", b"\x00\x0aping-ctx");
    let (flags, pong) = peer.frame().unwrap();
    assert_eq!((flags, pong.as_slice()), (0x04, &b"\x04PONGping-ctx"[..]));
    // The PONG came after the subscription was read: batches published now reach the peer.
    p.publish(batch(0)).unwrap();
    let (f1, topic) = peer.frame().unwrap();
    let (f2, seq) = peer.frame().unwrap();
    let (f3, payload) = peer.frame().unwrap();
    assert_eq!((f1, f2, f3 & 0x01), (0x01, 0x01, 0x00));
    assert_eq!(topic, b"kv@pod@model");
    assert_eq!(seq, 0u64.to_be_bytes());
    assert_eq!(
        kvlink_events::decode_batch(&payload).unwrap().batch,
        batch(0)
    );

    // A peer subscribed to another prefix gets nothing; one that cancels stops getting more.
    let mut other = RawPeer::connect(p.endpoint(), "SUB");
    other.frame().unwrap(); // READY
    other.command(b"SUBSCRIBE", b"zz");
    other.command(b"PING", b"\x00\x0a1");
    assert_eq!(other.frame().unwrap().1, b"\x04PONG1");
    p.publish(batch(1)).unwrap();
    let seq1 = [peer.frame(), peer.frame(), peer.frame()][1]
        .clone()
        .unwrap()
        .1;
    assert_eq!(seq1, 1u64.to_be_bytes());
    other.command(b"PING", b"\x00\x0a2");
    assert_eq!(
        other.frame().unwrap().1,
        b"\x04PONG2",
        "the other prefix got no message"
    );

    // A PING context longer than ZMTP's 16 bytes, and a command no subscriber sends, each cut
    // the connection.
    for (name, data) in [
        (&b"PING"[..], &b"\x00\x0a0123456789abcdefX"[..]),
        (b"HELLO", b""),
    ] {
        let mut bad = RawPeer::connect(p.endpoint(), "SUB");
        bad.frame().unwrap(); // READY
        bad.command(name, data);
        let end = Instant::now() + LIMIT;
        while bad.frame().is_some() {
            assert!(Instant::now() < end, "connection never closed");
        }
    }

    // A DEALER is not a subscriber: the connection is closed after the handshake.
    let mut dealer = RawPeer::connect(p.endpoint(), "DEALER");
    let end = Instant::now() + LIMIT;
    while dealer.frame().is_some() {
        assert!(Instant::now() < end, "connection never closed");
    }
}

/// A subscriber that takes nothing loses messages past its high-water mark (counted), rather
/// than growing the publisher's memory or holding up the others; what it reads later is whole
/// messages, in order.
#[test]
fn a_stalled_subscriber_loses_messages_past_its_bound() {
    let p = publisher(|c| {
        c.subscriber_hwm = 8;
        c.subscriber_hwm_bytes = 1 << 20;
        c.max_queue_bytes = 1 << 30;
    });
    let rt = rt();
    let mut sub = rt.block_on(Subscriber::connect(sub_config(&p))).unwrap();
    let mut stalled = RawPeer::connect(p.endpoint(), "SUB");
    stalled.frame().unwrap(); // READY
    stalled.command(b"SUBSCRIBE", b"");
    stalled.command(b"PING", b"\x00\x0aready");
    assert_eq!(stalled.frame().unwrap().1, b"\x04PONGready");
    wait_subscribed(&p, 2);
    // 64 MiB toward a peer that reads nothing: far past the kernel's buffers and the bound.
    // The live subscriber takes each message before the next is published, so it is never
    // behind (a subscriber behind by an eighth of its bound while the stalled one holds the
    // budget loses messages too, by design): it gets every one of them meanwhile.
    let payload = vec![0xC0u8; 256 << 10];
    let mut got = Vec::new();
    for i in 0..256 {
        p.publish_encoded(payload.clone()).unwrap();
        got.extend(rt.block_on(take_until(&mut sub, |g| !g.is_empty())));
        assert_eq!(got.len(), i + 1);
    }
    assert_eq!(p.stats().published, 256);
    let drops = p.stats().subscriber_drops;
    assert!(
        drops > 100,
        "only {drops} messages dropped toward the stalled peer"
    );
    // The stalled peer now reads whole messages in order, then nothing past its bound.
    let mut last = None;
    for _ in 0..3 {
        let (_, seq) = [stalled.frame(), stalled.frame(), stalled.frame()][1]
            .clone()
            .unwrap();
        let seq = u64::from_be_bytes(seq.try_into().unwrap());
        assert!(last.is_none_or(|l| seq > l), "in order");
        last = Some(seq);
    }
}
