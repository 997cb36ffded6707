//! Encoding of events and batches in either encoding (current maps or legacy arrays).

mod tokens;

use rmp::encode as w;

use super::{
    BlockHash, BlockStored, BlockStoredRef, Encoding, EventBatch, ExtraField, FieldKey, HashRef,
    HashesRef, KvEvent, Value, STORED_LEGACY_ALWAYS,
};

fn nil(out: &mut Vec<u8>) {
    // Writing into a Vec cannot fail.
    let _ = w::write_nil(out);
}

/// An unsigned integer in msgpack's shortest form (the hot path: token ids and hashes).
#[inline]
fn put_u64(out: &mut Vec<u8>, v: u64) {
    match u32::try_from(v) {
        Ok(v) => {
            let (word, len) = tokens::u32_form(v);
            out.extend_from_slice(&word.to_be_bytes()[..len]);
        }
        Err(_) => {
            // Marker and value as one 9-byte write (one capacity check, not two).
            let mut b = [0xcf; 9];
            b[1..].copy_from_slice(&v.to_be_bytes());
            out.extend_from_slice(&b);
        }
    }
}

#[inline]
fn put_hash(out: &mut Vec<u8>, h: &BlockHash) {
    match h {
        BlockHash::U64(v) => put_u64(out, *v),
        BlockHash::I64(v) => {
            let _ = w::write_sint(out, *v);
        }
        BlockHash::Bytes(b) => {
            let _ = w::write_bin(out, b);
        }
    }
}

fn put_hashes(out: &mut Vec<u8>, hs: &[BlockHash]) {
    put_array_len(out, hs.len());
    out.reserve(hs.len() * 9);
    for h in hs {
        put_hash(out, h);
    }
}

fn put_opt_str(out: &mut Vec<u8>, s: &Option<String>) {
    match s {
        Some(s) => put_str(out, s),
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

/// A string; the short ones (every key, most values) without going through rmp.
#[inline]
fn put_str(out: &mut Vec<u8>, k: &str) {
    if k.len() < 32 {
        out.push(0xa0 | k.len() as u8);
        out.extend_from_slice(k.as_bytes());
    } else {
        let _ = w::write_str(out, k);
    }
}

#[inline]
fn put_key(out: &mut Vec<u8>, k: &str) {
    put_str(out, k);
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
        put_str(out, v);
    }
}

/// An array header in its shortest form.
#[inline]
fn put_array_len(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else {
        let _ = w::write_array_len(out, n as u32);
    }
}

/// A map header in its shortest form.
#[inline]
fn put_map_len(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x80 | n as u8);
    } else {
        let _ = w::write_map_len(out, n as u32);
    }
}

fn put_hash_ref(out: &mut Vec<u8>, h: HashRef<'_>) {
    match h {
        HashRef::U64(v) => put_u64(out, v),
        HashRef::I64(v) => {
            let _ = w::write_sint(out, v);
        }
        HashRef::Bytes(b) => {
            let _ = w::write_bin(out, b);
        }
    }
}

fn put_hashes_ref(out: &mut Vec<u8>, hs: HashesRef<'_>) {
    match hs {
        HashesRef::Any(hs) => put_hashes(out, hs),
        HashesRef::U64(hs) => {
            put_array_len(out, hs.len());
            out.reserve(hs.len() * 9);
            for &h in hs {
                put_u64(out, h);
            }
        }
        HashesRef::I64(hs) => {
            put_array_len(out, hs.len());
            out.reserve(hs.len() * 9);
            for &h in hs {
                let _ = w::write_sint(out, h);
            }
        }
    }
}

fn put_opt_hash_ref(out: &mut Vec<u8>, h: Option<HashRef<'_>>) {
    match h {
        Some(h) => put_hash_ref(out, h),
        None => nil(out),
    }
}

fn put_opt_str_ref(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => put_str(out, s),
        None => nil(out),
    }
}

