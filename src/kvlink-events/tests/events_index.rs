//! The index fed by kvlink's subscriber over ZeroMQ on loopback: what a router sees when a
//! publisher restarts (its sequence reset) and when live batches are lost with no replay.

mod events_common;

use std::time::{Duration, Instant};

use events_common::*;
use kvlink_events::{
    BlockHash, BlockStored, EventBatch, HolderState, Index, KvEvent, Resync, SubItem, Subscriber,
    SubscriberConfig,
};

/// Batch `i` stores block `100 + i` (16 tokens) after block `99 + i` (none for the first).
fn store(i: u64) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::U64(100 + i)],
            parent_block_hash: (i > 0).then(|| BlockHash::U64(99 + i)),
            token_ids: (0..16).map(|t| (i * 16 + t) as u32).collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        dp_rank: Some(0),
    }
}

/// The prompt of batches `0..n`.
fn prompt(n: u64) -> Vec<u32> {
    (0..n * 16).map(|t| t as u32).collect()
}

fn matched(ix: &Index, n: u64) -> Option<(usize, HolderState)> {
    let o = ix.overlap_tokens(&prompt(n), 16, &Default::default());
    o.best().map(|m| (m.blocks, m.state))
}

/// Feeds items into the index until `done`, or fails after `LIMIT`.
async fn feed(sub: &mut Subscriber, ix: &mut Index, done: impl Fn(&[SubItem]) -> bool) {
    let end = Instant::now() + LIMIT;
    let mut got = Vec::new();
    while !done(&got) {
        assert!(Instant::now() < end, "timed out; got {:?}", summary(&got));
        if let Some(item) = sub.next(Duration::from_millis(150)).await.unwrap() {
            ix.apply_item("engine", &item);
            got.push(item);
        }
    }
}

#[test]
fn a_restarted_publishers_old_blocks_never_count() {
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
    for i in 0..6 {
        first.publish(store(i)).unwrap();
    }
    let mut ix = Index::default();
    rt.block_on(feed(&mut sub, &mut ix, |g| batches(g) >= 6));
    assert_eq!(matched(&ix, 6), Some((6, HolderState::Exact)));
    drop(first);
    // The new process holds only the first two blocks; its numbering starts again at 0.
    let second = publisher_at(ports);
    rt.block_on(async {
        let end = Instant::now() + LIMIT;
        let mut restarted = false;
        while !restarted || matched(&ix, 6).is_none_or(|(n, _)| n < 2) {
            assert!(Instant::now() < end, "{:?}", ix.stats());
            second.publish(store(0)).unwrap();
            second.publish(store(1)).unwrap();
            if let Some(item) = sub.next(Duration::from_millis(150)).await.unwrap() {
                restarted |= matches!(item, SubItem::Resync(Resync::PublisherRestart { .. }));
                ix.apply_item("engine", &item);
            }
        }
    });
    assert_eq!(matched(&ix, 6), Some((2, HolderState::Exact)));
    assert_eq!(ix.stats().restarts, 1);
}

fn drops(seq: u64) -> bool {
    (3..5).contains(&seq)
}

#[test]
fn batches_lost_without_replay_withhold_what_was_known() {
    let rt = rt();
    let p = publisher(|c| c.replay_endpoint = None);
    let mut sub = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            drop_live: Some(drops),
            ..sub_config(&p)
        }))
        .unwrap();
    wait_subscribed(&p, 1);
    for i in 0..3 {
        p.publish(store(i)).unwrap();
    }
    let mut ix = Index::default();
    rt.block_on(feed(&mut sub, &mut ix, |g| batches(g) >= 3));
    assert_eq!(matched(&ix, 3), Some((3, HolderState::Exact)));
    // Batches 3 and 4 are lost: they could as well have removed blocks the index knows.
    for i in 3..7 {
        p.publish(store(i)).unwrap();
    }
    rt.block_on(feed(&mut sub, &mut ix, |g| batches(g) >= 2));
    assert_eq!(ix.stats().losses, 1);
    // Blocks 0..3 are withheld, so the prompt matches nothing from its start.
    assert_eq!(matched(&ix, 7), None);
    let state = ix.holders()[0].1;
    assert_eq!(state, HolderState::Recovering);
}

#[test]
fn a_restart_is_seen_even_once_the_new_sequence_passed_the_old() {
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
    for i in 0..3 {
        first.publish(store(i)).unwrap();
    }
    let mut ix = Index::default();
    rt.block_on(feed(&mut sub, &mut ix, |g| batches(g) >= 3));
    assert_eq!(matched(&ix, 3), Some((3, HolderState::Exact)));
    let old = first.incarnation().expect("stamped by default");
    drop(first);
    // The new process stores one unrelated block per batch, many more batches than the old
    // one published, before the subscriber hears from it.
    let second = publisher_at(ports);
    assert_ne!(second.incarnation(), Some(old));
    let other = |i: u64| {
        let mut b = store(i + 1000);
        b.dp_rank = Some(0);
        b
    };
    for i in 0..20 {
        second.publish(other(i)).unwrap();
    }
    rt.block_on(async {
        let end = Instant::now() + LIMIT;
        let mut i = 20;
        while ix.stats().restarts == 0 || ix.stats().stored < 4 {
            assert!(Instant::now() < end, "{:?}", ix.stats());
            second.publish(other(i)).unwrap();
            i += 1;
            if let Some(item) = sub.next(Duration::from_millis(100)).await.unwrap() {
                ix.apply_item("engine", &item);
            }
        }
    });
    assert_eq!(matched(&ix, 3), None, "the old process's blocks are gone");
}
