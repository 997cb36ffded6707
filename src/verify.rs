//! Deterministic fill patterns and byte-for-byte checks of transferred blocks, for tests,
//! benchmarks (`kvlink-bench --verify`) and users validating a deployment.
//!
//! A region filled with seed `s` holds, at every 8-byte-aligned offset `8w`, a 64-bit word that
//! depends only on `(s, w)`, so any process can compute what any byte of a peer's cache should
//! be.

use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::KvLayout;
use crate::memory::Region;

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