/// A BlockStored's first seven fields (vLLM's required ones), map keys included in the current
/// encoding: what owned and borrowed events share.
fn put_stored_head(out: &mut Vec<u8>, s: &BlockStoredRef<'_>, enc: Encoding) {
    match enc {
        Encoding::Current => {
            // The keys (and the tag) as constant runs of msgpack: one copy each instead of a
            // string header and a copy per key.
            out.extend_from_slice(b"\xa4type\xabBlockStored\xacblock_hashes");
            put_hashes_ref(out, s.block_hashes);
            out.extend_from_slice(b"\xb1parent_block_hash");
            put_opt_hash_ref(out, s.parent_block_hash);
            out.extend_from_slice(b"\xa9token_ids");
            tokens::put_tokens(out, s.token_ids);
            out.extend_from_slice(b"\xaablock_size");
            put_u64(out, u64::from(s.block_size));
            out.extend_from_slice(b"\xa7lora_id");
            put_opt_sint(out, s.lora_id);
            out.extend_from_slice(b"\xa6medium");
            put_opt_str_ref(out, s.medium);
            out.extend_from_slice(b"\xa9lora_name");
            put_opt_str_ref(out, s.lora_name);
        }
        Encoding::Legacy => {
            out.extend_from_slice(b"\xabBlockStored");
            put_hashes_ref(out, s.block_hashes);
            put_opt_hash_ref(out, s.parent_block_hash);
            tokens::put_tokens(out, s.token_ids);
            put_u64(out, u64::from(s.block_size));
            put_opt_sint(out, s.lora_id);
            put_opt_str_ref(out, s.medium);
            put_opt_str_ref(out, s.lora_name);
        }
    }
}

/// Encodes a BlockStored given by reference (see [`BlockStoredRef`]): the same bytes as
/// [`encode_event`] writes for a [`BlockStored`] with these fields and no others.
pub fn encode_stored_ref(s: &BlockStoredRef<'_>, enc: Encoding, out: &mut Vec<u8>) {
    match enc {
        Encoding::Current => {
            put_map_len(out, 8 + usize::from(s.group_idx.is_some()));
            put_stored_head(out, s, enc);
            put_field_uint(out, "group_idx", s.group_idx.map(u64::from));
        }
        Encoding::Legacy => {
            // vLLM 0.23's eleven fields, nil when unset, as msgspec writes them.
            put_array_len(out, 1 + STORED_LEGACY_ALWAYS);
            put_stored_head(out, s, enc);
            nil(out); // extra_keys
            put_opt_uint(out, s.group_idx.map(u64::from));
            nil(out); // kv_cache_spec_kind
            nil(out); // kv_cache_spec_sliding_window
        }
    }
}

fn put_opt_sint(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => {
            let _ = w::write_sint(out, v);
        }
        None => nil(out),
    }
}

fn put_opt_value(out: &mut Vec<u8>, v: &Option<Value>) {
    match v {
        Some(v) => v.encode(out),
        None => nil(out),
    }
}

fn put_opt_lookahead(out: &mut Vec<u8>, v: &Option<Vec<Vec<u32>>>) {
    match v {
        Some(lists) => {
            let _ = w::write_array_len(out, lists.len() as u32);
            for l in lists {
                tokens::put_tokens(out, l);
            }
        }
        None => nil(out),
    }
}

/// The named extra fields (current encoding).
fn named(extra: &[ExtraField]) -> impl Iterator<Item = (&str, &Value)> {
    extra.iter().filter_map(|f| match &f.key {
        FieldKey::Name(n) => Some((n.as_str(), &f.value)),
        FieldKey::Position(_) => None,
    })
}

fn put_named(out: &mut Vec<u8>, extra: &[ExtraField]) {
    for (k, v) in named(extra) {
        put_key(out, k);
        v.encode(out);
    }
}

/// The legacy array's length: `known` fields (tag included), or more to hold the positional
/// extras.
fn legacy_len(known: usize, extra: &[ExtraField]) -> usize {
    extra
        .iter()
        .filter_map(|f| match f.key {
            FieldKey::Position(p) => Some(p.saturating_add(1)),
            FieldKey::Name(_) => None,
        })
        .fold(known, usize::max)
}

/// A legacy field kvlink may write: whether it is set, and how to write it.
type Later<'a> = (bool, &'a dyn Fn(&mut Vec<u8>));

