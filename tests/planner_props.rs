//! Property tests: the planner's segments move exactly the bytes a naive per-block copy moves,
//! for random layouts (tensor-major, block-major, padded, several regions) and random block
//! lists; and between TP groups of different sizes, exactly the bytes a naive per-head copy
//! moves, for random head arrangements, whole (MLA-like) tensors and block groups.

use std::collections::HashMap;

use kvlink::internal::{
    heads, heads_per_rank, plan, plan_read, plan_read_from, sources, tensor_reads, PlanOptions,
};
use kvlink::{HeadSplit, KvLayout, RegionId, TensorLayout, TpRank};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Side {
    layout: KvLayout,
    region_lens: HashMap<RegionId, u64>,
}

/// Builds a layout for `bytes` (block bytes per tensor) with the given arrangement.
fn build(bytes: &[u64], num_blocks: u32, mode: u8, pad: u64, base_region: u32) -> Side {
    let mut tensors = Vec::new();
    let mut region_lens: HashMap<RegionId, u64> = HashMap::new();
    let total: u64 = bytes.iter().sum();
    let mut cursor = 0u64;
    for (t, &b) in bytes.iter().enumerate() {
        let (region, offset, stride) = match mode {
            // Tensor-major: each tensor an array of blocks, one after the other.
            0 => {
                let o = cursor;
                cursor += (b + pad) * u64::from(num_blocks);
                (RegionId(base_region), o, b + pad)
            }
            // Block-major: all tensors of a block side by side.
            1 => {
                let o = cursor;
                cursor += b;
                (RegionId(base_region), o, total + pad)
            }
            // Two regions, tensors alternating between them.
            _ => {
                let r = RegionId(base_region + (t as u32 % 2));
                let o = *region_lens.get(&r).unwrap_or(&0);
                (r, o, b + pad)
            }
        };
        let end = offset + stride * u64::from(num_blocks);
        let e = region_lens.entry(region).or_insert(0);
        *e = (*e).max(end);
        tensors.push(TensorLayout {
            name: format!("t{t}"),
            region,
            offset,
            block_stride: stride,
            block_bytes: b,
            num_blocks,
            group: 0,
            heads: None,
            token_runs: None,
        });
    }
    Side {
        layout: KvLayout {
            tokens_per_block: 16,
            dtype: "x".into(),
            tensors,
        },
        region_lens,
    }
}

fn memory(side: &Side, seed: u8) -> HashMap<RegionId, Vec<u8>> {
    side.region_lens
        .iter()
        .map(|(&r, &len)| {
            let v = (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ r.0 as u8))
                .collect();
            (r, v)
        })
        .collect()
}

