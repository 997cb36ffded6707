//! Decoding of event batches: one pass over the bounded msgpack reader, both encodings, a bad
//! event skipped on its own.

use crate::events::msgpack::{self, Cursor, Token, MAX_RESERVE};

use super::{
    BatchError, BlockHash, BlockRemoved, BlockStored, BlockTransferred, Decoded, Encoding,
    EventBatch, ExtraField, FieldKey, KvEvent, Value, CLEARED_LEGACY_ORDER, REMOVED_LEGACY_ORDER,
    REMOVED_LEGACY_UPSTREAM, STORED_LEGACY_ORDER, STORED_LEGACY_UPSTREAM, TRANSFERRED_LEGACY_ORDER,
};

/// An event's fields as read, whichever encoding carried them.
#[derive(Default)]
struct Raw<'a> {
    ty: Option<&'a [u8]>,
    /// The fields of `ty` ([`fields_of`]; all while it is not known yet).
    fields: u32,
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
    extra_keys: Option<Value>,
    locality: Option<String>,
    ownership: Option<String>,
    session_id: Option<String>,
    lookahead_token_ids: Option<Vec<Vec<u32>>>,
    cache_salt: Option<String>,
    extra: Vec<ExtraField>,
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
            let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
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

/// A list of token ids (nil reads as `None`).
fn token_list(c: &mut Cursor<'_>, name: &str) -> Result<Option<Vec<u32>>, String> {
    match c.token().map_err(malformed)? {
        Token::Array(n) => {
            let mut v = Vec::with_capacity(n); // at most 4 bytes per byte that arrived
            while v.len() < n {
                if c.small_uints(n - v.len(), &mut v) == 0 {
                    // Anything else is an error, however it is spelled.
                    u32_of(c.token().map_err(malformed)?)
                        .map(|t| v.push(t))
                        .ok_or_else(|| format!("a {name} entry is not a u32 token id"))?;
                }
            }
            Ok(Some(v))
        }
        Token::Nil => Ok(None),
        _ => Err(format!("{name} is not an array")),
    }
}

/// The fields kvlink models, by their wire names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum F {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    TokenOffset,
    Locality,
    Ownership,
    SessionId,
    LookaheadTokenIds,
    CacheSalt,
    FromMedium,
    ToMedium,
}

impl F {
    fn of(name: &[u8]) -> Option<F> {
        Some(match name {
            b"type" => F::Type,
            b"block_hashes" => F::BlockHashes,
            b"parent_block_hash" => F::ParentBlockHash,
            b"token_ids" => F::TokenIds,
            b"block_size" => F::BlockSize,
            b"lora_id" => F::LoraId,
            b"medium" => F::Medium,
            b"lora_name" => F::LoraName,
            b"extra_keys" => F::ExtraKeys,
            b"group_idx" => F::GroupIdx,
            b"kv_cache_spec_kind" => F::KvCacheSpecKind,
            b"kv_cache_spec_sliding_window" => F::KvCacheSpecSlidingWindow,
            b"token_offset" => F::TokenOffset,
            b"locality" => F::Locality,
            b"ownership" => F::Ownership,
            b"session_id" => F::SessionId,
            b"lookahead_token_ids" => F::LookaheadTokenIds,
            b"cache_salt" => F::CacheSalt,
            b"from_medium" => F::FromMedium,
            b"to_medium" => F::ToMedium,
            _ => return None,
        })
    }

    const fn bit(self) -> u32 {
        1 << self as u32
    }
}

const fn mask(fields: &[F]) -> u32 {
    let mut m = F::Type.bit();
    let mut i = 0;
    while i < fields.len() {
        m |= fields[i].bit();
        i += 1;
    }
    m
}

/// The fields each event type has (the others are kept as unknown fields).
const STORED_FIELDS: u32 = mask(&[
    F::BlockHashes,
    F::ParentBlockHash,
    F::TokenIds,
    F::BlockSize,
    F::LoraId,
    F::Medium,
    F::LoraName,
    F::ExtraKeys,
    F::GroupIdx,
    F::KvCacheSpecKind,
    F::KvCacheSpecSlidingWindow,
    F::TokenOffset,
    F::Locality,
    F::Ownership,
    F::SessionId,
    F::LookaheadTokenIds,
    F::CacheSalt,
]);
const REMOVED_FIELDS: u32 = mask(&[
    F::BlockHashes,
    F::Medium,
    F::GroupIdx,
    F::Locality,
    F::Ownership,
]);
const CLEARED_FIELDS: u32 = mask(&[F::Medium]);
const TRANSFERRED_FIELDS: u32 = mask(&[F::BlockHashes, F::FromMedium, F::ToMedium, F::GroupIdx]);

