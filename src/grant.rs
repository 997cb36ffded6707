//! Read grants, without I/O: the blocks a prefill holds for one request, and the check the
//! data server runs on every requested byte range against them. A range is served only when
//! every byte of it lies inside a granted block of some tensor of the layout, so a reader of
//! one request never gets bytes of another request's blocks, of blocks the request does not
//! hold, or of memory outside the KV layout (padding between blocks, other registrations).
//! A grant keeps the layout its block ids were given in, and ends with its hold: a response
//! being sent stops at its next write once the grant has ended.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::holds::{Ending, HoldTable};
use crate::ids::{BlockId, RegionId};
use crate::layout::KvLayout;

/// The blocks held for one request, per block group (sorted, without repeats), in the layout
/// they were held in.
#[derive(Debug)]
pub struct Grant {
    blocks: Vec<Vec<BlockId>>,
    layout: Arc<KvLayout>,
    ended: AtomicBool,
    /// The hold table slot that tells same-host readers the hold is live, if it has one.
    published: OnceLock<(Arc<HoldTable>, usize)>,
}

impl Grant {
    /// A grant of `blocks[g]` of each block group `g` of `layout`. Refuses a list per group
    /// that does not match the layout's groups, no block at all, and block ids outside the
    /// layout.
    pub fn new<B: AsRef<[BlockId]>>(layout: Arc<KvLayout>, blocks: &[B]) -> Result<Grant> {
        if blocks.iter().all(|b| b.as_ref().is_empty()) {
            return Err(Error::invalid(
                "hold_blocks needs the request's block ids (the blocks its reader may read)",
            ));
        }
        Grant::open(layout, blocks)
    }

    /// A grant as [`Grant::new`] makes it, of no block at all too: the grant of a hold that
    /// grows, before its first part.
    pub fn open<B: AsRef<[BlockId]>>(layout: Arc<KvLayout>, blocks: &[B]) -> Result<Grant> {
        let groups = layout.num_groups();
        if blocks.len() != groups {
            return Err(Error::invalid(format!(
                "{} block lists for a layout of {groups} block groups; hold one list per group",
                blocks.len()
            )));
        }
        let mut out = Vec::with_capacity(groups);
        for (g, b) in blocks.iter().enumerate() {
            let n = layout.group_blocks(g);
            if let Some(b) = b.as_ref().iter().find(|b| **b >= n) {
                return Err(Error::invalid(format!(
                    "block {b} is outside this engine's KV cache ({n} blocks{})",
                    if groups > 1 {
                        format!(" in block group {g}")
                    } else {
                        String::new()
                    }
                )));
            }
            let mut b = b.as_ref().to_vec();
            b.sort_unstable();
            b.dedup();
            out.push(b);
        }
        Ok(Grant {
            blocks: out,
            layout,
            ended: AtomicBool::new(false),
            published: OnceLock::new(),
        })
    }

    /// A fingerprint of the granted block ids ([`blocks_hash`] of them): a same-host reader
    /// copies on its own only a read of exactly these blocks.
    pub(crate) fn blocks_hash(&self) -> u64 {
        blocks_hash(&self.blocks)
    }

    /// The layout the block ids refer to (the one in force when the blocks were held).
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The layout, shared (a grow of the hold makes its next grant in the same one).
    pub(crate) fn layout_arc(&self) -> Arc<KvLayout> {
        self.layout.clone()
    }

    /// The granted block ids per block group (each list sorted, without repeats).
    pub fn blocks(&self) -> &[Vec<BlockId>] {
        &self.blocks
    }

    /// Ends the grant (its hold finished, failed or expired): nothing more is served from it,
    /// and its hold table slot (if any) tells same-host readers so before this returns.
    pub fn end(&self) {
        drop(self.end_with_receipts());
    }

    /// Ends the grant as [`end`](Self::end) does, and returns its hold table slot's ending
    /// (the same-host readers that signed a receipt for the hold) for the caller to settle;
    /// `None` when the grant had ended already or has no slot.
    pub(crate) fn end_with_receipts(&self) -> Option<Ending> {
        if self.ended.swap(true, Ordering::AcqRel) {
            return None;
        }
        let (table, slot) = self.published.get()?;
        table.end(*slot)
    }

    /// Records the hold table slot that publishes this grant's hold (once); it is freed when
    /// the grant ends. A grant that ended already frees it at once.
    pub(crate) fn publish(&self, table: Arc<HoldTable>, slot: usize) {
        if self.published.set((table, slot)).is_ok() && self.is_ended() {
            if let Some((table, slot)) = self.published.get() {
                drop(table.end(*slot));
            }
        }
    }