/// (block bytes per tensor, local blocks, remote blocks, local mode, remote mode, local pad,
/// remote pad, block pairs, segment cap)
type Case = (Vec<u64>, u32, u32, u8, u8, u64, u64, Vec<(u32, u32)>, u64);

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(1u64..48, 1..6),
        2u32..24,
        2u32..24,
        0u8..3,
        0u8..3,
        0u64..3,
        0u64..3,
    )
        .prop_flat_map(|(bytes, ln, rn, lm, rm, lp, rp)| {
            let pairs = prop::collection::vec((0..ln, 0..rn), 0..(ln as usize));
            (
                Just(bytes),
                Just(ln),
                Just(rn),
                Just(lm),
                Just(rm),
                Just(lp),
                Just(rp),
                pairs,
                1u64..200,
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn plan_matches_naive_copy((bytes, ln, rn, lm, rm, lp, rp, mut pairs, cap) in case()) {
        // Local destinations must be unique; keep the first of each.
        let mut seen = std::collections::HashSet::new();
        pairs.retain(|p| seen.insert(p.0));
        let local = build(&bytes, ln, lm, lp, 0);
        let remote = build(&bytes, rn, rm, rp, 10);
        let lb: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        let rb: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        let p = plan(&local.layout, &remote.layout, &lb, &rb,
            PlanOptions { max_segment_bytes: cap }).unwrap();

        let src = memory(&remote, 7);
        let mut want = memory(&local, 99);
        let mut got = want.clone();
        for (t, (lt, rt)) in local.layout.tensors.iter().zip(&remote.layout.tensors).enumerate() {
            for &(l, r) in &pairs {
                let lo = (lt.offset + u64::from(l) * lt.block_stride) as usize;
                let ro = (rt.offset + u64::from(r) * rt.block_stride) as usize;
                let n = bytes[t] as usize;
                let s = src[&rt.region][ro..ro + n].to_vec();
                want.get_mut(&lt.region).unwrap()[lo..lo + n].copy_from_slice(&s);
            }
        }
        let mut total = 0;
        for s in &p.segments {
            prop_assert!(s.len > 0 && s.len <= cap);
            let (lo, ro, n) = (s.local_offset as usize, s.remote_offset as usize, s.len as usize);
            let chunk = src[&s.remote_region][ro..ro + n].to_vec();
            got.get_mut(&s.local_region).unwrap()[lo..lo + n].copy_from_slice(&chunk);
            total += s.len;
        }
        prop_assert_eq!(total, p.bytes);
        prop_assert_eq!(p.pieces, pairs.len() * bytes.len());
        prop_assert!(p.segments.len() <= p.pieces.max(1) * (48 / cap as usize + 1));
        prop_assert!(got == want, "planned copy differs from naive copy");
    }
}

/// One tensor of a model for the TP property test: heads (total, runs, bytes per head) split
/// over ranks, or a whole tensor of the given bytes per block every rank holds; and its block
/// group.
#[derive(Debug, Clone)]
struct ModelTensor {
    heads: Option<(u32, u32, u64)>,
    whole_bytes: u64,
    group: u32,
}

/// Rank `tp` of a model's layout: one region, tensors one after the other, `pad` bytes after
/// every block.
fn rank_layout(model: &[ModelTensor], tp: TpRank, num_blocks: u32, pad: u64) -> (KvLayout, u64) {
    let mut tensors = Vec::new();
    let mut cursor = 0u64;
    for (i, m) in model.iter().enumerate() {
        let (bytes, heads) = match m.heads {
            Some((total, runs, hb)) => {
                let local = heads_per_rank(total, tp.size).unwrap();
                (
                    u64::from(runs * local) * hb,
                    Some(HeadSplit { total, local, runs }),
                )
            }
            None => (m.whole_bytes, None),
        };
        tensors.push(TensorLayout {
            name: format!("t{i}"),
            region: RegionId(0),
            offset: cursor,
            block_stride: bytes + pad,
            block_bytes: bytes,
            num_blocks,
            group: m.group,
            heads,
            token_runs: None,
        });
        cursor += (bytes + pad) * u64::from(num_blocks);
    }
    let layout = KvLayout {
        tokens_per_block: 16,
        dtype: "x".into(),
        tensors,
    };
    (layout, cursor)
}

/// The byte `i` of head `g` (global) in run `k` of block `b` of tensor `t`: the same on every
/// rank that holds the head. Never 255, the decode's untouched fill.
fn model_byte(t: usize, b: u32, k: u32, g: u32, i: u64) -> u8 {
    let x =
        (t as u64 * 131 + u64::from(b) * 31 + u64::from(k) * 7 + u64::from(g) * 17 + i * 3) % 255;
    x as u8
}

/// A rank's memory filled by the model.
fn rank_memory(model: &[ModelTensor], layout: &KvLayout, tp: TpRank, len: u64) -> Vec<u8> {
    let mut mem = vec![255u8; len as usize];
    for (t, (m, lt)) in model.iter().zip(&layout.tensors).enumerate() {
        for b in 0..lt.num_blocks {
            let base = lt.offset + u64::from(b) * lt.block_stride;
            match (m.heads, lt.heads) {
                (Some((total, runs, hb)), Some(split)) => {
                    let first = heads(tp, total).start;
                    for k in 0..runs {
                        for j in 0..split.local {
                            for i in 0..hb {
                                let at = base + (u64::from(k * split.local + j)) * hb + i;
                                mem[at as usize] = model_byte(t, b, k, first + j, i);
                            }
                        }
                    }
                }
                _ => {
                    for i in 0..lt.block_bytes {
                        mem[(base + i) as usize] = model_byte(t, b, 0, 0, i);
                    }
                }
            }
        }
    }
    mem
}

fn model() -> impl Strategy<Value = Vec<ModelTensor>> {
    let tensor = (
        any::<bool>(),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        1u32..4,
        1u64..6,
        1u64..20,
    )
        .prop_map(|(h, total, runs, hb, whole)| ModelTensor {
            heads: h.then_some((total, runs, hb)),
            whole_bytes: whole,
            group: 0,
        });
    (prop::collection::vec(tensor, 1..5), 1u32..4).prop_map(|(mut ts, groups)| {
        let groups = groups.min(ts.len() as u32);
        for (i, t) in ts.iter_mut().enumerate() {
            t.group = i as u32 % groups;
        }
        ts
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// A decode rank of one TP size reading from a prefill of another (either larger) gets,
    /// in every requested block, exactly the bytes a naive copy head by head puts there (and
    /// nothing anywhere else): the plans of all the prefill ranks it reads together.
    #[test]
    fn head_sliced_reads_match_a_naive_per_head_copy(
        model in model(),
        sizes in (0u32..4, 0u32..4),
        decode_rank in 0u32..8,
        blocks in (2u32..10, 2u32..10),
        pads in (0u64..3, 0u64..3),
        pairs in prop::collection::vec(prop::collection::vec((0u32..10, 0u32..10), 0..6), 3),
        cap in 1u64..64,
    ) {
        let (p_size, d_size) = (1u32 << sizes.0, 1u32 << sizes.1);
        let decode = TpRank::new(decode_rank % d_size, d_size);
        let (dl, dlen) = rank_layout(&model, decode, blocks.1, pads.1);
        let groups = dl.num_groups();
        // Per group: unique local blocks, in range on both sides.
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for group in pairs.iter().take(groups) {
            let mut seen = std::collections::HashSet::new();
            let ps: Vec<(u32, u32)> = group
                .iter()
                .map(|&(l, r)| (l % blocks.1, r % blocks.0))
                .filter(|p| seen.insert(p.0))
                .collect();
            local.push(ps.iter().map(|p| p.0).collect::<Vec<_>>());
            remote.push(ps.iter().map(|p| p.1).collect::<Vec<_>>());
        }
        let mut got = vec![255u8; dlen as usize];
        let mut moved = 0;
        let sources = sources(decode, p_size).unwrap();
        for p in sources.clone() {
            let at = TpRank::new(p, p_size);
            let (pl, plen) = rank_layout(&model, at, blocks.0, pads.0);
            let mem = rank_memory(&model, &pl, at, plen);
            let reads = tensor_reads(&dl, decode, &pl, at, sources.clone()).unwrap();
            let plan = plan_read(&dl, &pl, &reads, &local, &remote,
                PlanOptions { max_segment_bytes: cap }).unwrap();
            for s in &plan.segments {
                prop_assert!(s.len > 0 && s.len <= cap);
                let (lo, ro, n) = (s.local_offset as usize, s.remote_offset as usize, s.len as usize);
                got[lo..lo + n].copy_from_slice(&mem[ro..ro + n]);
            }
            moved += plan.bytes;
        }
        // The naive copy: every head of every tensor of every requested block, one by one.
        let mut want = vec![255u8; dlen as usize];
        let mut needed = 0;
        for (t, (m, lt)) in model.iter().zip(&dl.tensors).enumerate() {
            let g = lt.group as usize;
            for (&lb, &rb) in local[g].iter().zip(&remote[g]) {
                let base = lt.offset + u64::from(lb) * lt.block_stride;
                needed += lt.block_bytes;
                match (m.heads, lt.heads) {
                    (Some((total, runs, hb)), Some(split)) => {
                        let first = heads(decode, total).start;
                        for k in 0..runs {
                            for j in 0..split.local {
                                for i in 0..hb {
                                    let at = base + u64::from(k * split.local + j) * hb + i;
                                    want[at as usize] = model_byte(t, rb, k, first + j, i);
                                }
                            }
                        }
                    }
                    _ => {
                        for i in 0..lt.block_bytes {
                            want[(base + i) as usize] = model_byte(t, rb, 0, 0, i);
                        }
                    }
                }
            }
        }
        prop_assert_eq!(moved, needed, "bytes moved vs bytes the blocks hold");
        prop_assert!(got == want, "planned copy differs from the naive per-head copy");
    }
}

/// One tensor of a model for the block-size property test: `parts` stretches of tokens,
/// `heads` KV heads over all ranks (0: none, every rank holds the tensor whole) of `hb` bytes
/// per token, head-major or token-major.
#[derive(Debug, Clone, Copy)]
struct TokenTensor {
    parts: u32,
    heads: u32,
    head_major: bool,
    hb: u64,
}

impl TokenTensor {
    /// Heads in a block of rank `tp` (1 without heads).
    fn local(&self, tp: TpRank) -> u32 {
        if self.heads == 0 {
            1
        } else {
            heads_per_rank(self.heads, tp.size).unwrap()
        }
    }

    /// Where byte `i` of local head `j` of token `s` of part `k` lies in a block of `n` tokens
    /// holding `h` heads.
    fn at(&self, n: u64, h: u64, k: u32, s: u64, j: u32, i: u64) -> u64 {
        let (k, j) = (u64::from(k), u64::from(j));
        if self.head_major {
            ((k * h + j) * n + s) * self.hb + i
        } else {
            ((k * n + s) * h + j) * self.hb + i
        }
    }
}

/// The byte `i` of global head `g`, part `k`, of the token at position `pos` of the read, in
/// tensor `t`. Never 255, the decode's untouched fill.
fn token_byte(t: usize, pos: u64, k: u32, g: u32, i: u64) -> u8 {
    ((t as u64 * 131 + pos * 31 + u64::from(k) * 7 + u64::from(g) * 17 + i * 3) % 255) as u8
}

/// Rank `tp`'s layout of the model with blocks of `tokens` tokens, tensors one after the other.
fn token_layout(model: &[TokenTensor], tp: TpRank, tokens: u32, blocks: u32) -> (KvLayout, u64) {
    let mut tensors = Vec::new();
    let mut cursor = 0;
    for (i, m) in model.iter().enumerate() {
        let h = m.local(tp);
        let bytes = u64::from(m.parts * h * tokens) * m.hb;
        let heads = (m.heads > 0).then_some(HeadSplit {
            total: m.heads,
            local: h,
            runs: if m.head_major {
                m.parts
            } else {
                m.parts * tokens
            },
        });
        let token_runs = if m.head_major && m.heads > 0 {
            m.parts * h
        } else {
            m.parts
        };
        tensors.push(TensorLayout {
            name: format!("t{i}"),
            region: RegionId(0),
            offset: cursor,
            block_stride: bytes,
            block_bytes: bytes,
            num_blocks: blocks,
            group: 0,
            heads,
            token_runs: Some(token_runs),
        });
        cursor += bytes * u64::from(blocks);
    }
    let layout = KvLayout {
        tokens_per_block: tokens,
        dtype: "x".into(),
        tensors,
    };
    (layout, cursor)
}

/// Writes, for every token `pos` in `0..count` of the run the blocks `list` hold from token
/// `first` of the first block on, the model's bytes of the heads rank `tp` holds.
fn write_tokens(
    mem: &mut [u8],
    model: &[TokenTensor],
    layout: &KvLayout,
    tp: TpRank,
    list: &[u32],
    first: u64,
    count: u64,
) {
    let n = u64::from(layout.tokens_per_block);
    for (t, (m, lt)) in model.iter().zip(&layout.tensors).enumerate() {
        let h = m.local(tp);
        let g0 = if m.heads == 0 {
            0
        } else {
            heads(tp, m.heads).start
        };
        for pos in 0..count {
            let q = pos + first;
            let base = lt.offset + u64::from(list[(q / n) as usize]) * lt.block_stride;
            for k in 0..m.parts {
                for j in 0..h {
                    for i in 0..m.hb {
                        let at = base + m.at(n, u64::from(h), k, q % n, j, i);
                        mem[at as usize] = token_byte(t, pos, k, g0 + j, i);
                    }
                }
            }
        }
    }
}

fn token_model() -> impl Strategy<Value = Vec<TokenTensor>> {
    let tensor = (
        1u32..3,
        prop::sample::select(vec![0u32, 1, 2, 4, 8]),
        any::<bool>(),
        1u64..5,
    )
        .prop_map(|(parts, heads, head_major, hb)| TokenTensor {
            parts,
            heads,
            head_major,
            hb,
        });
    prop::collection::vec(tensor, 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// A decode whose blocks hold more or fewer tokens than the prefill's (one a multiple of
    /// the other, either side the larger, from any token of the first block of the larger
    /// size), of the same or another TP size: every token it reads lands
    /// at its own position in the decode's blocks, head by head, and nothing else is written.
    #[test]
    fn reads_between_block_sizes_move_every_token_to_its_place(
        model in token_model(),
        sizes in (0u32..3, 0u32..3),
        decode_rank in 0u32..4,
        (small, ratio, decode_small) in (prop::sample::select(vec![1u32, 2, 4]),
            prop::sample::select(vec![1u32, 2, 4]), any::<bool>()),
        units in 0u64..12,
        skip in 0u32..4,
        order in Just(()).prop_perturb(|_, mut rng| {
            let mut ids: Vec<u32> = (0..16).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.random_range(0..=i));
            }
            ids
        }),
        cap in 1u64..64,
    ) {
        let large = small * ratio;
        let (dt, pt) = if decode_small { (small, large) } else { (large, small) };
        let skip = skip % ratio;
        let first_token = skip * small;
        let (p_size, d_size) = (1u32 << sizes.0, 1u32 << sizes.1);
        let decode = TpRank::new(decode_rank % d_size, d_size);
        let (dl, dlen) = token_layout(&model, decode, dt, 16);
        // The run of tokens read: `units` blocks of the smaller size.
        let count = units * u64::from(small);
        let blocks = |tokens: u32, first: u64| (first + count).div_ceil(u64::from(tokens)) as usize;
        // The side with the larger blocks may start inside its first one.
        let (lfirst, rfirst) = if decode_small { (0, first_token) } else { (first_token, 0) };
        let local: Vec<u32> = order[..blocks(dt, u64::from(lfirst))].to_vec();
        let remote: Vec<u32> = order[16 - blocks(pt, u64::from(rfirst))..].to_vec();
        let mut got = vec![255u8; dlen as usize];
        let mut moved = 0;
        let sources = sources(decode, p_size).unwrap();
        for p in sources.clone() {
            let at = TpRank::new(p, p_size);
            let (pl, plen) = token_layout(&model, at, pt, 16);
            // The prefill's blocks, every token of them, the run's tokens at their positions.
            let mut mem: Vec<u8> = (0..plen).map(|i| (i % 251) as u8).collect();
            write_tokens(&mut mem, &model, &pl, at, &remote, u64::from(rfirst), count);
            let reads = tensor_reads(&dl, decode, &pl, at, sources.clone()).unwrap();
            let plan = plan_read_from(&dl, &pl, &reads, &[&local], &[&remote], &[first_token],
                PlanOptions { max_segment_bytes: cap }).unwrap();
            for s in &plan.segments {
                prop_assert!(s.len > 0 && s.len <= cap);
                let (lo, ro, n) = (s.local_offset as usize, s.remote_offset as usize, s.len as usize);
                got[lo..lo + n].copy_from_slice(&mem[ro..ro + n]);
            }
            moved += plan.bytes;
        }
        let mut want = vec![255u8; dlen as usize];
        write_tokens(&mut want, &model, &dl, decode, &local, u64::from(lfirst), count);
        let needed: u64 = model
            .iter()
            .map(|m| count * u64::from(m.parts * m.local(decode)) * m.hb)
            .sum();
        prop_assert_eq!(moved, needed, "bytes moved vs bytes of the tokens read");
        prop_assert!(got == want, "planned copy differs from the token-by-token copy");
    }
}
