//! The JSON-lines form of batches (tail's output, publish's input). Every field kvlink models is
//! written, `null` when unset; hashes are integers, or `{"bytes": "<hex>"}` for binary hashes.
//! Fields kvlink does not model follow under their own names (`"@<index>"` for a legacy
//! array's positional ones), their msgpack values as JSON (see [`value_to_json`]).

use kvlink_events::{
    BlockHash, BlockRemoved, BlockStored, BlockTransferred, EventBatch, ExtraField, FieldKey,
    KvEvent, Resync, SkippedEvent, Value as MpValue, MAX_EXTRA_POSITION,
};
use serde_json::{json, Map, Value};

/// Seconds since the epoch.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(hex: &str) -> Result<Vec<u8>, String> {
    if !hex.len().is_multiple_of(2) || !hex.is_ascii() {
        return Err(format!("bad hex {hex:?}"));
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| format!("bad hex {hex:?}"))
}

fn hash(h: &BlockHash) -> Value {
    match h {
        BlockHash::U64(v) => json!(v),
        BlockHash::I64(v) => json!(v),
        BlockHash::Bytes(b) => json!({ "bytes": hex(b) }),
    }
}

fn hashes(hs: &[BlockHash]) -> Value {
    Value::Array(hs.iter().map(hash).collect())
}

/// Object shapes that stand for msgpack types JSON lacks; a real string-keyed map of one of
/// these shapes is written in the generic `{"map": [[k, v], ...]}` form instead.
fn reserved_shape(m: &Map<String, Value>) -> bool {
    let keys: Vec<&str> = m.keys().map(String::as_str).collect();
    matches!(
        keys.as_slice(),
        ["bytes"] | ["map"] | ["ext", "bytes"] | ["bytes", "ext"]
    )
}

/// A msgpack value as JSON: nil, booleans, integers, floats, strings and arrays as themselves,
/// binary as `{"bytes": hex}`, extension types as `{"ext": type, "bytes": hex}`, maps with
/// string keys as objects, any other map as `{"map": [[key, value], ...]}`.
pub fn value_to_json(v: &MpValue) -> Value {
    match v {
        MpValue::Nil => Value::Null,
        MpValue::Bool(b) => json!(b),
        MpValue::UInt(u) => json!(u),
        MpValue::Int(i) => json!(i),
        MpValue::Float(f) => json!(f),
        MpValue::Str(s) => json!(s),
        MpValue::Bin(b) => json!({ "bytes": hex(b) }),
        MpValue::Ext(t, b) => json!({ "ext": t, "bytes": hex(b) }),
        MpValue::Array(a) => Value::Array(a.iter().map(value_to_json).collect()),
        MpValue::Map(pairs) => {
            let mut m = Map::new();
            let mut plain = true;
            for (k, v) in pairs {
                match k {
                    MpValue::Str(k) if !m.contains_key(k) => {
                        m.insert(k.clone(), value_to_json(v));
                    }
                    _ => plain = false,
                }
            }
            if plain && !reserved_shape(&m) {
                Value::Object(m)
            } else {
                let pairs = pairs
                    .iter()
                    .map(|(k, v)| json!([value_to_json(k), value_to_json(v)]))
                    .collect();
                json!({ "map": Value::Array(pairs) })
            }
        }
    }
}

/// The inverse of [`value_to_json`] (a JSON number with a fraction or exponent is a float).
pub fn value_from_json(v: &Value) -> Result<MpValue, String> {
    Ok(match v {
        Value::Null => MpValue::Nil,
        Value::Bool(b) => MpValue::Bool(*b),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                MpValue::UInt(u)
            } else if let Some(i) = n.as_i64() {
                MpValue::Int(i)
            } else {
                MpValue::Float(n.as_f64().ok_or_else(|| format!("bad number {n}"))?)
            }
        }
        Value::String(s) => MpValue::Str(s.clone()),
        Value::Array(a) => MpValue::Array(a.iter().map(value_from_json).collect::<Result<_, _>>()?),
        Value::Object(m) if reserved_shape(m) => {
            if let Some(Value::Array(pairs)) = m.get("map") {
                let mut out = Vec::with_capacity(pairs.len());
                for p in pairs {
                    match p.as_array().map(Vec::as_slice) {
                        Some([k, v]) => out.push((value_from_json(k)?, value_from_json(v)?)),
                        _ => return Err(format!("a map entry must be [key, value], got {p}")),
                    }
                }
                MpValue::Map(out)
            } else {
                let bytes = m
                    .get("bytes")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("\"bytes\" must be a hex string in {v}"))
                    .and_then(unhex)?;
                match m.get("ext") {
                    None => MpValue::Bin(bytes),
                    Some(t) => MpValue::Ext(
                        t.as_i64()
                            .and_then(|t| i8::try_from(t).ok())
                            .ok_or_else(|| format!("bad extension type {t}"))?,
                        bytes,
                    ),
                }
            }
        }
        Value::Object(m) => MpValue::Map(
            m.iter()
                .map(|(k, v)| Ok((MpValue::Str(k.clone()), value_from_json(v)?)))
                .collect::<Result<_, String>>()?,
        ),
    })
}

