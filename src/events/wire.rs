//! KV-cache event types and their two msgpack encodings (see the shared wire notes):
//! *current* (vLLM >= 0.24, SGLang): each event a map whose first key is `"type"`; *legacy*
//! (older vLLM/SGLang, ATOM): each event an array, tag first, fields in declaration order.
//! A batch is `[ts, events, dp_rank]` (publishers before vLLM PR 18925 sent two elements).
//!
//! Decoding accepts both encodings and every hash form (u64, i64, bin), ignores unknown keys and
//! trailing elements, and skips a malformed or unknown event on its own (counted with its
//! reason) without losing the rest of its batch.

use rmp::encode as w;

use super::msgpack::{self, Value};

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

const STORED_ORDER: [&str; 12] = [
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
];
const REMOVED_ORDER: [&str; 3] = ["block_hashes", "medium", "group_idx"];
const CLEARED_ORDER: [&str; 1] = ["medium"];
const TRANSFERRED_ORDER: [&str; 4] = ["block_hashes", "from_medium", "to_medium", "group_idx"];

/// Fields of one event, by name, whichever encoding carried them.
struct Fields<'a> {
    map: Option<&'a [(Value, Value)]>,
    array: Option<(&'a [Value], &'static [&'static str])>,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        if let Some(m) = self.map {
            return m
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v);
        }
        let (items, order) = self.array?;
        let i = order.iter().position(|f| *f == name)?;
        items.get(i)
    }

    fn opt<T>(&self, name: &str, conv: impl Fn(&Value) -> Option<T>) -> Result<Option<T>, String> {
        match self.get(name) {
            None | Some(Value::Nil) => Ok(None),
            Some(v) => conv(v)
                .map(Some)
                .ok_or_else(|| format!("field {name} has the wrong type")),
        }
    }

    fn hashes(&self, name: &str) -> Result<Vec<BlockHash>, String> {
        match self.get(name) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| hash(v).ok_or_else(|| format!("a {name} entry is not a hash")))
                .collect(),
            None | Some(Value::Nil) => Ok(Vec::new()),
            Some(_) => Err(format!("field {name} is not an array")),
        }
    }
}

fn hash(v: &Value) -> Option<BlockHash> {
    match v {
        Value::UInt(u) => Some(BlockHash::U64(*u)),
        Value::Int(i) => Some(BlockHash::I64(*i)),
        Value::Bin(b) if !b.is_empty() => Some(BlockHash::Bytes(b.clone())),
        _ => None,
    }
}

fn string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_string)
}

fn u32_of(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

fn event(v: &Value) -> Result<KvEvent, String> {
    let (tag, fields) = match v {
        Value::Map(m) => {
            let tag = m
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, t)| t.as_str())
                .ok_or("map event without a string \"type\"")?;
            (
                tag,
                Fields {
                    map: Some(m),
                    array: None,
                },
            )
        }
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or("array event without a tag")?;
            let order: &'static [&'static str] = match tag {
                "BlockStored" => &STORED_ORDER,
                "BlockRemoved" => &REMOVED_ORDER,
                "AllBlocksCleared" => &CLEARED_ORDER,
                "BlockTransferred" => &TRANSFERRED_ORDER,
                _ => &[],
            };
            (
                tag,
                Fields {
                    map: None,
                    array: Some((&items[1..], order)),
                },
            )
        }
        _ => return Err("event is neither a map nor an array".into()),
    };
    match tag {
        "BlockStored" => {
            let token_ids = match fields.get("token_ids") {
                Some(Value::Array(t)) => t
                    .iter()
                    .map(|x| u32_of(x).ok_or("a token id is not a u32"))
                    .collect::<Result<Vec<_>, _>>()?,
                None | Some(Value::Nil) => Vec::new(),
                Some(_) => return Err("token_ids is not an array".into()),
            };
            let e = BlockStored {
                block_hashes: fields.hashes("block_hashes")?,
                parent_block_hash: fields.opt("parent_block_hash", hash)?,
                token_ids,
                block_size: fields.opt("block_size", u32_of)?.unwrap_or(0),
                lora_id: fields.opt("lora_id", Value::as_i64)?,
                medium: fields.opt("medium", string)?,
                lora_name: fields.opt("lora_name", string)?,
                group_idx: fields.opt("group_idx", u32_of)?,
                kv_cache_spec_kind: fields.opt("kv_cache_spec_kind", string)?,
                kv_cache_spec_sliding_window: fields.opt("kv_cache_spec_sliding_window", u32_of)?,
                token_offset: fields.opt("token_offset", Value::as_u64)?,
            };
            let capacity = e.block_hashes.len() as u64 * u64::from(e.block_size);
            if e.block_size > 0 && e.token_ids.len() as u64 > capacity {
                return Err(format!(
                    "BlockStored has {} tokens for {} blocks of {} (masked or sliding-window blocks?): refused rather than misaligned",
                    e.token_ids.len(),
                    e.block_hashes.len(),
                    e.block_size
                ));
            }
            Ok(KvEvent::BlockStored(e))
        }
        "BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: fields.hashes("block_hashes")?,
            medium: fields.opt("medium", string)?,
            group_idx: fields.opt("group_idx", u32_of)?,
        })),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared {
            medium: fields.opt("medium", string)?,
        }),
        "BlockTransferred" => Ok(KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: fields.hashes("block_hashes")?,
            from_medium: fields.opt("from_medium", string)?,
            to_medium: fields.opt("to_medium", string)?,
            group_idx: fields.opt("group_idx", u32_of)?,
        })),
        other => Err(format!("unknown event type {other:?}")),
    }
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Decoded, BatchError> {
    let v = msgpack::decode(payload).map_err(|e| BatchError(e.to_string()))?;
    let Value::Array(items) = v else {
        return Err(BatchError("a batch is not an array".into()));
    };
    if items.len() < 2 {
        return Err(BatchError(format!(
            "a batch has {} elements, at least 2 expected",
            items.len()
        )));
    }
    let ts = items[0]
        .as_f64()
        .ok_or_else(|| BatchError("the batch timestamp is not a number".into()))?;
    let Value::Array(raw) = &items[1] else {
        return Err(BatchError("the batch's events are not an array".into()));
    };
    let dp_rank = items.get(2).and_then(Value::as_i64);
    let mut events = Vec::with_capacity(raw.len());
    let mut skipped = Vec::new();
    for (i, e) in raw.iter().enumerate() {
        match event(e) {
            Ok(ev) => events.push(ev),
            Err(why) => skipped.push(format!("event {i}: {why}")),
        }
    }
    Ok(Decoded {
        batch: EventBatch {
            ts,
            events,
            dp_rank,
        },
        skipped,
    })
}

