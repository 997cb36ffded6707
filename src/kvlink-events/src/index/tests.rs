//! Tests of `crate::index`.

use super::*;
use crate::wire::{BlockRemoved, BlockStored, BlockTransferred};

const BS: u32 = 4;

fn toks(n: usize, from: u32) -> Vec<u32> {
    (from..from + n as u32).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| BlockHash::U64(*h)).collect(),
        parent_block_hash: parent.map(BlockHash::U64),
        token_ids: tokens.to_vec(),
        block_size: BS,
        ..Default::default()
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash::U64(*h)).collect(),
        ..Default::default()
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
    }
}

fn item(events: Vec<KvEvent>) -> SubItem {
    SubItem::Batch {
        seq: Some(0),
        batch: batch(events),
        skipped: Vec::new(),
        raw: Default::default(),
        topic: Default::default(),
        encoding: Default::default(),
    }
}

/// (engine, blocks, tokens, state) of each match.
fn summary(o: &Overlap) -> Vec<(String, usize, u64, HolderState)> {
    o.matches
        .iter()
        .map(|m| (m.holder.engine.clone(), m.blocks, m.tokens, m.state))
        .collect()
}

/// Engine `e` stores the 3 blocks [1, 2, 3] of tokens 0..12, in two events (parent chained).
fn three_blocks(ix: &mut Index, e: &str) {
    let t = toks(12, 0);
    ix.apply_item(e, &item(vec![stored(&[1, 2], None, &t[..8])]));
    ix.apply_item(e, &item(vec![stored(&[3], Some(2), &t[8..])]));
}

#[test]
fn the_longest_prefix_wins_by_engine_hashes_and_by_tokens() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    ix.apply_item("b", &item(vec![stored(&[1], None, &toks(4, 0))]));
    let by_hash = ix.overlap_hashes(&[1, 2, 3, 4]);
    let want = vec![
        ("a".to_string(), 3, 12, HolderState::Exact),
        ("b".to_string(), 1, 4, HolderState::Exact),
    ];
    assert_eq!(summary(&by_hash), want);
    assert_eq!(by_hash.best().unwrap().holder.engine, "a");
    // The same prompt as tokens (a partial last block is not looked up).
    let by_tokens = ix.overlap_tokens(&toks(14, 0), BS, &Salt::default());
    assert_eq!(summary(&by_tokens), want);
    // Another prompt shares only the first block.
    let mut other = toks(12, 0);
    other[5] = 999;
    let o = ix.overlap_tokens(&other, BS, &Salt::default());
    assert_eq!(
        o.matches.iter().map(|m| m.blocks).collect::<Vec<_>>(),
        [1, 1]
    );
    assert!(ix
        .overlap_tokens(&toks(12, 0), 8, &Salt::default())
        .matches
        .is_empty());
    assert!(
        ix.overlap_hashes(&[2, 3]).best().is_some(),
        "engine hashes need no root"
    );
}

#[test]
fn a_removed_block_ends_the_match_there() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    ix.apply_item("a", &item(vec![removed(&[2, 77])]));
    assert_eq!(summary(&ix.overlap_hashes(&[1, 2, 3]))[0].1, 1);
    assert_eq!(ix.stats().unknown_removed, 1);
    assert_eq!((ix.stats().stored, ix.stats().removed), (3, 1));
}

#[test]
fn a_restart_drops_what_the_old_process_held() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    three_blocks(&mut ix, "b");
    ix.apply_item(
        "a",
        &SubItem::Resync(Resync::PublisherRestart { last: 9, now: 0 }),
    );
    let o = ix.overlap_hashes(&[1, 2, 3]);
    assert_eq!(
        summary(&o),
        vec![("b".to_string(), 3, 12, HolderState::Exact)]
    );
    // The new process stores again: it counts.
    ix.apply_item("a", &item(vec![stored(&[1], None, &toks(4, 0))]));
    assert_eq!(ix.overlap_hashes(&[1, 2]).matches.len(), 2);
    assert_eq!(ix.stats().restarts, 1);
}

