//! The planner: from two KV layouts and a list of (local block, remote block) pairs, the byte
//! segments to read. Pure arithmetic, no I/O.
//!
//! Coalescing happens in two ways, both in one linear pass:
//! - *across adjacent tensors*: consecutive tensors whose blocks sit back to back with the same
//!   stride on both sides (a block-major layout such as `[num_blocks, layers, 2, ...]`) are
//!   treated as one wider tensor;
//! - *across consecutive blocks*: a segment grows while the next piece follows it on both sides,
//!   which also joins the last block of one tensor to the first of the next when they touch.
//!
//! Segments never exceed `max_segment_bytes`.

use crate::error::{Error, Result};
use crate::ids::{BlockId, RegionId};
use crate::layout::KvLayout;

/// One contiguous read: `len` bytes from the peer's `remote_region` at `remote_offset` into our
/// `local_region` at `local_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Destination region (ours).
    pub local_region: RegionId,
    /// Destination offset within `local_region`.
    pub local_offset: u64,
    /// Source region (the peer's).
    pub remote_region: RegionId,
    /// Source offset within `remote_region`.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// The segments of one request and what they came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Segments in ascending local order per tensor group.
    pub segments: Vec<Segment>,
    /// Block pairs requested.
    pub blocks: usize,
    /// Block-times-tensor pieces before coalescing (what a naive per-block transfer would post).
    pub pieces: usize,
    /// Total bytes.
    pub bytes: u64,
}

/// Planner settings.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    /// Largest segment produced (bytes); larger runs are split.
    pub max_segment_bytes: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            max_segment_bytes: 16 << 20,
        }
    }
}

/// A run of tensors that behaves as one tensor on both sides.
struct Group {
    local_region: RegionId,
    local_offset: u64,
    local_stride: u64,
    remote_region: RegionId,
    remote_offset: u64,
    remote_stride: u64,
    bytes: u64,
    tensors: usize,
}

fn groups(local: &KvLayout, remote: &KvLayout) -> Vec<Group> {
    let mut out: Vec<Group> = Vec::new();
    for (l, r) in local.tensors.iter().zip(&remote.tensors) {
        if let Some(g) = out.last_mut() {
            let joins = g.local_region == l.region
                && g.remote_region == r.region
                && g.local_stride == l.block_stride
                && g.remote_stride == r.block_stride
                && g.local_offset + g.bytes == l.offset
                && g.remote_offset + g.bytes == r.offset
                && g.bytes + l.block_bytes <= g.local_stride
                && g.bytes + l.block_bytes <= g.remote_stride;
            if joins {
                g.bytes += l.block_bytes;
                g.tensors += 1;
                continue;
            }
        }
        out.push(Group {
            local_region: l.region,
            local_offset: l.offset,
            local_stride: l.block_stride,
            remote_region: r.region,
            remote_offset: r.offset,
            remote_stride: r.block_stride,
            bytes: l.block_bytes,
            tensors: 1,
        });
    }
    out
}

/// Checks the local half of a request: list lengths, local block ids in range, and no local
/// block named twice (two reads into the same destination).
pub fn check_local_blocks(
    local: &KvLayout,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
) -> Result<()> {
    if local_blocks.len() != remote_blocks.len() {
        return Err(Error::invalid(format!(
            "{} local block ids but {} remote block ids; they pair one to one",
            local_blocks.len(),
            remote_blocks.len()
        )));
    }
    let ln = local.num_blocks();
    if let Some(b) = local_blocks.iter().find(|&&b| b >= ln) {
        return Err(Error::invalid(format!(
            "local block id {b} is out of range: this cache has {ln} blocks"
        )));
    }
    let mut seen = vec![0u64; (ln as usize).div_ceil(64)];
    for &b in local_blocks {
        let (w, bit) = ((b / 64) as usize, 1u64 << (b % 64));
        if seen[w] & bit != 0 {
            return Err(Error::invalid(format!(
                "local block id {b} appears twice in one request"
            )));
        }
        seen[w] |= bit;
    }
    Ok(())
}

