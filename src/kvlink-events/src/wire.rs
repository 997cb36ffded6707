//! KV-cache event types and their two msgpack encodings (see the shared wire notes):
//! *current* (vLLM >= 0.24, SGLang): each event a map whose first key is `"type"`; *legacy*
//! (older vLLM/SGLang, ATOM): each event an array, tag first, fields in declaration order.
//! A batch is `[ts, events, dp_rank]` (publishers before vLLM PR 18925 sent two elements).
//!
//! Decoding accepts both encodings and every hash form (u64, i64, bin), keeps fields it does not
//! model ([`ExtraField`]: unknown keys of a map, elements past the known order of an array) so
//! that they are re-emitted unchanged, and skips a malformed or unknown event on its own
//! (counted with its reason) without losing the rest of its batch.

mod decode;
mod encode;
mod errors;
mod stamp;

pub use decode::{decode_batch, decode_batch_reusing};
pub use encode::{encode_batch, encode_event, encode_stored_ref};
pub use errors::{BatchError, EventError, SkippedEvent};
pub use stamp::incarnation_of;
pub(crate) use stamp::{fresh_u64, stamp, stamped};

pub use super::msgpack::Value;

/// Where a field kvlink does not model sat in its event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FieldKey {
    /// A key of a current-encoding (map) event.
    Name(String),
    /// An element of a legacy-encoding (array) event past the fields kvlink knows, by its index
    /// in the array (the tag is index 0).
    Position(usize),
}

/// A field kvlink does not model, kept as read and re-emitted unchanged by the encoders: a
/// named field in the current encoding, a positional one in the legacy encoding (a field
/// has no name in an array and no place in a map, so it is not carried across encodings).
#[derive(Debug, Clone, PartialEq)]
pub struct ExtraField {
    /// The field's key or position.
    pub key: FieldKey,
    /// Its value, as decoded (strings with invalid UTF-8 are replaced; 32-bit floats widen).
    pub value: Value,
}

/// BlockStored's fields in the legacy (array) encoding, after the tag: vLLM's declaration order
/// up to `kv_cache_spec_sliding_window` (vLLM <= 0.23 writes all eleven), ATOM's `token_offset`,
/// then kvlink's extension with vLLM 0.33's and SGLang's newer fields (their publishers use the
/// current encoding only, so these places are kvlink's own).
pub const STORED_LEGACY_ORDER: [&str; 17] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "token_offset",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "cache_salt",
];
/// BlockStored's fields written in every legacy event (vLLM 0.23's eleven).
pub(crate) const STORED_LEGACY_ALWAYS: usize = 11;
/// BlockStored's legacy places defined upstream (vLLM's eleven and ATOM's `token_offset`);
/// the later ones are kvlink's.
pub(crate) const STORED_LEGACY_UPSTREAM: usize = 12;
/// The highest legacy array position of a field kvlink does not model that it accepts from JSON
/// or Python (decoded events keep whatever positions their arrays had).
pub const MAX_EXTRA_POSITION: usize = 1024;
/// BlockRemoved's legacy places defined upstream (vLLM's three).
pub(crate) const REMOVED_LEGACY_UPSTREAM: usize = 3;
/// BlockRemoved's fields in the legacy encoding, after the tag: vLLM's three (always written),
/// then kvlink's extension with vLLM 0.33's `locality` and `ownership`.
pub const REMOVED_LEGACY_ORDER: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];
/// AllBlocksCleared's fields in the legacy encoding (ATOM's medium).
pub const CLEARED_LEGACY_ORDER: [&str; 1] = ["medium"];
/// ATOM's BlockTransferred fields in the legacy encoding (all written).
pub const TRANSFERRED_LEGACY_ORDER: [&str; 4] =
    ["block_hashes", "from_medium", "to_medium", "group_idx"];

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
    /// vLLM: the extra keys of each block's hash (LoRA name, multimodal identifiers and
    /// offsets, cache salt, prompt-embedding digests), one entry (or nil) per block.
    pub extra_keys: Option<Value>,
    /// vLLM 0.33: `LOCAL` or `REMOTE` relative to the publisher.
    pub locality: Option<String>,
    /// vLLM 0.33: the secondary offloading tier that generated the event.
    pub ownership: Option<String>,
    /// vLLM 0.33 and SGLang: the session that triggered the store (attribution only).
    pub session_id: Option<String>,
    /// vLLM 0.33: tokens past each block used in its hash, one list per block.
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// SGLang: the cache salt mixed into the hashes.
    pub cache_salt: Option<String>,
    /// Fields kvlink does not model, in wire order.
    pub extra: Vec<ExtraField>,
}