#[test]
fn lost_history_withholds_the_old_blocks_until_removed_or_stored_again() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    let lost = Resync::HistoryLost {
        from: 3,
        resumed: 7,
    };
    ix.apply_item("a", &SubItem::Resync(lost));
    assert!(
        ix.overlap_hashes(&[1, 2, 3]).matches.is_empty(),
        "nothing vouched for"
    );
    assert_eq!(ix.holders()[0].1, HolderState::Recovering);
    assert_eq!(ix.holders()[0].3, 3, "three withheld");
    // Stored since the loss: counts (the chain still finds its parent's token hash).
    ix.apply_item("a", &item(vec![stored(&[1], None, &toks(4, 0))]));
    let o = ix.overlap_hashes(&[1, 2, 3]);
    assert_eq!(
        summary(&o),
        vec![("a".to_string(), 1, 4, HolderState::Recovering)]
    );
    // The rest removed: nothing is withheld, but stores may have been lost with the
    // history: still a lower bound, until a clear.
    ix.apply_item("a", &item(vec![removed(&[2, 3])]));
    assert_eq!(ix.holders()[0].3, 0);
    assert_eq!(ix.holders()[0].1, HolderState::Recovering);
    ix.apply_item("a", &item(vec![KvEvent::all_cleared(None)]));
    assert_eq!(ix.holders()[0].1, HolderState::Exact);
    // A holder the engine gets after a loss is partial too (its rank's stores may be lost).
    ix.lose("a");
    let mut b = batch(vec![stored(&[40], None, &toks(4, 0))]);
    b.dp_rank = Some(5);
    ix.apply_batch("a", &b);
    let r5 = ix.holders().into_iter().find(|h| h.0.dp_rank == 5).unwrap();
    assert_eq!(r5.1, HolderState::Recovering);
    // An unreadable batch and a batch with skipped events are losses too.
    ix.apply_item(
        "a",
        &SubItem::Malformed {
            seq: Some(9),
            reason: crate::BatchError::NotAnArray,
        },
    );
    assert_eq!(ix.holders()[0].1, HolderState::Recovering);
    assert_eq!(ix.stats().losses, 3);
}

#[test]
fn a_gap_filled_by_replay_changes_nothing_and_a_clear_makes_it_exact() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    ix.apply_item(
        "a",
        &SubItem::GapFilled {
            from: 2,
            through: 5,
        },
    );
    assert_eq!(ix.overlap_hashes(&[1, 2, 3]).matches[0].blocks, 3);
    ix.lose("a");
    ix.apply_item("a", &item(vec![KvEvent::all_cleared(None)]));
    assert_eq!(ix.holders()[0].1, HolderState::Exact);
    assert_eq!(ix.holders()[0].2, 0);
    assert!(ix.overlap_hashes(&[1]).matches.is_empty());
}

#[test]
fn dp_ranks_media_groups_and_lora_are_kept_apart() {
    let mut ix = Index::default();
    let mut b = batch(vec![stored(&[1, 2], None, &toks(8, 0))]);
    b.dp_rank = Some(1);
    ix.apply_batch("a", &b);
    let KvEvent::BlockStored(mut cpu) = stored(&[1], None, &toks(4, 0)) else {
        unreachable!()
    };
    cpu.medium = Some("CPU".into());
    let mut lora = cpu.clone();
    lora.medium = None;
    lora.group_idx = Some(1);
    lora.lora_name = Some("adapter".into());
    lora.block_hashes = vec![BlockHash::U64(50)];
    ix.apply_batch(
        "a",
        &batch(vec![KvEvent::BlockStored(cpu), KvEvent::BlockStored(lora)]),
    );
    let o = ix.overlap_hashes(&[1, 2]);
    let keys: Vec<(i64, &str, usize)> = o
        .matches
        .iter()
        .map(|m| (m.holder.dp_rank, m.holder.medium.as_str(), m.blocks))
        .collect();
    assert_eq!(keys, [(1, "GPU", 2), (0, "CPU", 1)]);
    // A removal on the GPU tier of rank 0 touches neither.
    ix.apply_item("a", &item(vec![removed(&[1])]));
    assert_eq!(ix.overlap_hashes(&[1, 2]).matches.len(), 2);
    // The adapter's blocks match only a query with the adapter.
    let plain = ix.overlap_tokens(&toks(4, 0), BS, &Salt::default());
    assert_eq!(plain.matches.len(), 2, "rank 1 and the CPU tier");
    let salt = Salt {
        lora_name: Some("adapter".into()),
        ..Salt::default()
    };
    let with = ix.overlap_tokens(&toks(4, 0), BS, &salt);
    assert_eq!(summary(&with)[0].0, "a");
    assert_eq!((with.matches.len(), with.matches[0].holder.group), (1, 1));
}

