//! KV events over ZeroMQ on tcp loopback: kvlink's publisher to kvlink's subscriber (both
//! encodings, in order, replay from any sequence, drops recovered by replay, restarts and
//! history loss reported) and hostile peers against the publisher's sockets. The merger's tests
//! are in `events_merger.rs`.

mod events_common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use bytes::Bytes;
use events_common::*;
use kvlink::events::{Encoding, ReplayFormat, Resync, SubItem, Subscriber, SubscriberConfig};

#[test]
fn every_batch_arrives_in_order_in_both_encodings() {
    let rt = rt();
    for encoding in [Encoding::Current, Encoding::Legacy] {
        let p = publisher(|c| c.encoding = encoding);
        let mut sub = rt.block_on(Subscriber::connect(sub_config(&p))).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let n = 1500u64;
        for i in 0..n {
            p.publish_timeout(batch(i), LIMIT).unwrap();
        }
        let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= n as usize));
        assert_eq!(seqs(&got), (0..n).collect::<Vec<_>>(), "{encoding:?}");
        for item in &got {
            if let SubItem::Batch {
                seq: Some(s),
                batch: b,
                skipped,
                ..
            } = item
            {
                assert!(skipped.is_empty());
                assert_eq!(*b, batch(*s), "{encoding:?} batch {s}");
            }
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
    std::thread::sleep(Duration::from_millis(200));
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
    std::thread::sleep(Duration::from_millis(200));
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
    std::thread::sleep(Duration::from_millis(200));
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
    std::thread::sleep(Duration::from_millis(200));
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
    std::thread::sleep(Duration::from_millis(200));
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

#[test]
fn malformed_payloads_and_hostile_peers_lose_nothing() {
    let rt = rt();
    let p = publisher(|_| {});
    let mut sub = rt.block_on(Subscriber::connect(sub_config(&p))).unwrap();
    std::thread::sleep(Duration::from_millis(200));

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