/// Checks a request's block lists against both layouts: [`check_local_blocks`], remote block
/// ids in range, and layouts that agree on tensors and bytes per block.
pub fn check_blocks(
    local: &KvLayout,
    remote: &KvLayout,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
) -> Result<()> {
    check_local_blocks(local, local_blocks, remote_blocks)?;
    let rn = remote.num_blocks();
    if let Some(b) = remote_blocks.iter().find(|&&b| b >= rn) {
        return Err(Error::invalid(format!(
            "remote block id {b} is out of range: the peer's cache has {rn} blocks"
        )));
    }
    if local.tensors.len() != remote.tensors.len() {
        return Err(Error::invalid(format!(
            "layouts differ in tensor count ({} vs {})",
            local.tensors.len(),
            remote.tensors.len()
        )));
    }
    if let Some((i, (l, r))) = local
        .tensors
        .iter()
        .zip(&remote.tensors)
        .enumerate()
        .find(|(_, (l, r))| l.block_bytes != r.block_bytes)
    {
        return Err(Error::invalid(format!(
            "tensor {i} holds {} bytes per block here but {} at the peer",
            l.block_bytes, r.block_bytes
        )));
    }
    Ok(())
}

/// Plans the reads that copy remote blocks into local blocks, pair by pair, for every tensor.
pub fn plan(
    local: &KvLayout,
    remote: &KvLayout,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
    opts: PlanOptions,
) -> Result<Plan> {
    check_blocks(local, remote, local_blocks, remote_blocks)?;
    if opts.max_segment_bytes == 0 {
        return Err(Error::invalid("max_segment_bytes is 0"));
    }
    let cap = opts.max_segment_bytes;
    let mut pairs: Vec<(BlockId, BlockId)> = local_blocks
        .iter()
        .copied()
        .zip(remote_blocks.iter().copied())
        .collect();
    pairs.sort_unstable_by_key(|p| p.0);

    let groups = groups(local, remote);
    let mut segments: Vec<Segment> = Vec::with_capacity(groups.len() * 4);
    let mut bytes = 0u64;
    for g in &groups {
        for &(lb, rb) in &pairs {
            let lo = g.local_offset + u64::from(lb) * g.local_stride;
            let ro = g.remote_offset + u64::from(rb) * g.remote_stride;
            bytes += g.bytes;
            push_piece(&mut segments, g, lo, ro, g.bytes, cap);
        }
    }
    Ok(Plan {
        segments,
        blocks: pairs.len(),
        pieces: pairs.len() * local.tensors.len(),
        bytes,
    })
}

#[inline]
fn push_piece(
    segs: &mut Vec<Segment>,
    g: &Group,
    mut lo: u64,
    mut ro: u64,
    mut len: u64,
    cap: u64,
) {
    if let Some(last) = segs.last_mut() {
        if last.local_region == g.local_region
            && last.remote_region == g.remote_region
            && last.local_offset + last.len == lo
            && last.remote_offset + last.len == ro
            && last.len < cap
        {
            let take = len.min(cap - last.len);
            last.len += take;
            lo += take;
            ro += take;
            len -= take;
        }
    }
    while len > 0 {
        let take = len.min(cap);
        segs.push(Segment {
            local_region: g.local_region,
            local_offset: lo,
            remote_region: g.remote_region,
            remote_offset: ro,
            len: take,
        });
        lo += take;
        ro += take;
        len -= take;
    }
}

#[cfg(test)]
mod tests {
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
        assert!(plan(&l, &l, &[1, 2], &[1], o)
            .unwrap_err()
            .to_string()
            .contains("pair"));
        assert!(plan(&l, &l, &[8], &[1], o)
            .unwrap_err()
            .to_string()
            .contains("local block id 8"));
        assert!(plan(&l, &l, &[1], &[9], o)
            .unwrap_err()
            .to_string()
            .contains("remote block id 9"));
        assert!(plan(&l, &l, &[3, 3], &[1, 2], o)
            .unwrap_err()
            .to_string()
            .contains("twice"));
        // The same remote block read into two local blocks is allowed.
        assert!(plan(&l, &l, &[3, 4], &[1, 1], o).is_ok());
    }
}
