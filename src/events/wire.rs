//! KV-cache event types and their two msgpack encodings (see the shared wire notes):
//! *current* (vLLM >= 0.24, SGLang): each event a map whose first key is `"type"`; *legacy*
//! (older vLLM/SGLang, ATOM): each event an array, tag first, fields in declaration order.
//! A batch is `[ts, events, dp_rank]` (publishers before vLLM PR 18925 sent two elements).
//!
//! Decoding accepts both encodings and every hash form (u64, i64, bin), ignores unknown keys and
//! trailing elements, and skips a malformed or unknown event on its own (counted with its
//! reason) without losing the rest of its batch.

use rmp::encode as w;

use super::msgpack::{self, Cursor, Token};

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

/// An event's fields as read, whichever encoding carried them.
#[derive(Default)]
struct Raw<'a> {
    ty: Option<&'a [u8]>,
    block_hashes: Vec<BlockHash>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Vec<u32>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<u32>,
    token_offset: Option<u64>,
    from_medium: Option<String>,
    to_medium: Option<String>,
}

fn hash(t: Token<'_>) -> Option<BlockHash> {
    match t {
        Token::UInt(u) => Some(BlockHash::U64(u)),
        Token::Int(i) => Some(BlockHash::I64(i)),
        Token::Bin(b) if !b.is_empty() => Some(BlockHash::Bytes(b.to_vec())),
        _ => None,
    }
}

fn string(t: Token<'_>) -> Option<String> {
    match t {
        Token::Str(s) => Some(String::from_utf8_lossy(s).into_owned()),
        _ => None,
    }
}

fn u32_of(t: Token<'_>) -> Option<u32> {
    match t {
        Token::UInt(v) => u32::try_from(v).ok(),
        _ => None,
    }
}

fn u64_of(t: Token<'_>) -> Option<u64> {
    match t {
        Token::UInt(v) => Some(v),
        _ => None,
    }
}

fn i64_of(t: Token<'_>) -> Option<i64> {
    match t {
        Token::UInt(v) => i64::try_from(v).ok(),
        Token::Int(v) => Some(v),
        _ => None,
    }
}

fn malformed(e: msgpack::DecodeError) -> String {
    e.to_string()
}

/// An optional field: nil is unset, any other type than `conv` takes is an error.
fn opt<T>(
    c: &mut Cursor<'_>,
    name: &str,
    conv: fn(Token<'_>) -> Option<T>,
) -> Result<Option<T>, String> {
    match c.token().map_err(malformed)? {
        Token::Nil => Ok(None),
        t => conv(t)
            .map(Some)
            .ok_or_else(|| format!("field {name} has the wrong type")),
    }
}

fn hashes(c: &mut Cursor<'_>, name: &str) -> Result<Vec<BlockHash>, String> {
    match c.token().map_err(malformed)? {
        Token::Array(n) => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(
                    hash(c.token().map_err(malformed)?)
                        .ok_or_else(|| format!("a {name} entry is not a hash"))?,
                );
            }
            Ok(v)
        }
        Token::Nil => Ok(Vec::new()),
        _ => Err(format!("field {name} is not an array")),
    }
}

/// Reads the value of field `name` into `raw` (an unknown field is skipped).
fn field<'a>(c: &mut Cursor<'a>, raw: &mut Raw<'a>, name: &[u8]) -> Result<(), String> {
    match name {
        b"type" => match c.token().map_err(malformed)? {
            Token::Str(t) => raw.ty = Some(t),
            _ => return Err("the event \"type\" is not a string".into()),
        },
        b"block_hashes" => raw.block_hashes = hashes(c, "block_hashes")?,
        b"parent_block_hash" => raw.parent_block_hash = opt(c, "parent_block_hash", hash)?,
        b"token_ids" => {
            raw.token_ids = match c.token().map_err(malformed)? {
                Token::Array(n) => {
                    let mut v = Vec::with_capacity(n);
                    for _ in 0..n {
                        match c.small_uint() {
                            Some(t) => v.push(t),
                            None => {
                                // Anything else is an error, however it is spelled.
                                u32_of(c.token().map_err(malformed)?)
                                    .map(|t| v.push(t))
                                    .ok_or("a token id is not a u32")?;
                            }
                        }
                    }
                    v
                }
                Token::Nil => Vec::new(),
                _ => return Err("token_ids is not an array".into()),
            }
        }
        b"block_size" => raw.block_size = opt(c, "block_size", u32_of)?,
        b"lora_id" => raw.lora_id = opt(c, "lora_id", i64_of)?,
        b"medium" => raw.medium = opt(c, "medium", string)?,
        b"lora_name" => raw.lora_name = opt(c, "lora_name", string)?,
        b"group_idx" => raw.group_idx = opt(c, "group_idx", u32_of)?,
        b"kv_cache_spec_kind" => raw.kv_cache_spec_kind = opt(c, "kv_cache_spec_kind", string)?,
        b"kv_cache_spec_sliding_window" => {
            raw.kv_cache_spec_sliding_window = opt(c, "kv_cache_spec_sliding_window", u32_of)?
        }
        b"token_offset" => raw.token_offset = opt(c, "token_offset", u64_of)?,
        b"from_medium" => raw.from_medium = opt(c, "from_medium", string)?,
        b"to_medium" => raw.to_medium = opt(c, "to_medium", string)?,
        _ => c.skip().map_err(malformed)?,
    }
    Ok(())
}

