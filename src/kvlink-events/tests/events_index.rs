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

/// Batch `i` of a prefix-caching stream over two DP ranks: a run of four chained blocks
/// (continuing the rank's previous run three times in four), a removal of the middle of the
/// rank's previous run every third batch, a move of a block to the CPU every fifth, and a clear
/// of the rank every 97th.
fn churn(i: u64) -> EventBatch {
    let h = |i: u64, k: u64| BlockHash::U64(i * 10 + k);
    let tokens = |i: u64| (0..64).map(|t| (i * 64 + t) as u32).collect();
    let prev = i.checked_sub(2);
    let mut events = vec![KvEvent::BlockStored(BlockStored {
        block_hashes: (1..=4).map(|k| h(i, k)).collect(),
        parent_block_hash: prev.filter(|_| !(i / 2).is_multiple_of(4)).map(|p| h(p, 4)),
        token_ids: tokens(i),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    })];
    if let Some(p) = prev.filter(|_| i.is_multiple_of(3)) {
        events.push(KvEvent::BlockRemoved(kvlink_events::BlockRemoved {
            block_hashes: vec![h(p, 2)],
            medium: Some("GPU".into()),
            ..Default::default()
        }));
    }
    if let Some(p) = prev.filter(|_| i.is_multiple_of(5)) {
        events.push(KvEvent::BlockTransferred(kvlink_events::BlockTransferred {
            block_hashes: vec![h(p, 3)],
            from_medium: Some("GPU".into()),
            to_medium: Some("CPU".into()),
            ..Default::default()
        }));
    }
    if i % 97 == 96 {
        events.push(KvEvent::all_cleared(None));
    }
    EventBatch {
        ts: 0.0,
        events,
        dp_rank: Some((i % 2) as i64),
    }
}

/// The holders that hold something, as dumped.
fn held(ix: &Index) -> Vec<(kvlink_events::HolderKey, HolderState, Vec<u64>)> {
    ix.dump().into_iter().filter(|h| !h.2.is_empty()).collect()
}

/// Every run's prompt asked of both indexes: the same answers; how many matched blocks.
fn same_answers(a: &Index, b: &Index, n: u64) -> usize {
    let mut matched = 0;
    for i in 0..n {
        // The rank's chain up to run `i`, from the last run without a parent.
        let start = i - 2 * ((i / 2) % 4);
        let prompt: Vec<u32> = (start..=i)
            .step_by(2)
            .flat_map(|j| (0..64).map(move |t| (j * 64 + t) as u32))
            .collect();
        let ask = |ix: &Index| {
            let o = ix.overlap_tokens(&prompt, 16, &Default::default());
            o.matches
                .iter()
                .map(|m| (m.holder.as_ref().clone(), m.blocks, m.tokens, m.state))
                .collect::<Vec<_>>()
        };
        assert_eq!(ask(a), ask(b), "prompt of run {i}");
        matched += ask(a).iter().map(|m| m.1).sum::<usize>();
    }
    matched
}

/// A subscriber asking for snapshots joins `p` late; batches go on being published (and
/// applied to `reference`) until it has delivered `upto`. Its index, its items, and itself
/// (kept open, so that the publisher's count of subscribers only grows).
fn join_late(
    rt: &tokio::runtime::Runtime,
    p: &kvlink_events::Publisher,
    reference: &mut Index,
    next: &mut u64,
    upto: u64,
) -> (Index, Vec<SubItem>, Subscriber) {
    let subscribed = p.subscribers().unwrap_or(0);
    let cfg = SubscriberConfig {
        snapshots: true,
        ..sub_config(p)
    };
    let mut sub = rt.block_on(Subscriber::connect(cfg)).unwrap();
    wait_subscribed(p, subscribed + 1);
    let mut ix = Index::default();
    let mut got = Vec::new();
    rt.block_on(async {
        let end = Instant::now() + LIMIT;
        while sub.last_seq().is_none_or(|s| s < upto) {
            assert!(Instant::now() < end, "got {:?}", summary(&got));
            if *next <= upto {
                let b = churn(*next);
                reference.apply_batch("engine", &b);
                p.publish(b).unwrap();
                *next += 1;
            }
            if let Some(item) = sub.next(Duration::from_millis(50)).await.unwrap() {
                ix.apply_item("engine", &item);
                got.push(item);
            }
        }
    });
    (ix, got, sub)
}

