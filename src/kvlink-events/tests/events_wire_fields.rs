//! KV-event wire format, the fields: every declared field of the legacy encoding, and fields
//! kvlink does not model (newer engines' and unknown ones) carried through in both encodings,
//! and token ids in every integer form.

use kvlink_events::*;
use rmp::encode as w;

/// Token ids in forms other than the compact unsigned ones (signed forms of non-negative values,
/// 64-bit), alone and between compact ones, decode to the same ids.
#[test]
fn token_ids_in_any_integer_form_decode() {
    let ids: Vec<u32> = (0..3000u32).map(|i| (i * 7919) % 150_000).collect();
    let mut ev = Vec::new();
    w::write_map_len(&mut ev, 4).unwrap();
    w::write_str(&mut ev, "type").unwrap();
    w::write_str(&mut ev, "BlockStored").unwrap();
    w::write_str(&mut ev, "block_hashes").unwrap();
    w::write_array_len(&mut ev, 1).unwrap();
    w::write_uint(&mut ev, 1).unwrap();
    w::write_str(&mut ev, "block_size").unwrap();
    w::write_uint(&mut ev, 0).unwrap();
    w::write_str(&mut ev, "token_ids").unwrap();
    w::write_array_len(&mut ev, ids.len() as u32).unwrap();
    for (i, &t) in ids.iter().enumerate() {
        match i % 3 {
            0 => w::write_uint(&mut ev, u64::from(t)).map(|_| ()).unwrap(),
            1 => w::write_i64(&mut ev, i64::from(t)).unwrap(),
            _ => w::write_u64(&mut ev, u64::from(t)).unwrap(),
        }
    }
    let d = decode_batch(&one_event_batch(&ev)).unwrap();
    assert!(d.skipped.is_empty(), "{:?}", d.skipped);
    let KvEvent::BlockStored(s) = &d.batch.events[0] else {
        panic!("a BlockStored")
    };
    assert_eq!(s.token_ids, ids);
}

/// msgpack of `['BlockStored', [1], None, [1], 16, None, 'GPU', None, None, None, None, None]`,
/// what vLLM 0.23's msgspec encoder writes for a legacy BlockStored with those fields.
#[test]
fn legacy_encoding_writes_every_declared_field() {
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash::U64(1)],
        token_ids: vec![1],
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    });
    let mut want = Vec::new();
    w::write_array_len(&mut want, 12).unwrap();
    w::write_str(&mut want, "BlockStored").unwrap();
    w::write_array_len(&mut want, 1).unwrap();
    w::write_uint(&mut want, 1).unwrap();
    w::write_nil(&mut want).unwrap();
    w::write_array_len(&mut want, 1).unwrap();
    w::write_uint(&mut want, 1).unwrap();
    w::write_uint(&mut want, 16).unwrap();
    w::write_nil(&mut want).unwrap();
    w::write_str(&mut want, "GPU").unwrap();
    for _ in 0..5 {
        w::write_nil(&mut want).unwrap();
    }
    let mut got = Vec::new();
    encode_event(&ev, Encoding::Legacy, &mut got);
    assert_eq!(got, want);
    // BlockRemoved: ['BlockRemoved', [2], None, None].
    let mut got = Vec::new();
    encode_event(
        &KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::U64(2)],
            ..Default::default()
        }),
        Encoding::Legacy,
        &mut got,
    );
    assert_eq!(
        got,
        [
            0x94, 0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o', b'v', b'e', b'd',
            0x91, 0x02, 0xc0, 0xc0
        ]
    );
    // ATOM's token_offset is the 13th element, written only when set.
    let mut with_offset = ev.clone();
    if let KvEvent::BlockStored(s) = &mut with_offset {
        s.token_offset = Some(32);
    }
    let mut got = Vec::new();
    encode_event(&with_offset, Encoding::Legacy, &mut got);
    assert_eq!(got[0], 0x9d);
    assert_eq!(*got.last().unwrap(), 32);
}