/// The cache tier an event without a medium is about.
pub(crate) const DEFAULT_MEDIUM: &str = "GPU";

impl BlockStored {
    /// Whether the tokens are carried block by block: `block_size` each, the last block
    /// possibly shorter (else they cannot be cut into the blocks).
    pub(crate) fn tokens_fit_blocks(&self) -> bool {
        let (n, size, len) = (
            self.block_hashes.len(),
            self.block_size as usize,
            self.token_ids.len(),
        );
        size > 0 && n > 0 && len > (n - 1) * size && len <= n * size
    }

    /// The fields a [`BlockStoredRef`] carries, borrowed.
    pub(crate) fn head(&self) -> BlockStoredRef<'_> {
        BlockStoredRef {
            block_hashes: HashesRef::Any(&self.block_hashes),
            parent_block_hash: self.parent_block_hash.as_ref().map(HashRef::from),
            token_ids: &self.token_ids,
            block_size: self.block_size,
            lora_id: self.lora_id,
            medium: self.medium.as_deref(),
            lora_name: self.lora_name.as_deref(),
            group_idx: self.group_idx,
        }
    }
}

/// One block hash, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashRef<'a> {
    /// An unsigned 64-bit hash (vLLM).
    U64(u64),
    /// A signed 64-bit hash (SGLang).
    I64(i64),
    /// Raw digest bytes.
    Bytes(&'a [u8]),
}

impl<'a> From<&'a BlockHash> for HashRef<'a> {
    fn from(h: &'a BlockHash) -> Self {
        match h {
            BlockHash::U64(v) => HashRef::U64(*v),
            BlockHash::I64(v) => HashRef::I64(*v),
            BlockHash::Bytes(b) => HashRef::Bytes(b),
        }
    }
}

