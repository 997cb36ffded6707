//! Shapes of common models ([`ModelShape`]): the layouts of their KV caches, for benchmarks,
//! tests and examples.

use super::{HeadSplit, KvLayout, TensorLayout};
use crate::error::{Error, Result};
use crate::ids::RegionId;
use crate::tp::{self, TpRank};

/// Shapes of common models, for benchmarks, tests and examples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    /// Preset name.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u32,
    /// Tensors per layer (2 for separate K and V, 1 for an MLA latent).
    pub tensors_per_layer: u32,
    /// Bytes per token per tensor (for K: kv_heads * head_dim * element size).
    pub bytes_per_token: u64,
    /// KV heads in `bytes_per_token`, which TP splits over ranks ([`layout_tp`]); 0 when every
    /// rank holds the whole tensor (MLA's latent).
    ///
    /// [`layout_tp`]: ModelShape::layout_tp
    pub kv_heads: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// dtype tag.
    pub dtype: &'static str,
}

impl ModelShape {
    /// Llama-3-8B at TP 1: 32 layers, K and V separate, 8 KV heads x 128 dims, bf16.
    pub const LLAMA3_8B: ModelShape = ModelShape {
        name: "llama-3-8b",
        layers: 32,
        tensors_per_layer: 2,
        bytes_per_token: 8 * 128 * 2,
        kv_heads: 8,
        tokens_per_block: 16,
        dtype: "bf16",
    };
    /// Llama-3-70B at TP 8: 80 layers, one of 8 KV heads per rank x 128 dims, bf16.
    pub const LLAMA3_70B_TP8: ModelShape = ModelShape {
        name: "llama-3-70b-tp8",
        layers: 80,
        tensors_per_layer: 2,
        bytes_per_token: 128 * 2,
        kv_heads: 1,
        tokens_per_block: 16,
        dtype: "bf16",
    };
    /// DeepSeek-V3 MLA: 61 layers, one latent tensor of 576 bytes per token (fp8).
    pub const DEEPSEEK_V3_MLA: ModelShape = ModelShape {
        name: "deepseek-v3-mla",
        layers: 61,
        tensors_per_layer: 1,
        bytes_per_token: 576,
        kv_heads: 0,
        tokens_per_block: 16,
        dtype: "fp8_e4m3",
    };
    /// Qwen2.5-7B (GQA): 28 layers, 4 KV heads x 128 dims, bf16.
    pub const QWEN25_7B: ModelShape = ModelShape {
        name: "qwen2.5-7b",
        layers: 28,
        tensors_per_layer: 2,
        bytes_per_token: 4 * 128 * 2,
        kv_heads: 4,
        tokens_per_block: 16,
        dtype: "bf16",
    };

    /// All presets.
    pub const PRESETS: [ModelShape; 4] = [
        Self::LLAMA3_8B,
        Self::LLAMA3_70B_TP8,
        Self::DEEPSEEK_V3_MLA,
        Self::QWEN25_7B,
    ];

    /// Looks a preset up by name.
    pub fn preset(name: &str) -> Option<ModelShape> {
        Self::PRESETS.iter().find(|p| p.name == name).cloned()
    }

    /// Bytes of one block of one tensor.
    pub fn block_bytes(&self) -> u64 {
        self.bytes_per_token * u64::from(self.tokens_per_block)
    }

    /// Bytes a region needs to hold `num_blocks` blocks of every tensor.
    pub fn region_bytes(&self, num_blocks: u32) -> u64 {
        self.block_bytes() * u64::from(num_blocks) * u64::from(self.layers * self.tensors_per_layer)
    }

    /// The layout of a cache with `num_blocks` blocks per tensor, all in `region`, one tensor
    /// after the other (vLLM's per-layer K and V tensors, ATOM's `kv[2, L, NB, ...]`).
    pub fn layout(&self, region: RegionId, num_blocks: u32) -> KvLayout {
        let block_bytes = self.block_bytes();
        let tensor_bytes = block_bytes * u64::from(num_blocks);
        let names: &[&str] = if self.tensors_per_layer == 2 {
            &["k", "v"]
        } else {
            &["kv"]
        };
        let mut tensors = Vec::new();
        for layer in 0..self.layers {
            for name in names {
                let i = tensors.len() as u64;
                tensors.push(TensorLayout {
                    name: format!("layer{layer}.{name}"),
                    region,
                    offset: i * tensor_bytes,
                    block_stride: block_bytes,
                    block_bytes,
                    num_blocks,
                    group: 0,
                    heads: None,
                    token_runs: Some(1),
                });
            }
        }
        KvLayout {
            tokens_per_block: self.tokens_per_block,
            dtype: self.dtype.to_string(),
            tensors,
        }
    }

    /// Bytes per token per tensor on one rank of a TP group of `tp_size` (all of
    /// `bytes_per_token` without heads), or why the heads do not split over it.
    pub fn rank_bytes_per_token(&self, tp_size: u32) -> Result<u64> {
        if self.kv_heads == 0 {
            return Ok(self.bytes_per_token);
        }
        let n = tp::heads_per_rank(self.kv_heads, tp_size).ok_or_else(|| {
            Error::invalid(format!(
                "{}: {} KV heads do not split evenly over TP {tp_size}",
                self.name, self.kv_heads
            ))
        })?;
        Ok(self.bytes_per_token / u64::from(self.kv_heads) * u64::from(n))
    }

    /// Bytes a region of one rank of TP `tp_size` needs for `num_blocks` blocks of every tensor.
    pub fn region_bytes_tp(&self, num_blocks: u32, tp_size: u32) -> Result<u64> {
        Ok(self.rank_bytes_per_token(tp_size)?
            * u64::from(self.tokens_per_block)
            * u64::from(num_blocks)
            * u64::from(self.layers * self.tensors_per_layer))
    }

    /// The layout of rank `tp` of a TP group: [`layout`](Self::layout) with this rank's share
    /// of the KV heads, which every tensor declares ([`HeadSplit`]; blocks head-major
    /// `[heads, tokens, dim]` when `head_major`, else token-major `[tokens, heads, dim]`), so
    /// that engines of other TP sizes can read it. MLA shapes (no heads) are the same on every
    /// rank.
    pub fn layout_tp(
        &self,
        region: RegionId,
        num_blocks: u32,
        tp: TpRank,
        head_major: bool,
    ) -> Result<KvLayout> {
        let per_token = self.rank_bytes_per_token(tp.size)?;
        let rank = ModelShape {
            bytes_per_token: per_token,
            ..self.clone()
        };
        let mut layout = rank.layout(region, num_blocks);
        if self.kv_heads > 0 {
            let split = HeadSplit {
                total: self.kv_heads,
                local: tp::heads_per_rank(self.kv_heads, tp.size).unwrap_or(1),
                runs: if head_major { 1 } else { self.tokens_per_block },
            };
            for t in &mut layout.tensors {
                t.heads = Some(split);
                t.token_runs = Some(if head_major { split.local } else { 1 });
            }
        }
        Ok(layout)
    }
}
