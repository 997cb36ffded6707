//! Reads between engines whose blocks hold different numbers of tokens (one a multiple of the
//! other), over TCP loopback: either side the larger, head-major and token-major blocks, a read
//! that starts inside a block of the larger size; every token of every layer checked head by
//! head; a read that misstates the prefill's block size.

mod common;

use std::time::Duration;

use common::*;
use kvlink::ModelShape;

/// A read between engines whose blocks hold different numbers of tokens, `count` tokens from
/// token `first` of the first prefill block: every token of every tensor checked, and the
/// prefill hears the read.
fn resized_read(prefill_tokens: u32, decode_tokens: u32, first: u32, count: u64, head_major: bool) {
    let shape = |tokens| ModelShape {
        tokens_per_block: tokens,
        layers: 4,
        ..ModelShape::LLAMA3_8B
    };
    let solo = kvlink::TpRank::new(0, 1);
    let start = |tokens, seed| {
        let mut s = side(&shape(tokens), 16, seed, quick_config());
        let layout = shape(tokens)
            .layout_tp(s.region.id(), 16, solo, head_major)
            .unwrap();
        s.engine.set_layout(layout.clone()).unwrap();
        s.layout = layout;
        s
    };
    let prefill = start(prefill_tokens, Some(41));
    let decode = start(decode_tokens, None);
    let blocks = |tokens: u32, from: u64, ids: &[u32]| {
        ids[..(from + count).div_ceil(u64::from(tokens)) as usize].to_vec()
    };
    let remote = blocks(prefill_tokens, u64::from(first), &[9, 2, 14, 5, 11, 0, 7]);
    let local = blocks(decode_tokens, 0, &[3, 12, 6, 1, 15, 8, 10]);
    let hold = prefill.engine.hold_blocks("resized", &remote).unwrap();
    decode
        .engine
        .read(kvlink::ReadRequest {
            hold: Some(hold),
            remote_tokens_per_block: Some(prefill_tokens),
            first_tokens: vec![first],
            ..kvlink::ReadRequest::blocks(
                prefill.engine.handshake_address().to_string(),
                "resized",
                &local,
                &remote,
            )
        })
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    let checked = kvlink::verify::check_tokens(
        &decode.region,
        &decode.layout,
        &prefill.layout,
        41,
        (&local, &remote),
        first,
        count,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let per_token = 4 * 2 * 8 * 128 * 2;
    assert_eq!(checked, count * per_token);
    // Whole units of the smaller block size move (the last one past `count` too).
    let unit = u64::from(prefill_tokens.min(decode_tokens));
    assert_eq!(f.reports[0].bytes, count.next_multiple_of(unit) * per_token);
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(sent.sending.len(), 1, "{sent:?}");
}

#[test]
fn a_decode_of_larger_blocks_reads_a_prefill_of_smaller_ones() {
    // 100 tokens: 7 prefill blocks of 16 into 2 decode blocks of 64, the last one in part.
    resized_read(16, 64, 0, 100, true);
    resized_read(16, 64, 0, 100, false);
}

#[test]
fn a_decode_of_smaller_blocks_reads_a_prefill_of_larger_ones() {
    // 80 tokens from token 32 of the first prefill block (the decode's own prefix ends there).
    resized_read(64, 16, 32, 80, true);
    resized_read(64, 16, 0, 64, false);
}

#[test]
fn a_read_that_misstates_the_prefills_block_size_fails_with_the_sizes() {
    let prefill = side(&ModelShape::LLAMA3_8B, 8, Some(5), quick_config());
    let decode = side(&ModelShape::LLAMA3_8B, 8, None, quick_config());
    prefill.engine.hold_blocks("m", &[0, 1, 2, 3]).unwrap();
    decode
        .engine
        .read(kvlink::ReadRequest {
            remote_tokens_per_block: Some(64),
            ..kvlink::ReadRequest::blocks(
                prefill.engine.handshake_address().to_string(),
                "m",
                &[0, 1, 2, 3, 4],
                &[0, 1, 2],
            )
        })
        .unwrap_err();
    decode
        .engine
        .read(kvlink::ReadRequest {
            remote_tokens_per_block: Some(64),
            ..kvlink::ReadRequest::blocks(
                prefill.engine.handshake_address().to_string(),
                "m",
                &[0, 1, 2, 3],
                &[0],
            )
        })
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Other, "{f:?}");
    assert!(
        f.failed[0]
            .reason
            .contains("the peer's blocks hold 16 tokens"),
        "{f:?}"
    );
}
