use super::*;
use crate::wire::{BlockHash, BlockRemoved, BlockTransferred};

fn stored(hashes: &[u64], parent: Option<u64>, medium: Option<&str>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHash::U64(h)).collect(),
        parent_block_hash: parent.map(BlockHash::U64),
        token_ids: (0..hashes.len() as u32 * 4).collect(),
        block_size: 4,
        medium: medium.map(str::to_string),
        token_offset: Some(0),
        ..Default::default()
    })
}

fn removed(hashes: &[u64], medium: Option<&str>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| BlockHash::U64(h)).collect(),
        medium: medium.map(str::to_string),
        ..Default::default()
    })
}

fn apply(set: &mut LiveSet, dp: Option<i64>, events: Vec<KvEvent>) {
    set.apply(LiveDelta::take(EventBatch {
        ts: 0.0,
        events,
        dp_rank: dp,
    }));
}

/// One snapshot event as (dp, medium, hashes, parent, tokens).
type Shape = (Option<i64>, Option<String>, Vec<u64>, Option<u64>, Vec<u32>);

/// The snapshot's events.
fn shape(set: &LiveSet) -> Vec<Shape> {
    let mut out = Vec::new();
    for b in set.snapshot(1.0).expect("vouched for") {
        for e in b.events {
            let KvEvent::BlockStored(s) = e else {
                panic!("a snapshot holds only stores")
            };
            out.push((
                b.dp_rank,
                s.medium,
                s.block_hashes.iter().map(BlockHash::as_u64).collect(),
                s.parent_block_hash.as_ref().map(BlockHash::as_u64),
                s.token_ids,
            ));
        }
    }
    out
}

#[test]
fn a_store_comes_back_as_it_was_published() {
    let mut set = LiveSet::new(100);
    let e = stored(&[1, 2, 3], Some(9), None);
    apply(&mut set, Some(2), vec![e.clone()]);
    let snap = set.snapshot(5.0).unwrap();
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].dp_rank, Some(2));
    assert_eq!(snap[0].events, vec![e]);
    assert_eq!(set.len(), 3);
}

#[test]
fn removing_a_middle_block_splits_its_store_with_parents_and_tokens_cut() {
    let mut set = LiveSet::new(100);
    apply(&mut set, None, vec![stored(&[1, 2, 3, 4], None, None)]);
    apply(&mut set, None, vec![removed(&[2], None)]);
    let got = shape(&set);
    assert_eq!(
        got,
        vec![
            (None, None, vec![1], None, vec![0, 1, 2, 3]),
            (None, None, vec![3, 4], Some(2), (8..16).collect()),
        ]
    );
    let snap = set.snapshot(0.0).unwrap();
    let KvEvent::BlockStored(tail) = &snap[0].events[1] else {
        unreachable!()
    };
    assert_eq!(tail.token_offset, Some(8));
}

#[test]
fn stores_come_back_in_the_order_they_were_made_and_a_store_again_moves_the_block() {
    let mut set = LiveSet::new(100);
    apply(&mut set, None, vec![stored(&[1], None, None)]);
    apply(&mut set, None, vec![stored(&[2], Some(1), None)]);
    apply(&mut set, None, vec![stored(&[1], None, None)]);
    let hashes: Vec<Vec<u64>> = shape(&set).into_iter().map(|s| s.2).collect();
    assert_eq!(hashes, vec![vec![2], vec![1]]);
    assert_eq!(set.len(), 2);
}

#[test]
fn the_same_hash_twice_in_one_store_keeps_the_later_block() {
    let mut set = LiveSet::new(100);
    apply(&mut set, None, vec![stored(&[5, 5], None, None)]);
    assert_eq!(set.len(), 1);
    let got = shape(&set);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].2, vec![5]);
    assert_eq!(got[0].3, Some(5), "the second block's parent is the first");
}

#[test]
fn clears_take_a_ranks_tiers_of_the_named_medium_or_all() {
    let mut set = LiveSet::new(100);
    apply(
        &mut set,
        Some(0),
        vec![stored(&[1], None, None), stored(&[2], None, Some("CPU"))],
    );
    apply(&mut set, Some(1), vec![stored(&[3], None, None)]);
    apply(
        &mut set,
        Some(0),
        vec![KvEvent::AllBlocksCleared {
            medium: Some("CPU".into()),
            extra: vec![],
        }],
    );
    let hashes: Vec<Vec<u64>> = shape(&set).into_iter().map(|s| s.2).collect();
    assert_eq!(hashes, vec![vec![1], vec![3]]);
    apply(
        &mut set,
        Some(0),
        vec![KvEvent::AllBlocksCleared {
            medium: None,
            extra: vec![],
        }],
    );
    let got = shape(&set);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0, got[0].2.clone()), (Some(1), vec![3]));
}

#[test]
fn moved_blocks_come_back_in_their_new_medium() {
    let mut set = LiveSet::new(100);
    apply(&mut set, None, vec![stored(&[1, 2], None, Some("GPU"))]);
    let moved = KvEvent::BlockTransferred(BlockTransferred {
        block_hashes: vec![BlockHash::U64(2)],
        from_medium: Some("GPU".into()),
        to_medium: Some("CPU".into()),
        ..Default::default()
    });
    apply(&mut set, None, vec![moved]);
    let got = shape(&set);
    assert_eq!(got.len(), 2);
    assert_eq!(
        (got[0].1.as_deref(), got[0].2.clone()),
        (Some("GPU"), vec![1])
    );
    assert_eq!(
        (got[1].1.as_deref(), got[1].2.clone(), got[1].3),
        (Some("CPU"), vec![2], Some(1))
    );
    // Removing it from its old medium does nothing; from its new one, it goes.
    apply(&mut set, None, vec![removed(&[2], Some("GPU"))]);
    assert_eq!(set.len(), 2);
    apply(&mut set, None, vec![removed(&[2], Some("CPU"))]);
    assert_eq!(set.len(), 1);
}

#[test]
fn past_its_bound_or_after_an_unreadable_batch_it_refuses_until_emptied() {
    let mut set = LiveSet::new(2);
    apply(&mut set, None, vec![stored(&[1, 2, 3], None, None)]);
    assert_eq!(set.len(), 2);
    assert!(set.snapshot(0.0).is_none());
    apply(&mut set, None, vec![removed(&[1, 2], None)]);
    assert!(
        set.snapshot(0.0).is_none(),
        "a removal does not make it sure"
    );
    apply(
        &mut set,
        None,
        vec![KvEvent::AllBlocksCleared {
            medium: None,
            extra: vec![],
        }],
    );
    let snap = set.snapshot(0.0).unwrap();
    assert_eq!(snap.len(), 1);
    assert!(snap[0].events.is_empty());
    set.apply(LiveDelta::of_payload(b"\x93not a batch"));
    assert!(set.snapshot(0.0).is_none());
}

#[test]
fn a_large_set_comes_back_in_bounded_parts() {
    let mut set = LiveSet::new(1 << 20);
    for i in 0..3000u64 {
        apply(&mut set, Some(0), vec![stored(&[i * 2 + 1], None, None)]);
    }
    let snap = set.snapshot(0.0).unwrap();
    assert_eq!(snap.len(), 3);
    assert!(snap.iter().all(|b| b.events.len() <= PART_EVENTS));
    assert_eq!(snap.iter().map(|b| b.events.len()).sum::<usize>(), 3000);
}