#[test]
fn a_late_index_loads_the_publishers_snapshot_and_answers_as_one_that_saw_everything() {
    let rt = rt();
    // The ring keeps 16 batches: a subscriber joining after 300 cannot replay from 0.
    let p = publisher(|c| c.buffer_steps = 16);
    let mut reference = Index::default();
    for i in 0..300 {
        let b = churn(i);
        reference.apply_batch("engine", &b);
        p.publish(b).unwrap();
    }
    let mut next = 300;
    let (ix, got, _first) = join_late(&rt, &p, &mut reference, &mut next, 305);
    let first = summary(&got).into_iter().next().unwrap_or_default();
    assert!(first.starts_with("snapshot "), "{:?}", summary(&got));
    assert!(resyncs(&got).is_empty(), "no loss: {:?}", summary(&got));
    assert_eq!(ix.stats().snapshots, 1);
    assert_eq!(p.stats().snapshots, 1);
    assert!(held(&ix).iter().all(|h| h.1 == HolderState::Exact));
    assert_eq!(held(&ix), held(&reference));
    assert_eq!(p.stats().live_blocks, reference.stats().blocks as u64);
    let matched = same_answers(&ix, &reference, 306);
    assert!(matched > 200, "the prompts match blocks: {matched}");
    // A second one soon after gets the same snapshot (the publisher builds one a second at
    // most) followed by the ring's batches since, or a newer one: the same index either way.
    let (second, got, _) = join_late(&rt, &p, &mut reference, &mut next, 310);
    assert!(resyncs(&got).is_empty(), "no loss: {:?}", summary(&got));
    assert_eq!(second.stats().snapshots, 1);
    assert_eq!(held(&second), held(&reference));
    same_answers(&second, &reference, 311);
}

#[test]
fn without_a_snapshot_the_lost_history_is_reported_at_once() {
    let rt = rt();
    // vLLM's stream (no incarnation: never asked, as its publisher would log and not answer)
    // and a kvlink publisher without a live set (asked; answers with its ring).
    let plain = |c: &mut kvlink_events::PublisherConfig| {
        c.buffer_steps = 4;
        c.stamp_incarnation = false;
    };
    let no_live = |c: &mut kvlink_events::PublisherConfig| {
        c.buffer_steps = 4;
        c.snapshot_max_blocks = 0;
    };
    for (name, p) in [
        ("plain", publisher(plain)),
        ("no live set", publisher(no_live)),
    ] {
        for i in 0..20 {
            p.publish(churn(i)).unwrap();
        }
        let mut sub = rt
            .block_on(Subscriber::connect(SubscriberConfig {
                snapshots: true,
                replay_timeout: Duration::from_secs(20),
                ..sub_config(&p)
            }))
            .unwrap();
        wait_subscribed(&p, 1);
        let t = Instant::now();
        let mut ix = Index::default();
        rt.block_on(async {
            let end = Instant::now() + LIMIT;
            let mut i = 20;
            while ix.stats().losses == 0 {
                assert!(Instant::now() < end, "{name}: {:?}", ix.stats());
                p.publish(churn(i)).unwrap();
                i += 1;
                if let Some(item) = sub.next(Duration::from_millis(50)).await.unwrap() {
                    assert!(!matches!(item, SubItem::Snapshot { .. }), "{name}");
                    ix.apply_item("engine", &item);
                }
            }
        });
        // Answered, not timed out (the replay timeout is 20 s).
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{name}: {:?}",
            t.elapsed()
        );
        assert_eq!(p.stats().bad_replay_requests, 0, "{name}");
        assert_eq!(sub.stats().replay_failures, 0, "{name}");
    }
}