#[test]
fn a_block_moved_between_tiers_keeps_its_trust() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    let moved = |hashes: &[u64]| {
        KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: hashes.iter().map(|h| BlockHash::U64(*h)).collect(),
            from_medium: Some("GPU".into()),
            to_medium: Some("CPU".into()),
            ..Default::default()
        })
    };
    ix.apply_item("a", &item(vec![moved(&[1])]));
    let media: Vec<(String, usize)> = ix
        .overlap_hashes(&[1])
        .matches
        .iter()
        .map(|m| (m.holder.medium.clone(), m.blocks))
        .collect();
    assert_eq!(media, [("CPU".to_string(), 1)]);
    ix.lose("a");
    ix.apply_item("a", &item(vec![moved(&[2])]));
    let cpu = ix
        .holders()
        .into_iter()
        .find(|h| h.0.medium == "CPU")
        .unwrap();
    assert_eq!(
        (cpu.1, cpu.3),
        (HolderState::Recovering, 2),
        "withheld where it went"
    );
    assert!(ix.overlap_hashes(&[2]).matches.is_empty());
}

#[test]
fn a_stale_stream_counts_for_nothing_and_comes_back_recovering() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    ix.set_stale("a", true);
    assert!(ix.overlap_hashes(&[1]).matches.is_empty());
    assert_eq!(ix.holders()[0].1, HolderState::Stale);
    ix.set_stale("a", false);
    assert_eq!(ix.holders()[0].1, HolderState::Recovering);
    ix.remove_engine("a");
    assert!(ix.holders().is_empty());
    assert_eq!(ix.stats().blocks, 0);
    three_blocks(&mut ix, "c");
    assert_eq!(ix.stats().holders, 1, "the freed holder is reused");
}

#[test]
fn hostile_streams_are_counted_and_bounded() {
    let mut ix = Index::new(IndexConfig {
        max_blocks: 4,
        max_holders: 2,
    });
    // An unknown parent: kept for removals and engine-hash queries, no token hash.
    ix.apply_item("a", &item(vec![stored(&[10, 11], Some(999), &toks(8, 0))]));
    assert_eq!(ix.stats().unknown_parent, 1);
    assert!(ix
        .overlap_tokens(&toks(8, 0), BS, &Salt::default())
        .matches
        .is_empty());
    assert_eq!(
        ix.overlap_hashes(&[10, 11]).matches[0].tokens,
        8,
        "block_size x blocks"
    );
    // Tokens that do not fit the blocks: no token hash.
    ix.apply_item("a", &item(vec![stored(&[12], None, &toks(9, 0))]));
    assert!(ix
        .overlap_tokens(&toks(4, 0), BS, &Salt::default())
        .matches
        .is_empty());
    // The block limit: 3 held, 2 more offered, 1 taken.
    ix.apply_item("a", &item(vec![stored(&[13, 14], None, &toks(8, 0))]));
    assert_eq!((ix.stats().blocks, ix.stats().dropped), (4, 1));
    // The holder limit: a third holder's stores are dropped.
    let mut b = batch(vec![stored(&[20], None, &toks(4, 0))]);
    b.dp_rank = Some(7);
    ix.apply_batch("a", &b);
    b.dp_rank = Some(8);
    ix.apply_batch("a", &b);
    assert_eq!(ix.stats().holders, 2);
    assert_eq!(ix.stats().dropped, 3);
    // Zero block size and no hashes are harmless.
    let KvEvent::BlockStored(mut odd) = stored(&[], None, &[]) else {
        unreachable!()
    };
    odd.block_size = 0;
    ix.apply_batch("a", &batch(vec![KvEvent::BlockStored(odd)]));
    assert!(ix
        .overlap_tokens(&[], 0, &Salt::default())
        .matches
        .is_empty());
}