/// Adds the fields kvlink does not model: a named one under its name, a positional one (legacy
/// encoding) as `"@<index>"`.
fn put_extra(v: &mut Value, extra: &[ExtraField]) {
    if let Value::Object(m) = v {
        for f in extra {
            let k = match &f.key {
                FieldKey::Name(n) => n.clone(),
                FieldKey::Position(p) => format!("@{p}"),
            };
            m.insert(k, value_to_json(&f.value));
        }
    }
}

/// One event as JSON: every field kvlink models (null when unset), then the others.
pub fn event(e: &KvEvent) -> Value {
    let mut v = match e {
        KvEvent::BlockStored(s) => json!({
            "type": "BlockStored",
            "block_hashes": hashes(&s.block_hashes),
            "parent_block_hash": s.parent_block_hash.as_ref().map(hash),
            "token_ids": s.token_ids,
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "medium": s.medium,
            "lora_name": s.lora_name,
            "extra_keys": s.extra_keys.as_ref().map(value_to_json),
            "group_idx": s.group_idx,
            "kv_cache_spec_kind": s.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
            "token_offset": s.token_offset,
            "locality": s.locality,
            "ownership": s.ownership,
            "session_id": s.session_id,
            "lookahead_token_ids": s.lookahead_token_ids,
            "cache_salt": s.cache_salt,
        }),
        KvEvent::BlockRemoved(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": hashes(&r.block_hashes),
            "medium": r.medium,
            "group_idx": r.group_idx,
            "locality": r.locality,
            "ownership": r.ownership,
        }),
        KvEvent::AllBlocksCleared { medium, .. } => {
            json!({"type": "AllBlocksCleared", "medium": medium})
        }
        KvEvent::BlockTransferred(t) => json!({
            "type": "BlockTransferred",
            "block_hashes": hashes(&t.block_hashes),
            "from_medium": t.from_medium,
            "to_medium": t.to_medium,
            "group_idx": t.group_idx,
        }),
    };
    put_extra(&mut v, e.extra());
    v
}

/// A batch line of `tail`.
pub fn batch_line(
    seq: Option<u64>,
    topic: &[u8],
    b: &EventBatch,
    skipped: &[SkippedEvent],
) -> Value {
    json!({
        "seq": seq,
        "topic": String::from_utf8_lossy(topic),
        "ts": b.ts,
        "dp_rank": b.dp_rank,
        "events": b.events.iter().map(event).collect::<Vec<_>>(),
        "skipped": skipped.iter().map(ToString::to_string).collect::<Vec<_>>(),
    })
}

/// A snapshot line of `tail`: the publisher's live blocks as of `seq`, replacing what was
/// derived from the stream before.
pub fn snapshot_line(
    seq: u64,
    topic: &[u8],
    batches: &[EventBatch],
    skipped: &[SkippedEvent],
) -> Value {
    let parts: Vec<Value> = batches
        .iter()
        .map(|b| json!({"ts": b.ts, "dp_rank": b.dp_rank, "events": b.events.iter().map(event).collect::<Vec<_>>()}))
        .collect();
    json!({
        "snapshot": seq,
        "topic": String::from_utf8_lossy(topic),
        "batches": parts,
        "skipped": skipped.iter().map(ToString::to_string).collect::<Vec<_>>(),
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
        return unhex(hex)
            .map(BlockHash::Bytes)
            .map_err(|e| format!("hash: {e}"));
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

fn tokens(v: &Value) -> Result<Vec<u32>, String> {
    match v {
        Value::Array(a) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| format!("token id {t} is not a u32"))
            })
            .collect(),
        v => Err(format!("token ids must be an array, got {v}")),
    }
}

/// The fields of `m` kvlink does not model for type `ty`, in order.
fn parse_extra(ty: &str, m: &Map<String, Value>) -> Result<Vec<ExtraField>, String> {
    let first = KvEvent::first_extra_position(ty);
    let mut out = Vec::new();
    for (k, v) in m {
        if KvEvent::known_field(ty, k) {
            continue;
        }
        let key = match k.strip_prefix('@') {
            Some(p) => match p.parse::<usize>() {
                Ok(p) if (first..=MAX_EXTRA_POSITION).contains(&p) => FieldKey::Position(p),
                _ => {
                    return Err(format!(
                    "positional field {k:?}: \"@<index>\" from @{first} to @{MAX_EXTRA_POSITION}"
                ))
                }
            },
            None => FieldKey::Name(k.clone()),
        };
        out.push(ExtraField {
            key,
            value: value_from_json(v)?,
        });
    }
    Ok(out)
}