fn nil(out: &mut Vec<u8>) {
    // Writing into a Vec cannot fail.
    let _ = w::write_nil(out);
}

fn put_hash(out: &mut Vec<u8>, h: &BlockHash) {
    let _ = match h {
        BlockHash::U64(v) => w::write_uint(out, *v).map(|_| ()),
        BlockHash::I64(v) => w::write_sint(out, *v).map(|_| ()),
        BlockHash::Bytes(b) => w::write_bin(out, b),
    };
}

fn put_hashes(out: &mut Vec<u8>, hs: &[BlockHash]) {
    let _ = w::write_array_len(out, hs.len() as u32);
    for h in hs {
        put_hash(out, h);
    }
}

fn put_opt_str(out: &mut Vec<u8>, s: &Option<String>) {
    match s {
        Some(s) => {
            let _ = w::write_str(out, s);
        }
        None => nil(out),
    }
}

fn put_opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => {
            let _ = w::write_uint(out, v);
        }
        None => nil(out),
    }
}

fn put_key(out: &mut Vec<u8>, k: &str) {
    let _ = w::write_str(out, k);
}

/// A map field written only when set (current encoding: defaults are omitted).
fn put_field_uint(out: &mut Vec<u8>, k: &str, v: Option<u64>) {
    if let Some(v) = v {
        put_key(out, k);
        let _ = w::write_uint(out, v);
    }
}

/// A string map field written only when set.
fn put_field_str(out: &mut Vec<u8>, k: &str, v: &Option<String>) {
    if let Some(v) = v {
        put_key(out, k);
        let _ = w::write_str(out, v);
    }
}

