//! KV-event wire format: both encodings, every hash form, hostile input, and the page splitter
//! (known-answer vectors computed independently with Python's hashlib).

use kvlink_events::*;
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
                                                      // A BlockStored whose tokens overflow its blocks: refused, not misaligned.
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
    let places: Vec<usize> = d.skipped.iter().map(|s| s.index).collect();
    assert_eq!(places, [1, 2, 3]);
    assert_eq!(d.skipped[0].why, EventError::NotAMapOrArray);
    assert_eq!(
        d.skipped[1].why,
        EventError::UnknownType("BlockExploded".into())
    );
    assert!(d.skipped[1]
        .to_string()
        .contains("unknown event type \"BlockExploded\""));
    assert!(matches!(
        d.skipped[2].why,
        EventError::TokensExceedBlocks {
            tokens: 3,
            blocks: 1,
            block_size: 2
        }
    ));
    assert!(d.skipped[2]
        .to_string()
        .contains("refused rather than misaligned"));
    assert_eq!(d.batch.dp_rank, Some(0));
}

#[test]
fn unreadable_batches_are_errors() {
    assert_eq!(decode_batch(&[0x91, 0xc0]), Err(BatchError::TooShort(1)));
    assert_eq!(decode_batch(&[0xc0]), Err(BatchError::NotAnArray));
    assert_eq!(
        decode_batch(&[0x92, 0xa1, b'x', 0x90]),
        Err(BatchError::TimestampNotANumber)
    );
    assert_eq!(
        decode_batch(&[0x92, 0x01, 0xc0]),
        Err(BatchError::EventsNotAnArray)
    );
    assert_eq!(
        decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
        Err(BatchError::Msgpack(msgpack::DecodeError::TooManyItems {
            items: 0xffff_ffff,
            left: 0
        }))
    );
    assert_eq!(
        decode_batch(&[0x92, 0x01, 0x90, 0x00]),
        Err(BatchError::Msgpack(msgpack::DecodeError::TrailingBytes(1)))
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
