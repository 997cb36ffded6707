//! Tests of `crate::plan`.

use super::*;
use crate::layout::{ModelShape, TensorLayout};

#[test]
fn contiguous_blocks_merge_into_one_segment_per_tensor() {
    let l = ModelShape::LLAMA3_8B.layout(RegionId(0), 64);
    let r = ModelShape::LLAMA3_8B.layout(RegionId(1), 64);
    let ids: Vec<u32> = (10..20).collect();
    let p = plan(&l, &r, &ids, &ids, PlanOptions::default()).unwrap();
    assert_eq!(p.segments.len(), 64);
    assert_eq!(p.pieces, 640);
    assert_eq!(p.bytes, 640 * 32 * 1024);
    // Whole caches, identical on both sides: one segment over all tensors.
    let all: Vec<u32> = (0..64).collect();
    let p = plan(
        &l,
        &r,
        &all,
        &all,
        PlanOptions {
            max_segment_bytes: u64::MAX,
        },
    )
    .unwrap();
    assert_eq!(p.segments.len(), 1);
}

#[test]
fn block_major_layout_merges_across_tensors() {
    // [num_blocks, tensors, block] layout: each block's tensors are adjacent.
    let mk = |region| KvLayout {
        tokens_per_block: 16,
        dtype: "bf16".into(),
        tensors: (0..4)
            .map(|t| TensorLayout {
                name: format!("t{t}"),
                region,
                offset: t * 100,
                block_stride: 400,
                block_bytes: 100,
                num_blocks: 8,
                group: 0,
                heads: None,
                token_runs: None,
            })
            .collect(),
    };
    let p = plan(
        &mk(RegionId(0)),
        &mk(RegionId(1)),
        &[1, 5],
        &[6, 2],
        PlanOptions::default(),
    )
    .unwrap();
    assert_eq!(p.segments.len(), 2);
    assert_eq!(p.segments[0].len, 400);
    assert_eq!(p.segments[0].local_offset, 400);
    assert_eq!(p.segments[0].remote_offset, 2400);
}

#[test]
fn cap_splits_segments() {
    let l = ModelShape::DEEPSEEK_V3_MLA.layout(RegionId(0), 16);
    let ids: Vec<u32> = (0..16).collect();
    let p = plan(
        &l,
        &l,
        &ids,
        &ids,
        PlanOptions {
            max_segment_bytes: 10_000,
        },
    )
    .unwrap();
    assert!(p.segments.iter().all(|s| s.len <= 10_000));
    assert_eq!(p.segments.iter().map(|s| s.len).sum::<u64>(), p.bytes);
}

#[test]
fn bad_block_lists_are_refused() {
    let l = ModelShape::LLAMA3_8B.layout(RegionId(0), 8);
    let o = PlanOptions::default();
    assert!(invalid(plan(&l, &l, &[1, 2], &[1], o), "pair"));
    assert!(invalid(plan(&l, &l, &[8], &[1], o), "local block id 8"));
    assert!(invalid(plan(&l, &l, &[1], &[9], o), "remote block id 9"));
    assert!(invalid(plan(&l, &l, &[3, 3], &[1, 2], o), "twice"));
    // The same remote block read into two local blocks is allowed.
    assert!(plan(&l, &l, &[3, 4], &[1, 1], o).is_ok());
}

/// One tensor of `heads` heads of 4 bytes in `runs` runs, on a rank of TP `size`, in
/// region 0, blocks back to back, in block group `group`.
fn heads_layout(total: u32, runs: u32, size: u32, blocks: u32) -> KvLayout {
    let local = tp::heads_per_rank(total, size).unwrap();
    let bytes = u64::from(runs * local) * 4;
    let mut l = KvLayout::numbered(16, "bf16", [(RegionId(0), 0, bytes, bytes, blocks)]);
    l.tensors[0].heads = Some(crate::layout::HeadSplit { total, local, runs });
    l
}

#[test]
fn a_larger_decode_reads_its_heads_out_of_each_block() {
    // Prefill TP 1 holds 4 heads, head-major; decode rank 1 of 2 holds heads 2 and 3.
    let p = heads_layout(4, 1, 1, 8);
    let d = heads_layout(4, 1, 2, 8);
    let reads = tensor_reads(&d, TpRank::new(1, 2), &p, TpRank::SOLO, 0..1).unwrap();
    assert_eq!(
        reads,
        [TensorRead::Heads {
            local_first: 0,
            remote_first: 2,
            count: 2
        }]
    );
    let plan = plan_read(&d, &p, &reads, &[[3, 4]], &[[6, 7]], PlanOptions::default()).unwrap();
    // Blocks of 16 bytes at the prefill, 8 here: bytes 8..16 of blocks 6 and 7.
    let got: Vec<(u64, u64, u64)> = plan
        .segments
        .iter()
        .map(|s| (s.local_offset, s.remote_offset, s.len))
        .collect();
    assert_eq!(got, [(24, 6 * 16 + 8, 8), (32, 7 * 16 + 8, 8)]);
    assert_eq!(plan.bytes, 16);
    // Token-major blocks: one piece per run (token), here 3 runs.
    let p = heads_layout(4, 3, 1, 8);
    let d = heads_layout(4, 3, 2, 8);
    let reads = tensor_reads(&d, TpRank::new(0, 2), &p, TpRank::SOLO, 0..1).unwrap();
    let plan = plan_read(&d, &p, &reads, &[[0]], &[[1]], PlanOptions::default()).unwrap();
    let got: Vec<(u64, u64, u64)> = plan
        .segments
        .iter()
        .map(|s| (s.local_offset, s.remote_offset, s.len))
        .collect();
    assert_eq!(got, [(0, 48, 8), (8, 64, 8), (16, 80, 8)]);
    assert_eq!(plan.pieces, 3);
}