/// Parses one event.
pub fn parse_event(v: &Value) -> Result<KvEvent, String> {
    let m = v.as_object().ok_or("an event must be an object")?;
    let o = Obj(m);
    let ty = o.str("type")?.ok_or("an event needs a \"type\"")?;
    let extra = parse_extra(&ty, m)?;
    Ok(match ty.as_str() {
        "BlockStored" => KvEvent::BlockStored(BlockStored {
            block_hashes: o.hashes("block_hashes")?,
            parent_block_hash: o.hash("parent_block_hash")?,
            token_ids: o
                .field("token_ids")
                .map(tokens)
                .transpose()?
                .unwrap_or_default(),
            block_size: o.int("block_size")?.unwrap_or(0),
            lora_id: o.int("lora_id")?,
            medium: o.str("medium")?,
            lora_name: o.str("lora_name")?,
            group_idx: o.int("group_idx")?,
            kv_cache_spec_kind: o.str("kv_cache_spec_kind")?,
            kv_cache_spec_sliding_window: o.int("kv_cache_spec_sliding_window")?,
            token_offset: o.int("token_offset")?,
            extra_keys: o.field("extra_keys").map(value_from_json).transpose()?,
            locality: o.str("locality")?,
            ownership: o.str("ownership")?,
            session_id: o.str("session_id")?,
            lookahead_token_ids: match o.field("lookahead_token_ids") {
                None => None,
                Some(Value::Array(a)) => Some(a.iter().map(tokens).collect::<Result<_, _>>()?),
                Some(v) => return Err(format!("lookahead_token_ids must be an array, got {v}")),
            },
            cache_salt: o.str("cache_salt")?,
            extra,
        }),
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: o.hashes("block_hashes")?,
            medium: o.str("medium")?,
            group_idx: o.int("group_idx")?,
            locality: o.str("locality")?,
            ownership: o.str("ownership")?,
            extra,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared {
            medium: o.str("medium")?,
            extra,
        },
        "BlockTransferred" => KvEvent::BlockTransferred(BlockTransferred {
            block_hashes: o.hashes("block_hashes")?,
            from_medium: o.str("from_medium")?,
            to_medium: o.str("to_medium")?,
            group_idx: o.int("group_idx")?,
            extra,
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
        let back = batch_line(Some(3), b"kv@p@m", &b, &[]);
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

    #[test]
    fn unknown_fields_and_exact_timestamps_round_trip() {
        let line = r#"{"ts": 1795255560.1496913, "dp_rank": null, "events": [
            {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
             "extra_keys": [["lora-a", ["mm", 3]], null], "session_id": "s1",
             "lookahead_token_ids": [[5, 6]], "future": {"nested": [1.5, {"bytes": "0a"}]},
             "odd": {"map": [[1, "one"]]}, "bin_like": {"map": [["bytes", "x"]]}},
            {"type": "BlockRemoved", "block_hashes": [2], "@6": {"ext": 5, "bytes": "ff"}}]}"#;
        let b = parse_batch(line).unwrap();
        assert_eq!(b.ts.to_string(), "1795255560.1496913");
        let KvEvent::BlockStored(s) = &b.events[0] else {
            panic!()
        };
        assert_eq!(s.session_id.as_deref(), Some("s1"));
        let names: Vec<_> = s.extra.iter().map(|f| f.key.clone()).collect();
        assert_eq!(
            names,
            ["future", "odd", "bin_like"].map(|n| FieldKey::Name(n.into()))
        );
        assert_eq!(
            s.extra[1].value,
            MpValue::Map(vec![(MpValue::UInt(1), MpValue::Str("one".into()))])
        );
        assert_eq!(
            s.extra[2].value,
            MpValue::Map(vec![(
                MpValue::Str("bytes".into()),
                MpValue::Str("x".into())
            )]),
            "a real map shaped like a binary value"
        );
        assert_eq!(b.events[1].extra()[0].key, FieldKey::Position(6));
        let back = batch_line(None, b"", &b, &[]).to_string();
        assert!(back.contains("1795255560.1496913"), "{back}");
        assert_eq!(parse_batch(&back).unwrap(), b);
        assert!(parse_batch(r#"{"events": [{"type": "BlockRemoved", "@2": 1}]}"#).is_err());
        assert!(parse_batch(r#"{"events": [{"type": "BlockRemoved", "@4": 1}]}"#).is_ok());
        assert!(parse_batch(r#"{"events": [{"type": "BlockStored", "@13": 1}]}"#).is_ok());
        assert!(parse_batch(r#"{"events": [{"type": "BlockStored", "@5000000000": 1}]}"#).is_err());
    }
}
