//! KV events over ZeroMQ on tcp loopback: kvlink's publisher to kvlink's subscriber (both
//! encodings, in order, replay from any sequence, drops recovered by replay, restarts and
//! history loss reported), hostile peers against the publisher's sockets, and the merger.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvlink::events::{
    encode_batch, llm_d_topic, parse_llm_d_topic, BlockHash, BlockRemoved, Encoding, EventBatch,
    ExtraField, FieldKey, KvEvent, Merger, MergerConfig, MergerInput, PageHash, PageSplitter,
    Publisher, PublisherConfig, ReplayFormat, Resync, SubItem, Subscriber, SubscriberConfig, Value,
};

const LIMIT: Duration = Duration::from_secs(30);

fn local(ep: &str) -> String {
    ep.replace("0.0.0.0", "127.0.0.1")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn publisher(f: impl FnOnce(&mut PublisherConfig)) -> Publisher {
    let mut cfg = PublisherConfig {
        endpoint: "tcp://*:0".into(),
        replay_endpoint: Some("tcp://*:0".into()),
        ..Default::default()
    };
    f(&mut cfg);
    Publisher::start(cfg).unwrap()
}

fn sub_config(p: &Publisher) -> SubscriberConfig {
    SubscriberConfig {
        replay_endpoint: p.replay_endpoint().map(local),
        ..SubscriberConfig::new(local(p.endpoint()))
    }
}

/// A batch whose content depends on `i`: stored pages with chained hashes (some >= 2^63),
/// removals with negative and binary hashes, an occasional clear.
fn batch(i: u64) -> EventBatch {
    let tokens: Vec<u32> = (0..(16 * (1 + i % 5) as u32 + 7))
        .map(|t| t * 7 + i as u32)
        .collect();
    let mut events: Vec<KvEvent> = PageSplitter::new(16, PageHash::VllmU64)
        .split(None, &tokens, 0, Some("GPU"))
        .events
        .into_iter()
        .map(KvEvent::BlockStored)
        .collect();
    events.push(KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![
            BlockHash::I64(-(i as i64) - 1),
            BlockHash::Bytes(vec![i as u8; 32]),
            BlockHash::U64(u64::MAX - i),
        ],
        medium: Some("CPU".into()),
        group_idx: Some(1),
        ..Default::default()
    }));
    if i % 7 == 3 {
        events.push(KvEvent::all_cleared(None));
    }
    EventBatch {
        ts: 1_700_000_000.0 + i as f64 / 8.0,
        events,
        dp_rank: Some(0),
    }
}

