//! Decoding of event batches: one pass over the bounded msgpack reader, both encodings, a bad
//! event skipped on its own.

use std::mem::take;

use crate::msgpack::{self, Cursor, Token, MAX_RESERVE};

use super::{
    BatchError, BlockHash, BlockStored, Decoded, Encoding, EventBatch, EventError, ExtraField,
    FieldKey, KvEvent, SkippedEvent, REMOVED_LEGACY_UPSTREAM, STORED_LEGACY_UPSTREAM,
};

mod fields;
mod walk;

use fields::*;
use walk::{array_event, map_event, typed};

/// An event's fields as read, whichever encoding carried them: a BlockStored (the most common
/// event, and the one with most fields) is built in its slot of the batch; the other types take
/// their fields from it.
struct Raw<'a, 's> {
    ty: Option<&'a [u8]>,
    /// The fields of `ty` ([`type_of`]; all while it is not known yet).
    fields: u32,
    /// The fields of `ty` in the order encoders write them.
    order: &'static [F],
    /// The event's slot in the batch, filled where it lies (no 400-byte moves per event).
    stored: &'s mut BlockStored,
    from_medium: Option<String>,
    to_medium: Option<String>,
    /// String buffers of earlier events of the batch, refilled instead of allocated.
    strings: &'s mut Vec<String>,
}

/// At most this many string buffers wait for reuse while a batch is decoded.
const SPARE_STRINGS: usize = 64;
/// A recycled event keeps room for at most this many token ids (256 KiB)...
const KEEP_TOKENS: usize = 64 << 10;
/// ... and this many block hashes.
const KEEP_HASHES: usize = 4096;
/// A recycled batch keeps room for at most this many events.
const KEEP_EVENTS: usize = 16 << 10;

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
        Token::Str(s) => Some(owned(s)),
        _ => None,
    }
}

/// A string value (invalid UTF-8 replaced).
fn owned(s: &[u8]) -> String {
    match std::str::from_utf8(s) {
        Ok(s) => s.to_owned(),
        Err(_) => String::from_utf8_lossy(s).into_owned(),
    }
}