/// A legacy event's elements from position `from` on: each kvlink-extension field (`later`,
/// from `from` on) when set, else the positional extra kept at its place, else nil; then the
/// positional extras past them. Written up to the last set field or extra.
fn put_later(out: &mut Vec<u8>, later: &[Later<'_>], extra: &[ExtraField], from: usize) {
    let last_set = later
        .iter()
        .rposition(|(set, _)| *set)
        .map_or(from, |i| from + i + 1);
    let len = legacy_len(last_set, extra);
    for p in from..len {
        match later.get(p - from) {
            Some((true, put)) => put(out),
            _ => match extra.iter().find(|f| f.key == FieldKey::Position(p)) {
                Some(f) => f.value.encode(out),
                None => nil(out),
            },
        }
    }
}

/// The length of a legacy array whose fields up to `from` are always written.
fn later_len(later: &[Later<'_>], extra: &[ExtraField], from: usize) -> usize {
    let last_set = later
        .iter()
        .rposition(|(set, _)| *set)
        .map_or(from, |i| from + i + 1);
    legacy_len(last_set, extra)
}

fn encode_stored_current(s: &BlockStored, out: &mut Vec<u8>) {
    let optional = [
        s.extra_keys.is_some(),
        s.group_idx.is_some(),
        s.kv_cache_spec_kind.is_some(),
        s.kv_cache_spec_sliding_window.is_some(),
        s.token_offset.is_some(),
        s.locality.is_some(),
        s.ownership.is_some(),
        s.session_id.is_some(),
        s.lookahead_token_ids.is_some(),
        s.cache_salt.is_some(),
    ];
    let n = 8 + optional.iter().filter(|x| **x).count() + named(&s.extra).count();
    put_map_len(out, n);
    put_stored_head(out, &s.head(), Encoding::Current);
    if let Some(v) = &s.extra_keys {
        put_key(out, "extra_keys");
        v.encode(out);
    }
    put_field_uint(out, "group_idx", s.group_idx.map(u64::from));
    put_field_str(out, "kv_cache_spec_kind", &s.kv_cache_spec_kind);
    put_field_uint(
        out,
        "kv_cache_spec_sliding_window",
        s.kv_cache_spec_sliding_window.map(u64::from),
    );
    put_field_uint(out, "token_offset", s.token_offset);
    put_field_str(out, "locality", &s.locality);
    put_field_str(out, "ownership", &s.ownership);
    put_field_str(out, "session_id", &s.session_id);
    if s.lookahead_token_ids.is_some() {
        put_key(out, "lookahead_token_ids");
        put_opt_lookahead(out, &s.lookahead_token_ids);
    }
    put_field_str(out, "cache_salt", &s.cache_salt);
    put_named(out, &s.extra);
}

fn encode_stored_legacy(s: &BlockStored, out: &mut Vec<u8>) {
    // Every field vLLM 0.23 declares (tag and eleven, nil when unset, as msgspec writes them);
    // ATOM's token_offset and kvlink's extension (STORED_LEGACY_ORDER) up to the last set.
    let later: [Later<'_>; 6] = [
        (s.token_offset.is_some(), &|o| {
            put_opt_uint(o, s.token_offset)
        }),
        (s.locality.is_some(), &|o| put_opt_str(o, &s.locality)),
        (s.ownership.is_some(), &|o| put_opt_str(o, &s.ownership)),
        (s.session_id.is_some(), &|o| put_opt_str(o, &s.session_id)),
        (s.lookahead_token_ids.is_some(), &|o| {
            put_opt_lookahead(o, &s.lookahead_token_ids)
        }),
        (s.cache_salt.is_some(), &|o| put_opt_str(o, &s.cache_salt)),
    ];
    let from = 1 + STORED_LEGACY_ALWAYS;
    put_array_len(out, later_len(&later, &s.extra, from));
    put_stored_head(out, &s.head(), Encoding::Legacy);
    put_opt_value(out, &s.extra_keys);
    put_opt_uint(out, s.group_idx.map(u64::from));
    put_opt_str(out, &s.kv_cache_spec_kind);
    put_opt_uint(out, s.kv_cache_spec_sliding_window.map(u64::from));
    put_later(out, &later, &s.extra, from);
}

/// Encodes one event.
pub fn encode_event(e: &KvEvent, enc: Encoding, out: &mut Vec<u8>) {
    match (e, enc) {
        (KvEvent::BlockStored(s), Encoding::Current) => encode_stored_current(s, out),
        (KvEvent::BlockStored(s), Encoding::Legacy) => encode_stored_legacy(s, out),
        (KvEvent::BlockRemoved(r), Encoding::Current) => {
            let optional = [
                r.group_idx.is_some(),
                r.locality.is_some(),
                r.ownership.is_some(),
            ];
            let n = 3 + optional.iter().filter(|x| **x).count() + named(&r.extra).count();
            let _ = w::write_map_len(out, n as u32);
            put_key(out, "type");
            let _ = w::write_str(out, "BlockRemoved");
            put_key(out, "block_hashes");
            put_hashes(out, &r.block_hashes);
            put_key(out, "medium");
            put_opt_str(out, &r.medium);
            put_field_uint(out, "group_idx", r.group_idx.map(u64::from));
            put_field_str(out, "locality", &r.locality);
            put_field_str(out, "ownership", &r.ownership);
            put_named(out, &r.extra);
        }
        (KvEvent::BlockRemoved(r), Encoding::Legacy) => {
            // Tag, hashes, medium and group_idx always (vLLM 0.23); locality and ownership
            // (kvlink's extension) up to the last set.
            let later: [Later<'_>; 2] = [
                (r.locality.is_some(), &|o| put_opt_str(o, &r.locality)),
                (r.ownership.is_some(), &|o| put_opt_str(o, &r.ownership)),
            ];
            let _ = w::write_array_len(out, later_len(&later, &r.extra, 4) as u32);
            let _ = w::write_str(out, "BlockRemoved");
            put_hashes(out, &r.block_hashes);
            put_opt_str(out, &r.medium);
            put_opt_uint(out, r.group_idx.map(u64::from));
            put_later(out, &later, &r.extra, 4);
        }
        (KvEvent::AllBlocksCleared { medium, extra }, Encoding::Current) => {
            let n = 1 + usize::from(medium.is_some()) + named(extra).count();
            let _ = w::write_map_len(out, n as u32);
            put_key(out, "type");
            let _ = w::write_str(out, "AllBlocksCleared");
            put_field_str(out, "medium", medium);
            put_named(out, extra);
        }
        (KvEvent::AllBlocksCleared { medium, extra }, Encoding::Legacy) => {
            // vLLM: the tag alone; ATOM: the tag and a medium.
            let later: [Later<'_>; 1] = [(medium.is_some(), &|o| put_opt_str(o, medium))];
            let _ = w::write_array_len(out, later_len(&later, extra, 1) as u32);
            let _ = w::write_str(out, "AllBlocksCleared");
            put_later(out, &later, extra, 1);
        }
        (KvEvent::BlockTransferred(t), Encoding::Current) => {
            let n = 4 + usize::from(t.group_idx.is_some()) + named(&t.extra).count();
            let _ = w::write_map_len(out, n as u32);
            put_key(out, "type");
            let _ = w::write_str(out, "BlockTransferred");
            put_key(out, "block_hashes");
            put_hashes(out, &t.block_hashes);
            put_key(out, "from_medium");
            put_opt_str(out, &t.from_medium);
            put_key(out, "to_medium");
            put_opt_str(out, &t.to_medium);
            put_field_uint(out, "group_idx", t.group_idx.map(u64::from));
            put_named(out, &t.extra);
        }
        (KvEvent::BlockTransferred(t), Encoding::Legacy) => {
            let _ = w::write_array_len(out, legacy_len(5, &t.extra) as u32);
            let _ = w::write_str(out, "BlockTransferred");
            put_hashes(out, &t.block_hashes);
            put_opt_str(out, &t.from_medium);
            put_opt_str(out, &t.to_medium);
            put_opt_uint(out, t.group_idx.map(u64::from));
            put_later(out, &[], &t.extra, 5);
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
