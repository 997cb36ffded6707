//! A soak engine's KV cache: a small model's layout over host memory, with the pattern of a
//! hold's seed written into its blocks and checked in the reader's.

use std::sync::Arc;

use kvlink::verify::{check_read, pattern_into, PrefillRank};
use kvlink::{KvLayout, ModelShape, Region, Result, TpRank};

use crate::proto::Groups;

/// The model the soak moves: `layers` layers of K and V with 2 KV heads of `token_bytes / 2`
/// bytes per token each, 16 tokens per block.
pub fn shape(layers: u32, token_bytes: u64) -> ModelShape {
    ModelShape {
        name: "soak",
        layers,
        tensors_per_layer: 2,
        bytes_per_token: token_bytes,
        kv_heads: 2,
        tokens_per_block: 16,
        dtype: "bf16",
    }
}

/// The layout of `blocks` blocks of `shape` in `region`, with odd layers in block group 1
/// when `groups` is 2 (as a hybrid model's sliding-window layers have block ids of their own).
pub fn layout(shape: &ModelShape, region: &Region, blocks: u32, groups: u32) -> Result<KvLayout> {
    let mut layout = shape.layout_tp(region.id(), blocks, TpRank::SOLO, false)?;
    for (i, t) in layout.tensors.iter_mut().enumerate() {
        t.group = (i as u32 / shape.tensors_per_layer) % groups.max(1);
    }
    Ok(layout)
}

/// Writes the pattern of `seed` into every tensor's copy of `blocks` (per group), addressed by
/// the byte's offset in the region, as the prefill's memory would hold a request's KV.
pub fn write(region: &Region, layout: &KvLayout, blocks: &Groups, seed: u64) -> Result<()> {
    let mut buf = Vec::new();
    for t in &layout.tensors {
        for &b in blocks.get(t.group as usize).map_or(&[][..], Vec::as_slice) {
            let at = t.block_offset(b);
            buf.resize(t.block_bytes as usize, 0);
            pattern_into(seed, at, &mut buf);
            region.write_at(at, &buf)?;
        }
    }
    Ok(())
}

/// Checks that `local` (this engine's blocks) holds what `remote` of a prefill with the same
/// layout held under `seed`; returns the bytes checked, or the first difference.
pub fn check(
    region: &Arc<Region>,
    layout: &KvLayout,
    local: &Groups,
    remote: &Groups,
    seed: u64,
) -> Result<u64> {
    let bytes = move |_region, offset: u64, out: &mut [u8]| {
        pattern_into(seed, offset, out);
        Ok(())
    };
    let prefill = [PrefillRank {
        layout,
        tp: TpRank::SOLO,
        bytes: &bytes,
    }];
    check_read(region, layout, TpRank::SOLO, &prefill, local, remote)
}

/// Total bytes of `blocks` (per group) in `layout`.
#[cfg(test)]
pub fn bytes(layout: &KvLayout, blocks: &Groups) -> u64 {
    layout
        .tensors
        .iter()
        .map(|t| t.block_bytes * blocks.get(t.group as usize).map_or(0, Vec::len) as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvlink::{Engine, EngineConfig, TransportChoice};

    fn engine() -> Engine {
        Engine::start(EngineConfig::default().with(|c| {
            c.transport = TransportChoice::Tcp;
        }))
        .unwrap()
    }

    #[test]
    fn a_written_hold_checks_and_anything_else_does_not() {
        let e = engine();
        let s = shape(4, 512);
        let region = e.allocate_host(s.region_bytes(8), false).unwrap();
        let l = layout(&s, &region, 8, 2).unwrap();
        assert_eq!(l.tensors[2].group, 1, "layer 1 is in group 1");
        // Blocks 1 and 2 of group 0 and block 5 of group 1 hold seed 7; the "decode" reads
        // them from itself into the same ids.
        let blocks = vec![vec![1, 2], vec![5]];
        write(&region, &l, &blocks, 7).unwrap();
        let n = check(&region, &l, &blocks, &blocks, 7).unwrap();
        assert_eq!(n, bytes(&l, &blocks));
        assert_eq!(n, 3 * 4 * 16 * 512, "3 blocks of 4 tensors each of 8 KiB");
        assert!(
            check(&region, &l, &blocks, &blocks, 8).is_err(),
            "another seed"
        );
        write(&region, &l, &vec![vec![], vec![5]], 9).unwrap();
        assert!(
            check(&region, &l, &blocks, &blocks, 7).is_err(),
            "one block overwritten"
        );
        assert!(
            check(&region, &l, &vec![vec![1, 2]], &vec![vec![1, 2]], 7).is_err(),
            "no group 1"
        );
    }
}
