//! Property tests: the planner's segments move exactly the bytes a naive per-block copy moves,
//! for random layouts (tensor-major, block-major, padded, several regions) and random block
//! lists.

use std::collections::HashMap;

use kvlink::internal::{plan, PlanOptions};
use kvlink::{KvLayout, RegionId, TensorLayout};
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
