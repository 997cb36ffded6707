//! KV-cache event types and their two msgpack encodings (see the shared wire notes):
//! *current* (vLLM >= 0.24, SGLang): each event a map whose first key is `"type"`; *legacy*
//! (older vLLM/SGLang, ATOM): each event an array, tag first, fields in declaration order.
//! A batch is `[ts, events, dp_rank]` (publishers before vLLM PR 18925 sent two elements).
//!
//! Decoding accepts both encodings and every hash form (u64, i64, bin), ignores unknown keys and
//! trailing elements, and skips a malformed or unknown event on its own (counted with its
//! reason) without losing the rest of its batch.

mod decode;
mod encode;

pub use decode::decode_batch;
pub use encode::{encode_batch, encode_event};

/// A block hash as it appeared on the wire. Consumers index by [`BlockHash::as_u64`]: msgpack
/// does not tell a non-negative signed integer from an unsigned one, so such an `I64` hash
/// decodes as `U64` with the same bits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// vLLM's default: low 64 bits of the digest, unsigned (values >= 2^63 are common).
    U64(u64),
    /// SGLang: first 8 bytes of SHA-256 as a signed integer.
    I64(i64),
    /// Raw digest bytes (vLLM with integer hashes off).
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The hash as u64: integers keep their bits; bytes reduce to their first 8 bytes
    /// (big-endian, zero-padded).
    pub fn as_u64(&self) -> u64 {
        match self {
            BlockHash::U64(v) => *v,
            BlockHash::I64(v) => *v as u64,
            BlockHash::Bytes(b) => {
                let mut a = [0u8; 8];
                let n = b.len().min(8);
                a[..n].copy_from_slice(&b[..n]);
                u64::from_be_bytes(a)
            }
        }
    }
}

/// Blocks stored in a cache tier.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// One hash per block, in order.
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the block before the first one, if any.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens the blocks hold.
    pub token_ids: Vec<u32>,
    /// Tokens per block (a partial tail page may carry its own length; 0 for placeholders).
    pub block_size: u32,
    /// Deprecated LoRA id.
    pub lora_id: Option<i64>,
    /// Cache tier (`GPU`, `CPU`, ...).
    pub medium: Option<String>,
    /// LoRA name.
    pub lora_name: Option<String>,
    /// KV-cache group index.
    pub group_idx: Option<u32>,
    /// Attention kind of the group (`full_attention`, `mla_attention`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window of the group.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// ATOM: position of the first block's first token in the sequence.
    pub token_offset: Option<u64>,
}

/// Blocks removed from a cache tier.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Cache tier.
    pub medium: Option<String>,
    /// KV-cache group index.
    pub group_idx: Option<u32>,
}

/// ATOM: blocks moved between tiers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockTransferred {
    /// Hashes of the moved blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Source tier.
    pub from_medium: Option<String>,
    /// Destination tier.
    pub to_medium: Option<String>,
    /// KV-cache group index.
    pub group_idx: Option<u32>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// `BlockStored`
    BlockStored(BlockStored),
    /// `BlockRemoved`
    BlockRemoved(BlockRemoved),
    /// `AllBlocksCleared` (ATOM adds a medium).
    AllBlocksCleared {
        /// Cache tier, when given.
        medium: Option<String>,
    },
    /// `BlockTransferred` (ATOM).
    BlockTransferred(BlockTransferred),
}

/// One batch (one scheduler step).
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher's timestamp, seconds since the epoch.
    pub ts: f64,
    /// The events.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank (vLLM) or attention-DP rank (SGLang).
    pub dp_rank: Option<i64>,
}

/// Event encoding on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// Tagged maps (vLLM >= 0.24, SGLang 0.5.23).
    #[default]
    Current,
    /// Tagged arrays (vLLM <= 0.23, older SGLang, ATOM).
    Legacy,
}

/// A decoded batch and the events that had to be skipped (with reasons).
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The batch, without the skipped events.
    pub batch: EventBatch,
    /// Why each skipped event was skipped.
    pub skipped: Vec<String>,
}

/// Why a whole batch is unreadable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unreadable event batch: {0}")]
pub struct BatchError(pub String);