fn current_event_with_unknown_fields() -> Vec<u8> {
    // In the encoder's order: type, the seven always-present fields, the set optional ones
    // (vLLM 0.33's and SGLang's), then the unknown ones in wire order.
    let mut b = Vec::new();
    w::write_map_len(&mut b, 18).unwrap();
    w::write_str(&mut b, "type").unwrap();
    w::write_str(&mut b, "BlockStored").unwrap();
    w::write_str(&mut b, "block_hashes").unwrap();
    w::write_array_len(&mut b, 2).unwrap();
    w::write_uint(&mut b, u64::MAX).unwrap();
    w::write_uint(&mut b, 3).unwrap();
    w::write_str(&mut b, "parent_block_hash").unwrap();
    w::write_nil(&mut b).unwrap();
    w::write_str(&mut b, "token_ids").unwrap();
    w::write_array_len(&mut b, 2).unwrap();
    w::write_uint(&mut b, 7).unwrap();
    w::write_uint(&mut b, 70_000).unwrap();
    w::write_str(&mut b, "block_size").unwrap();
    w::write_uint(&mut b, 1).unwrap();
    w::write_str(&mut b, "lora_id").unwrap();
    w::write_nil(&mut b).unwrap();
    w::write_str(&mut b, "medium").unwrap();
    w::write_str(&mut b, "GPU").unwrap();
    w::write_str(&mut b, "lora_name").unwrap();
    w::write_str(&mut b, "adapter").unwrap();
    w::write_str(&mut b, "extra_keys").unwrap();
    // [["adapter", ["mm-1", 0]], None]
    w::write_array_len(&mut b, 2).unwrap();
    w::write_array_len(&mut b, 2).unwrap();
    w::write_str(&mut b, "adapter").unwrap();
    w::write_array_len(&mut b, 2).unwrap();
    w::write_str(&mut b, "mm-1").unwrap();
    w::write_uint(&mut b, 0).unwrap();
    w::write_nil(&mut b).unwrap();
    w::write_str(&mut b, "group_idx").unwrap();
    w::write_uint(&mut b, 1).unwrap();
    for (k, v) in [
        ("locality", "REMOTE"),
        ("ownership", "tier-2"),
        ("session_id", "s-9"),
    ] {
        w::write_str(&mut b, k).unwrap();
        w::write_str(&mut b, v).unwrap();
    }
    w::write_str(&mut b, "lookahead_token_ids").unwrap();
    w::write_array_len(&mut b, 2).unwrap();
    w::write_array_len(&mut b, 1).unwrap();
    w::write_uint(&mut b, 8).unwrap();
    w::write_array_len(&mut b, 0).unwrap();
    w::write_str(&mut b, "cache_salt").unwrap();
    w::write_str(&mut b, "salt").unwrap();
    // Unknown: a nested map with a binary value and a float, an extension value, a nil.
    w::write_str(&mut b, "z_future").unwrap();
    w::write_map_len(&mut b, 2).unwrap();
    w::write_uint(&mut b, 1).unwrap();
    w::write_bin(&mut b, &[0, 1, 2]).unwrap();
    w::write_str(&mut b, "f").unwrap();
    w::write_f64(&mut b, 0.1).unwrap();
    w::write_str(&mut b, "a_ext").unwrap();
    w::write_ext_meta(&mut b, 2, 7).unwrap();
    b.extend_from_slice(&[9, 9]);
    w::write_str(&mut b, "nothing").unwrap();
    w::write_nil(&mut b).unwrap();
    b
}

fn one_event_batch(ev: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    w::write_array_len(&mut b, 3).unwrap();
    w::write_f64(&mut b, 1_795_255_560.149_691_3).unwrap();
    w::write_array_len(&mut b, 1).unwrap();
    b.extend_from_slice(ev);
    w::write_sint(&mut b, 0).unwrap();
    b
}

#[test]
fn newer_and_unknown_fields_round_trip_in_the_current_encoding() {
    let payload = one_event_batch(&current_event_with_unknown_fields());
    let d = decode_batch(&payload).unwrap();
    assert!(d.skipped.is_empty(), "{:?}", d.skipped);
    assert_eq!(d.encoding, Encoding::Current);
    let KvEvent::BlockStored(s) = &d.batch.events[0] else {
        panic!()
    };
    assert_eq!(s.locality.as_deref(), Some("REMOTE"));
    assert_eq!(s.ownership.as_deref(), Some("tier-2"));
    assert_eq!(s.session_id.as_deref(), Some("s-9"));
    assert_eq!(s.cache_salt.as_deref(), Some("salt"));
    assert_eq!(s.lookahead_token_ids, Some(vec![vec![8], vec![]]));
    assert!(matches!(&s.extra_keys, Some(Value::Array(a)) if a.len() == 2));
    let names: Vec<&FieldKey> = s.extra.iter().map(|f| &f.key).collect();
    assert_eq!(
        names,
        ["z_future", "a_ext", "nothing"]
            .map(|n| FieldKey::Name(n.into()))
            .iter()
            .collect::<Vec<_>>()
    );
    assert_eq!(s.extra[1].value, Value::Ext(7, vec![9, 9]));
    let mut again = Vec::new();
    encode_batch(&d.batch, Encoding::Current, &mut again);
    assert_eq!(again, payload, "re-encoded byte for byte");
}