/// Publishes batches `range` and waits (up to `LIMIT`) until the publisher has sent them all.
fn publish_all(p: &Publisher, range: std::ops::Range<u64>) {
    let want = range.end;
    for i in range {
        p.publish(batch(i)).unwrap();
    }
    let end = Instant::now() + LIMIT;
    while p.stats().published < want {
        assert!(Instant::now() < end, "publisher stalled: {:?}", p.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Collects items until `done` says so, or fails after `LIMIT`.
async fn take_until(sub: &mut Subscriber, done: impl Fn(&[SubItem]) -> bool) -> Vec<SubItem> {
    let end = Instant::now() + LIMIT;
    let mut got = Vec::new();
    while !done(&got) {
        assert!(Instant::now() < end, "timed out; got {:?}", summary(&got));
        if let Some(item) = sub.next(Duration::from_millis(200)).await.unwrap() {
            got.push(item);
        }
    }
    got
}

fn batches(items: &[SubItem]) -> usize {
    items
        .iter()
        .filter(|i| !matches!(i, SubItem::Resync(_) | SubItem::GapFilled { .. }))
        .count()
}

fn summary(items: &[SubItem]) -> Vec<String> {
    items
        .iter()
        .map(|i| match i {
            SubItem::Batch { seq, .. } => format!("{seq:?}"),
            SubItem::Malformed { seq, .. } => format!("malformed {seq:?}"),
            SubItem::Resync(r) => format!("{r:?}"),
            SubItem::GapFilled { from, through } => format!("filled {from}..={through}"),
        })
        .collect()
}

fn seqs(items: &[SubItem]) -> Vec<u64> {
    items
        .iter()
        .filter_map(|i| match i {
            SubItem::Batch { seq, .. } | SubItem::Malformed { seq, .. } => *seq,
            SubItem::Resync(_) | SubItem::GapFilled { .. } => None,
        })
        .collect()
}

fn resyncs(items: &[SubItem]) -> Vec<Resync> {
    items
        .iter()
        .filter_map(|i| match i {
            SubItem::Resync(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

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

/// Starts a publisher on fixed ports, retrying while the previous one's ports close.
fn publisher_at(ports: (u16, u16)) -> Publisher {
    let end = Instant::now() + LIMIT;
    loop {
        match Publisher::start(PublisherConfig {
            endpoint: format!("tcp://*:{}", ports.0),
            replay_endpoint: Some(format!("tcp://*:{}", ports.1)),
            ..Default::default()
        }) {
            Ok(p) => return p,
            Err(e) if Instant::now() < end => {
                eprintln!("retrying: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

fn port(ep: &str) -> u16 {
    ep.rsplit(':').next().unwrap().parse().unwrap()
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

#[test]
fn merger_renumbers_ranks_and_clears_a_restarted_rank() {
    let rt = rt();
    let rank0 = publisher(|c| c.encoding = Encoding::Legacy);
    let rank1 = publisher(|_| {});
    let ports1 = (
        port(rank1.endpoint()),
        port(rank1.replay_endpoint().unwrap()),
    );
    let input = |p: &Publisher, dp| MergerInput {
        endpoint: local(p.endpoint()),
        replay_endpoint: p.replay_endpoint().map(local),
        dp_rank: Some(dp),
    };
    let merger = Merger::start(MergerConfig::new(
        vec![input(&rank0, 0), input(&rank1, 1)],
        PublisherConfig {
            endpoint: "tcp://*:0".into(),
            replay_endpoint: Some("tcp://*:0".into()),
            ..Default::default()
        },
    ))
    .unwrap();
    let mut sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            replay_endpoint: merger.replay_endpoint().map(local),
            ..SubscriberConfig::new(local(merger.endpoint()))
        }))
        .unwrap();
    // Wait until the merger's inputs are connected.
    let end = Instant::now() + LIMIT;
    while !merger.stats().1.iter().all(|i| i.connected) {
        assert!(Instant::now() < end);
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let tagged = |i: u64, dp: i64| EventBatch {
        dp_rank: Some(dp),
        ..batch(i)
    };
    for i in 0..20 {
        rank0.publish(tagged(i, 0)).unwrap();
        rank1.publish(tagged(i, 1)).unwrap();
    }
    let got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 40));
    assert_eq!(
        seqs(&got),
        (0..40).collect::<Vec<_>>(),
        "one global sequence"
    );
    for dp in [0, 1] {
        let mine: Vec<&EventBatch> = got
            .iter()
            .filter_map(|i| match i {
                SubItem::Batch { batch, .. } if batch.dp_rank == Some(dp) => Some(batch),
                _ => None,
            })
            .collect();
        let want: Vec<EventBatch> = (0..20).map(|i| tagged(i, dp)).collect();
        assert_eq!(
            mine.into_iter().cloned().collect::<Vec<_>>(),
            want,
            "rank {dp} in order"
        );
    }
    let (out, inputs) = merger.stats();
    assert_eq!(out.published, 40);
    assert_eq!(inputs[1].last_seq, Some(19));

    // Rank 1 restarts: the merged stream gets a clear for dp_rank 1, then its new batches.
    drop(rank1);
    let rank1 = publisher_at(ports1);
    let got = rt.block_on(async {
        let end = Instant::now() + LIMIT;
        let mut got = Vec::new();
        let mut next = 0;
        loop {
            let cleared = got.iter().any(|i| {
                matches!(i, SubItem::Batch { batch, .. }
                    if batch.dp_rank == Some(1)
                        && batch.events == vec![KvEvent::all_cleared(None)])
            });
            if cleared {
                break got;
            }
            assert!(Instant::now() < end, "{:?}", summary(&got));
            if next < 15 {
                rank1.publish(tagged(next, 1)).unwrap();
                next += 1;
            }
            if let Some(i) = sub.next(Duration::from_millis(150)).await.unwrap() {
                got.push(i);
            }
        }
    });
    assert!(
        resyncs(&got).is_empty(),
        "the merged stream itself is continuous"
    );
    assert_eq!(merger.stats().1[1].resyncs, 1);
}

fn merger_over(
    inputs: Vec<MergerInput>,
    f: impl FnOnce(&mut MergerConfig),
) -> (Merger, Subscriber, tokio::runtime::Runtime) {
    let rt = rt();
    let mut cfg = MergerConfig::new(
        inputs,
        PublisherConfig {
            endpoint: "tcp://*:0".into(),
            replay_endpoint: Some("tcp://*:0".into()),
            ..Default::default()
        },
    );
    f(&mut cfg);
    let merger = Merger::start(cfg).unwrap();
    let sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            replay_endpoint: merger.replay_endpoint().map(local),
            ..SubscriberConfig::new(local(merger.endpoint()))
        }))
        .unwrap();
    let end = Instant::now() + LIMIT;
    while !merger.stats().1.iter().all(|i| i.connected) {
        assert!(Instant::now() < end);
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    (merger, sub, rt)
}

fn input_of(p: &Publisher) -> MergerInput {
    MergerInput {
        endpoint: local(p.endpoint()),
        replay_endpoint: p.replay_endpoint().map(local),
        dp_rank: Some(0),
    }
}

fn batch_items(items: &[SubItem]) -> Vec<(Bytes, EventBatch)> {
    items
        .iter()
        .filter_map(|i| match i {
            SubItem::Batch { topic, batch, .. } => Some((topic.clone(), batch.clone())),
            _ => None,
        })
        .collect()
}

/// A batch the merger must re-encode (one of its events is unreadable) keeps the other events'
/// unknown fields, in either encoding, and each input's topic frame when asked.
#[test]
fn the_merger_keeps_unknown_fields_and_input_topics() {
    let a = publisher(|c| c.topic = llm_d_topic("pod-a", "llama"));
    let b = publisher(|c| c.topic = llm_d_topic("pod-b", "llama"));
    let (_m, mut sub, rt) = merger_over(vec![input_of(&a), input_of(&b)], |c| {
        c.topic = "kv@".into();
        c.keep_input_topics = true;
    });
    let with_extra = |enc: Encoding| {
        let key = match enc {
            Encoding::Current => FieldKey::Name("x_future".into()),
            Encoding::Legacy => FieldKey::Position(30),
        };
        let ev = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::U64(7)],
            locality: Some("LOCAL".into()),
            extra: vec![ExtraField {
                key,
                value: Value::Map(vec![(Value::Str("k".into()), Value::Bin(vec![1, 2]))]),
            }],
            ..Default::default()
        });
        let mut p = Vec::new();
        encode_batch(
            &EventBatch {
                ts: 1.0,
                events: vec![ev.clone()],
                dp_rank: Some(0),
            },
            enc,
            &mut p,
        );
        // Splice a second, unreadable event (an integer) after it: events array 1 -> 2.
        let at = p.iter().position(|x| *x == 0x91).unwrap();
        p[at] = 0x92;
        let last = p.len() - 1; // dp_rank 0
        p.insert(last, 0x2a);
        (ev, Bytes::from(p))
    };
    let (cur, cur_payload) = with_extra(Encoding::Current);
    let (leg, leg_payload) = with_extra(Encoding::Legacy);
    a.publish_encoded(cur_payload).unwrap();
    b.publish_encoded(leg_payload).unwrap();
    let got = batch_items(&rt.block_on(take_until(&mut sub, |g| batches(g) >= 2)));
    let mut seen: Vec<(String, KvEvent)> = got
        .into_iter()
        .map(|(t, b)| {
            (
                String::from_utf8_lossy(&t).into_owned(),
                b.events[0].clone(),
            )
        })
        .collect();
    seen.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        seen,
        vec![
            ("kv@pod-a@llama".into(), cur),
            ("kv@pod-b@llama".into(), leg)
        ]
    );
    assert_eq!(
        parse_llm_d_topic(b"kv@pod-a@llama"),
        Some(("pod-a", "llama"))
    );
}

/// vLLM's TP rule: with two TP workers, an event goes out once both emitted it.
#[test]
fn the_merger_applies_the_tp_rule() {
    let w0 = publisher(|_| {});
    let w1 = publisher(|_| {});
    let (m, mut sub, rt) = merger_over(vec![input_of(&w0), input_of(&w1)], |c| c.tp_size = 2);
    let ev = |h: u64| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::U64(h)],
            ..Default::default()
        })
    };
    let b = |hs: &[u64]| EventBatch {
        ts: 1.0,
        events: hs.iter().map(|h| ev(*h)).collect(),
        dp_rank: Some(0),
    };
    w0.publish(b(&[1, 2, 3])).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    w1.publish(b(&[2, 9])).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    w1.publish(b(&[1])).unwrap();
    let got = batch_items(&rt.block_on(take_until(&mut sub, |g| batches(g) >= 2)));
    let events: Vec<KvEvent> = got.into_iter().flat_map(|(_, b)| b.events).collect();
    assert_eq!(
        events,
        vec![ev(2), ev(1)],
        "3 and 9 were emitted by one worker only"
    );
    let g = m.tp_stats();
    assert_eq!((g[0].forwarded, g[0].held), (2, 2));
    assert!(matches!(
        Merger::start(MergerConfig {
            tp_size: 3,
            ..MergerConfig::new(
                vec![input_of(&w0), input_of(&w1)],
                PublisherConfig::default()
            )
        }),
        Err(kvlink::events::EventsError::Config(_))
    ));
}
