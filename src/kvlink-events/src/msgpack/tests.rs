//! The msgpack reader: scalars and containers, hostile lengths, the fast paths of the cursor
//! (token ids, unsigned integers, container headers) against the general reader.

use super::*;
use proptest::prelude::*;

#[test]
fn scalars_and_containers() {
    assert_eq!(
        decode(&[0x93, 0x01, 0xc0, 0xa1, b'x']).unwrap(),
        Value::Array(vec![Value::UInt(1), Value::Nil, Value::Str("x".into())])
    );
    let big = [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe];
    assert_eq!(decode(&big).unwrap(), Value::UInt(u64::MAX - 1));
    assert_eq!(
        decode(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]).unwrap(),
        Value::Int(i64::MIN)
    );
    assert_eq!(decode(&[0xff]).unwrap(), Value::Int(-1));
    assert_eq!(decode(&[0xc4, 2, 9, 8]).unwrap(), Value::Bin(vec![9, 8]));
    assert_eq!(
        decode(&[0x81, 0xa1, b'k', 0x05]).unwrap(),
        Value::Map(vec![(Value::Str("k".into()), Value::UInt(5))])
    );
}

#[test]
fn values_encode_back_to_their_bytes() {
    let bytes: &[u8] = &[
        0x95, 0xc0, 0xc3, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xd0, 0x80, 0x82,
        0xa1, b'k', 0xc4, 1, 7, 0x01, 0x92, 0xd4, 5, 9, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0,
    ];
    let v = decode(bytes).unwrap();
    let mut out = Vec::new();
    v.encode(&mut out);
    assert_eq!(out, bytes);
}

/// Token ids at every form boundary, each list read at every distance from the end of the
/// buffer (the word-at-a-time path and the byte-by-byte tail), stop at the first item of
/// another form.
#[test]
fn small_uints_read_every_form() {
    let ids: Vec<u32> = vec![
        0,
        0x7f,
        0x80,
        0xff,
        0x100,
        0xffff,
        0x1_0000,
        150_000,
        u32::MAX,
        5,
    ];
    for stop in [None, Some(-1i64), Some(1 << 40), Some(0x1_0000_0000)] {
        let mut buf = Vec::new();
        for &t in &ids {
            rmp::encode::write_uint(&mut buf, u64::from(t)).unwrap();
        }
        let ids_len = buf.len();
        if let Some(s) = stop {
            rmp::encode::write_sint(&mut buf, s).unwrap();
        }
        for pad in 0..10 {
            let mut b = buf.clone();
            b.extend(std::iter::repeat_n(0xc0, pad));
            let mut c = Cursor::new(&b);
            let mut out = Vec::new();
            let n = c.small_uints(ids.len() + 1, &mut out);
            assert_eq!(n, ids.len(), "stop {stop:?} pad {pad}");
            assert_eq!(out, ids);
            assert_eq!(c.pos(), ids_len);
            if stop.is_none() && pad == 0 {
                continue;
            }
            let rest = c.token().unwrap();
            match stop {
                None => assert_eq!(rest, Token::Nil, "pad {pad}"),
                Some(s) if s < 0 => assert_eq!(rest, Token::Int(s)),
                Some(s) => assert_eq!(rest, Token::UInt(s as u64)),
            }
        }
    }
}

