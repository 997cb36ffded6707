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
//!
//! Reads between TP groups of different sizes take heads: [`tensor_reads`] says, per tensor,
//! which of a prefill rank's heads land where in our blocks, and the planner emits one piece per
//! run of heads in a block (one per block for head-major blocks). Block groups each pair their
//! own block lists.

use crate::error::{Error, Result};
use crate::ids::{BlockId, RegionId};
use crate::layout::KvLayout;
use crate::tp::{self, TpRank};

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
    /// Block pairs requested (over all block groups).
    pub blocks: usize,
    /// Block-times-tensor pieces (times runs of heads) before coalescing (what a naive per-block transfer would post).
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

/// What one tensor of a read takes from one source (one prefill rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRead {
    /// Whole blocks.
    Whole,
    /// `count` heads: the source's heads from `remote_first` into ours from `local_first`
    /// (head indices within each side's blocks), in every run of the block.
    Heads {
        /// Our first head written.
        local_first: u32,
        /// The source's first head read.
        remote_first: u32,
        /// Heads read.
        count: u32,
    },
    /// Nothing: another source of the read provides this tensor.
    Skip,
}

/// What each tensor of our layout takes from the source at `remote_tp`, one of the prefill
/// ranks `sources` that one read draws on (`crate::tp::sources`, or a single engine).
///
/// - Tensors with heads ([`HeadSplit`](crate::layout::HeadSplit)) take the heads both ranks
///   hold; a head several sources hold (more prefill ranks than heads) comes from the first.
/// - Tensors without heads (the same on every rank, such as MLA's latent) are shared out
///   among the sources in contiguous runs of tensors, so a decode gathering several prefill
///   ranks reads from all of them.
///
/// Refuses layouts that cannot pair, and a read whose sources do not hold all of our heads (a
/// single prefill rank of a larger prefill, say).
pub fn tensor_reads(
    local: &KvLayout,
    local_tp: TpRank,
    remote: &KvLayout,
    remote_tp: TpRank,
    sources: std::ops::Range<u32>,
) -> Result<Vec<TensorRead>> {
    if !sources.contains(&remote_tp.rank) || sources.end > remote_tp.size {
        return Err(Error::invalid(format!(
            "the peer is {remote_tp}, not one of the ranks {sources:?} of the read"
        )));
    }
    if local.tensors.len() != remote.tensors.len() {
        return Err(Error::invalid(format!(
            "layouts differ in tensor count ({} vs {})",
            local.tensors.len(),
            remote.tensors.len()
        )));
    }
    let n = local.tensors.len() as u64;
    let shares = u64::from(sources.end - sources.start);
    let share = u64::from(remote_tp.rank - sources.start);
    let mut out = Vec::with_capacity(local.tensors.len());
    for (i, (l, r)) in local.tensors.iter().zip(&remote.tensors).enumerate() {
        let read = match (&l.heads, &r.heads) {
            (None, None) => {
                if l.block_bytes != r.block_bytes {
                    return Err(Error::invalid(format!(
                        "tensor {i} holds {} bytes per block here but {} at the peer",
                        l.block_bytes, r.block_bytes
                    )));
                }
                if i as u64 * shares / n == share {
                    TensorRead::Whole
                } else {
                    TensorRead::Skip
                }
            }
            (Some(lh), Some(rh)) => {
                let (lhb, rhb) = (lh.head_bytes(l.block_bytes), rh.head_bytes(r.block_bytes));
                if lh.total != rh.total || lh.runs != rh.runs || lhb != rhb {
                    return Err(Error::invalid(format!(
                        "tensor {i}: {} KV heads of {lhb} bytes in {} runs here, {} of {rhb} in {} runs at the peer",
                        lh.total, lh.runs, rh.total, rh.runs
                    )));
                }
                let total = lh.total;
                let ours = tp::heads(local_tp, total);
                let theirs = tp::heads(remote_tp, total);
                if ours.len() as u32 != lh.local || theirs.len() as u32 != rh.local {
                    return Err(Error::invalid(format!(
                        "tensor {i}: {} and {} heads declared for {local_tp} and {remote_tp} of {total} KV heads",
                        lh.local, rh.local
                    )));
                }
                // The first source holding head g provides it.
                let provider = |g: u32| {
                    sources
                        .clone()
                        .find(|&p| tp::heads(TpRank::new(p, remote_tp.size), total).contains(&g))
                };
                if let Some(g) = ours.clone().find(|&g| provider(g).is_none()) {
                    return Err(Error::invalid(format!(
                        "tensor {i}: KV head {g} of this engine ({local_tp}) is on none of the \
                         prefill ranks {sources:?} read (of TP {}); read from the whole prefill \
                         TP group",
                        remote_tp.size
                    )));
                }
                let from = ours.start.max(theirs.start);
                let to = ours.end.min(theirs.end);
                if from < to && provider(from) == Some(remote_tp.rank) {
                    let count = to - from;
                    let (local_first, remote_first) = (from - ours.start, from - theirs.start);
                    if local_first == 0
                        && remote_first == 0
                        && count == lh.local
                        && count == rh.local
                    {
                        TensorRead::Whole
                    } else {
                        TensorRead::Heads {
                            local_first,
                            remote_first,
                            count,
                        }
                    }
                } else {
                    TensorRead::Skip
                }
            }
            _ => {
                return Err(Error::invalid(format!(
                    "tensor {i} declares its KV heads on one side only"
                )))
            }
        };
        out.push(read);
    }
    Ok(out)
}