#[test]
fn unknown_positional_fields_round_trip_in_the_legacy_encoding() {
    let mut ev = Vec::new();
    w::write_array_len(&mut ev, 20).unwrap();
    w::write_str(&mut ev, "BlockStored").unwrap();
    w::write_array_len(&mut ev, 1).unwrap();
    w::write_sint(&mut ev, -5).unwrap();
    w::write_nil(&mut ev).unwrap();
    w::write_array_len(&mut ev, 1).unwrap();
    w::write_uint(&mut ev, 1).unwrap();
    w::write_uint(&mut ev, 1).unwrap();
    for _ in 0..7 {
        w::write_nil(&mut ev).unwrap(); // lora_id .. kv_cache_spec_sliding_window
    }
    w::write_uint(&mut ev, 64).unwrap(); // 12: ATOM's token_offset
    w::write_uint(&mut ev, 99).unwrap(); // 13: not a string: another publisher's field
    w::write_str(&mut ev, "tier").unwrap(); // 14: ownership
    w::write_nil(&mut ev).unwrap();
    w::write_nil(&mut ev).unwrap();
    w::write_nil(&mut ev).unwrap();
    w::write_nil(&mut ev).unwrap(); // 18: past every known place
    w::write_array_len(&mut ev, 1).unwrap(); // 19
    w::write_bool(&mut ev, true).unwrap();
    let payload = one_event_batch(&ev);
    let d = decode_batch(&payload).unwrap();
    assert!(d.skipped.is_empty(), "{:?}", d.skipped);
    assert_eq!(d.encoding, Encoding::Legacy);
    let KvEvent::BlockStored(s) = &d.batch.events[0] else {
        panic!()
    };
    assert_eq!(s.token_offset, Some(64));
    assert_eq!(s.locality, None);
    assert_eq!(s.ownership.as_deref(), Some("tier"));
    let kept: Vec<(FieldKey, Value)> = s
        .extra
        .iter()
        .map(|f| (f.key.clone(), f.value.clone()))
        .collect();
    assert_eq!(
        kept,
        vec![
            (FieldKey::Position(13), Value::UInt(99)),
            (
                FieldKey::Position(19),
                Value::Array(vec![Value::Bool(true)])
            ),
        ]
    );
    let mut again = Vec::new();
    encode_batch(&d.batch, Encoding::Legacy, &mut again);
    assert_eq!(again, payload, "re-encoded byte for byte");
    // A legacy BlockRemoved and AllBlocksCleared with trailing elements too.
    let mut ev = Vec::new();
    w::write_array_len(&mut ev, 3).unwrap();
    w::write_str(&mut ev, "AllBlocksCleared").unwrap();
    w::write_nil(&mut ev).unwrap();
    w::write_str(&mut ev, "x").unwrap();
    let payload = one_event_batch(&ev);
    let d = decode_batch(&payload).unwrap();
    assert_eq!(d.batch.events[0].extra().len(), 1);
    let mut again = Vec::new();
    encode_batch(&d.batch, Encoding::Legacy, &mut again);
    assert_eq!(again, payload);
}

#[test]
fn a_second_type_key_is_refused_and_kvlink_places_take_unknown_values() {
    // {"type": "AllBlocksCleared", "block_hashes": [1], "type": "BlockRemoved"}: refused alone.
    let mut ev = Vec::new();
    w::write_map_len(&mut ev, 3).unwrap();
    w::write_str(&mut ev, "type").unwrap();
    w::write_str(&mut ev, "AllBlocksCleared").unwrap();
    w::write_str(&mut ev, "block_hashes").unwrap();
    w::write_array_len(&mut ev, 1).unwrap();
    w::write_uint(&mut ev, 1).unwrap();
    w::write_str(&mut ev, "type").unwrap();
    w::write_str(&mut ev, "BlockRemoved").unwrap();
    let d = decode_batch(&one_event_batch(&ev)).unwrap();
    assert!(d.batch.events.is_empty());
    assert_eq!(d.skipped[0].why, EventError::SecondType, "{:?}", d.skipped);
    // A positional unknown field at one of kvlink's places (13: locality) round-trips while
    // locality is unset.
    assert_eq!(KvEvent::first_extra_position("BlockStored"), 13);
    assert_eq!(KvEvent::first_extra_position("BlockRemoved"), 4);
    let e = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash::U64(1)],
        extra: vec![ExtraField {
            key: FieldKey::Position(13),
            value: Value::UInt(7),
        }],
        ..Default::default()
    });
    let mut out = Vec::new();
    encode_event(&e, Encoding::Legacy, &mut out);
    let d = decode_batch(&one_event_batch(&out)).unwrap();
    assert_eq!(d.batch.events, vec![e]);
}
