//! KV-cache layout: where each block of each tensor lives, by arithmetic.
//!
//! A worker's KV cache is a list of tensors (per layer K and V, or one MLA latent tensor per
//! layer, plus any per-block extras such as fp8 scales). Block `b` of tensor `t` occupies
//! `[offset_t + b * block_stride_t, +block_bytes_t)` of region `region_t`. There are no
//! per-block tables.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::{BlockId, RegionId};
use crate::memory::RegionInfo;
use crate::tp;

/// Most tensors one layout may hold (bounds a peer's descriptor).
pub const MAX_TENSORS: usize = 16_384;

/// Most block groups one layout may have.
pub const MAX_GROUPS: usize = 64;

/// How a tensor's blocks hold KV heads that tensor parallelism splits over ranks. A block is
/// `runs` repetitions of this rank's `local` heads side by side, each head `block_bytes /
/// (runs * local)` bytes: `runs` is 1 when a block is head-major (`[heads, tokens, dim]`, vLLM's
/// HND), `tokens_per_block` when it is token-major (`[tokens, heads, dim]`, NHD), twice that
/// for `[2, tokens, heads, dim]` (K and V in one block). With it, a decode of another TP size
/// reads its own heads out of the prefill's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadSplit {
    /// KV heads of the model in this tensor, over all TP ranks.
    pub total: u32,
    /// KV heads this rank holds: `total / tp_size`, or 1 when there are more ranks than heads.
    pub local: u32,
    /// Runs of heads per block (see the type's docs).
    pub runs: u32,
}

impl HeadSplit {
    /// Bytes of one head in one run of a block of `block_bytes`.
    pub fn head_bytes(&self, block_bytes: u64) -> u64 {
        block_bytes / (u64::from(self.runs) * u64::from(self.local)).max(1)
    }
}

/// One tensor of the KV cache, as a run of equally spaced blocks in one region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorLayout {
    /// Free-form label for logs and errors, e.g. `"layer3.k"`.
    pub name: String,
    /// Region that holds the tensor.
    pub region: RegionId,
    /// Byte offset of block 0 within the region.
    pub offset: u64,
    /// Distance in bytes from one block to the next (at least `block_bytes`).
    pub block_stride: u64,
    /// Bytes of one block of this tensor.
    pub block_bytes: u64,
    /// Number of blocks.
    pub num_blocks: u32,
    /// The block group (block-id space) the tensor belongs to: reads and holds give block ids
    /// per group (vLLM's KV cache groups of hybrid models, SGLang's aux and state buffers).
    /// Groups are numbered from 0 without gaps; most layouts have only group 0.
    #[serde(default)]
    pub group: u32,
    /// How the tensor's KV heads are split over TP ranks; `None` when every rank holds the
    /// tensor whole (MLA's latent) or when the TP sizes of both sides are the same.
    #[serde(default)]
    pub heads: Option<HeadSplit>,
    /// How a block holds its tokens: `token_runs` stretches side by side, each with every
    /// token of the block in order, all tokens' bytes alike. 1 when tokens are the block's
    /// outer axis (`[tokens, ...]`, MLA's latent, token-major `[tokens, heads, dim]`), 2 for
    /// `[2, tokens, heads, dim]`, and for head-major blocks (`[heads, tokens, dim]`) the local
    /// heads times that. Needed only to read between layouts of different `tokens_per_block`
    /// (a block is then read token range by token range); `None` refuses such reads.
    #[serde(default)]
    pub token_runs: Option<u32>,
}

/// What one block of a tensor is, token by token: `parts` stretches (K and V, say) of
/// `tokens` tokens, each token `heads` heads of `head_bytes`; the heads sit inside each token
/// (token-major) or each head holds all the stretch's tokens (head-major).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenShape {
    /// Stretches of the block's tokens that are not heads (1, or 2 for K and V).
    pub parts: u64,
    /// Whether heads are outside the tokens (`[heads, tokens, dim]`).
    pub head_major: bool,
    /// Heads per stretch in this block (1 without heads).
    pub heads: u64,
    /// Tokens per block.
    pub tokens: u64,
    /// Bytes of one head of one token.
    pub head_bytes: u64,
}

