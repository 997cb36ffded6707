//! The JSON-lines form of batches (tail's output, publish's input). Every field is written,
//! `null` when unset; hashes are integers, or `{"bytes": "<hex>"}` for binary hashes.

use kvlink::events::{
    BlockHash, BlockRemoved, BlockStored, BlockTransferred, EventBatch, KvEvent, Resync,
};
use serde_json::{json, Map, Value};

/// Seconds since the epoch.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn hash(h: &BlockHash) -> Value {
    match h {
        BlockHash::U64(v) => json!(v),
        BlockHash::I64(v) => json!(v),
        BlockHash::Bytes(b) => {
            let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
            json!({ "bytes": hex })
        }
    }
}

fn hashes(hs: &[BlockHash]) -> Value {
    Value::Array(hs.iter().map(hash).collect())
}

/// One event as JSON.
pub fn event(e: &KvEvent) -> Value {
    match e {
        KvEvent::BlockStored(s) => json!({
            "type": "BlockStored",
            "block_hashes": hashes(&s.block_hashes),
            "parent_block_hash": s.parent_block_hash.as_ref().map(hash),
            "token_ids": s.token_ids,
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "medium": s.medium,
            "lora_name": s.lora_name,
            "group_idx": s.group_idx,
            "kv_cache_spec_kind": s.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
            "token_offset": s.token_offset,
        }),
        KvEvent::BlockRemoved(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": hashes(&r.block_hashes),
            "medium": r.medium,
            "group_idx": r.group_idx,
        }),
        KvEvent::AllBlocksCleared { medium } => {
            json!({"type": "AllBlocksCleared", "medium": medium})
        }
        KvEvent::BlockTransferred(t) => json!({
            "type": "BlockTransferred",
            "block_hashes": hashes(&t.block_hashes),
            "from_medium": t.from_medium,
            "to_medium": t.to_medium,
            "group_idx": t.group_idx,
        }),
    }
}

/// A batch line of `tail`.
pub fn batch_line(seq: Option<u64>, b: &EventBatch, skipped: &[String]) -> Value {
    json!({
        "seq": seq,
        "ts": b.ts,
        "dp_rank": b.dp_rank,
        "events": b.events.iter().map(event).collect::<Vec<_>>(),
        "skipped": skipped,
    })
}

/// A resynchronisation line of `tail`.
pub fn resync_line(r: &Resync) -> Value {
    match r {
        Resync::PublisherRestart { last, now } => {
            json!({"resync": "publisher_restart", "last": last, "now": now})
        }
        Resync::HistoryLost { from, resumed } => {
            json!({"resync": "history_lost", "from": from, "resumed": resumed})
        }
    }
}

fn parse_hash(v: &Value) -> Result<BlockHash, String> {
    if let Some(u) = v.as_u64() {
        return Ok(BlockHash::U64(u));
    }
    if let Some(i) = v.as_i64() {
        return Ok(BlockHash::I64(i));
    }
    if let Some(hex) = v.get("bytes").and_then(Value::as_str) {
        if hex.len() % 2 != 0 || !hex.is_ascii() {
            return Err(format!("bad hex hash {hex:?}"));
        }
        return (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map(BlockHash::Bytes)
            .map_err(|_| format!("bad hex hash {hex:?}"));
    }
    Err(format!(
        "a hash must be an integer or {{\"bytes\": hex}}, got {v}"
    ))
}

struct Obj<'a>(&'a Map<String, Value>);

impl Obj<'_> {
    fn field(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn hashes(&self, k: &str) -> Result<Vec<BlockHash>, String> {
        match self.field(k) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(parse_hash).collect(),
            Some(v) => Err(format!("{k} must be an array, got {v}")),
        }
    }
    fn hash(&self, k: &str) -> Result<Option<BlockHash>, String> {
        self.field(k).map(parse_hash).transpose()
    }
    fn str(&self, k: &str) -> Result<Option<String>, String> {
        self.field(k)
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{k} must be a string"))
            })
            .transpose()
    }
    fn int<T: TryFrom<i128>>(&self, k: &str) -> Result<Option<T>, String> {
        self.field(k)
            .map(|v| {
                v.as_i64()
                    .map(i128::from)
                    .or_else(|| v.as_u64().map(i128::from))
                    .and_then(|x| T::try_from(x).ok())
                    .ok_or_else(|| format!("{k} must be an integer in range, got {v}"))
            })
            .transpose()
    }
}