/// A run of tensors that behaves as one tensor on both sides, read whole or by heads.
struct Run {
    local_region: RegionId,
    local_offset: u64,
    local_stride: u64,
    remote_region: RegionId,
    remote_offset: u64,
    remote_stride: u64,
    bytes: u64,
    tensors: usize,
    group: usize,
    /// For head reads: (runs, our run bytes, their run bytes, our first byte in a run, theirs,
    /// bytes per run read).
    heads: Option<HeadRuns>,
}

#[derive(Clone, Copy)]
struct HeadRuns {
    runs: u64,
    local_run: u64,
    remote_run: u64,
    local_first: u64,
    remote_first: u64,
    len: u64,
}

fn runs(local: &KvLayout, remote: &KvLayout, reads: &[TensorRead]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for ((l, r), read) in local.tensors.iter().zip(&remote.tensors).zip(reads) {
        let heads = match *read {
            TensorRead::Skip => continue,
            TensorRead::Whole => None,
            TensorRead::Heads {
                local_first,
                remote_first,
                count,
            } => {
                let (lh, rh) = (l.heads.expect("checked"), r.heads.expect("checked"));
                let hb = lh.head_bytes(l.block_bytes);
                Some(HeadRuns {
                    runs: u64::from(lh.runs),
                    local_run: hb * u64::from(lh.local),
                    remote_run: hb * u64::from(rh.local),
                    local_first: hb * u64::from(local_first),
                    remote_first: hb * u64::from(remote_first),
                    len: hb * u64::from(count),
                })
            }
        };
        if let Some(g) = out.last_mut() {
            let joins = heads.is_none()
                && g.heads.is_none()
                && g.group == l.group as usize
                && g.local_region == l.region
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
        out.push(Run {
            local_region: l.region,
            local_offset: l.offset,
            local_stride: l.block_stride,
            remote_region: r.region,
            remote_offset: r.offset,
            remote_stride: r.block_stride,
            bytes: l.block_bytes,
            tensors: 1,
            group: l.group as usize,
            heads,
        });
    }
    out
}

/// Checks the local half of a request: one block list per block group of the layout, list
/// lengths, local block ids in range, and no local block named twice in a group (two reads
/// into the same destination).
pub fn check_local_blocks<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    local_blocks: &[L],
    remote_blocks: &[R],
) -> Result<()> {
    let groups = local.num_groups();
    if local_blocks.len() != groups || remote_blocks.len() != groups {
        return Err(Error::invalid(format!(
            "{} local and {} remote block lists for a layout of {groups} block groups; give one \
             list per group",
            local_blocks.len(),
            remote_blocks.len()
        )));
    }
    for (g, (lb, rb)) in local_blocks.iter().zip(remote_blocks).enumerate() {
        let (lb, rb) = (lb.as_ref(), rb.as_ref());
        let in_group = |what: String| {
            if groups > 1 {
                format!("block group {g}: {what}")
            } else {
                what
            }
        };
        if lb.len() != rb.len() {
            return Err(Error::invalid(in_group(format!(
                "{} local block ids but {} remote block ids; they pair one to one",
                lb.len(),
                rb.len()
            ))));
        }
        let ln = local.group_blocks(g);
        if let Some(b) = lb.iter().find(|&&b| b >= ln) {
            return Err(Error::invalid(in_group(format!(
                "local block id {b} is out of range: this cache has {ln} blocks"
            ))));
        }
        let mut seen = vec![0u64; (ln as usize).div_ceil(64)];
        for &b in lb {
            let (w, bit) = ((b / 64) as usize, 1u64 << (b % 64));
            if seen[w] & bit != 0 {
                return Err(Error::invalid(in_group(format!(
                    "local block id {b} appears twice in one request"
                ))));
            }
            seen[w] |= bit;
        }
    }
    Ok(())
}