/// The fields of event type `ty` (every one while the type is unknown: such an event is refused
/// anyway).
fn fields_of(ty: &[u8]) -> u32 {
    match ty {
        b"BlockStored" => STORED_FIELDS,
        b"BlockRemoved" => REMOVED_FIELDS,
        b"AllBlocksCleared" => CLEARED_FIELDS,
        b"BlockTransferred" => TRANSFERRED_FIELDS,
        _ => u32::MAX,
    }
}

/// Reads the value of field `name` into `raw` (a name kvlink does not model is kept whole in
/// `raw.extra` under `key`).
fn field<'a>(
    c: &mut Cursor<'a>,
    raw: &mut Raw<'a>,
    name: &[u8],
    key: impl FnOnce() -> FieldKey,
) -> Result<(), String> {
    let f = match F::of(name) {
        Some(f) if raw.fields & f.bit() != 0 => f,
        _ => {
            let value = c.value(0).map_err(malformed)?;
            raw.extra.push(ExtraField { key: key(), value });
            return Ok(());
        }
    };
    match f {
        F::Type if raw.ty.is_some() => return Err("a second \"type\" in one event".into()),
        F::Type => match c.token().map_err(malformed)? {
            Token::Str(t) => {
                raw.ty = Some(t);
                raw.fields = fields_of(t);
            }
            _ => return Err("the event \"type\" is not a string".into()),
        },
        F::BlockHashes => raw.block_hashes = hashes(c, "block_hashes")?,
        F::ParentBlockHash => raw.parent_block_hash = opt(c, "parent_block_hash", hash)?,
        F::TokenIds => raw.token_ids = token_list(c, "token_ids")?.unwrap_or_default(),
        F::BlockSize => raw.block_size = opt(c, "block_size", u32_of)?,
        F::LoraId => raw.lora_id = opt(c, "lora_id", i64_of)?,
        F::Medium => raw.medium = opt(c, "medium", string)?,
        F::LoraName => raw.lora_name = opt(c, "lora_name", string)?,
        F::GroupIdx => raw.group_idx = opt(c, "group_idx", u32_of)?,
        F::KvCacheSpecKind => raw.kv_cache_spec_kind = opt(c, "kv_cache_spec_kind", string)?,
        F::KvCacheSpecSlidingWindow => {
            raw.kv_cache_spec_sliding_window = opt(c, "kv_cache_spec_sliding_window", u32_of)?
        }
        F::TokenOffset => raw.token_offset = opt(c, "token_offset", u64_of)?,
        F::FromMedium => raw.from_medium = opt(c, "from_medium", string)?,
        F::ToMedium => raw.to_medium = opt(c, "to_medium", string)?,
        F::ExtraKeys => {
            raw.extra_keys = Some(c.value(0).map_err(malformed)?).filter(|v| !v.is_nil())
        }
        F::Locality => raw.locality = opt(c, "locality", string)?,
        F::Ownership => raw.ownership = opt(c, "ownership", string)?,
        F::SessionId => raw.session_id = opt(c, "session_id", string)?,
        F::CacheSalt => raw.cache_salt = opt(c, "cache_salt", string)?,
        F::LookaheadTokenIds => {
            raw.lookahead_token_ids = match c.token().map_err(malformed)? {
                Token::Array(n) => {
                    let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                    for _ in 0..n {
                        v.push(token_list(c, "lookahead_token_ids")?.unwrap_or_default());
                    }
                    Some(v)
                }
                Token::Nil => None,
                _ => return Err("lookahead_token_ids is not an array".into()),
            }
        }
    }
    Ok(())
}

