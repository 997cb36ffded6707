//! Encoding of events and batches in either encoding (current maps or legacy arrays).

use rmp::encode as w;

use super::{BlockHash, Encoding, EventBatch, KvEvent};

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