    /// Whether the grant has ended.
    pub fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Whether block `b` of block group `group` is granted.
    pub fn has(&self, group: usize, b: BlockId) -> bool {
        self.blocks
            .get(group)
            .is_some_and(|g| g.binary_search(&b).is_ok())
    }

    /// Number of granted blocks, over all block groups.
    pub fn len(&self) -> usize {
        self.blocks.iter().map(Vec::len).sum()
    }

    /// Whether no block is granted (never true for a grant built by [`Grant::new`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks that every byte of `[offset, offset + len)` of `region` lies in a granted block of
    /// a tensor of the layout (see [`Checker::check`]; a request's entries go through one
    /// [`Checker`]).
    pub fn check(
        &self,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> std::result::Result<(), Refusal> {
        self.checker().check(region, offset, len)
    }

    /// A checker of ranges against this grant, for the entries of one request.
    pub fn checker(&self) -> Checker<'_> {
        Checker {
            grant: self,
            layout: &self.layout,
            last: 0,
        }
    }
}

/// A fingerprint of block id lists per block group, as a grant holds them (each list sorted,
/// without repeats; FNV-1a over the group count, each list's length and ids): the same in
/// every process of a build.
pub(crate) fn blocks_hash<B: AsRef<[BlockId]>>(groups: &[B]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut mix = |v: u64| {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    mix(groups.len() as u64);
    for g in groups {
        let mut ids = g.as_ref().to_vec();
        ids.sort_unstable();
        ids.dedup();
        mix(ids.len() as u64);
        ids.iter().for_each(|b| mix(u64::from(*b)));
    }
    h
}

/// Checks the ranges of one request against a grant, remembering where the previous range
/// ended: entries come in tensor order, so the next range is found in its tensor or the next.
#[derive(Debug)]
pub struct Checker<'a> {
    grant: &'a Grant,
    layout: &'a KvLayout,
    last: usize,
}

impl Checker<'_> {
    /// Checks that every byte of `[offset, offset + len)` of `region` lies in a granted block of
    /// a tensor of the layout. The walk advances by at least one block's bytes per step and
    /// looks from the tensor of the previous step on, wrapping, so its cost is linear in the
    /// number of blocks the range covers (times the tensors of the layout at worst, once per
    /// tensor change, or per block where block groups share memory). The error names only
    /// what the reader asked for.
    pub fn check(
        &mut self,
        region: RegionId,
        offset: u64,
        len: u64,
    ) -> std::result::Result<(), Refusal> {
        let layout = self.layout;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| outside(format!("range at {offset} of {len} bytes overflows")))?;
        if len == 0 {
            return Err(outside("empty range"));
        }
        let n = layout.tensors.len();
        let mut at = offset;
        while at < end {
            let start = self.last;
            // The first tensor (from the previous one on) whose granted block holds `at`; a
            // byte in memory that tensors of several block groups share is served when any of
            // them grants it.
            let mut held_elsewhere = None;
            let mut hit = None;
            for i in (0..n).map(|k| (start + k) % n) {
                if let Some((block, block_end)) = piece(layout, i, region, at) {
                    if self.grant.has(layout.tensors[i].group as usize, block) {
                        hit = Some((i, block_end));
                        break;
                    }
                    held_elsewhere.get_or_insert(block);
                }
            }
            let Some((i, block_end)) = hit else {
                return Err(match held_elsewhere {
                    Some(block) => outside(format!(
                        "block {block} (byte {at} of {region}) is not held for this request"
                    )),
                    None => Refusal::new(
                        RefusalKind::NotExported,
                        format!("byte {at} of {region} is not in a block of the KV layout"),
                    ),
                });
            };
            self.last = i;
            at = block_end.min(end);
        }
        Ok(())
    }
}

/// A range the grant does not cover, refused with `reason`.
fn outside(reason: impl Into<String>) -> Refusal {
    Refusal::new(RefusalKind::OutOfGrant, reason)
}