/// Encodes one event.
pub fn encode_event(e: &KvEvent, enc: Encoding, out: &mut Vec<u8>) {
    match (e, enc) {
        (KvEvent::BlockStored(s), Encoding::Current) => {
            let optional = [
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
                s.token_offset.is_some(),
            ];
            let n = 8 + optional.iter().filter(|x| **x).count() as u32;
            let _ = w::write_map_len(out, n);
            put_key(out, "type");
            let _ = w::write_str(out, "BlockStored");
            put_key(out, "block_hashes");
            put_hashes(out, &s.block_hashes);
            put_key(out, "parent_block_hash");
            match &s.parent_block_hash {
                Some(h) => put_hash(out, h),
                None => nil(out),
            }
            put_key(out, "token_ids");
            let _ = w::write_array_len(out, s.token_ids.len() as u32);
            for t in &s.token_ids {
                let _ = w::write_uint(out, u64::from(*t));
            }
            put_key(out, "block_size");
            let _ = w::write_uint(out, u64::from(s.block_size));
            put_key(out, "lora_id");
            match s.lora_id {
                Some(v) => {
                    let _ = w::write_sint(out, v);
                }
                None => nil(out),
            }
            put_key(out, "medium");
            put_opt_str(out, &s.medium);
            put_key(out, "lora_name");
            put_opt_str(out, &s.lora_name);
            put_field_uint(out, "group_idx", s.group_idx.map(u64::from));
            put_field_str(out, "kv_cache_spec_kind", &s.kv_cache_spec_kind);
            put_field_uint(
                out,
                "kv_cache_spec_sliding_window",
                s.kv_cache_spec_sliding_window.map(u64::from),
            );
            put_field_uint(out, "token_offset", s.token_offset);
        }
        (KvEvent::BlockStored(s), Encoding::Legacy) => {
            // Like msgspec's array_like structs with omit_defaults (vLLM): the seven required
            // fields always, the optional ones up to the last that is set.
            let optional = [
                false, // extra_keys: never set by kvlink
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
                s.token_offset.is_some(),
            ];
            let tail = optional.iter().rposition(|x| *x).map_or(0, |i| i + 1);
            let _ = w::write_array_len(out, 8 + tail as u32);
            let _ = w::write_str(out, "BlockStored");
            put_hashes(out, &s.block_hashes);
            match &s.parent_block_hash {
                Some(h) => put_hash(out, h),
                None => nil(out),
            }
            let _ = w::write_array_len(out, s.token_ids.len() as u32);
            for t in &s.token_ids {
                let _ = w::write_uint(out, u64::from(*t));
            }
            let _ = w::write_uint(out, u64::from(s.block_size));
            match s.lora_id {
                Some(v) => {
                    let _ = w::write_sint(out, v);
                }
                None => nil(out),
            }
            put_opt_str(out, &s.medium);
            put_opt_str(out, &s.lora_name);
            if tail >= 1 {
                nil(out); // extra_keys
            }
            if tail >= 2 {
                put_opt_uint(out, s.group_idx.map(u64::from));
            }
            if tail >= 3 {
                put_opt_str(out, &s.kv_cache_spec_kind);
            }
            if tail >= 4 {
                put_opt_uint(out, s.kv_cache_spec_sliding_window.map(u64::from));
            }
            if tail >= 5 {
                put_opt_uint(out, s.token_offset);
            }
        }
        (KvEvent::BlockRemoved(r), Encoding::Current) => {
            let _ = w::write_map_len(out, 3 + u32::from(r.group_idx.is_some()));
            put_key(out, "type");
            let _ = w::write_str(out, "BlockRemoved");
            put_key(out, "block_hashes");
            put_hashes(out, &r.block_hashes);
            put_key(out, "medium");
            put_opt_str(out, &r.medium);
            put_field_uint(out, "group_idx", r.group_idx.map(u64::from));
        }
        (KvEvent::BlockRemoved(r), Encoding::Legacy) => {
            let _ = w::write_array_len(out, 3 + u32::from(r.group_idx.is_some()));
            let _ = w::write_str(out, "BlockRemoved");
            put_hashes(out, &r.block_hashes);
            put_opt_str(out, &r.medium);
            if let Some(g) = r.group_idx {
                let _ = w::write_uint(out, u64::from(g));
            }
        }
        (KvEvent::AllBlocksCleared { medium }, Encoding::Current) => {
            let _ = w::write_map_len(out, 1 + u32::from(medium.is_some()));
            put_key(out, "type");
            let _ = w::write_str(out, "AllBlocksCleared");
            put_field_str(out, "medium", medium);
        }
        (KvEvent::AllBlocksCleared { medium }, Encoding::Legacy) => {
            let _ = w::write_array_len(out, 1 + u32::from(medium.is_some()));
            let _ = w::write_str(out, "AllBlocksCleared");
            if let Some(m) = medium {
                let _ = w::write_str(out, m);
            }
        }
        (KvEvent::BlockTransferred(t), enc) => {
            if enc == Encoding::Current {
                let _ = w::write_map_len(out, 4 + u32::from(t.group_idx.is_some()));
                put_key(out, "type");
            } else {
                let _ = w::write_array_len(out, 4 + u32::from(t.group_idx.is_some()));
            }
            let _ = w::write_str(out, "BlockTransferred");
            let field = |out: &mut Vec<u8>, k: &str| {
                if enc == Encoding::Current {
                    put_key(out, k)
                }
            };
            field(out, "block_hashes");
            put_hashes(out, &t.block_hashes);
            field(out, "from_medium");
            put_opt_str(out, &t.from_medium);
            field(out, "to_medium");
            put_opt_str(out, &t.to_medium);
            if enc == Encoding::Legacy {
                if let Some(g) = t.group_idx {
                    let _ = w::write_uint(out, u64::from(g));
                }
            } else {
                put_field_uint(out, "group_idx", t.group_idx.map(u64::from));
            }
        }
    }
}

/// Encodes a batch `[ts, events, dp_rank]` into `out` (cleared first).
pub fn encode_batch(b: &EventBatch, enc: Encoding, out: &mut Vec<u8>) {
    out.clear();
    let _ = w::write_array_len(out, 3);
    let _ = w::write_f64(out, b.ts);
    let _ = w::write_array_len(out, b.events.len() as u32);
    for e in &b.events {
        encode_event(e, enc, out);
    }
    match b.dp_rank {
        Some(r) => {
            let _ = w::write_sint(out, r);
        }
        None => nil(out),
    }
}
