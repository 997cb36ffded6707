//! KV-event wire format: both encodings, every hash form, hostile input, and the page splitter
//! (known-answer vectors computed independently with Python's hashlib).

use kvlink::events::*;
use proptest::prelude::*;
use rmp::encode as w;

fn stored(hashes: Vec<BlockHash>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes,
        parent_block_hash: Some(BlockHash::U64(u64::MAX)),
        token_ids: (0..32).collect(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        group_idx: Some(1),
        kv_cache_spec_kind: Some("full_attention".into()),
        kv_cache_spec_sliding_window: None,
        token_offset: Some(4096),
        ..Default::default()
    })
}

fn sample() -> EventBatch {
    EventBatch {
        ts: 1_763_700_000.25,
        events: vec![
            stored(vec![BlockHash::U64(1 << 63 | 5), BlockHash::I64(-7)]),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Bytes(vec![0xAB; 32])],
                medium: Some("CPU".into()),
                group_idx: None,
                ..Default::default()
            }),
            KvEvent::all_cleared(None),
            KvEvent::BlockTransferred(BlockTransferred {
                block_hashes: vec![BlockHash::U64(9)],
                from_medium: Some("GPU".into()),
                to_medium: Some("CPU".into()),
                group_idx: Some(0),
                ..Default::default()
            }),
        ],
        dp_rank: Some(3),
    }
}

#[test]
fn both_encodings_roundtrip() {
    for enc in [Encoding::Current, Encoding::Legacy] {
        let mut buf = Vec::new();
        encode_batch(&sample(), enc, &mut buf);
        let d = decode_batch(&buf).unwrap();
        assert!(d.skipped.is_empty(), "{enc:?}: {:?}", d.skipped);
        assert_eq!(d.batch, sample(), "{enc:?}");
    }
}

#[test]
fn current_encoding_puts_type_first_and_omits_defaults() {
    let mut buf = Vec::new();
    encode_event(&KvEvent::all_cleared(None), Encoding::Current, &mut buf);
    // fixmap(1) { "type": "AllBlocksCleared" }
    assert_eq!(buf[0], 0x81);
    assert_eq!(&buf[1..6], b"\xa4type");
    let mut buf = Vec::new();
    let mut plain = stored(vec![BlockHash::U64(1)]);
    if let KvEvent::BlockStored(s) = &mut plain {
        s.group_idx = None;
        s.kv_cache_spec_kind = None;
        s.token_offset = None;
    }
    encode_event(&plain, Encoding::Current, &mut buf);
    assert_eq!(buf[0], 0x88, "type + the 7 always-present fields");
}

/// A vLLM-style map event built by hand: keys in another order, unknown keys, extra_keys.
fn vllm_map_event(out: &mut Vec<u8>) {
    w::write_map_len(out, 10).unwrap();
    for (k, v) in [("type", "BlockStored"), ("medium", "GPU")] {
        w::write_str(out, k).unwrap();
        w::write_str(out, v).unwrap();
    }
    w::write_str(out, "block_hashes").unwrap();
    w::write_array_len(out, 2).unwrap();
    w::write_u64(out, u64::MAX).unwrap();
    w::write_u64(out, 1 << 63).unwrap();
    w::write_str(out, "parent_block_hash").unwrap();
    w::write_nil(out).unwrap();
    w::write_str(out, "token_ids").unwrap();
    w::write_array_len(out, 20).unwrap();
    for t in 0..20u32 {
        w::write_u32(out, 100_000 + t).unwrap();
    }
    w::write_str(out, "block_size").unwrap();
    w::write_uint(out, 16).unwrap();
    w::write_str(out, "lora_id").unwrap();
    w::write_nil(out).unwrap();
    w::write_str(out, "lora_name").unwrap();
    w::write_nil(out).unwrap();
    w::write_str(out, "extra_keys").unwrap();
    w::write_array_len(out, 1).unwrap();
    w::write_str(out, "mm-hash").unwrap();
    w::write_str(out, "a_future_field").unwrap();
    w::write_map_len(out, 0).unwrap();
}

