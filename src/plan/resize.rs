//! Reads between layouts whose blocks hold different numbers of tokens, one a multiple of the
//! other (a prefill of 16-token blocks read by a decode of 64-token blocks, or the reverse).
//! Pure arithmetic, no I/O.
//!
//! A read then pairs *units* of the smaller block size: unit `u` is the whole `u`-th block of
//! the side with the smaller blocks and token range `(u + first) % ratio` of block
//! `(u + first) / ratio` of the other side's list, `first` being the units of that side's
//! first block that are not read (the read starts inside a block of the larger size: a decode
//! with smaller blocks whose own cached prefix ends inside a prefill block, or a sliding window
//! whose first needed token is inside one; per block group). Each tensor's token range is cut
//! per its [`TokenShape`]: one piece per part of token-major blocks, one per part and head of
//! head-major blocks, one per part and token when a decode of another TP size takes some of a
//! token-major block's heads.

use super::{push_piece, Plan, Run, Segment, TensorRead};
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::{KvLayout, TensorLayout, TokenShape};

/// How the block lists of one read pair when the two sides' block sizes differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resize {
    /// Tokens per block of this engine (the reader).
    pub local_tokens: u32,
    /// Tokens per block of the peer.
    pub remote_tokens: u32,
    /// Tokens of the first block of the side with the larger blocks (this engine's or the
    /// peer's) before the first one read: a multiple of the smaller block size, below the
    /// larger; 0 when the sizes are the same.
    pub first_token: u32,
}

impl Resize {
    /// Checks the sizes: each a multiple of the other, and `first_token` where a read can
    /// start.
    pub fn check(&self) -> Result<()> {
        let (l, r, f) = (self.local_tokens, self.remote_tokens, self.first_token);
        if l == 0 || r == 0 || l.max(r) % l.min(r) != 0 {
            return Err(Error::invalid(format!(
                "blocks of {l} tokens here and {r} at the peer: one size must be a multiple of the other"
            )));
        }
        let (small, large) = (l.min(r), l.max(r));
        if f % small != 0 || f >= large || (l == r && f != 0) {
            return Err(Error::invalid(format!(
                "a read cannot start {f} tokens into a block of {large} tokens when the other \
                 side's blocks hold {small} (a multiple of {small} below {large}; 0 for blocks \
                 of one size)"
            )));
        }
        Ok(())
    }

    /// Units of the smaller size per larger block.
    pub fn ratio(&self) -> u32 {
        self.local_tokens.max(self.remote_tokens) / self.local_tokens.min(self.remote_tokens)
    }

    fn local_small(&self) -> bool {
        self.local_tokens < self.remote_tokens
    }

    /// Units of the larger side's first block skipped.
    fn skip(&self) -> u32 {
        self.first_token / self.local_tokens.min(self.remote_tokens)
    }

    /// Checks one block group's lists: the larger side's blocks cover the smaller side's
    /// (after the skipped units) exactly.
    // A String error kept: the planner wraps the reason with the argument it names.
    pub fn check_lengths(&self, local: usize, remote: usize) -> std::result::Result<(), String> {
        let (small, large) = if self.local_small() {
            (local, remote)
        } else {
            (remote, local)
        };
        let want = (small + self.skip() as usize).div_ceil(self.ratio() as usize);
        if large == want || self.ratio() == 1 && small == large {
            return Ok(());
        }
        let (ls, rs) = (self.local_tokens, self.remote_tokens);
        Err(format!(
            "{local} local blocks of {ls} tokens and {remote} remote blocks of {rs} tokens{}: \
             {small} blocks of the smaller size need {want} of the larger",
            if self.first_token > 0 {
                let side = if self.local_small() {
                    "remote"
                } else {
                    "local"
                };
                format!(" from token {} of the first {side} block", self.first_token)
            } else {
                String::new()
            }
        ))
    }

