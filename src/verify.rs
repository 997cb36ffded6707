//! Deterministic fill patterns and byte-for-byte checks of transferred blocks, for tests,
//! benchmarks (`kvlink-bench --verify`) and users validating a deployment.
//!
//! A region filled with seed `s` holds, at every 8-byte-aligned offset `8w`, a 64-bit word that
//! depends only on `(s, w)`, so any process can compute what any byte of a peer's cache should
//! be.

use crate::error::{Error, Result};
use crate::ids::{BlockId, RegionId};
use crate::layout::KvLayout;
use crate::memory::Region;
use crate::tp::{self, TpRank};

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Writes the pattern of `seed` at `[offset, offset + out.len())` into `out`.
pub fn pattern_into(seed: u64, offset: u64, out: &mut [u8]) {
    let mut word = offset / 8;
    let mut skip = (offset % 8) as usize;
    let mut i = 0;
    while i < out.len() {
        let bytes = mix(seed ^ word.wrapping_mul(0xD6E8_FEB8_6659_FD93)).to_le_bytes();
        let n = (8 - skip).min(out.len() - i);
        out[i..i + n].copy_from_slice(&bytes[skip..skip + n]);
        i += n;
        skip = 0;
        word += 1;
    }
}

/// The pattern of `seed` at `[offset, offset + len)`.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern_into(seed, offset, &mut v);
    v
}