impl TokenShape {
    /// Bytes from one part to the next.
    pub fn part_bytes(&self) -> u64 {
        self.heads * self.tokens * self.head_bytes
    }

    /// `self` and `other` with one orientation: a block of one head is head-major and
    /// token-major at once, so it takes the other side's.
    pub fn aligned(mut self, mut other: TokenShape) -> (TokenShape, TokenShape) {
        if self.head_major != other.head_major {
            if self.heads == 1 {
                self.head_major = other.head_major;
            } else if other.heads == 1 {
                other.head_major = self.head_major;
            }
        }
        (self, other)
    }
}

impl TensorLayout {
    /// How a block of this tensor holds `tokens_per_block` tokens, from
    /// [`token_runs`](Self::token_runs) and the heads it declares; `Err` says what does not fit.
    // A String error kept: public; `validate` wraps the reason with the tensor it names.
    pub fn token_shape(&self, tokens_per_block: u32) -> std::result::Result<TokenShape, String> {
        let runs = self.token_runs.ok_or(
            "declares no token runs (token_runs), which reads between different block sizes need",
        )?;
        let (runs, tokens) = (u64::from(runs), u64::from(tokens_per_block));
        if runs == 0 || tokens == 0 || !self.block_bytes.is_multiple_of(runs * tokens) {
            return Err(format!(
                "a block of {} bytes is not {runs} token runs of {tokens} tokens",
                self.block_bytes
            ));
        }
        // Bytes of one token in one run: every head of it, or (head-major) one.
        let per_token = self.block_bytes / (runs * tokens);
        let shape = |parts, head_major, heads: u64, head_bytes| TokenShape {
            parts,
            head_major,
            heads,
            tokens,
            head_bytes,
        };
        let Some(h) = self.heads else {
            return Ok(shape(runs, false, 1, per_token));
        };
        let (hr, local) = (u64::from(h.runs), u64::from(h.local));
        if hr == runs * tokens && per_token.is_multiple_of(local) {
            Ok(shape(runs, false, local, per_token / local))
        } else if hr * local == runs {
            Ok(shape(hr, true, local, per_token))
        } else {
            Err(format!(
                "{runs} token runs do not fit {} runs of {local} heads in a block of {tokens} tokens",
                h.runs
            ))
        }
    }

    /// Byte offset of block `b` within the tensor's region (no bounds check).
    #[inline]
    pub fn block_offset(&self, b: BlockId) -> u64 {
        self.offset + u64::from(b) * self.block_stride
    }

    /// One past the last byte the tensor covers.
    fn end(&self) -> Option<u64> {
        if self.num_blocks == 0 {
            return Some(self.offset);
        }
        u64::from(self.num_blocks - 1)
            .checked_mul(self.block_stride)?
            .checked_add(self.offset)?
            .checked_add(self.block_bytes)
    }
}

/// A worker's whole KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Tokens stored per block (16 in vLLM's default).
    pub tokens_per_block: u32,
    /// Element type tag (`"bf16"`, `"fp8_e4m3"`, ...); peers must agree.
    pub dtype: String,
    /// The tensors, in the order both sides agree on (layer-major, K before V).
    pub tensors: Vec<TensorLayout>,
}

impl KvLayout {
    /// A layout of `tensors`, each given as `(region, offset, block_stride, block_bytes,
    /// num_blocks)` and named `t0`, `t1`, ... in order (the names only appear in logs and
    /// errors). The bindings build their layouts with it; check it with
    /// [`validate`](Self::validate) (as `Engine::set_layout` does).
    pub fn numbered(
        tokens_per_block: u32,
        dtype: impl Into<String>,
        tensors: impl IntoIterator<Item = (RegionId, u64, u64, u64, u32)>,
    ) -> KvLayout {
        KvLayout {
            tokens_per_block,
            dtype: dtype.into(),
            tensors: tensors
                .into_iter()
                .enumerate()
                .map(
                    |(i, (region, offset, block_stride, block_bytes, num_blocks))| TensorLayout {
                        name: format!("t{i}"),
                        region,
                        offset,
                        block_stride,
                        block_bytes,
                        num_blocks,
                        group: 0,
                        heads: None,
                        token_runs: None,
                    },
                )
                .collect(),
        }
    }