#[test]
fn fixed_size_pages_from_the_page_splitter_are_indexed_by_tokens() {
    let splitter = crate::PageSplitter::new(BS, crate::PageHash::SglangI64);
    let run = toks(10, 100);
    let pages = splitter.split(None, &run, 0, Some("GPU"));
    let mut ix = Index::default();
    let events = pages.events.into_iter().map(KvEvent::BlockStored).collect();
    ix.apply_item("sglang", &item(events));
    let o = ix.overlap_tokens(&run, BS, &Salt::default());
    assert_eq!(
        summary(&o),
        vec![("sglang".to_string(), 2, 8, HolderState::Exact)]
    );
}

#[test]
fn many_holders_stored_in_any_order_match_what_each_holds() {
    // Engine e holds the first len[e] blocks of one chain; stores arrive interleaved in a
    // scrambled engine order, so each block's holder list is built out of order.
    let lens: Vec<usize> = (0..24).map(|e| (e * 7) % 11 + 1).collect();
    let order: Vec<usize> = (0..24).map(|i| (i * 5 + 3) % 24).collect();
    let t = toks(11 * BS as usize, 0);
    let mut ix = Index::default();
    for b in 0..11usize {
        for &e in &order {
            if b < lens[e] {
                let parent = (b > 0).then_some(b as u64);
                let span = &t[b * BS as usize..(b + 1) * BS as usize];
                ix.apply_item(
                    &format!("e{e:02}"),
                    &item(vec![stored(&[b as u64 + 1], parent, span)]),
                );
            }
        }
    }
    let o = ix.overlap_tokens(&t, BS, &Salt::default());
    let mut want: Vec<(String, usize)> = lens
        .iter()
        .enumerate()
        .map(|(e, n)| (format!("e{e:02}"), *n))
        .collect();
    want.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let got: Vec<(String, usize)> = o
        .matches
        .iter()
        .map(|m| (m.holder.engine.clone(), m.blocks))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        ix.overlap_hashes(&(1..=11).collect::<Vec<u64>>())
            .matches
            .len(),
        24
    );
}

#[test]
fn clearing_one_holder_leaves_the_others_blocks_whole_in_both_maps() {
    let mut ix = Index::default();
    three_blocks(&mut ix, "a");
    three_blocks(&mut ix, "b");
    ix.apply_item("c", &item(vec![stored(&[9], None, &toks(4, 100))]));
    ix.apply_item(
        "a",
        &item(vec![KvEvent::AllBlocksCleared {
            medium: None,
            extra: Default::default(),
        }]),
    );
    let b_only = vec![("b".to_string(), 3, 12, HolderState::Exact)];
    assert_eq!(summary(&ix.overlap_hashes(&[1, 2, 3])), b_only);
    assert_eq!(
        summary(&ix.overlap_tokens(&toks(12, 0), BS, &Salt::default())),
        b_only
    );
    assert_eq!(ix.stats().blocks, 4);
    let held: Vec<(String, usize)> = ix
        .holders()
        .into_iter()
        .map(|(k, _, n, _)| (k.engine, n))
        .collect();
    assert_eq!(held, [("a".into(), 0), ("b".into(), 3), ("c".into(), 1)]);
    let dump: Vec<(String, Vec<u64>)> = ix
        .dump()
        .into_iter()
        .map(|(k, _, blocks)| (k.engine, blocks))
        .collect();
    assert_eq!(
        dump,
        [
            ("a".into(), vec![]),
            ("b".into(), vec![1, 2, 3]),
            ("c".into(), vec![9])
        ]
    );
    // Removing what a no longer holds is counted, and leaves b's blocks alone.
    ix.apply_item("a", &item(vec![removed(&[1, 2])]));
    assert_eq!(ix.stats().unknown_removed, 2);
    assert_eq!(summary(&ix.overlap_hashes(&[1, 2, 3])), b_only);
    // a stores again: both count.
    three_blocks(&mut ix, "a");
    assert_eq!(
        ix.overlap_tokens(&toks(12, 0), BS, &Salt::default())
            .matches
            .len(),
        2
    );
}