/// Fills a whole region with the pattern of `seed`.
pub fn fill(region: &Region, seed: u64) -> Result<()> {
    let mut buf = vec![0u8; 4 << 20];
    let mut off = 0u64;
    while off < region.len() {
        let n = (buf.len() as u64).min(region.len() - off) as usize;
        pattern_into(seed, off, &mut buf[..n]);
        region.write_at(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Checks that, for every tensor, local block `local[i]` in `region` (laid out as `ours`) holds
/// what remote block `remote[i]` of a peer filled with `seed` (laid out as `theirs`) held.
/// Returns the bytes checked, or an error naming the first differing tensor and blocks.
pub fn check_blocks(
    region: &Region,
    ours: &KvLayout,
    theirs: &KvLayout,
    seed: u64,
    local: &[BlockId],
    remote: &[BlockId],
) -> Result<u64> {
    let mut got = Vec::new();
    let mut want = Vec::new();
    let mut checked = 0u64;
    for (t, (lt, rt)) in ours.tensors.iter().zip(&theirs.tensors).enumerate() {
        if lt.region != region.id() {
            return Err(Error::invalid(format!(
                "tensor {t} lives in {}, not in {}",
                lt.region,
                region.id()
            )));
        }
        got.resize(lt.block_bytes as usize, 0);
        want.resize(rt.block_bytes as usize, 0);
        for (&l, &r) in local.iter().zip(remote) {
            region.read_at(lt.block_offset(l), &mut got)?;
            pattern_into(seed, rt.block_offset(r), &mut want);
            if got != want {
                let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                return Err(Error::invalid(format!(
                    "tensor {t} ({}): local block {l} differs from remote block {r} at byte {at}",
                    lt.name
                )));
            }
            checked += lt.block_bytes;
        }
    }
    Ok(checked)
}

/// Checks a read between engines of the same TP size whose blocks hold different numbers of
/// tokens, token by token, without the planner: token `p` of the `count` read sits at token
/// `p % n` of local block `local[p / n]` (`n`: our tokens per block) and at token
/// `(p + first_token) % m` of remote block `remote[(p + first_token) / m]` of a peer filled
/// with `seed` (`m`: its tokens per block); every part and head of it must hold the same bytes
/// on both sides (tensors declare their token runs, [`TensorLayout::token_shape`]). Returns the
/// bytes checked, or an error naming the first difference.
///
/// [`TensorLayout::token_shape`]: crate::layout::TensorLayout::token_shape
pub fn check_tokens(
    region: &Region,
    ours: &KvLayout,
    theirs: &KvLayout,
    seed: u64,
    (local, remote): (&[BlockId], &[BlockId]),
    first_token: u32,
    count: u64,
) -> Result<u64> {
    let (n, m) = (
        u64::from(ours.tokens_per_block),
        u64::from(theirs.tokens_per_block),
    );
    let mut checked = 0u64;
    for (t, (lt, rt)) in ours.tensors.iter().zip(&theirs.tensors).enumerate() {
        let bad = |why: String| Error::invalid(format!("tensor {t} ({}): {why}", lt.name));
        let ls = lt.token_shape(ours.tokens_per_block).map_err(&bad)?;
        let rs = rt.token_shape(theirs.tokens_per_block).map_err(&bad)?;
        let (mut got, mut want) = (
            vec![0u8; ls.head_bytes as usize],
            vec![0u8; ls.head_bytes as usize],
        );
        for p in 0..count {
            let q = p + u64::from(first_token);
            let (lb, rb) = (local[(p / n) as usize], remote[(q / m) as usize]);
            for k in 0..ls.parts {
                for j in 0..ls.heads {
                    let lo = lt.block_offset(lb) + token_offset(&ls, k, p % n, j);
                    let ro = rt.block_offset(rb) + token_offset(&rs, k, q % m, j);
                    region.read_at(lo, &mut got)?;
                    pattern_into(seed, ro, &mut want);
                    if got != want {
                        return Err(bad(format!(
                            "token {p} (local block {lb}, remote block {rb}), part {k}, head {j} differs"
                        )));
                    }
                    checked += ls.head_bytes;
                }
            }
        }
    }
    Ok(checked)
}

/// Where head `j` of token `s` of part `k` starts in a block of `shape`.
fn token_offset(shape: &crate::layout::TokenShape, k: u64, s: u64, j: u64) -> u64 {
    let (n, h, hb) = (shape.tokens, shape.heads, shape.head_bytes);
    if shape.head_major {
        ((k * h + j) * n + s) * hb
    } else {
        ((k * n + s) * h + j) * hb
    }
}

/// Reads a prefill rank's memory: fills `out` with the bytes at `offset` of `region`.
pub type ReadMemory = dyn Fn(RegionId, u64, &mut [u8]) -> Result<()>;

/// One prefill rank as [`check_read`] sees it: its layout, its TP rank, and its bytes
/// (`bytes(region, offset, out)` fills `out` with what the rank's memory holds there: the
/// pattern of its seed, or its actual memory).
pub struct PrefillRank<'a> {
    /// The rank's KV layout.
    pub layout: &'a KvLayout,
    /// The rank in the prefill's TP group.
    pub tp: TpRank,
    /// Reads the rank's memory.
    pub bytes: &'a ReadMemory,
}

/// Checks a read between TP groups head by head, without the planner: for every tensor of
/// every block pair (`local[g][i]` with `remote[g][i]`, per block group `g`), each KV head of
/// this rank (`ours` at `our_tp`) must hold what that head holds in the remote block at the
/// first prefill rank of `prefill` that has it; a tensor without heads must hold the remote
/// block of the first prefill rank. Returns the bytes checked, or an error naming the first
/// difference.
// Long: compares every byte a read wrote against the source it came from, tensor by tensor,
//   with and without heads, inline so that an error names where the first difference is.
pub fn check_read<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    region: &Region,
    ours: &KvLayout,
    our_tp: TpRank,
    prefill: &[PrefillRank<'_>],
    local: &[L],
    remote: &[R],
) -> Result<u64> {
    let first = prefill
        .first()
        .ok_or_else(|| Error::invalid("no prefill rank to check against"))?;
    let mut checked = 0u64;
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (t, lt) in ours.tensors.iter().enumerate() {
        if lt.region != region.id() {
            return Err(Error::invalid(format!(
                "tensor {t} lives in {}, not in {}",
                lt.region,
                region.id()
            )));
        }
        let g = lt.group as usize;
        let (Some(lb), Some(rb)) = (local.get(g), remote.get(g)) else {
            return Err(Error::invalid(format!("no block list for block group {g}")));
        };
        for (&l, &r) in lb.as_ref().iter().zip(rb.as_ref()) {
            let at = lt.block_offset(l);
            let differs = |what: String| {
                Error::invalid(format!(
                    "tensor {t} ({}): local block {l} differs from remote block {r} ({what})",
                    lt.name
                ))
            };
            match lt.heads {
                None => {
                    let rt = &first.layout.tensors[t];
                    got.resize(lt.block_bytes as usize, 0);
                    want.resize(lt.block_bytes as usize, 0);
                    region.read_at(at, &mut got)?;
                    (first.bytes)(rt.region, rt.block_offset(r), &mut want)?;
                    if got != want {
                        return Err(differs(format!("whole block, prefill {}", first.tp)));
                    }
                }
                Some(h) => {
                    let hb = h.head_bytes(lt.block_bytes);
                    got.resize(hb as usize, 0);
                    want.resize(hb as usize, 0);
                    let mine = tp::heads(our_tp, h.total);
                    for head in mine.clone() {
                        let Some(p) = prefill
                            .iter()
                            .find(|p| tp::heads(p.tp, h.total).contains(&head))
                        else {
                            return Err(Error::invalid(format!(
                                "no prefill rank given holds KV head {head}"
                            )));
                        };
                        let rt = &p.layout.tensors[t];
                        let rh = rt.heads.ok_or_else(|| {
                            Error::invalid(format!("tensor {t} has no heads at prefill {}", p.tp))
                        })?;
                        let theirs = tp::heads(p.tp, h.total);
                        for k in 0..u64::from(h.runs) {
                            let lo =
                                at + (k * u64::from(h.local) + u64::from(head - mine.start)) * hb;
                            let ro = rt.block_offset(r)
                                + (k * u64::from(rh.local) + u64::from(head - theirs.start)) * hb;
                            region.read_at(lo, &mut got)?;
                            (p.bytes)(rt.region, ro, &mut want)?;
                            if got != want {
                                return Err(differs(format!(
                                    "KV head {head}, run {k}, from prefill {}",
                                    p.tp
                                )));
                            }
                        }
                    }
                }
            }
            checked += lt.block_bytes;
        }
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_position_dependent_and_unaligned_consistent() {
        let whole = pattern(5, 0, 64);
        assert_eq!(pattern(5, 13, 20), whole[13..33].to_vec());
        assert_ne!(pattern(6, 0, 64), whole);
        assert_ne!(whole[0..8], whole[8..16]);
    }
}
