//! The publisher's live set, measured: what keeping it costs a publish, the memory it holds per
//! block, and how long a late subscriber waits for a snapshot of a million blocks.
//!
//! `cargo bench -p kvlink-events --bench snapshot` runs itself four times, in fresh processes
//! (so that one run's freed memory does not hide another's): without a live set
//! (`snapshot_max_blocks = 0`) and with one, for an engine cache of 64 Ki blocks (each batch
//! evicts the runs stored 64 batches before, as an LRU would, so the set stays at 64 Ki blocks)
//! and of 1 Mi (nothing evicted). Each publishes `BLOCKS` blocks (runs of 16 chained 16-token
//! blocks, 64 runs per batch, with a replay endpoint and a ring of 16 batches) and prints one
//! JSON line; `publish_ns_per_block` includes making the batch (the same in every case).

use std::time::{Duration, Instant};

use kvlink_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, Publisher, PublisherConfig, SubItem,
    Subscriber, SubscriberConfig,
};

const BLOCKS: u64 = 1 << 20;
const RUN: u64 = 16;
const RUNS_PER_BATCH: u64 = 64;

/// Batch storing runs `first_run..+RUNS_PER_BATCH`, evicting those `cached` blocks older.
fn batch(first_run: u64, cached: u64) -> EventBatch {
    let mut events: Vec<KvEvent> = (first_run..first_run + RUNS_PER_BATCH)
        .map(|r| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..RUN).map(|k| BlockHash::U64(r * RUN + k + 1)).collect(),
                parent_block_hash: None,
                token_ids: (0..RUN * 16)
                    .map(|t| ((r * 7 + t) % 150_000) as u32)
                    .collect(),
                block_size: 16,
                medium: Some("GPU".into()),
                ..Default::default()
            })
        })
        .collect();
    if let Some(old) = first_run.checked_sub(cached / RUN) {
        events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: (old * RUN + 1..(old + RUNS_PER_BATCH) * RUN + 1)
                .map(BlockHash::U64)
                .collect(),
            medium: Some("GPU".into()),
            ..Default::default()
        }));
    }
    EventBatch {
        ts: 1.0,
        events,
        dp_rank: Some(0),
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn child(max_blocks: usize, cached: u64) {
    let p = Publisher::start(PublisherConfig {
        endpoint: "tcp://*:0".into(),
        replay_endpoint: Some("tcp://*:0".into()),
        buffer_steps: 16,
        snapshot_max_blocks: max_blocks,
        ..Default::default()
    })
    .expect("publisher");
    // Batches are made as an engine makes them, one step at a time: without a live set their
    // memory is freed after each publish (and reused), with one the live set keeps what it
    // needs, so the growth of the resident set is the live set's footprint.
    let before = rss_bytes();
    let t = Instant::now();
    for b in 0..BLOCKS / (RUN * RUNS_PER_BATCH) {
        p.publish(batch(b * RUNS_PER_BATCH, cached))
            .expect("publish");
    }
    let publish_ns = t.elapsed().as_nanos() as f64 / BLOCKS as f64;
    let held = rss_bytes().saturating_sub(before);
    let mut snapshot_ms = None;
    if max_blocks > 0 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let local = |ep: &str| ep.replace("0.0.0.0", "127.0.0.1");
        let cfg = SubscriberConfig {
            replay_endpoint: p.replay_endpoint().map(local),
            start_from: Some(0),
            snapshots: true,
            replay_timeout: Duration::from_secs(60),
            ..SubscriberConfig::new(local(p.endpoint()))
        };
        let t = Instant::now();
        rt.block_on(async {
            let mut sub = Subscriber::connect(cfg).await.expect("subscriber");
            loop {
                match sub.next(Duration::from_secs(60)).await.expect("next") {
                    Some(SubItem::Snapshot { batches, .. }) => {
                        let blocks: usize = batches
                            .iter()
                            .flat_map(|b| &b.events)
                            .map(|e| match e {
                                KvEvent::BlockStored(s) => s.block_hashes.len(),
                                _ => 0,
                            })
                            .sum();
                        assert_eq!(blocks as u64, cached, "the whole live set");
                        break;
                    }
                    Some(_) => {}
                    None => panic!("no snapshot within 60 s"),
                }
            }
        });
        snapshot_ms = Some(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "{{\"snapshot_max_blocks\": {max_blocks}, \"cached\": {cached}, \"blocks\": {BLOCKS}, \"publish_ns_per_block\": {publish_ns:.1}, \"rss_bytes_per_block\": {:.1}, \"live_blocks\": {}, \"snapshot_ms\": {}}}",
        held as f64 / BLOCKS as f64,
        p.stats().live_blocks,
        snapshot_ms.map_or("null".into(), |m| format!("{m:.1}"))
    );
}

fn main() {
    if let Ok(v) = std::env::var("KVLINK_SNAPSHOT_BENCH_CHILD") {
        let (max, cached) = v.split_once(',').expect("max,cached");
        child(max.parse().expect("max"), cached.parse().expect("cached"));
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    let cases = [
        (0, 1 << 16),
        (1 << 21, 1 << 16),
        (0, BLOCKS),
        (1 << 21, BLOCKS),
    ];
    for (max, cached) in cases {
        let out = std::process::Command::new(&exe)
            .env("KVLINK_SNAPSHOT_BENCH_CHILD", format!("{max},{cached}"))
            .output()
            .expect("child run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{}", String::from_utf8_lossy(&out.stdout).trim());
    }
}