/// Reads one event and says which encoding carried it. On error the cursor is left anywhere
/// inside it (the caller rewinds).
fn event(c: &mut Cursor<'_>) -> Result<(KvEvent, Encoding), String> {
    let mut raw = Raw {
        fields: u32::MAX,
        ..Raw::default()
    };
    let encoding = match c.token().map_err(malformed)? {
        Token::Map(n) => {
            for _ in 0..n {
                let k = match c.short_str() {
                    Some(k) => k,
                    None => match c.token().map_err(malformed)? {
                        Token::Str(k) => k,
                        _ => return Err("a map event has a key that is not a string".into()),
                    },
                };
                field(c, &mut raw, k, || {
                    FieldKey::Name(String::from_utf8_lossy(k).into_owned())
                })?;
            }
            if raw.ty.is_none() {
                return Err("map event without a string \"type\"".into());
            }
            Encoding::Current
        }
        Token::Array(n) => {
            let Some(Token::Str(tag)) =
                (n > 0).then(|| c.token()).transpose().map_err(malformed)?
            else {
                return Err("array event without a tag".into());
            };
            raw.ty = Some(tag);
            raw.fields = fields_of(tag);
            let order: &[&str] = match tag {
                b"BlockStored" => &STORED_LEGACY_ORDER,
                b"BlockRemoved" => &REMOVED_LEGACY_ORDER,
                b"AllBlocksCleared" => &CLEARED_LEGACY_ORDER,
                b"BlockTransferred" => &TRANSFERRED_LEGACY_ORDER,
                _ => &[],
            };
            // Places past the upstream fields are kvlink's extension: an element of another
            // type there is some other publisher's field, kept as a positional extra.
            let upstream = match tag {
                b"BlockStored" => STORED_LEGACY_UPSTREAM,
                b"BlockRemoved" => REMOVED_LEGACY_UPSTREAM,
                _ => order.len(),
            };
            for i in 1..n {
                let start = c.pos();
                match order.get(i - 1) {
                    Some(name) if i > upstream => {
                        if field(c, &mut raw, name.as_bytes(), || FieldKey::Position(i)).is_err() {
                            c.rewind(start);
                            let value = c.value(0).map_err(malformed)?;
                            raw.extra.push(ExtraField {
                                key: FieldKey::Position(i),
                                value,
                            });
                        }
                    }
                    Some(name) => field(c, &mut raw, name.as_bytes(), || FieldKey::Position(i))?,
                    None => {
                        // A nil between kept elements is padding the encoder writes again; a
                        // trailing one is kept, so that the array keeps its length.
                        let value = c.value(0).map_err(malformed)?;
                        if !value.is_nil() || i + 1 == n {
                            raw.extra.push(ExtraField {
                                key: FieldKey::Position(i),
                                value,
                            });
                        }
                    }
                }
            }
            Encoding::Legacy
        }
        _ => return Err("event is neither a map nor an array".into()),
    };
    let ev = match raw.ty.unwrap_or_default() {
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
                extra_keys: raw.extra_keys,
                locality: raw.locality,
                ownership: raw.ownership,
                session_id: raw.session_id,
                lookahead_token_ids: raw.lookahead_token_ids,
                cache_salt: raw.cache_salt,
                extra: raw.extra,
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
            locality: raw.locality,
            ownership: raw.ownership,
            extra: raw.extra,
        })),
        b"AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared {
            medium: raw.medium,
            extra: raw.extra,
        }),
        b"BlockTransferred" => Ok(KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: raw.block_hashes,
            from_medium: raw.from_medium,
            to_medium: raw.to_medium,
            group_idx: raw.group_idx,
            extra: raw.extra,
        })),
        other => Err(format!(
            "unknown event type {:?}",
            String::from_utf8_lossy(other)
        )),
    }?;
    Ok((ev, encoding))
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
    let mut events = Vec::with_capacity(count.min(MAX_RESERVE));
    let mut skipped = Vec::new();
    let mut encoding = None;
    for i in 0..count {
        let start = c.pos();
        match event(&mut c) {
            Ok((ev, enc)) => {
                encoding.get_or_insert(enc);
                events.push(ev)
            }
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
        encoding: encoding.unwrap_or_default(),
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvEvent;

    /// The decoder's per-type field masks say the same as the field lists the encoders, the
    /// JSON and the Python API use.
    #[test]
    fn field_masks_match_the_field_lists() {
        let names = STORED_LEGACY_ORDER
            .iter()
            .chain(&REMOVED_LEGACY_ORDER)
            .chain(&TRANSFERRED_LEGACY_ORDER)
            .chain(&["type", "not_a_field"]);
        for ty in [
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "BlockTransferred",
        ] {
            for name in names.clone() {
                let in_mask =
                    F::of(name.as_bytes()).is_some_and(|f| fields_of(ty.as_bytes()) & f.bit() != 0);
                assert_eq!(in_mask, KvEvent::known_field(ty, name), "{ty}.{name}");
            }
        }
    }
}