    /// Number of block groups (one more than the highest group of a tensor).
    pub fn num_groups(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.group as usize + 1)
            .max()
            .unwrap_or(1)
    }

    /// Number of blocks every tensor of block group `group` can address.
    pub fn group_blocks(&self, group: usize) -> u32 {
        self.tensors
            .iter()
            .filter(|t| t.group as usize == group)
            .map(|t| t.num_blocks)
            .min()
            .unwrap_or(0)
    }

    /// Bytes per block and block count of a KV cache buffer of `nbytes` whose first axis holds
    /// `blocks` blocks (an array of shape `(blocks, ...)`): refused unless it splits evenly into
    /// 1 to `u32::MAX` blocks.
    pub fn split_buffer(nbytes: u64, blocks: u64) -> Result<(u64, u32)> {
        match u32::try_from(blocks) {
            Ok(n) if n > 0 && nbytes.is_multiple_of(blocks) && nbytes > 0 => {
                Ok((nbytes / blocks, n))
            }
            _ => Err(Error::invalid(format!(
                "a KV cache array of {nbytes} bytes cannot be split into {blocks} blocks"
            ))),
        }
    }

    /// Number of blocks every tensor can address (the smallest `num_blocks`; per block group:
    /// [`group_blocks`](Self::group_blocks)).
    pub fn num_blocks(&self) -> u32 {
        self.tensors.iter().map(|t| t.num_blocks).min().unwrap_or(0)
    }

    /// Bytes moved per block id over all tensors.
    pub fn bytes_per_block(&self) -> u64 {
        self.tensors.iter().map(|t| t.block_bytes).sum()
    }

    /// Checks the layout is well formed and lies inside `regions`. Used for our own layout at
    /// registration and for every peer's layout received in a handshake.
    pub fn validate(&self, regions: &[RegionInfo]) -> Result<()> {
        if self.tensors.is_empty() {
            return Err(Error::invalid("layout has no tensors"));
        }
        if self.tensors.len() > MAX_TENSORS {
            return Err(Error::invalid(format!(
                "layout has {} tensors, the limit is {MAX_TENSORS}",
                self.tensors.len()
            )));
        }
        if self.tokens_per_block == 0 {
            return Err(Error::invalid("tokens_per_block is 0"));
        }
        if self.dtype.is_empty() || self.dtype.len() > 32 {
            return Err(Error::invalid("dtype tag must be 1 to 32 bytes"));
        }
        let lens: HashMap<RegionId, u64> = regions.iter().map(|r| (r.id, r.len)).collect();
        let mut groups = [false; MAX_GROUPS];
        for (i, t) in self.tensors.iter().enumerate() {
            let what = || format!("tensor {i} ({:?})", t.name);
            match groups.get_mut(t.group as usize) {
                Some(seen) => *seen = true,
                None => {
                    return Err(Error::invalid(format!(
                        "{}: block group {} (at most {MAX_GROUPS} groups, numbered from 0)",
                        what(),
                        t.group
                    )))
                }
            }
            self.check_tensor(t, &what, &lens)?;
        }
        if let Some(g) = groups[..self.num_groups()].iter().position(|seen| !seen) {
            return Err(Error::invalid(format!(
                "block group {g} has no tensor (groups are numbered from 0 without gaps)"
            )));
        }
        Ok(())
    }

    /// One tensor's checks for [`validate`](Self::validate): its heads and token runs split
    /// its blocks, its name, block size and stride are sane, and its blocks lie inside its
    /// registered region (`lens`: each region's length). `what` names it in the errors.
    fn check_tensor(
        &self,
        t: &TensorLayout,
        what: &dyn Fn() -> String,
        lens: &HashMap<RegionId, u64>,
    ) -> Result<()> {
        if let Some(h) = &t.heads {
            let runs_heads = u64::from(h.runs) * u64::from(h.local);
            if h.total == 0 || h.local == 0 || h.runs == 0 || h.local > h.total {
                return Err(Error::invalid(format!(
                    "{}: heads {} of {} in {} runs (each at least 1, local at most total)",
                    what(),
                    h.local,
                    h.total,
                    h.runs
                )));
            }
            if !t.block_bytes.is_multiple_of(runs_heads) {
                return Err(Error::invalid(format!(
                    "{}: a block of {} bytes does not split into {} runs of {} heads",
                    what(),
                    t.block_bytes,
                    h.runs,
                    h.local
                )));
            }
        }
        if t.token_runs.is_some() {
            t.token_shape(self.tokens_per_block)
                .map_err(|why| Error::invalid(format!("{}: {why}", what())))?;
        }
        if t.name.len() > 128 {
            return Err(Error::invalid(format!(
                "{}: name longer than 128 bytes",
                what()
            )));
        }
        if t.block_bytes == 0 {
            return Err(Error::invalid(format!("{}: block_bytes is 0", what())));
        }
        if t.block_stride < t.block_bytes {
            return Err(Error::invalid(format!(
                "{}: block_stride {} is smaller than block_bytes {} (blocks would overlap)",
                what(),
                t.block_stride,
                t.block_bytes
            )));
        }
        let Some(&region_len) = lens.get(&t.region) else {
            return Err(Error::invalid(format!(
                "{}: {} is not registered",
                what(),
                t.region
            )));
        };
        match t.end() {
            Some(end) if end <= region_len => {}
            _ => {
                return Err(Error::invalid(format!(
                    "{}: {} blocks of stride {} from offset {} run past the end of {} ({} bytes)",
                    what(),
                    t.num_blocks,
                    t.block_stride,
                    t.offset,
                    t.region,
                    region_len
                )))
            }
        }
        Ok(())
    }

    /// Checks that the heads each tensor declares are what a rank of a TP group of `tp_size`
    /// holds (`total / tp_size`, or 1 with more ranks than heads).
    pub fn validate_tp(&self, tp_size: u32) -> Result<()> {
        for (i, t) in self.tensors.iter().enumerate() {
            let Some(h) = &t.heads else { continue };
            match tp::heads_per_rank(h.total, tp_size) {
                Some(n) if n == h.local => {}
                Some(n) => {
                    return Err(Error::invalid(format!(
                        "tensor {i} ({:?}) declares {} of {} KV heads, but a rank of TP {tp_size} holds {n}",
                        t.name, h.local, h.total
                    )))
                }
                None => {
                    return Err(Error::invalid(format!(
                        "tensor {i} ({:?}): {} KV heads cannot be split evenly over TP {tp_size}",
                        t.name, h.total
                    )))
                }
            }
        }
        Ok(())
    }

    /// Lists every difference that makes `theirs` unusable with `self` for block transfers;
    /// empty when compatible. Offsets, strides and block counts may differ; what a block *is*
    /// may not.
    pub fn differences(&self, theirs: &KvLayout) -> Vec<String> {
        let mut diffs = Vec::new();
        let (a, b) = (self.tokens_per_block, theirs.tokens_per_block);
        let resized = a != b && a.max(b) % a.min(b) == 0;
        if a != b && !resized {
            diffs.push(format!(
                "tokens_per_block {a} vs {b} (neither a multiple of the other)"
            ));
        }
        if self.dtype != theirs.dtype {
            diffs.push(format!("dtype {:?} vs {:?}", self.dtype, theirs.dtype));
        }
        if self.tensors.len() != theirs.tensors.len() {
            diffs.push(format!(
                "tensor count {} vs {}",
                self.tensors.len(),
                theirs.tensors.len()
            ));
        }
        let mut mismatched = 0;
        let mut first = String::new();
        for (i, (a, b)) in self.tensors.iter().zip(&theirs.tensors).enumerate() {
            let why = if resized {
                token_difference(a, self.tokens_per_block, b, theirs.tokens_per_block)
            } else {
                tensor_difference(a, b)
            };
            let Some(why) = why else {
                continue;
            };
            if mismatched == 0 {
                let _ = write!(first, "tensor {i} ({:?}) {why}", a.name);
            }
            mismatched += 1;
        }
        if mismatched > 0 {
            if mismatched > 1 {
                let _ = write!(first, " (and {} more tensors)", mismatched - 1);
            }
            diffs.push(first);
        }
        diffs
    }
}