/// Reads one event. On error the cursor is left anywhere inside it (the caller rewinds).
fn event(c: &mut Cursor<'_>) -> Result<KvEvent, String> {
    let mut raw = Raw::default();
    match c.token().map_err(malformed)? {
        Token::Map(n) => {
            for _ in 0..n {
                match c.token().map_err(malformed)? {
                    Token::Str(k) => field(c, &mut raw, k)?,
                    _ => c.skip().map_err(malformed)?,
                }
            }
            if raw.ty.is_none() {
                return Err("map event without a string \"type\"".into());
            }
        }
        Token::Array(n) => {
            let Some(Token::Str(tag)) =
                (n > 0).then(|| c.token()).transpose().map_err(malformed)?
            else {
                return Err("array event without a tag".into());
            };
            raw.ty = Some(tag);
            let order: &[&str] = match tag {
                b"BlockStored" => &STORED_ORDER,
                b"BlockRemoved" => &REMOVED_ORDER,
                b"AllBlocksCleared" => &CLEARED_ORDER,
                b"BlockTransferred" => &TRANSFERRED_ORDER,
                _ => &[],
            };
            for i in 1..n {
                match order.get(i - 1) {
                    Some(name) => field(c, &mut raw, name.as_bytes())?,
                    None => c.skip().map_err(malformed)?,
                }
            }
        }
        _ => return Err("event is neither a map nor an array".into()),
    }
    match raw.ty.unwrap_or_default() {
        b"BlockStored" => {
            let e = BlockStored {
                block_hashes: raw.block_hashes,
                parent_block_hash: raw.parent_block_hash,
                token_ids: raw.token_ids,
                block_size: raw.block_size.unwrap_or(0),
                lora_id: raw.lora_id,
                medium: raw.medium,
                lora_name: raw.lora_name,
                group_idx: raw.group_idx,
                kv_cache_spec_kind: raw.kv_cache_spec_kind,
                kv_cache_spec_sliding_window: raw.kv_cache_spec_sliding_window,
                token_offset: raw.token_offset,
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
        b"BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: raw.block_hashes,
            medium: raw.medium,
            group_idx: raw.group_idx,
        })),
        b"AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared { medium: raw.medium }),
        b"BlockTransferred" => Ok(KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: raw.block_hashes,
            from_medium: raw.from_medium,
            to_medium: raw.to_medium,
            group_idx: raw.group_idx,
        })),
        other => Err(format!(
            "unknown event type {:?}",
            String::from_utf8_lossy(other)
        )),
    }
}

/// Decodes one batch payload. It is read in one pass without building a generic tree; an
/// event that fails is skipped whole (its extent is found by re-reading it structurally), so
/// only bytes that are not msgpack at all make the whole batch unreadable.
pub fn decode_batch(payload: &[u8]) -> Result<Decoded, BatchError> {
    let bad = |e: msgpack::DecodeError| BatchError(e.to_string());
    let mut c = Cursor::new(payload);
    let n = match c.token().map_err(bad)? {
        Token::Array(n) => n,
        _ => return Err(BatchError("a batch is not an array".into())),
    };
    if n < 2 {
        return Err(BatchError(format!(
            "a batch has {n} elements, at least 2 expected"
        )));
    }
    let ts = match c.token().map_err(bad)? {
        Token::Float(f) => f,
        Token::UInt(u) => u as f64,
        Token::Int(i) => i as f64,
        _ => return Err(BatchError("the batch timestamp is not a number".into())),
    };
    let Token::Array(count) = c.token().map_err(bad)? else {
        return Err(BatchError("the batch's events are not an array".into()));
    };
    let mut events = Vec::with_capacity(count);
    let mut skipped = Vec::new();
    for i in 0..count {
        let start = c.pos();
        match event(&mut c) {
            Ok(ev) => events.push(ev),
            Err(why) => {
                c.rewind(start);
                c.skip().map_err(bad)?;
                skipped.push(format!("event {i}: {why}"));
            }
        }
    }
    let mut dp_rank = None;
    for i in 2..n {
        let start = c.pos();
        let t = c.token().map_err(bad)?;
        if i == 2 {
            dp_rank = i64_of(t);
        }
        if matches!(t, Token::Array(_) | Token::Map(_)) {
            c.rewind(start);
            c.skip().map_err(bad)?;
        }
    }
    if c.remaining() != 0 {
        return Err(BatchError(format!(
            "malformed msgpack: {} trailing bytes",
            c.remaining()
        )));
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