/// Checks a request's block lists against both layouts: [`check_local_blocks`], remote block
/// ids in range, and layouts with the same tensors and block groups (sizes are checked by
/// [`tensor_reads`]).
pub fn check_blocks<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    remote: &KvLayout,
    local_blocks: &[L],
    remote_blocks: &[R],
) -> Result<()> {
    check_local_blocks(local, local_blocks, remote_blocks)?;
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
        .find(|(_, (l, r))| l.group != r.group)
    {
        return Err(Error::invalid(format!(
            "tensor {i} is in block group {} here but {} at the peer",
            l.group, r.group
        )));
    }
    for (g, rb) in remote_blocks.iter().enumerate() {
        let rn = remote.group_blocks(g);
        if let Some(b) = rb.as_ref().iter().find(|&&b| b >= rn) {
            return Err(Error::invalid(format!(
                "remote block id {b} is out of range: the peer's cache has {rn} blocks{}",
                if remote_blocks.len() > 1 {
                    format!(" in block group {g}")
                } else {
                    String::new()
                }
            )));
        }
    }
    Ok(())
}

/// Plans the reads that copy remote blocks into local blocks, pair by pair, for every tensor
/// (one block group, the same TP size on both sides: whole blocks).
pub fn plan(
    local: &KvLayout,
    remote: &KvLayout,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
    opts: PlanOptions,
) -> Result<Plan> {
    let whole = whole_reads(local, remote)?;
    plan_read(
        local,
        remote,
        &whole,
        &[local_blocks],
        &[remote_blocks],
        opts,
    )
}

/// Every tensor read whole (the same TP rank on both sides), once the layouts agree on sizes.
pub fn whole_reads(local: &KvLayout, remote: &KvLayout) -> Result<Vec<TensorRead>> {
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
    Ok(vec![TensorRead::Whole; local.tensors.len()])
}

/// Plans the reads of one source: block pairs per block group (`local_blocks[g]` with
/// `remote_blocks[g]`), each tensor read as `reads` says ([`tensor_reads`]).
pub fn plan_read<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    remote: &KvLayout,
    reads: &[TensorRead],
    local_blocks: &[L],
    remote_blocks: &[R],
    opts: PlanOptions,
) -> Result<Plan> {
    check_blocks(local, remote, local_blocks, remote_blocks)?;
    if reads.len() != local.tensors.len() {
        return Err(Error::invalid(format!(
            "{} tensor reads for {} tensors",
            reads.len(),
            local.tensors.len()
        )));
    }
    if opts.max_segment_bytes == 0 {
        return Err(Error::invalid("max_segment_bytes is 0"));
    }
    let cap = opts.max_segment_bytes;
    let pairs: Vec<Vec<(BlockId, BlockId)>> = local_blocks
        .iter()
        .zip(remote_blocks)
        .map(|(l, r)| {
            let mut p: Vec<(BlockId, BlockId)> = l
                .as_ref()
                .iter()
                .copied()
                .zip(r.as_ref().iter().copied())
                .collect();
            p.sort_unstable_by_key(|p| p.0);
            p
        })
        .collect();

    let runs = runs(local, remote, reads);
    let mut segments: Vec<Segment> = Vec::with_capacity(runs.len() * 4);
    let mut bytes = 0u64;
    let mut pieces = 0usize;
    for g in &runs {
        let pairs = &pairs[g.group];
        match g.heads {
            None => {
                pieces += pairs.len() * g.tensors;
                for &(lb, rb) in pairs {
                    let lo = g.local_offset + u64::from(lb) * g.local_stride;
                    let ro = g.remote_offset + u64::from(rb) * g.remote_stride;
                    bytes += g.bytes;
                    push_piece(&mut segments, g, lo, ro, g.bytes, cap);
                }
            }
            Some(h) => {
                pieces += pairs.len() * h.runs as usize;
                for &(lb, rb) in pairs {
                    let lo = g.local_offset + u64::from(lb) * g.local_stride + h.local_first;
                    let ro = g.remote_offset + u64::from(rb) * g.remote_stride + h.remote_first;
                    for k in 0..h.runs {
                        bytes += h.len;
                        push_piece(
                            &mut segments,
                            g,
                            lo + k * h.local_run,
                            ro + k * h.remote_run,
                            h.len,
                            cap,
                        );
                    }
                }
            }
        }
    }
    Ok(Plan {
        segments,
        blocks: pairs.iter().map(Vec::len).sum(),
        pieces,
        bytes,
    })
}

#[inline]
fn push_piece(segs: &mut Vec<Segment>, g: &Run, mut lo: u64, mut ro: u64, mut len: u64, cap: u64) {
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
                    group: 0,
                    heads: None,
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
        let e = tensor_reads(&d, TpRank::SOLO, &p, TpRank::new(1, 2), 1..2).unwrap_err();
        assert!(e.to_string().contains("KV head 0"), "{e}");
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
        )
        .unwrap_err();
        assert!(e.to_string().contains("2 block groups"), "{e}");
        let e = plan_read(
            &l,
            &r,
            &reads,
            &[vec![1], vec![8]],
            &[vec![5], vec![6]],
            PlanOptions::default(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("block group 1: local block id 8"),
            "{e}"
        );
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
}