#[test]
fn a_smaller_decode_gathers_the_prefill_ranks_and_shares_out_whole_tensors() {
    // Decode TP 1 from prefill TP 2: each prefill rank gives its 2 heads.
    let d = heads_layout(4, 1, 1, 4);
    let p = heads_layout(4, 1, 2, 4);
    for (rank, first) in [(0u32, 0u32), (1, 2)] {
        let reads = tensor_reads(&d, TpRank::SOLO, &p, TpRank::new(rank, 2), 0..2).unwrap();
        assert_eq!(
            reads,
            [TensorRead::Heads {
                local_first: first,
                remote_first: 0,
                count: 2
            }]
        );
    }
    // One prefill rank alone does not hold all the heads.
    let r = tensor_reads(&d, TpRank::SOLO, &p, TpRank::new(1, 2), 1..2);
    assert!(invalid(r, "KV head 0"));
    // MLA-like tensors (no heads) are shared out: 4 tensors over 2 sources.
    let mla = ModelShape::DEEPSEEK_V3_MLA.layout(RegionId(0), 4);
    let mut mla4 = mla.clone();
    mla4.tensors.truncate(4);
    let r0 = tensor_reads(&mla4, TpRank::SOLO, &mla4, TpRank::new(0, 2), 0..2).unwrap();
    let r1 = tensor_reads(&mla4, TpRank::SOLO, &mla4, TpRank::new(1, 2), 0..2).unwrap();
    use TensorRead::{Skip, Whole};
    assert_eq!(r0, [Whole, Whole, Skip, Skip]);
    assert_eq!(r1, [Skip, Skip, Whole, Whole]);
    // More prefill ranks than heads: a head two ranks hold comes from the first.
    let d = heads_layout(2, 1, 1, 4);
    let p = heads_layout(2, 1, 4, 4);
    let from: Vec<_> = (0..4)
        .map(|r| tensor_reads(&d, TpRank::SOLO, &p, TpRank::new(r, 4), 0..4).unwrap()[0])
        .collect();
    assert_eq!(
        from,
        [
            TensorRead::Heads {
                local_first: 0,
                remote_first: 0,
                count: 1
            },
            Skip,
            TensorRead::Heads {
                local_first: 1,
                remote_first: 0,
                count: 1
            },
            Skip
        ]
    );
}

#[test]
fn block_groups_pair_their_own_block_lists() {
    // Tensor 0 in group 0, tensor 1 in group 1, block-major in one region.
    let mk = |region| {
        let mut l = KvLayout::numbered(
            16,
            "bf16",
            [
                (RegionId(region), 0, 200, 100, 8),
                (RegionId(region), 100, 200, 100, 8),
            ],
        );
        l.tensors[1].group = 1;
        l
    };
    let (l, r) = (mk(0), mk(1));
    assert_eq!(l.num_groups(), 2);
    let reads = whole_reads(&l, &r).unwrap();
    let p = plan_read(
        &l,
        &r,
        &reads,
        &[vec![1], vec![2]],
        &[vec![5], vec![6]],
        PlanOptions::default(),
    )
    .unwrap();
    let got: Vec<(u64, u64)> = p
        .segments
        .iter()
        .map(|s| (s.local_offset, s.remote_offset))
        .collect();
    // Not fused across groups: each tensor with its own group's blocks.
    assert_eq!(got, [(200, 1000), (500, 1300)]);
    assert_eq!(p.blocks, 2);
    let e = plan_read(
        &l,
        &r,
        &reads,
        &[vec![1]],
        &[vec![5]],
        PlanOptions::default(),
    );
    assert!(invalid(e, "2 block groups"));
    let e = plan_read(
        &l,
        &r,
        &reads,
        &[vec![1], vec![8]],
        &[vec![5], vec![6]],
        PlanOptions::default(),
    );
    assert!(invalid(e, "block group 1: local block id 8"));
    // The same block id in two groups is fine; twice in one group is not.
    assert!(plan_read(
        &l,
        &r,
        &reads,
        &[vec![1], vec![1]],
        &[vec![5], vec![6]],
        PlanOptions::default()
    )
    .is_ok());
}

/// Whether `r` is an invalid argument whose message names `what`.
fn invalid<T: std::fmt::Debug>(r: Result<T>, what: &str) -> bool {
    matches!(&r, Err(Error::InvalidArgument(m)) if m.contains(what))
}