/// What makes tensor `b` (theirs) unusable with `a` (ours), if anything: another block group,
/// heads declared on one side only, another head count, arrangement or head size, or (without
/// heads) another size of block.
fn tensor_difference(a: &TensorLayout, b: &TensorLayout) -> Option<String> {
    if a.group != b.group {
        return Some(format!("block group {} vs {}", a.group, b.group));
    }
    match (&a.heads, &b.heads) {
        (None, None) if a.block_bytes != b.block_bytes => Some(format!(
            "bytes per block {} vs {}",
            a.block_bytes, b.block_bytes
        )),
        (None, None) => None,
        (Some(x), Some(y)) => {
            let (hx, hy) = (x.head_bytes(a.block_bytes), y.head_bytes(b.block_bytes));
            if x.total != y.total {
                Some(format!("KV heads {} vs {}", x.total, y.total))
            } else if x.runs != y.runs {
                Some(format!(
                    "runs of heads per block {} vs {} (head-major vs token-major blocks?)",
                    x.runs, y.runs
                ))
            } else if hx != hy {
                Some(format!("bytes per head {hx} vs {hy}"))
            } else {
                None
            }
        }
        (Some(_), None) => Some("declares its KV heads here but not at the peer".into()),
        (None, Some(_)) => Some("declares its KV heads at the peer but not here".into()),
    }
}

