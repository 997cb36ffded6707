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
//! own block lists. Layouts whose blocks hold different numbers of tokens pair token ranges
//! instead of blocks (`resize.rs`).

mod check;
mod resize;

pub use check::{check_blocks, check_local_blocks, resizes};
pub use resize::Resize;

use crate::error::{Error, Result};
use crate::ids::{BlockId, RegionId};
use crate::layout::{token_difference, KvLayout, TensorLayout};
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
// Long: the pairing of one local tensor with its sources over TP, heads and token runs, each case
//   refused with its own reason in the order the checks depend on each other.
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
            _ if local.tokens_per_block != remote.tokens_per_block => {
                let (lt, rt) = (local.tokens_per_block, remote.tokens_per_block);
                if let Some(why) = token_difference(l, lt, r, rt) {
                    return Err(Error::invalid(format!("tensor {i}: {why}")));
                }
                match (&l.heads, &r.heads) {
                    (Some(lh), Some(rh)) => head_read(
                        i,
                        lh.total,
                        (local_tp, lh.local),
                        (remote_tp, rh.local),
                        &sources,
                    )?,
                    _ if i as u64 * shares / n == share => TensorRead::Whole,
                    _ => TensorRead::Skip,
                }
            }
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
                head_read(
                    i,
                    lh.total,
                    (local_tp, lh.local),
                    (remote_tp, rh.local),
                    &sources,
                )?
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

/// What tensor `i` (of `total` KV heads, `local.1` and `remote.1` of them declared on each
/// side) takes from the prefill rank `remote.0`, one of `sources`.
fn head_read(
    i: usize,
    total: u32,
    (local_tp, local_heads): (TpRank, u32),
    (remote_tp, remote_heads): (TpRank, u32),
    sources: &std::ops::Range<u32>,
) -> Result<TensorRead> {
    let ours = tp::heads(local_tp, total);
    let theirs = tp::heads(remote_tp, total);
    if ours.len() as u32 != local_heads || theirs.len() as u32 != remote_heads {
        return Err(Error::invalid(format!(
            "tensor {i}: {local_heads} and {remote_heads} heads declared for {local_tp} and {remote_tp} of {total} KV heads"
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
    if from >= to || provider(from) != Some(remote_tp.rank) {
        return Ok(TensorRead::Skip);
    }
    let count = to - from;
    let (local_first, remote_first) = (from - ours.start, from - theirs.start);
    if local_first == 0 && remote_first == 0 && count == local_heads && count == remote_heads {
        Ok(TensorRead::Whole)
    } else {
        Ok(TensorRead::Heads {
            local_first,
            remote_first,
            count,
        })
    }
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

impl Run {
    /// One tensor on its own, read whole.
    fn single(l: &TensorLayout, r: &TensorLayout) -> Run {
        Run {
            local_region: l.region,
            local_offset: l.offset,
            local_stride: l.block_stride,
            remote_region: r.region,
            remote_offset: r.offset,
            remote_stride: r.block_stride,
            bytes: l.block_bytes,
            tensors: 1,
            group: l.group as usize,
            heads: None,
        }
    }
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
            heads,
            ..Run::single(l, r)
        });
    }
    out
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
    let (lt, rt) = (local.tokens_per_block, remote.tokens_per_block);
    if lt != rt {
        for (i, (l, r)) in local.tensors.iter().zip(&remote.tensors).enumerate() {
            if let Some(why) = token_difference(l, lt, r, rt) {
                return Err(Error::invalid(format!("tensor {i}: {why}")));
            }
        }
        return Ok(vec![TensorRead::Whole; local.tensors.len()]);
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
    Ok(vec![TensorRead::Whole; local.tensors.len()])
}

/// Plans the reads of one source: block pairs per block group (`local_blocks[g]` with
/// `remote_blocks[g]`), each tensor read as `reads` says ([`tensor_reads`]). Layouts of
/// different block sizes pair token ranges ([`Resize`]), from the start of each first block.
pub fn plan_read<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    remote: &KvLayout,
    reads: &[TensorRead],
    local_blocks: &[L],
    remote_blocks: &[R],
    opts: PlanOptions,
) -> Result<Plan> {
    plan_read_from(local, remote, reads, local_blocks, remote_blocks, &[], opts)
}

/// [`plan_read`] of a read that starts `first_tokens[g]` tokens into group `g`'s first remote
/// block (a reader with smaller blocks than the peer whose cached prefix, or sliding window,
/// starts inside one of the peer's blocks; see [`Resize`]); none: 0 everywhere.
// Long: the planner's one pass over groups and blocks, with the offsets into the first remote block
//   threading through it; its pieces are the helpers it calls.
pub fn plan_read_from<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    remote: &KvLayout,
    reads: &[TensorRead],
    local_blocks: &[L],
    remote_blocks: &[R],
    first_tokens: &[u32],
    opts: PlanOptions,
) -> Result<Plan> {
    check_blocks(local, remote, local_blocks, remote_blocks, first_tokens)?;
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
    if local.tokens_per_block != remote.tokens_per_block {
        let lists: Vec<(&[BlockId], &[BlockId])> = local_blocks
            .iter()
            .zip(remote_blocks)
            .map(|(l, r)| (l.as_ref(), r.as_ref()))
            .collect();
        let (lt, rt) = (local.tokens_per_block, remote.tokens_per_block);
        let resizes = resizes(lt, rt, first_tokens, lists.len())?;
        return resize::plan_resized(local, remote, reads, &lists, &resizes, cap);
    }
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
mod tests;