/// An optional string field: nil is unset, any other type than a string is an error. A short
/// string goes into one of `spare`'s buffers when there is one.
#[inline(always)]
fn opt_str(
    c: &mut Cursor<'_>,
    name: &'static str,
    spare: &mut Vec<String>,
) -> Result<Option<String>, EventError> {
    match c.short_str() {
        Some(s) => Ok(Some(match std::str::from_utf8(s) {
            Ok(s) => match spare.pop() {
                Some(mut buf) => {
                    buf.clear();
                    buf.push_str(s);
                    buf
                }
                None => s.to_owned(),
            },
            Err(_) => String::from_utf8_lossy(s).into_owned(),
        })),
        None => opt(c, name, string),
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

fn malformed(e: msgpack::DecodeError) -> EventError {
    EventError::Msgpack(e)
}

/// An optional field: nil is unset, any other type than `conv` takes is an error.
#[inline(always)]
fn opt<T>(
    c: &mut Cursor<'_>,
    name: &'static str,
    conv: impl FnOnce(Token<'_>) -> Option<T>,
) -> Result<Option<T>, EventError> {
    if c.nil() {
        return Ok(None);
    }
    // An unsigned integer (most fields) without going through `token`.
    let t = match c.uint() {
        Some(u) => Token::UInt(u),
        None => c.token().map_err(malformed)?,
    };
    match t {
        Token::Nil => Ok(None),
        t => conv(t).map(Some).ok_or(EventError::WrongType(name)),
    }
}

/// The next item, an array's header read without going through `token`.
#[inline(always)]
fn array_or_token<'a>(c: &mut Cursor<'a>) -> Result<Token<'a>, EventError> {
    match c.container_len(false) {
        Some(n) => Ok(Token::Array(n)),
        None => c.token().map_err(malformed),
    }
}

/// A list of block hashes into `v` (emptied first, its allocation kept; nil reads as empty).
fn hashes(
    c: &mut Cursor<'_>,
    name: &'static str,
    v: &mut Vec<BlockHash>,
) -> Result<(), EventError> {
    v.clear();
    match array_or_token(c)? {
        Token::Array(n) => {
            v.reserve(n.min(MAX_RESERVE));
            for _ in 0..n {
                v.push(match c.uint() {
                    Some(u) => BlockHash::U64(u),
                    None => {
                        hash(c.token().map_err(malformed)?).ok_or(EventError::NotAHash(name))?
                    }
                });
            }
            Ok(())
        }
        Token::Nil => Ok(()),
        _ => Err(EventError::NotAnArray(name)),
    }
}

/// A list of token ids into `v` (emptied first, its allocation kept); says whether it was a
/// list (nil is not).
fn token_list(
    c: &mut Cursor<'_>,
    name: &'static str,
    v: &mut Vec<u32>,
) -> Result<bool, EventError> {
    v.clear();
    match array_or_token(c)? {
        Token::Array(n) => {
            v.reserve(n); // at most 4 bytes per byte that arrived
            while v.len() < n {
                if c.small_uints(n - v.len(), v) == 0 {
                    // Anything else is an error, however it is spelled.
                    u32_of(c.token().map_err(malformed)?)
                        .map(|t| v.push(t))
                        .ok_or(EventError::NotATokenId(name))?;
                }
            }
            Ok(true)
        }
        Token::Nil => Ok(false),
        _ => Err(EventError::NotAnArray(name)),
    }
}

/// Reads the value of field `f` into `raw`; a field kvlink does not model (`None`, or one the
/// event's type does not have) is kept whole in the event's extra fields under `key`.
#[inline(always)]
fn field<'a>(
    c: &mut Cursor<'a>,
    raw: &mut Raw<'a, '_>,
    f: Option<F>,
    key: impl FnOnce() -> FieldKey,
) -> Result<(), EventError> {
    let f = match f {
        Some(f) if raw.fields & f.bit() != 0 => f,
        _ => {
            let value = c.value(0).map_err(malformed)?;
            raw.stored.extra.push(ExtraField { key: key(), value });
            return Ok(());
        }
    };
    let s = &mut *raw.stored;
    match f {
        F::Type if raw.ty.is_some() => return Err(EventError::SecondType),
        F::Type => {
            // The tag as encoders write it, compared whole; else read and looked up.
            if let Some(i) = TAGS.iter().position(|tag| c.skip_if(tag)) {
                let (name, order, fields) = TYPES[i];
                raw.ty = Some(name.as_bytes());
                (raw.fields, raw.order) = (fields, order);
            } else {
                match c.token().map_err(malformed)? {
                    Token::Str(t) => {
                        raw.ty = Some(t);
                        (raw.fields, raw.order) = type_of(t);
                    }
                    _ => return Err(EventError::TypeNotAString),
                }
            }
        }
        F::BlockHashes => hashes(c, "block_hashes", &mut s.block_hashes)?,
        F::ParentBlockHash => s.parent_block_hash = opt(c, "parent_block_hash", hash)?,
        F::TokenIds => {
            token_list(c, "token_ids", &mut s.token_ids)?;
        }
        F::BlockSize => s.block_size = opt(c, "block_size", u32_of)?.unwrap_or(0),
        F::LoraId => s.lora_id = opt(c, "lora_id", i64_of)?,
        F::Medium => s.medium = opt_str(c, "medium", raw.strings)?,
        F::LoraName => s.lora_name = opt_str(c, "lora_name", raw.strings)?,
        F::GroupIdx => s.group_idx = opt(c, "group_idx", u32_of)?,
        F::KvCacheSpecKind => s.kv_cache_spec_kind = opt_str(c, "kv_cache_spec_kind", raw.strings)?,
        F::KvCacheSpecSlidingWindow => {
            s.kv_cache_spec_sliding_window = opt(c, "kv_cache_spec_sliding_window", u32_of)?
        }
        F::TokenOffset => s.token_offset = opt(c, "token_offset", u64_of)?,
        F::FromMedium => raw.from_medium = opt_str(c, "from_medium", raw.strings)?,
        F::ToMedium => raw.to_medium = opt_str(c, "to_medium", raw.strings)?,
        F::ExtraKeys => s.extra_keys = Some(c.value(0).map_err(malformed)?).filter(|v| !v.is_nil()),
        F::Locality => s.locality = opt_str(c, "locality", raw.strings)?,
        F::Ownership => s.ownership = opt_str(c, "ownership", raw.strings)?,
        F::SessionId => s.session_id = opt_str(c, "session_id", raw.strings)?,
        F::CacheSalt => s.cache_salt = opt_str(c, "cache_salt", raw.strings)?,
        F::LookaheadTokenIds => {
            s.lookahead_token_ids = match c.token().map_err(malformed)? {
                Token::Array(n) => {
                    let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                    for _ in 0..n {
                        let mut ids = Vec::new();
                        token_list(c, "lookahead_token_ids", &mut ids)?;
                        v.push(ids);
                    }
                    Some(v)
                }
                Token::Nil => None,
                _ => return Err(EventError::NotAnArray("lookahead_token_ids")),
            }
        }
    }
    Ok(())
}