/// Parses one event.
pub fn parse_event(v: &Value) -> Result<KvEvent, String> {
    let m = v.as_object().ok_or("an event must be an object")?;
    let o = Obj(m);
    let ty = o.str("type")?.ok_or("an event needs a \"type\"")?;
    Ok(match ty.as_str() {
        "BlockStored" => KvEvent::BlockStored(BlockStored {
            block_hashes: o.hashes("block_hashes")?,
            parent_block_hash: o.hash("parent_block_hash")?,
            token_ids: match o.field("token_ids") {
                None => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or_else(|| format!("token id {t} is not a u32"))
                    })
                    .collect::<Result<_, _>>()?,
                Some(v) => return Err(format!("token_ids must be an array, got {v}")),
            },
            block_size: o.int("block_size")?.unwrap_or(0),
            lora_id: o.int("lora_id")?,
            medium: o.str("medium")?,
            lora_name: o.str("lora_name")?,
            group_idx: o.int("group_idx")?,
            kv_cache_spec_kind: o.str("kv_cache_spec_kind")?,
            kv_cache_spec_sliding_window: o.int("kv_cache_spec_sliding_window")?,
            token_offset: o.int("token_offset")?,
        }),
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: o.hashes("block_hashes")?,
            medium: o.str("medium")?,
            group_idx: o.int("group_idx")?,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared {
            medium: o.str("medium")?,
        },
        "BlockTransferred" => KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: o.hashes("block_hashes")?,
            from_medium: o.str("from_medium")?,
            to_medium: o.str("to_medium")?,
            group_idx: o.int("group_idx")?,
        }),
        t => return Err(format!("unknown event type {t:?}")),
    })
}

/// Parses one batch line: `{"ts": .., "dp_rank": .., "events": [..]}`.
pub fn parse_batch(line: &str) -> Result<EventBatch, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let m = v.as_object().ok_or("a batch must be an object")?;
    let o = Obj(m);
    let events = match o.field("events") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, e)| parse_event(e).map_err(|why| format!("event {i}: {why}")))
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(format!("events must be an array, got {v}")),
    };
    Ok(EventBatch {
        ts: o.field("ts").and_then(Value::as_f64).unwrap_or_else(now),
        events,
        dp_rank: o.int("dp_rank")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let line = r#"{"ts": 1.5, "dp_rank": 2, "events": [
            {"type": "BlockStored", "block_hashes": [18446744073709551615, -5, {"bytes": "00ff"}],
             "parent_block_hash": 9223372036854775808, "token_ids": [1, 2], "block_size": 16,
             "medium": "GPU", "token_offset": 32},
            {"type": "BlockRemoved", "block_hashes": [1]},
            {"type": "AllBlocksCleared"}]}"#;
        let b = parse_batch(line).unwrap();
        let KvEvent::BlockStored(s) = &b.events[0] else {
            panic!()
        };
        assert_eq!(
            s.block_hashes,
            vec![
                BlockHash::U64(u64::MAX),
                BlockHash::I64(-5),
                BlockHash::Bytes(vec![0, 255])
            ]
        );
        let back = batch_line(Some(3), &b, &[]);
        let again = parse_batch(&back.to_string()).unwrap();
        assert_eq!(again, b);
        assert!(parse_batch(r#"{"events": [{"type": "Nope"}]}"#).is_err());
        assert!(parse_batch(
            r#"{"events": [{"type": "BlockRemoved", "block_hashes": [{"bytes": "a\u00e90"}]}]}"#
        )
        .is_err());
        assert!(
            parse_batch(r#"{"events": [{"type": "BlockStored", "token_ids": [-1]}]}"#).is_err()
        );
    }
}
