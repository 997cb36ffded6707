//! The decoder's field tables against the wire's field lists, map keys in any order, and
//! decoding into a spare batch against decoding afresh.

use super::*;
use crate::msgpack::{decode, Value};
use crate::wire::{encode_batch, BlockRemoved};
use crate::wire::{
    CLEARED_LEGACY_ORDER, REMOVED_LEGACY_ORDER, STORED_LEGACY_ORDER, TRANSFERRED_LEGACY_ORDER,
};
use crate::KvEvent;
use proptest::prelude::*;

/// The decoder's field orders and names are the wire's: each order spells the legacy field
/// list of its type, and each name looks up its own field.
#[test]
fn field_orders_match_the_legacy_orders() {
    for (ty, names) in [
        ("BlockStored", &STORED_LEGACY_ORDER[..]),
        ("BlockRemoved", &REMOVED_LEGACY_ORDER[..]),
        ("AllBlocksCleared", &CLEARED_LEGACY_ORDER[..]),
        ("BlockTransferred", &TRANSFERRED_LEGACY_ORDER[..]),
    ] {
        let order: Vec<&str> = type_of(ty.as_bytes()).1.iter().map(|f| f.name()).collect();
        assert_eq!(order, names, "{ty}");
        for f in type_of(ty.as_bytes()).1 {
            assert!(F::of(f.name().as_bytes()) == Some(*f), "{}", f.name());
        }
    }
    assert!(F::of(b"type") == Some(F::Type));
}

/// Keys out of the usual order, a field skipped, an unknown one between known ones: the
/// expected-next-key shortcut falls back to the lookup and every field lands.
#[test]
fn map_keys_in_any_order() {
    let mut buf = Vec::new();
    let e = KvEvent::BlockStored(crate::BlockStored {
        block_hashes: vec![BlockHash::U64(7)],
        token_ids: vec![1, 2, 3],
        block_size: 4,
        medium: Some("GPU".into()),
        group_idx: Some(2),
        cache_salt: Some("s".into()),
        ..Default::default()
    });
    let batch = EventBatch {
        ts: 1.0,
        events: vec![e.clone()],
        dp_rank: None,
    };
    super::super::encode_batch(&batch, Encoding::Current, &mut buf);
    assert_eq!(decode_batch(&buf).unwrap().batch, batch);
    // The same fields, keys reversed, with an unknown key in the middle.
    let Value::Array(top) = decode(&buf).unwrap() else {
        panic!("a batch is an array")
    };
    let Value::Array(evs) = &top[1] else {
        panic!("events are an array")
    };
    let Value::Map(fields) = &evs[0] else {
        panic!("a current event is a map")
    };
    let mut fields = fields.clone();
    fields.reverse();
    fields.insert(3, (Value::Str("zz".into()), Value::UInt(9)));
    let mut out = Vec::new();
    Value::Array(vec![
        top[0].clone(),
        Value::Array(vec![Value::Map(fields)]),
        top[2].clone(),
    ])
    .encode(&mut out);
    let got = decode_batch(&out).unwrap().batch;
    let KvEvent::BlockStored(mut s) = got.events[0].clone() else {
        panic!("a BlockStored")
    };
    assert_eq!(s.extra.len(), 1);
    assert_eq!(s.extra[0].key, FieldKey::Name("zz".into()));
    s.extra.clear();
    assert_eq!(KvEvent::BlockStored(s), e);
}

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
                F::of(name.as_bytes()).is_some_and(|f| type_of(ty.as_bytes()).0 & f.bit() != 0);
            assert_eq!(in_mask, KvEvent::known_field(ty, name), "{ty}.{name}");
        }
    }
}

fn some_string() -> impl Strategy<Value = Option<String>> {
    prop::option::of(
        prop::sample::select(vec!["GPU", "CPU", "", "disk-tier-2"]).prop_map(String::from),
    )
}

/// Events of every type, with and without their string fields; a BlockStored with more tokens
/// than its blocks hold is refused by the decoder, so failed events take their turn too.
fn any_event() -> impl Strategy<Value = KvEvent> {
    let hashes = || prop::collection::vec(any::<u64>().prop_map(BlockHash::U64), 0..4);
    prop_oneof![
        4 => (
            hashes(),
            prop::option::of(any::<u64>()),
            prop::collection::vec(0u32..200_000, 0..70),
            (some_string(), some_string(), some_string()),
            (prop::option::of(any::<u32>()), prop::option::of(any::<i64>())),
        )
            .prop_map(|(block_hashes, parent, token_ids, (medium, lora_name, session_id), (group_idx, lora_id))| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: parent.map(BlockHash::U64),
                    token_ids,
                    block_size: 16,
                    lora_id,
                    medium,
                    lora_name,
                    group_idx,
                    session_id,
                    ..BlockStored::default()
                })
            }),
        1 => (hashes(), some_string()).prop_map(|(block_hashes, medium)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
                ..BlockRemoved::default()
            })
        }),
        1 => some_string().prop_map(KvEvent::all_cleared),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]
    /// A stream of batches (either encoding, some with a byte changed) decoded each into the
    /// last one's allocations reads exactly as each decoded afresh: same events, same skipped
    /// events, same errors.
    #[test]
    fn decoding_into_a_spare_batch_equals_decoding_afresh(
        stream in prop::collection::vec(
            (
                prop::collection::vec(any_event(), 0..10),
                any::<bool>(),
                prop::option::of((any::<usize>(), any::<u8>())),
            ),
            1..6,
        )
    ) {
        let mut spare = EventBatch::default();
        for (events, legacy, flip) in stream {
            let enc = if legacy { Encoding::Legacy } else { Encoding::Current };
            let mut buf = Vec::new();
            encode_batch(&EventBatch { ts: 2.5, events, dp_rank: Some(1) }, enc, &mut buf);
            if let Some((at, x)) = flip {
                let i = at % buf.len();
                buf[i] ^= x;
            }
            match (decode_batch(&buf), decode_batch_reusing(&buf, std::mem::take(&mut spare))) {
                (Ok(fresh), Ok(reused)) => {
                    prop_assert_eq!(&fresh, &reused);
                    spare = reused.batch;
                }
                (Err(fresh), Err(reused)) => prop_assert_eq!(fresh, reused),
                (fresh, reused) => prop_assert!(false, "afresh {:?}, reusing {:?}", fresh, reused),
            }
        }
    }
}
