//! The checks of a request's block lists against the layouts: one list per block group, list
//! lengths (one to one, or covering each other between block sizes), block ids in range, no
//! local block twice. Pure, no I/O.

use super::Resize;
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::layout::KvLayout;

/// How each block group of a read pairs its lists: this engine's and the peer's tokens per
/// block, and where the read starts in each group's first remote block (`first_tokens`, one
/// per group, or none for 0 everywhere). Refuses sizes that do not divide and starts that do
/// not fit ([`Resize::check`]).
pub fn resizes(
    local_tokens: u32,
    remote_tokens: u32,
    first_tokens: &[u32],
    groups: usize,
) -> Result<Vec<Resize>> {
    if !first_tokens.is_empty() && first_tokens.len() != groups {
        return Err(Error::invalid(format!(
            "{} first tokens for a layout of {groups} block groups; give one per group, or none",
            first_tokens.len()
        )));
    }
    (0..groups)
        .map(|g| {
            let r = Resize {
                local_tokens,
                remote_tokens,
                first_token: first_tokens.get(g).copied().unwrap_or(0),
            };
            r.check().map(|()| r)
        })
        .collect()
}

/// Checks the local half of a request: one block list per block group of the layout, list
/// lengths (one to one, or covering each other when the peer's blocks, of `remote_tokens`
/// tokens, hold another number of tokens than ours: see [`resizes`]), local block ids in range,
/// and no local block named twice in a group (two reads into the same destination).
pub fn check_local_blocks<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    local_blocks: &[L],
    remote_blocks: &[R],
    remote_tokens: u32,
    first_tokens: &[u32],
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
    let resizes = resizes(local.tokens_per_block, remote_tokens, first_tokens, groups)?;
    for (g, (lb, rb)) in local_blocks.iter().zip(remote_blocks).enumerate() {
        let (lb, rb) = (lb.as_ref(), rb.as_ref());
        let in_group = |what: String| {
            if groups > 1 {
                format!("block group {g}: {what}")
            } else {
                what
            }
        };
        match &resizes[g] {
            r if r.ratio() > 1 => r
                .check_lengths(lb.len(), rb.len())
                .map_err(|why| Error::invalid(in_group(why)))?,
            _ if lb.len() != rb.len() => {
                return Err(Error::invalid(in_group(format!(
                    "{} local block ids but {} remote block ids; they pair one to one",
                    lb.len(),
                    rb.len()
                ))))
            }
            _ => {}
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

/// Checks a request's block lists against both layouts: [`check_local_blocks`] (with the
/// layouts' block sizes, the read starting `first_tokens[g]` tokens into group `g`'s first
/// remote block), remote block ids in range, and layouts with the same tensors and block groups
/// (sizes are checked by [`tensor_reads`]).
pub fn check_blocks<L: AsRef<[BlockId]>, R: AsRef<[BlockId]>>(
    local: &KvLayout,
    remote: &KvLayout,
    local_blocks: &[L],
    remote_blocks: &[R],
    first_tokens: &[u32],
) -> Result<()> {
    let tokens = remote.tokens_per_block;
    check_local_blocks(local, local_blocks, remote_blocks, tokens, first_tokens)?;
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