    /// The units of one block group: `(local block, its unit), (remote block, its unit)`,
    /// units counted in the smaller size within each block.
    fn units<'a>(
        &self,
        local: &'a [BlockId],
        remote: &'a [BlockId],
    ) -> impl Iterator<Item = ((BlockId, u64), (BlockId, u64))> + 'a {
        let (ratio, skip, local_small) = (self.ratio(), self.skip(), self.local_small());
        let small = if local_small { local } else { remote };
        let large = if local_small { remote } else { local };
        small.iter().enumerate().map(move |(u, &b)| {
            let at = u as u32 + skip;
            let big = (large[(at / ratio) as usize], u64::from(at % ratio));
            if local_small {
                ((b, 0), big)
            } else {
                (big, (b, 0))
            }
        })
    }
}

/// Where one side's pieces of a unit lie within a block: the unit's bytes start at `first +
/// unit * unit_step`, and piece `(a, b)` at `a * a_step + b * b_step` from there.
#[derive(Debug, Clone, Copy)]
struct Side {
    first: u64,
    unit_step: u64,
    a_step: u64,
    b_step: u64,
}

/// One tensor's cut of a unit: `count_a` by `count_b` pieces of `len` bytes on each side.
#[derive(Debug, Clone, Copy)]
struct Cut {
    local: Side,
    remote: Side,
    count_a: u64,
    count_b: u64,
    len: u64,
}

/// Heads read: `(local first, remote first, count)`, heads counted within each side's blocks.
fn heads_read(read: TensorRead, l: &TokenShape) -> Option<(u64, u64, u64)> {
    match read {
        TensorRead::Skip => None,
        TensorRead::Whole => Some((0, 0, l.heads)),
        TensorRead::Heads {
            local_first,
            remote_first,
            count,
        } => Some((
            u64::from(local_first),
            u64::from(remote_first),
            u64::from(count),
        )),
    }
}

/// The cut of one tensor: `n` tokens per unit, heads `(local first, remote first, count)`.
fn cut(l: &TokenShape, r: &TokenShape, n: u64, (lf, rf, count): (u64, u64, u64)) -> Cut {
    let hb = l.head_bytes;
    if l.head_major {
        // [parts][heads][tokens][dim]: per part and head, the unit's tokens.
        let side = |s: &TokenShape, first: u64| Side {
            first: first * s.tokens * hb,
            unit_step: n * hb,
            a_step: s.part_bytes(),
            b_step: s.tokens * hb,
        };
        return Cut {
            local: side(l, lf),
            remote: side(r, rf),
            count_a: l.parts,
            count_b: count,
            len: n * hb,
        };
    }
    // [parts][tokens][heads][dim]: per part, the unit's tokens whole, or per token the heads.
    let whole = count == l.heads && count == r.heads;
    let side = |s: &TokenShape, first: u64| Side {
        first: if whole { 0 } else { first * hb },
        unit_step: n * s.heads * hb,
        a_step: s.part_bytes(),
        b_step: s.heads * hb,
    };
    Cut {
        local: side(l, lf),
        remote: side(r, rf),
        count_a: l.parts,
        count_b: if whole { 1 } else { n },
        len: if whole { n * count * hb } else { count * hb },
    }
}

/// The shape of tensor `i` on one side, or why it cannot be cut.
fn shape(t: &TensorLayout, tokens: u32, i: usize, side: &str) -> Result<TokenShape> {
    t.token_shape(tokens)
        .map_err(|why| Error::invalid(format!("tensor {i} {side}: {why}")))
}