/// The block of tensor `i` that holds byte `at` of `region`, and one past its last byte.
fn piece(layout: &KvLayout, i: usize, region: RegionId, at: u64) -> Option<(BlockId, u64)> {
    let t = &layout.tensors[i];
    if t.region != region || at < t.offset || t.block_stride == 0 {
        return None;
    }
    let rel = at - t.offset;
    let b = rel / t.block_stride;
    if b >= u64::from(t.num_blocks) || rel % t.block_stride >= t.block_bytes {
        return None;
    }
    let block_end = t.offset + b * t.block_stride + t.block_bytes;
    Some((b as BlockId, block_end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{ModelShape, TensorLayout};
    use proptest::prelude::*;

    fn tensor(region: u32, offset: u64, stride: u64, bytes: u64, n: u32) -> TensorLayout {
        TensorLayout {
            name: "t".into(),
            region: RegionId(region),
            offset,
            block_stride: stride,
            block_bytes: bytes,
            num_blocks: n,
            group: 0,
            heads: None,
            token_runs: None,
        }
    }

    fn layout(tensors: Vec<TensorLayout>) -> KvLayout {
        KvLayout {
            tokens_per_block: 16,
            dtype: "bf16".into(),
            tensors,
        }
    }

    #[test]
    fn granted_blocks_are_served_and_nothing_else() {
        // Two tensors interleaved in region 1 (stride twice the block), padding after each.
        let l = layout(vec![tensor(1, 0, 256, 100, 8), tensor(1, 128, 256, 100, 8)]);
        let g = Grant::new(Arc::new(l.clone()), &[[2, 3, 3]]).unwrap();
        assert_eq!(g.len(), 2);
        let r = RegionId(1);
        assert!(g.check(r, 512, 100).is_ok(), "block 2 of t0");
        assert!(g.check(r, 512 + 128, 100).is_ok(), "block 2 of t1");
        assert!(g.check(r, 768 + 10, 50).is_ok(), "inside block 3");
        let e = g.check(r, 0, 100).unwrap_err();
        assert_eq!(e.kind(), RefusalKind::OutOfGrant, "block 0: {e}");
        let e = g.check(r, 512, 101).unwrap_err();
        assert_eq!(
            e.kind(),
            RefusalKind::NotExported,
            "padding after the block: {e}"
        );
        assert!(g.check(r, 512, 256).is_err(), "spans into the other tensor");
        assert!(g.check(RegionId(2), 512, 10).is_err(), "other region");
        assert!(g.check(r, 512, 0).is_err(), "empty");
        assert!(g.check(r, u64::MAX, 2).is_err(), "overflow");
        assert!(g.check(r, 8 * 256, 10).is_err(), "past the last block");
        assert!(!g.is_ended());
        g.end();
        assert!(g.is_ended());
    }

    #[test]
    fn contiguous_blocks_may_be_read_in_one_range() {
        let l = ModelShape::LLAMA3_8B.layout(RegionId(1), 16);
        let t = &l.tensors[0];
        assert_eq!(t.block_stride, t.block_bytes);
        let g = Grant::new(Arc::new(l.clone()), &[[4, 5, 6]]).unwrap();
        let r = RegionId(1);
        assert!(g.check(r, t.block_offset(4), 3 * t.block_bytes).is_ok());
        assert!(g.check(r, t.block_offset(4), 4 * t.block_bytes).is_err());
        assert!(g.check(r, t.block_offset(3) + 1, t.block_bytes).is_err());
    }

    #[test]
    fn empty_and_out_of_range_grants_are_refused() {
        let l = layout(vec![tensor(1, 0, 100, 100, 4)]);
        assert!(Grant::new(Arc::new(l.clone()), &[[0u32; 0]]).is_err());
        assert!(Grant::new::<[u32; 0]>(Arc::new(l.clone()), &[]).is_err());
        assert!(Grant::new(Arc::new(l.clone()), &[[4]])
            .unwrap_err()
            .to_string()
            .contains("outside"));
    }

    proptest! {
        /// The walk agrees with a byte-by-byte reference on random layouts, grants and ranges.
        #[test]
        fn check_matches_a_byte_by_byte_reference(
            stride_extra in 0u64..8,
            bytes in 1u64..12,
            n in 1u32..6,
            interleave in any::<bool>(),
            granted in proptest::collection::vec(0u32..6, 1..6),
            offset in 0u64..160,
            len in 1u64..60,
        ) {
            let stride = bytes + stride_extra + if interleave { bytes } else { 0 };
            let mut tensors = vec![tensor(1, 0, stride, bytes, n)];
            if interleave {
                tensors.push(tensor(1, bytes, stride, bytes, n));
            }
            let l = layout(tensors);
            let granted: Vec<u32> = granted.into_iter().filter(|b| *b < n).collect();
            prop_assume!(!granted.is_empty());
            let g = Grant::new(Arc::new(l.clone()), &[&granted]).unwrap();
            let byte_ok = |x: u64| l.tensors.iter().any(|t| {
                x >= t.offset && (x - t.offset) / t.block_stride < u64::from(t.num_blocks)
                    && (x - t.offset) % t.block_stride < t.block_bytes
                    && g.has(0, ((x - t.offset) / t.block_stride) as u32)
            });
            let want = (offset..offset + len).all(byte_ok);
            prop_assert_eq!(g.check(RegionId(1), offset, len).is_ok(), want);
        }
    }
}
