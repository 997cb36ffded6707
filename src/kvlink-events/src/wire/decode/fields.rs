//! The fields the decoder models: their wire names, the order encoders write them in per event
//! type (for the key a map most likely has next, and the legacy encoding's places), per-type
//! masks, and the keys and tags as encoders write them, for whole comparisons.

use crate::msgpack::Encoded;

/// The fields kvlink models, by their wire names.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum F {
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
    pub(super) fn of(name: &[u8]) -> Option<F> {
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

    pub(super) const fn bit(self) -> u32 {
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

/// Field orders as the encoders write them (vLLM's declaration order), for the key a map event
/// most likely has next; the legacy encoding's places. The fields of a type not listed are kept
/// as unknown fields.
pub(super) const STORED_ORDER: [F; 17] = [
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
];
pub(super) const REMOVED_ORDER: [F; 5] = [
    F::BlockHashes,
    F::Medium,
    F::GroupIdx,
    F::Locality,
    F::Ownership,
];
pub(super) const CLEARED_ORDER: [F; 1] = [F::Medium];
pub(super) const TRANSFERRED_ORDER: [F; 4] =
    [F::BlockHashes, F::FromMedium, F::ToMedium, F::GroupIdx];

/// Each event type: its tag, its fields in order, and their mask.
pub(super) const TYPES: [(&str, &[F], u32); 4] = [
    ("BlockStored", &STORED_ORDER, mask(&STORED_ORDER)),
    ("BlockRemoved", &REMOVED_ORDER, mask(&REMOVED_ORDER)),
    ("AllBlocksCleared", &CLEARED_ORDER, mask(&CLEARED_ORDER)),
    (
        "BlockTransferred",
        &TRANSFERRED_ORDER,
        mask(&TRANSFERRED_ORDER),
    ),
];

/// The fields of event type `ty`, as a mask and in order (every field and none while the type
/// is unknown: such an event is refused anyway).
pub(super) fn type_of(ty: &[u8]) -> (u32, &'static [F]) {
    for (name, order, fields) in TYPES {
        if same_key(ty, name.as_bytes()) {
            return (fields, order);
        }
    }
    (u32::MAX, &[])
}

/// Every field, in declaration order (`ALL[f as usize] == f`).
pub(super) const ALL: [F; 20] = [
    F::Type,
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
    F::FromMedium,
    F::ToMedium,
];

/// Each field's name as encoders write a map key (fixstr), by `F as usize`.
pub(super) const KEYS: [Encoded; 20] = {
    let mut k = [Encoded::str(""); 20];
    let mut i = 0;
    while i < ALL.len() {
        k[i] = Encoded::str(ALL[i].name());
        i += 1;
    }
    k
};

/// Each event type's tag as encoders write it, in the order of [`TYPES`].
pub(super) const TAGS: [Encoded; 4] = [
    Encoded::str(TYPES[0].0),
    Encoded::str(TYPES[1].0),
    Encoded::str(TYPES[2].0),
    Encoded::str(TYPES[3].0),
];

/// The key a map event starts with.
pub(super) const TYPE_FIRST: [F; 1] = [F::Type];

impl F {
    /// The field's wire name.
    pub(super) const fn name(self) -> &'static str {
        match self {
            F::Type => "type",
            F::BlockHashes => "block_hashes",
            F::ParentBlockHash => "parent_block_hash",
            F::TokenIds => "token_ids",
            F::BlockSize => "block_size",
            F::LoraId => "lora_id",
            F::Medium => "medium",
            F::LoraName => "lora_name",
            F::ExtraKeys => "extra_keys",
            F::GroupIdx => "group_idx",
            F::KvCacheSpecKind => "kv_cache_spec_kind",
            F::KvCacheSpecSlidingWindow => "kv_cache_spec_sliding_window",
            F::TokenOffset => "token_offset",
            F::Locality => "locality",
            F::Ownership => "ownership",
            F::SessionId => "session_id",
            F::LookaheadTokenIds => "lookahead_token_ids",
            F::CacheSalt => "cache_salt",
            F::FromMedium => "from_medium",
            F::ToMedium => "to_medium",
        }
    }
}

/// Whether a map key equals a field name: short keys compared a word at a time inline rather
/// than through a call to `memcmp`.
#[inline(always)]
pub(super) fn same_key(k: &[u8], name: &[u8]) -> bool {
    if k.len() != name.len() {
        return false;
    }
    let n = k.len();
    if n < 8 {
        return k == name;
    }
    let word = |b: &[u8], at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().expect("8"));
    let mut i = 0;
    while i + 8 < n {
        if word(k, i) != word(name, i) {
            return false;
        }
        i += 8;
    }
    // The last (possibly overlapping) word.
    word(k, n - 8) == word(name, n - 8)
}