/// Plans a read between layouts of different block sizes (see the module's docs); `reads`
/// from [`super::tensor_reads`] or [`super::whole_reads`].
pub(super) fn plan_resized(
    local: &KvLayout,
    remote: &KvLayout,
    reads: &[TensorRead],
    pairs: &[(&[BlockId], &[BlockId])],
    resizes: &[Resize],
    cap: u64,
) -> Result<Plan> {
    let (lt, rt) = (local.tokens_per_block, remote.tokens_per_block);
    let n = u64::from(lt.min(rt));
    let mut segments: Vec<Segment> = Vec::new();
    let (mut bytes, mut pieces) = (0u64, 0usize);
    for (i, ((l, r), read)) in local
        .tensors
        .iter()
        .zip(&remote.tensors)
        .zip(reads)
        .enumerate()
    {
        let (ls, rs) = shape(l, lt, i, "here")?.aligned(shape(r, rt, i, "at the peer")?);
        let Some(heads) = heads_read(*read, &ls) else {
            continue;
        };
        let c = cut(&ls, &rs, n, heads);
        let run = Run::single(l, r);
        let g = l.group as usize;
        let (lb, rb) = pairs[g];
        for ((lblk, lu), (rblk, ru)) in resizes[g].units(lb, rb) {
            let lo = l.block_offset(lblk) + c.local.first + lu * c.local.unit_step;
            let ro = r.block_offset(rblk) + c.remote.first + ru * c.remote.unit_step;
            for a in 0..c.count_a {
                for b in 0..c.count_b {
                    let at = |s: &Side, base: u64| base + a * s.a_step + b * s.b_step;
                    push_piece(
                        &mut segments,
                        &run,
                        at(&c.local, lo),
                        at(&c.remote, ro),
                        c.len,
                        cap,
                    );
                }
            }
            let per_unit = c.count_a * c.count_b;
            pieces += per_unit as usize;
            bytes += per_unit * c.len;
        }
    }
    Ok(Plan {
        segments,
        blocks: pairs.iter().map(|(l, r)| l.len().max(r.len())).sum(),
        pieces,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resize(l: u32, r: u32, first: u32) -> Resize {
        Resize {
            local_tokens: l,
            remote_tokens: r,
            first_token: first,
        }
    }

    #[test]
    fn sizes_and_starts_are_checked() {
        resize(16, 64, 0).check().unwrap();
        resize(16, 64, 48).check().unwrap();
        resize(64, 16, 0).check().unwrap();
        resize(64, 16, 16).check().unwrap();
        assert!(resize(16, 48, 0).check().is_ok());
        assert!(resize(16, 40, 0).check().is_err());
        assert!(resize(16, 64, 64).check().is_err());
        assert!(resize(16, 64, 8).check().is_err());
        assert!(resize(64, 16, 64).check().is_err());
        assert!(resize(16, 16, 16).check().is_err());
    }

    #[test]
    fn lists_cover_each_other_exactly() {
        // 7 blocks of 16 tokens fill 2 of 64.
        resize(16, 64, 0).check_lengths(7, 2).unwrap();
        resize(64, 16, 0).check_lengths(2, 7).unwrap();
        assert!(resize(16, 64, 0).check_lengths(7, 3).is_err());
        // From token 48 of the first: 1 + 4 + 2 units.
        resize(16, 64, 48).check_lengths(7, 3).unwrap();
        let e = resize(16, 64, 48).check_lengths(7, 2).unwrap_err();
        assert!(e.contains("from token 48"), "{e}");
    }

    #[test]
    fn units_pair_small_blocks_with_ranges_of_large_ones() {
        let u: Vec<_> = resize(16, 64, 32).units(&[5, 6, 7], &[9, 3]).collect();
        assert_eq!(
            u,
            vec![((5, 0), (9, 2)), ((6, 0), (9, 3)), ((7, 0), (3, 0))]
        );
        // A decode of the larger blocks that starts inside its first one (a sliding window).
        let u: Vec<_> = resize(32, 16, 16).units(&[4, 1], &[8, 2]).collect();
        assert_eq!(u, vec![((4, 1), (8, 0)), ((1, 0), (2, 0))]);
        let u: Vec<_> = resize(32, 16, 0).units(&[4, 1], &[8, 2, 6]).collect();
        assert_eq!(
            u,
            vec![((4, 0), (8, 0)), ((4, 1), (2, 0)), ((1, 0), (6, 0))]
        );
    }
}