#[test]
fn reads_vllm_sglang_and_atom_shapes() {
    let mut buf = Vec::new();
    // Legacy two-element batch (no dp_rank) mixing encodings and hash forms.
    w::write_array_len(&mut buf, 2).unwrap();
    w::write_f64(&mut buf, 1.5).unwrap();
    w::write_array_len(&mut buf, 4).unwrap();
    vllm_map_event(&mut buf);
    // SGLang legacy BlockStored with a negative i64 hash and trailing unknown elements.
    w::write_array_len(&mut buf, 14).unwrap();
    w::write_str(&mut buf, "BlockStored").unwrap();
    w::write_array_len(&mut buf, 1).unwrap();
    w::write_i64(&mut buf, -4_267_439_428_730_857_592).unwrap();
    w::write_i64(&mut buf, 5_059_399_719_711_515_881).unwrap();
    w::write_array_len(&mut buf, 2).unwrap();
    w::write_uint(&mut buf, 4).unwrap();
    w::write_uint(&mut buf, 5).unwrap();
    w::write_uint(&mut buf, 16).unwrap();
    for _ in 0..7 {
        w::write_nil(&mut buf).unwrap();
    }
    w::write_uint(&mut buf, 77).unwrap(); // ATOM token_offset
    w::write_str(&mut buf, "trailing").unwrap();
    // Bytes hash (vLLM with integer hashes off) in a legacy BlockRemoved.
    w::write_array_len(&mut buf, 3).unwrap();
    w::write_str(&mut buf, "BlockRemoved").unwrap();
    w::write_array_len(&mut buf, 1).unwrap();
    w::write_bin(&mut buf, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).unwrap();
    w::write_str(&mut buf, "CPU_PINNED").unwrap();
    // ATOM legacy AllBlocksCleared with a medium.
    w::write_array_len(&mut buf, 2).unwrap();
    w::write_str(&mut buf, "AllBlocksCleared").unwrap();
    w::write_str(&mut buf, "GPU").unwrap();
    let d = decode_batch(&buf).unwrap();
    assert!(d.skipped.is_empty(), "{:?}", d.skipped);
    assert_eq!(d.batch.dp_rank, None);
    let KvEvent::BlockStored(a) = &d.batch.events[0] else {
        panic!()
    };
    assert_eq!(a.block_hashes[0].as_u64(), u64::MAX);
    assert_eq!(a.token_ids.len(), 20);
    assert_eq!(a.medium.as_deref(), Some("GPU"));
    let KvEvent::BlockStored(b) = &d.batch.events[1] else {
        panic!()
    };
    assert_eq!(
        b.block_hashes,
        vec![BlockHash::I64(-4_267_439_428_730_857_592)]
    );
    assert_eq!(
        b.parent_block_hash,
        Some(BlockHash::U64(5_059_399_719_711_515_881))
    );
    assert_eq!(b.token_offset, Some(77));
    let KvEvent::BlockRemoved(c) = &d.batch.events[2] else {
        panic!()
    };
    assert_eq!(c.block_hashes[0].as_u64(), 0x0102_0304_0506_0708);
    assert_eq!(c.medium.as_deref(), Some("CPU_PINNED"));
    assert_eq!(d.batch.events[3], KvEvent::all_cleared(Some("GPU".into())));
}

#[test]
fn a_bad_event_is_skipped_alone() {
    let mut buf = Vec::new();
    w::write_array_len(&mut buf, 3).unwrap();
    w::write_f64(&mut buf, 2.0).unwrap();
    w::write_array_len(&mut buf, 5).unwrap();
    encode_event(&KvEvent::all_cleared(None), Encoding::Current, &mut buf);
    w::write_uint(&mut buf, 42).unwrap(); // not an event
    w::write_array_len(&mut buf, 1).unwrap();
    w::write_str(&mut buf, "BlockExploded").unwrap(); // unknown type
                                                      // BlockStored whose tokens overflow its blocks: refused, not misaligned.
    w::write_map_len(&mut buf, 4).unwrap();
    w::write_str(&mut buf, "type").unwrap();
    w::write_str(&mut buf, "BlockStored").unwrap();
    w::write_str(&mut buf, "block_hashes").unwrap();
    w::write_array_len(&mut buf, 1).unwrap();
    w::write_uint(&mut buf, 1).unwrap();
    w::write_str(&mut buf, "token_ids").unwrap();
    w::write_array_len(&mut buf, 3).unwrap();
    for t in 0..3 {
        w::write_uint(&mut buf, t).unwrap();
    }
    w::write_str(&mut buf, "block_size").unwrap();
    w::write_uint(&mut buf, 2).unwrap();
    encode_event(
        &KvEvent::all_cleared(Some("CPU".into())),
        Encoding::Legacy,
        &mut buf,
    );
    w::write_sint(&mut buf, 0).unwrap();
    let d = decode_batch(&buf).unwrap();
    assert_eq!(d.batch.events.len(), 2);
    assert_eq!(d.skipped.len(), 3, "{:?}", d.skipped);
    assert!(d.skipped[1].contains("unknown event type \"BlockExploded\""));
    assert!(d.skipped[2].contains("refused rather than misaligned"));
    assert_eq!(d.batch.dp_rank, Some(0));
}

