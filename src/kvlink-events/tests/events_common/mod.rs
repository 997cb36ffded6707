//! Helpers shared by the KV-event socket tests (`events_zmq`, `events_merger`): publishers on
//! loopback, a batch workload whose content depends on its index, and collecting subscriber
//! items until a condition holds, with a deadline.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvlink_events::{
    BlockHash, BlockRemoved, EventBatch, KvEvent, PageHash, PageSplitter, Publisher,
    PublisherConfig, Resync, SubItem, Subscriber, SubscriberConfig,
};

pub const LIMIT: Duration = Duration::from_secs(30);

pub fn local(ep: &str) -> String {
    ep.replace("0.0.0.0", "127.0.0.1")
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub fn publisher(f: impl FnOnce(&mut PublisherConfig)) -> Publisher {
    let mut cfg = PublisherConfig {
        endpoint: "tcp://*:0".into(),
        replay_endpoint: Some("tcp://*:0".into()),
        ..Default::default()
    };
    f(&mut cfg);
    Publisher::start(cfg).unwrap()
}

pub fn sub_config(p: &Publisher) -> SubscriberConfig {
    SubscriberConfig {
        replay_endpoint: p.replay_endpoint().map(local),
        ..SubscriberConfig::new(local(p.endpoint()))
    }
}

/// A batch whose content depends on `i`: stored pages with chained hashes (some >= 2^63),
/// removals with negative and binary hashes, an occasional clear.
pub fn batch(i: u64) -> EventBatch {
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

/// Waits (up to `LIMIT`) until `n` peers of `p`'s bound tcp endpoint have subscribed: what a
/// test waits for before publishing what a subscriber must see live.
pub fn wait_subscribed(p: &Publisher, n: usize) {
    let end = Instant::now() + LIMIT;
    loop {
        let got = p
            .subscribers()
            .expect("a bound tcp endpoint counts its subscribers");
        if got >= n {
            return;
        }
        assert!(
            Instant::now() < end,
            "{got} of {n} subscribers after {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Publishes batches `range` and waits (up to `LIMIT`) until the publisher has sent them all.
pub fn publish_all(p: &Publisher, range: std::ops::Range<u64>) {
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
pub async fn take_until(sub: &mut Subscriber, done: impl Fn(&[SubItem]) -> bool) -> Vec<SubItem> {
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

pub fn batches(items: &[SubItem]) -> usize {
    items
        .iter()
        .filter(|i| {
            !matches!(
                i,
                SubItem::Resync(_) | SubItem::GapFilled { .. } | SubItem::Snapshot { .. }
            )
        })
        .count()
}

pub fn summary(items: &[SubItem]) -> Vec<String> {
    items
        .iter()
        .map(|i| match i {
            SubItem::Batch { seq, .. } => format!("{seq:?}"),
            SubItem::Malformed { seq, .. } => format!("malformed {seq:?}"),
            SubItem::Resync(r) => format!("{r:?}"),
            SubItem::GapFilled { from, through } => format!("filled {from}..={through}"),
            SubItem::Snapshot { seq, batches, .. } => {
                format!("snapshot {seq} of {} batches", batches.len())
            }
        })
        .collect()
}

pub fn seqs(items: &[SubItem]) -> Vec<u64> {
    items
        .iter()
        .filter_map(|i| match i {
            SubItem::Batch { seq, .. } | SubItem::Malformed { seq, .. } => *seq,
            SubItem::Resync(_) | SubItem::GapFilled { .. } | SubItem::Snapshot { .. } => None,
        })
        .collect()
}

pub fn resyncs(items: &[SubItem]) -> Vec<Resync> {
    items
        .iter()
        .filter_map(|i| match i {
            SubItem::Resync(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

/// Starts a publisher on fixed ports, retrying while the previous one's ports close.
pub fn publisher_at(ports: (u16, u16)) -> Publisher {
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

pub fn port(ep: &str) -> u16 {
    ep.rsplit(':').next().unwrap().parse().unwrap()
}
