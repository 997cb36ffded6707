//! The KV-event merger on tcp loopback: one global sequence over several ranks, a restarted
//! rank cleared downstream, unknown fields and input topics kept, vLLM's TP rule, and the
//! merged stream's snapshot for a late subscriber.

mod events_common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use events_common::*;
use kvlink_events::{
    encode_batch, llm_d_topic, parse_llm_d_topic, BlockHash, BlockRemoved, Encoding, EventBatch,
    ExtraField, FieldKey, KvEvent, Merger, MergerConfig, MergerInput, Publisher, PublisherConfig,
    SubItem, Subscriber, SubscriberConfig, Value,
};

/// A merger over the ranks' publishers (each with its `dp_rank`; settings adjusted by `f`) and
/// a subscriber to it, once the merger subscribed to every rank and the subscriber to it.
fn merger_over(
    ranks: &[(&Publisher, i64)],
    f: impl FnOnce(&mut MergerConfig),
) -> (Merger, Subscriber, tokio::runtime::Runtime) {
    let rt = rt();
    let mut cfg = MergerConfig::new(
        ranks.iter().map(|(p, dp)| input_of(p, *dp)).collect(),
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
    for (p, _) in ranks {
        wait_subscribed(p, 1);
    }
    wait_merger_subscribed(&merger, 1);
    (merger, sub, rt)
}

/// Waits (up to `LIMIT`) until `n` subscribers subscribed to the merged stream.
fn wait_merger_subscribed(merger: &Merger, n: usize) {
    let end = Instant::now() + LIMIT;
    while merger.subscribers() != Some(n) {
        assert!(
            Instant::now() < end,
            "{n} subscribers never subscribed to the merger"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `batch(i)` of rank `dp`.
fn tagged(i: u64, dp: i64) -> EventBatch {
    EventBatch {
        dp_rank: Some(dp),
        ..batch(i)
    }
}

fn input_of(p: &Publisher, dp_rank: i64) -> MergerInput {
    MergerInput {
        endpoint: local(p.endpoint()),
        replay_endpoint: p.replay_endpoint().map(local),
        dp_rank: Some(dp_rank),
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

#[test]
fn merger_renumbers_ranks_and_clears_a_restarted_rank() {
    let rank0 = publisher(|c| c.encoding = Encoding::Legacy);
    let rank1 = publisher(|_| {});
    let ports1 = (
        port(rank1.endpoint()),
        port(rank1.replay_endpoint().unwrap()),
    );
    let (merger, mut sub, rt) = merger_over(&[(&rank0, 0), (&rank1, 1)], |_| {});
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

/// A batch the merger must re-encode (one of its events is unreadable) keeps the other events'
/// unknown fields, in either encoding, and each input's topic frame when asked.
#[test]
fn the_merger_keeps_unknown_fields_and_input_topics() {
    let a = publisher(|c| c.topic = llm_d_topic("pod-a", "llama"));
    let b = publisher(|c| c.topic = llm_d_topic("pod-b", "llama"));
    let (_m, mut sub, rt) = merger_over(&[(&a, 0), (&b, 0)], |c| {
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
    let (m, mut sub, rt) = merger_over(&[(&w0, 0), (&w1, 0)], |c| c.tp_size = 2);
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
    // Each batch reaches the merger before the next is published: the rule's outcome depends
    // on the order.
    let forwarded = |m: &Merger, want: u64| {
        let end = Instant::now() + LIMIT;
        while m
            .stats()
            .1
            .iter()
            .map(|i| i.batches + i.dropped)
            .sum::<u64>()
            < want
        {
            assert!(Instant::now() < end, "the merger took {:?}", m.stats().1);
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    w0.publish(b(&[1, 2, 3])).unwrap();
    forwarded(&m, 1);
    w1.publish(b(&[2, 9])).unwrap();
    forwarded(&m, 2);
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
                vec![input_of(&w0, 0), input_of(&w1, 0)],
                PublisherConfig::default()
            )
        }),
        Err(kvlink_events::EventsError::Config(_))
    ));
}

#[test]
fn a_late_subscriber_of_the_merged_stream_gets_every_ranks_blocks_in_a_snapshot() {
    let rank0 = publisher(|_| {});
    let rank1 = publisher(|_| {});
    // The merged stream's ring keeps 4 batches: a late subscriber cannot replay from 0.
    let (merger, mut sub, rt) = merger_over(&[(&rank0, 0), (&rank1, 1)], |c| {
        c.output.buffer_steps = 4;
    });
    for i in 0..20 {
        rank0.publish(tagged(i, 0)).unwrap();
        rank1.publish(tagged(i, 1)).unwrap();
    }
    // What a subscriber that saw the whole merged stream holds.
    let mut reference = kvlink_events::Index::default();
    let mut got = rt.block_on(take_until(&mut sub, |g| batches(g) >= 40));
    let mut late = rt
        .block_on(Subscriber::connect(SubscriberConfig {
            replay_endpoint: merger.replay_endpoint().map(local),
            snapshots: true,
            ..SubscriberConfig::new(local(merger.endpoint()))
        }))
        .unwrap();
    wait_merger_subscribed(&merger, 2);
    // One more batch: the late subscriber hears the stream is past 0 and asks.
    rank0.publish(tagged(20, 0)).unwrap();
    got.extend(rt.block_on(take_until(&mut sub, |g| batches(g) >= 1)));
    for item in &got {
        reference.apply_item("merged", item);
    }
    // A snapshot, then (if it was taken before the last batch) the rest, up to seq 40.
    let items = rt.block_on(take_until(&mut late, |g| {
        let snapshot = g.iter().find_map(|i| match i {
            SubItem::Snapshot { seq, .. } => Some(*seq),
            _ => None,
        });
        snapshot.is_some_and(|s| s.max(seqs(g).last().copied().unwrap_or(0)) >= 40)
    }));
    assert!(resyncs(&items).is_empty(), "{:?}", summary(&items));
    let mut ix = kvlink_events::Index::default();
    for item in &items {
        ix.apply_item("merged", item);
    }
    let held = |ix: &kvlink_events::Index| -> Vec<_> {
        ix.dump().into_iter().filter(|h| !h.2.is_empty()).collect()
    };
    assert!(held(&reference).iter().any(|h| h.0.dp_rank == 1));
    assert_eq!(held(&ix), held(&reference));
    assert_eq!(merger.stats().0.snapshots, 1);
}