/// What makes tensor `b` (theirs, blocks of `tb` tokens) unusable with `a` (ours, `ta`) when
/// the block sizes differ, if anything: another block group, heads declared on one side only or
/// of another count, or another shape per token ([`TokenShape`]: parts, head-major or not,
/// bytes per head and token).
pub(crate) fn token_difference(
    a: &TensorLayout,
    ta: u32,
    b: &TensorLayout,
    tb: u32,
) -> Option<String> {
    if a.group != b.group {
        return Some(format!("block group {} vs {}", a.group, b.group));
    }
    match (&a.heads, &b.heads) {
        (Some(x), Some(y)) if x.total != y.total => {
            return Some(format!("KV heads {} vs {}", x.total, y.total))
        }
        (Some(_), None) => return Some("declares its KV heads here but not at the peer".into()),
        (None, Some(_)) => return Some("declares its KV heads at the peer but not here".into()),
        _ => {}
    }
    let (x, y) = match (a.token_shape(ta), b.token_shape(tb)) {
        (Ok(x), Ok(y)) => x.aligned(y),
        (Err(e), _) => return Some(format!("here {e}")),
        (_, Err(e)) => return Some(format!("at the peer {e}")),
    };
    let per = |s: &TokenShape| (s.parts, s.head_major, s.head_bytes);
    (per(&x) != per(&y)).then(|| {
        format!(
            "per token: {} parts of {} heads of {} bytes{} vs {} parts of {} of {}{}",
            x.parts,
            x.heads,
            x.head_bytes,
            if x.head_major { ", head-major" } else { "" },
            y.parts,
            y.heads,
            y.head_bytes,
            if y.head_major { ", head-major" } else { "" },
        )
    })
}

mod shapes;

pub use shapes::ModelShape;

#[cfg(test)]
mod tests;