/// Makes `slot` a default BlockStored for the next event while keeping its allocations: its
/// vectors emptied, its strings moved to `strings` for [`opt_str`] to refill.
fn recycle(slot: &mut KvEvent, strings: &mut Vec<String>) {
    let KvEvent::BlockStored(s) = slot else {
        let mut hashes = match slot {
            KvEvent::BlockRemoved(r) => take(&mut r.block_hashes),
            KvEvent::BlockTransferred(t) => take(&mut t.block_hashes),
            _ => Vec::new(),
        };
        hashes.clear();
        *slot = KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            ..BlockStored::default()
        });
        return;
    };
    // Every field named, so that a new one cannot be left out of the reset.
    let BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name,
        group_idx,
        kv_cache_spec_kind,
        kv_cache_spec_sliding_window,
        token_offset,
        extra_keys,
        locality,
        ownership,
        session_id,
        lookahead_token_ids,
        cache_salt,
        extra,
    } = s;
    // Vectors kept only up to a bound, so that one huge event does not pin its memory in
    // every batch after it.
    if token_ids.capacity() > KEEP_TOKENS {
        *token_ids = Vec::new();
    }
    if block_hashes.capacity() > KEEP_HASHES {
        *block_hashes = Vec::new();
    }
    block_hashes.clear();
    token_ids.clear();
    extra.clear();
    *parent_block_hash = None;
    *block_size = 0;
    *lora_id = None;
    *group_idx = None;
    *kv_cache_spec_sliding_window = None;
    *token_offset = None;
    *extra_keys = None;
    *lookahead_token_ids = None;
    for f in [
        medium,
        lora_name,
        kv_cache_spec_kind,
        locality,
        ownership,
        session_id,
        cache_salt,
    ] {
        if let Some(buf) = f.take().filter(|_| strings.len() < SPARE_STRINGS) {
            strings.push(buf);
        }
    }
}

/// Reads one event into `slot` (a default BlockStored, left as the event when it is one,
/// replaced otherwise) and says which encoding carried it. On error the cursor is left anywhere
/// inside the event (the caller rewinds) and the slot holds whatever was read.
fn event(
    c: &mut Cursor<'_>,
    slot: &mut KvEvent,
    strings: &mut Vec<String>,
) -> Result<Encoding, EventError> {
    let KvEvent::BlockStored(stored) = slot else {
        unreachable!("the caller passes a BlockStored slot")
    };
    let mut raw = Raw {
        ty: None,
        fields: u32::MAX,
        order: &[],
        stored,
        from_medium: None,
        to_medium: None,
        strings,
    };
    let head = match c.container_len(true) {
        Some(n) => Token::Map(n),
        None => c.token().map_err(malformed)?,
    };
    let encoding = match head {
        Token::Map(n) => {
            map_event(c, &mut raw, n)?;
            Encoding::Current
        }
        Token::Array(n) => {
            array_event(c, &mut raw, n)?;
            Encoding::Legacy
        }
        _ => return Err(EventError::NotAMapOrArray),
    };
    if let Some(other) = typed(raw)? {
        *slot = other;
    }
    Ok(encoding)
}

/// Decodes one batch payload. It is read in one pass without building a generic tree; an
/// event that fails is skipped whole (its extent is found by re-reading it structurally), so
/// only bytes that are not msgpack at all make the whole batch unreadable.
pub fn decode_batch(payload: &[u8]) -> Result<Decoded, BatchError> {
    decode_batch_reusing(payload, EventBatch::default())
}

/// [`decode_batch`] into the allocations of `spare`, a batch the caller is done with: its
/// events' vectors and strings are refilled rather than allocated again, which is most of a
/// steady stream's decoding cost. The result equals [`decode_batch`]'s.
pub fn decode_batch_reusing(payload: &[u8], spare: EventBatch) -> Result<Decoded, BatchError> {
    let bad = BatchError::Msgpack;
    let mut c = Cursor::new(payload);
    let n = match c.token().map_err(bad)? {
        Token::Array(n) => n,
        _ => return Err(BatchError::NotAnArray),
    };
    if n < 2 {
        return Err(BatchError::TooShort(n));
    }
    let ts = match c.token().map_err(bad)? {
        Token::Float(f) => f,
        Token::UInt(u) => u as f64,
        Token::Int(i) => i as f64,
        _ => return Err(BatchError::TimestampNotANumber),
    };
    let Token::Array(count) = c.token().map_err(bad)? else {
        return Err(BatchError::EventsNotAnArray);
    };
    let mut events = spare.events;
    if events.capacity() > KEEP_EVENTS {
        events = Vec::new();
    }
    events.reserve(count.min(MAX_RESERVE).saturating_sub(events.len()));
    let mut strings = Vec::new();
    let mut skipped = Vec::new();
    let mut encoding = None;
    // Events decoded so far: slot `done` takes the next one (a failed event's slot is reused).
    let mut done = 0;
    for i in 0..count {
        let start = c.pos();
        match events.get_mut(done) {
            Some(slot) => recycle(slot, &mut strings),
            None => events.push(KvEvent::BlockStored(BlockStored::default())),
        }
        match event(&mut c, &mut events[done], &mut strings) {
            Ok(enc) => {
                done += 1;
                encoding.get_or_insert(enc);
            }
            Err(why) => {
                c.rewind(start);
                c.skip().map_err(bad)?;
                skipped.push(SkippedEvent { index: i, why });
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
        return Err(BatchError::Msgpack(msgpack::DecodeError::TrailingBytes(
            c.remaining(),
        )));
    }
    events.truncate(done);
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
mod tests;