#[test]
fn unreadable_batches_are_errors() {
    assert!(decode_batch(&[0x91, 0xc0]).is_err(), "one element");
    assert!(decode_batch(&[0xc0]).is_err(), "not an array");
    assert!(
        decode_batch(&[0x92, 0xa1, b'x', 0x90]).is_err(),
        "timestamp not a number"
    );
    assert!(
        decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err(),
        "huge length, no bytes"
    );
}

#[test]
fn page_splitter_chains_fixed_size_pages() {
    // Known answers (Python): d1 = sha256(pack('<3I',1,2,3)); d2 = sha256(d1 + pack('<2I',4,5)).
    let s = PageSplitter::new(3, PageHash::SglangI64);
    let p = s.split(None, &[1, 2, 3, 4, 5], 100, Some("GPU"));
    assert_eq!(p.events.len(), 2);
    assert_eq!(
        p.events[0].block_hashes,
        vec![BlockHash::I64(5_059_399_719_711_515_881)]
    );
    assert_eq!(p.events[0].parent_block_hash, None);
    assert_eq!(
        (p.events[0].block_size, p.events[0].token_offset),
        (3, Some(100))
    );
    assert_eq!(
        p.events[1].block_hashes,
        vec![BlockHash::I64(-4_267_439_428_730_857_592)]
    );
    assert_eq!(
        p.events[1].parent_block_hash,
        Some(BlockHash::I64(5_059_399_719_711_515_881))
    );
    assert_eq!(
        (p.events[1].block_size, p.events[1].token_offset),
        (2, Some(103))
    );
    assert_eq!(p.events[1].token_ids, vec![4, 5]);
    // Continuing from the last digest equals splitting in one go.
    let first = s.split(None, &[1, 2, 3], 100, None);
    let rest = s.split(first.last_digest.as_ref(), &[4, 5], 103, None);
    assert_eq!(rest.events[0].block_hashes, p.events[1].block_hashes);
    assert_eq!(rest.last_digest, p.last_digest);
    let v = PageSplitter::new(3, PageHash::VllmU64).split(None, &[1, 2, 3], 0, None);
    assert_eq!(
        v.events[0].block_hashes,
        vec![BlockHash::U64(16_914_456_172_814_760_525)]
    );
    // Every page survives the wire in both encodings.
    for enc in [Encoding::Current, Encoding::Legacy] {
        let batch = EventBatch {
            ts: 0.0,
            events: p.events.iter().cloned().map(KvEvent::BlockStored).collect(),
            dp_rank: None,
        };
        let mut buf = Vec::new();
        encode_batch(&batch, enc, &mut buf);
        // A non-negative signed hash is an unsigned integer on the wire (msgpack cannot tell
        // them apart): compare what consumers index by.
        /// (block hashes, parent hash, tokens, token offset) as consumers index them.
        type Key = (Vec<u64>, Option<u64>, Vec<u32>, Option<u64>);
        let key = |events: &[KvEvent]| -> Vec<Key> {
            events
                .iter()
                .map(|e| match e {
                    KvEvent::BlockStored(s) => (
                        s.block_hashes.iter().map(BlockHash::as_u64).collect(),
                        s.parent_block_hash.as_ref().map(BlockHash::as_u64),
                        s.token_ids.clone(),
                        s.token_offset,
                    ),
                    other => panic!("unexpected {other:?}"),
                })
                .collect()
        };
        assert_eq!(
            key(&decode_batch(&buf).unwrap().batch.events),
            key(&batch.events)
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    #[test]
    fn random_payloads_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn corrupted_valid_payloads_never_panic(flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..8), enc in 0..2u8) {
        let mut buf = Vec::new();
        encode_batch(&sample(), if enc == 0 { Encoding::Current } else { Encoding::Legacy }, &mut buf);
        for (i, b) in flips {
            let n = buf.len();
            buf[i % n] = b;
        }
        let _ = decode_batch(&buf);
    }

    /// Token ids of every size: written in msgpack's shortest form (as rmp and msgspec write
    /// them) and read back, in both encodings, however many follow in the batch.
    #[test]
    fn token_ids_use_the_shortest_form(
        tokens in prop::collection::vec(
            prop_oneof![
                0u32..0x100,
                0x80u32..0x1_0000,
                0u32..150_000,
                any::<u32>(),
                Just(u32::MAX),
            ],
            0..300,
        ),
        enc in 0..2u8,
    ) {
        let enc = if enc == 0 { Encoding::Current } else { Encoding::Legacy };
        let batch = EventBatch {
            ts: 1.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![BlockHash::U64(1)],
                token_ids: tokens.clone(),
                ..Default::default()
            })],
            dp_rank: None,
        };
        let mut buf = Vec::new();
        encode_batch(&batch, enc, &mut buf);
        let mut expected = Vec::new();
        w::write_array_len(&mut expected, tokens.len() as u32).unwrap();
        for &t in &tokens {
            w::write_uint(&mut expected, u64::from(t)).unwrap();
        }
        prop_assert!(buf.windows(expected.len()).any(|w| w == expected));
        prop_assert_eq!(decode_batch(&buf).unwrap().batch, batch);
    }

    /// A BlockStored given by reference encodes to the bytes of the owned event with the same
    /// fields, in both encodings and for every hash form.
    #[test]
    fn stored_refs_encode_as_owned_events(
        hashes in prop::collection::vec(any::<u64>(), 0..20),
        form in 0..3u8,
        parent in prop::option::of(any::<i64>()),
        tokens in prop::collection::vec(any::<u32>(), 0..100),
        block_size in any::<u32>(),
        lora_id in prop::option::of(any::<i64>()),
        medium in prop::option::of("[A-Z]{0,40}"),
        lora_name in prop::option::of("[a-z]{0,3}"),
        group_idx in prop::option::of(any::<u32>()),
        enc in 0..2u8,
    ) {
        let enc = if enc == 0 { Encoding::Current } else { Encoding::Legacy };
        let signed: Vec<i64> = hashes.iter().map(|&h| h as i64).collect();
        let any: Vec<BlockHash> = hashes.iter().map(|&h| BlockHash::Bytes(h.to_be_bytes().to_vec())).collect();
        let (hs, owned): (HashesRef<'_>, Vec<BlockHash>) = match form {
            0 => (HashesRef::U64(&hashes), hashes.iter().map(|&h| BlockHash::U64(h)).collect()),
            1 => (HashesRef::I64(&signed), signed.iter().map(|&h| BlockHash::I64(h)).collect()),
            _ => (HashesRef::Any(&any), any.clone()),
        };
        let r = BlockStoredRef {
            block_hashes: hs,
            parent_block_hash: parent.map(HashRef::I64),
            token_ids: &tokens,
            block_size,
            lora_id,
            medium: medium.as_deref(),
            lora_name: lora_name.as_deref(),
            group_idx,
        };
        let e = KvEvent::BlockStored(BlockStored {
            block_hashes: owned,
            parent_block_hash: parent.map(BlockHash::I64),
            token_ids: tokens.clone(),
            block_size,
            lora_id,
            medium: medium.clone(),
            lora_name: lora_name.clone(),
            group_idx,
            ..Default::default()
        });
        let (mut a, mut b) = (Vec::new(), Vec::new());
        encode_stored_ref(&r, enc, &mut a);
        encode_event(&e, enc, &mut b);
        prop_assert_eq!(a, b);
    }
}

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
    assert!(d.skipped[0].contains("second \"type\""), "{:?}", d.skipped);
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