#[test]
fn hostile_lengths_are_refused_without_allocating() {
    // Arrays, maps, strings and bins announcing 4 G items/bytes with 0 behind them.
    for b in [0xdd, 0xdf, 0xdb, 0xc6] {
        assert!(decode(&[b, 0xff, 0xff, 0xff, 0xff]).is_err());
    }
    let deep = vec![0x91; 1000];
    assert_eq!(decode(&deep).unwrap_err(), DecodeError::TooDeep(MAX_DEPTH));
    assert_eq!(decode(&[0xc1]).unwrap_err(), DecodeError::ReservedByte);
    assert_eq!(
        decode(&[0x01, 0x02]).unwrap_err(),
        DecodeError::TrailingBytes(1)
    );
    assert!(decode(&[]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn rmp_serde_values_decode(v in prop::collection::vec((any::<u64>(), any::<i64>(), ".{0,8}"), 0..8)) {
        let bytes = rmp_serde::to_vec(&v).unwrap();
        let d = decode(&bytes).unwrap();
        let Value::Array(items) = d else { panic!("array") };
        prop_assert_eq!(items.len(), v.len());
        for (item, (u, i, s)) in items.iter().zip(&v) {
            let Value::Array(fields) = item else { panic!("tuple as array: {item:?}") };
            prop_assert_eq!(fields.len(), 3);
            prop_assert_eq!(fields[0].as_u64(), Some(*u));
            prop_assert_eq!(fields[1].as_i64(), Some(*i));
            prop_assert_eq!(fields[2].as_str(), Some(s.as_str()));
        }
    }
}

/// What `uint` and `container_len` make of `bytes` equals what `token` makes of them: the
/// same value and the same position when they take the item, nothing consumed when they
/// leave it (and then `token` reads something else, refuses it, or reads a non-negative value
/// in a signed form).
fn fast_paths_agree(bytes: &[u8]) {
    let general = |at: usize| {
        let mut c = Cursor::new(bytes);
        c.rewind(at);
        let t = c.token().ok();
        (t, c.pos())
    };
    for at in 0..=bytes.len() {
        let (t, end) = general(at);
        let mut c = Cursor::new(bytes);
        c.rewind(at);
        match c.uint() {
            Some(v) => assert_eq!(
                (t, c.pos()),
                (Some(Token::UInt(v)), end),
                "{bytes:02x?} at {at}"
            ),
            None => {
                assert_eq!(c.pos(), at);
                // A non-negative value in a signed form is left to `token`.
                let signed = bytes.get(at).is_some_and(|b| (0xd0..=0xd3).contains(b));
                assert!(
                    signed || !matches!(t, Some(Token::UInt(_))),
                    "{bytes:02x?} at {at}: {t:?}"
                );
            }
        }
        for map in [false, true] {
            let mut c = Cursor::new(bytes);
            c.rewind(at);
            match (c.container_len(map), t) {
                (Some(n), Some(Token::Map(m))) if map => assert_eq!((n, c.pos()), (m, end)),
                (Some(n), Some(Token::Array(m))) if !map => assert_eq!((n, c.pos()), (m, end)),
                (Some(n), t) => panic!("{bytes:02x?} at {at}: {n} items (map {map}), token {t:?}"),
                (None, t) => {
                    assert_eq!(c.pos(), at);
                    let taken = if map {
                        matches!(t, Some(Token::Map(_)))
                    } else {
                        matches!(t, Some(Token::Array(_)))
                    };
                    assert!(!taken, "{bytes:02x?} at {at}: left {t:?} (map {map})");
                }
            }
        }
    }
}

/// Every unsigned form at its boundaries, negative and other items, and container headers in
/// each width with their items there or not, each cut short at every length.
#[test]
fn fast_paths_read_every_form_as_token_does() {
    let mut items: Vec<Vec<u8>> = Vec::new();
    for v in [
        0u64,
        0x7f,
        0x80,
        0xff,
        0x100,
        0xffff,
        0x1_0000,
        u32::MAX as u64,
        1 << 32,
        u64::MAX,
    ] {
        let mut b = Vec::new();
        rmp::encode::write_uint(&mut b, v).unwrap();
        items.push(b);
    }
    for v in [-1i64, -33, i64::MIN] {
        let mut b = Vec::new();
        rmp::encode::write_sint(&mut b, v).unwrap();
        items.push(b);
    }
    items.push(vec![0xc0]);
    items.push(vec![0xa3, b'G', b'P', b'U']);
    for n in [0u32, 3, 15, 16, 300, 70_000] {
        let mut a = Vec::new();
        rmp::encode::write_array_len(&mut a, n).unwrap();
        let mut m = Vec::new();
        rmp::encode::write_map_len(&mut m, n).unwrap();
        // Enough one-byte items for small lengths, too few for the large ones.
        let fill = (n as usize).min(40);
        a.extend(std::iter::repeat_n(0x01, fill));
        m.extend(std::iter::repeat_n(0x01, 2 * fill));
        items.push(a);
        items.push(m);
    }
    for item in &items {
        for cut in 0..=item.len() {
            fast_paths_agree(&item[..cut]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    #[test]
    fn fast_paths_agree_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..24)) {
        fast_paths_agree(&bytes);
    }
}

/// `skip_if` takes an encoded key exactly when the bytes start with it, whatever the key's
/// length (both word paths) and however many bytes follow (the short-buffer path), and a
/// difference in any one byte leaves the cursor where it was.
#[test]
fn skip_if_takes_exactly_the_encoded_key() {
    let name = "kv_cache_spec_sliding_window_x"; // 30 bytes: keys of 0 to 30 bytes
    for len in 0..=name.len() {
        let key = Encoded::str(&name[..len]);
        let mut bytes = vec![0xa0 | len as u8];
        bytes.extend_from_slice(&name.as_bytes()[..len]);
        for tail in [0usize, 1, 5, 40] {
            let mut b = bytes.clone();
            b.extend(std::iter::repeat_n(0xc0, tail));
            let mut c = Cursor::new(&b);
            assert!(c.skip_if(&key), "len {len} tail {tail}");
            assert_eq!(c.pos(), len + 1);
            for flip in 0..=len {
                let mut bad = b.clone();
                bad[flip] ^= 0x20;
                let mut c = Cursor::new(&bad);
                assert!(!c.skip_if(&key), "len {len} tail {tail} flip {flip}");
                assert_eq!(c.pos(), 0);
            }
            // Cut short: never taken.
            let mut c = Cursor::new(&b[..len]);
            assert!(!c.skip_if(&key));
        }
    }
}