/// A BlockStored's block hashes in the caller's memory, in whichever form it keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashesRef<'a> {
    /// Unsigned 64-bit hashes (vLLM).
    U64(&'a [u64]),
    /// Signed 64-bit hashes (SGLang).
    I64(&'a [i64]),
    /// Hashes of any form.
    Any(&'a [BlockHash]),
}

/// A BlockStored given by reference to the publisher's own memory: the fields engines fill on
/// every store. It is encoded straight into a batch ([`crate::BatchBuilder`],
/// [`encode_stored_ref`]) without building a [`BlockStored`] (no copy of the hashes or the
/// tokens, no allocation); events with more fields go in as [`KvEvent`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStoredRef<'a> {
    /// One hash per block, in order.
    pub block_hashes: HashesRef<'a>,
    /// Hash of the block before the first one, if any.
    pub parent_block_hash: Option<HashRef<'a>>,
    /// The tokens the blocks hold.
    pub token_ids: &'a [u32],
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA id.
    pub lora_id: Option<i64>,
    /// Cache tier (`GPU`, `CPU`, ...).
    pub medium: Option<&'a str>,
    /// LoRA name.
    pub lora_name: Option<&'a str>,
    /// KV-cache group index.
    pub group_idx: Option<u32>,
}

impl BlockStoredRef<'_> {
    /// The same event, owned.
    pub fn to_owned_event(&self) -> BlockStored {
        let block_hashes = match self.block_hashes {
            HashesRef::U64(v) => v.iter().map(|&h| BlockHash::U64(h)).collect(),
            HashesRef::I64(v) => v.iter().map(|&h| BlockHash::I64(h)).collect(),
            HashesRef::Any(v) => v.to_vec(),
        };
        BlockStored {
            block_hashes,
            parent_block_hash: self.parent_block_hash.map(|h| match h {
                HashRef::U64(v) => BlockHash::U64(v),
                HashRef::I64(v) => BlockHash::I64(v),
                HashRef::Bytes(b) => BlockHash::Bytes(b.to_vec()),
            }),
            token_ids: self.token_ids.to_vec(),
            block_size: self.block_size,
            lora_id: self.lora_id,
            medium: self.medium.map(str::to_string),
            lora_name: self.lora_name.map(str::to_string),
            group_idx: self.group_idx,
            ..Default::default()
        }
    }
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
    /// vLLM 0.33: `LOCAL` or `REMOTE` relative to the publisher.
    pub locality: Option<String>,
    /// vLLM 0.33: the secondary offloading tier that generated the event.
    pub ownership: Option<String>,
    /// Fields kvlink does not model, in wire order.
    pub extra: Vec<ExtraField>,
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
    /// Fields kvlink does not model, in wire order.
    pub extra: Vec<ExtraField>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
// BlockStored, the large variant, is also by far the most common event: boxing it would cost an
// allocation per event to shrink the rare ones.
#[allow(clippy::large_enum_variant)]
pub enum KvEvent {
    /// `BlockStored`
    BlockStored(BlockStored),
    /// `BlockRemoved`
    BlockRemoved(BlockRemoved),
    /// `AllBlocksCleared` (ATOM adds a medium).
    AllBlocksCleared {
        /// Cache tier, when given.
        medium: Option<String>,
        /// Fields kvlink does not model, in wire order.
        extra: Vec<ExtraField>,
    },
    /// `BlockTransferred` (ATOM).
    BlockTransferred(BlockTransferred),
}

/// One batch (one scheduler step).
#[derive(Debug, Clone, PartialEq, Default)]
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

impl KvEvent {
    /// `AllBlocksCleared` for a tier (or all tiers), with no other fields.
    pub fn all_cleared(medium: Option<String>) -> KvEvent {
        KvEvent::AllBlocksCleared {
            medium,
            extra: Vec::new(),
        }
    }

    /// The event's type name on the wire.
    pub fn type_name(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared { .. } => "AllBlocksCleared",
            KvEvent::BlockTransferred(_) => "BlockTransferred",
        }
    }

    /// The fields kvlink does not model.
    pub fn extra(&self) -> &[ExtraField] {
        match self {
            KvEvent::BlockStored(e) => &e.extra,
            KvEvent::BlockRemoved(e) => &e.extra,
            KvEvent::AllBlocksCleared { extra, .. } => extra,
            KvEvent::BlockTransferred(e) => &e.extra,
        }
    }

    /// The first legacy array position a field kvlink does not model may take in an event of
    /// type `ty`: past the places defined upstream. (kvlink's own later places may hold such a
    /// field too; it is written there only while kvlink's field is unset.)
    pub fn first_extra_position(ty: &str) -> usize {
        1 + match ty {
            "BlockStored" => STORED_LEGACY_UPSTREAM,
            "BlockRemoved" => REMOVED_LEGACY_UPSTREAM,
            "AllBlocksCleared" => CLEARED_LEGACY_ORDER.len(),
            _ => TRANSFERRED_LEGACY_ORDER.len(),
        }
    }

    /// Whether `name` is a field kvlink models for events of type `ty` (either encoding).
    pub fn known_field(ty: &str, name: &str) -> bool {
        name == "type"
            || match ty {
                "BlockStored" => STORED_LEGACY_ORDER.contains(&name),
                "BlockRemoved" => REMOVED_LEGACY_ORDER.contains(&name),
                "AllBlocksCleared" => CLEARED_LEGACY_ORDER.contains(&name),
                "BlockTransferred" => TRANSFERRED_LEGACY_ORDER.contains(&name),
                _ => false,
            }
    }
}

/// A decoded batch and the events that had to be skipped (with reasons).
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The batch, without the skipped events.
    pub batch: EventBatch,
    /// The encoding of the batch's first event (current when it has none): a batch re-encoded
    /// in it keeps its unknown fields.
    pub encoding: Encoding,
    /// The events skipped, each with why.
    pub skipped: Vec<SkippedEvent>,
}
