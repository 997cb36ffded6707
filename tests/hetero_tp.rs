//! Reads between a prefill and a decode of different TP sizes over TCP, in both directions,
//! all ranks in this process: per-head layouts (head-major and token-major blocks) where each
//! decode rank takes its heads out of the prefill's blocks or gathers several prefill ranks
//! into its own, MLA layouts read whole, block groups with block ids of their own; every byte
//! checked head by head against the prefill ranks' memory. Refusals: sizes that cannot pair, a
//! single prefill rank that lacks heads, addresses out of rank order.

mod common;

use std::time::Duration;

use common::tp::{rank, run, Case};
use common::*;
use kvlink::{
    EngineConfig, Error, FailureCause, ModelShape, ReadFrom, ReadRequest, RequestId, TpRank,
};

fn tcp() -> EngineConfig {
    quick_config().with(|c| {
        c.transport = kvlink::TransportChoice::Tcp;
    })
}

fn case(shape: ModelShape, prefill: u32, decode: u32, head_major: bool, groups: bool) -> Case {
    Case {
        shape,
        prefill,
        decode,
        head_major,
        groups,
        requests: 3,
        per: 6,
        blocks: 24,
        config: tcp,
    }
}

/// Runs the case and checks that every prefill rank served bytes (TCP counts them), so a
/// decode gathering several ranks really read from each.
fn run_checked(c: Case) {
    let ran = run(&c);
    for p in &ran.prefill {
        assert!(
            p.engine.stats().bytes_served > 0,
            "prefill {} served nothing",
            p.tp
        );
    }
    let total: u64 = ran.reports.iter().map(|r| r.bytes).sum();
    let per_decode = c.shape.region_bytes_tp(c.per, c.decode).unwrap() * c.requests as u64;
    assert_eq!(total, per_decode * u64::from(c.decode));
}

#[test]
fn one_prefill_rank_read_by_two_decode_ranks_token_major() {
    run_checked(case(ModelShape::QWEN25_7B, 1, 2, false, false));
}

#[test]
fn one_prefill_rank_read_by_four_decode_ranks_head_major() {
    run_checked(case(ModelShape::QWEN25_7B, 1, 4, true, false));
}

#[test]
fn two_prefill_ranks_gathered_by_one_decode_rank_token_major() {
    run_checked(case(ModelShape::QWEN25_7B, 2, 1, false, false));
}

#[test]
fn four_prefill_ranks_gathered_by_one_decode_rank_head_major() {
    run_checked(case(ModelShape::QWEN25_7B, 4, 1, true, false));
}

#[test]
fn mla_read_whole_by_two_decode_ranks_and_shared_out_over_two_prefill_ranks() {
    run_checked(case(ModelShape::DEEPSEEK_V3_MLA, 1, 2, false, false));
    run_checked(case(ModelShape::DEEPSEEK_V3_MLA, 2, 1, false, false));
    run_checked(case(ModelShape::DEEPSEEK_V3_MLA, 4, 1, false, false));
}

#[test]
fn block_groups_with_their_own_block_ids_same_and_other_tp() {
    run_checked(case(ModelShape::QWEN25_7B, 1, 1, false, true));
    run_checked(case(ModelShape::QWEN25_7B, 2, 4, true, true));
    run_checked(case(ModelShape::DEEPSEEK_V3_MLA, 2, 1, false, true));
}

#[test]
fn unpairable_sizes_and_partial_sources_are_refused_with_the_reason() {
    let shape = ModelShape::QWEN25_7B;
    // TP 3 of 4 heads does not split: refused when the layout is set.
    let e = kvlink::Engine::start(tcp().with(|c| {
        c.tp_rank = 0;
        c.tp_size = 3;
    }))
    .unwrap();
    let region = e.allocate_host(1 << 20, false).unwrap();
    let mut bad = shape
        .layout_tp(region.id(), 2, TpRank::SOLO, false)
        .unwrap();
    bad.tensors.truncate(2);
    let err = e.set_layout(bad).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("TP 3"),
        "{err}"
    );

    let p: Vec<_> = (0..2)
        .map(|r| rank(&shape, TpRank::new(r, 2), 8, Some(7), false, false, tcp()))
        .collect();
    let d = rank(&shape, TpRank::SOLO, 8, None, false, false, tcp());
    let addrs: Vec<String> = p
        .iter()
        .map(|r| r.engine.handshake_address().to_string())
        .collect();
    for r in &p {
        r.engine.hold_blocks("half", &[1]).unwrap();
        r.engine.hold_blocks("swapped", &[1]).unwrap();
    }
    // One prefill rank of two lacks half of the decode's heads.
    d.engine.read_blocks(&addrs[1], "half", &[0], &[1]).unwrap();
    let f = collect(&d.engine, Duration::from_secs(20), |f| !f.failed.is_empty());
    assert_eq!(f.failed[0].cause, FailureCause::Other, "{:?}", f.failed);
    assert!(
        f.failed[0].reason.contains("KV head 0") && f.failed[0].reason.contains("whole prefill"),
        "{:?}",
        f.failed
    );
    // Addresses out of rank order: the rank is checked at the handshake.
    let swapped = vec![addrs[1].clone(), addrs[0].clone()];
    d.engine
        .read(ReadRequest {
            id: RequestId::from("swapped"),
            remote_id: RequestId::from("swapped"),
            from: ReadFrom::TpGroup(swapped),
            local: vec![vec![0]],
            remote: vec![vec![1]],
            remote_tokens_per_block: None,
            first_tokens: Vec::new(),
            hold: None,
        })
        .unwrap();
    let f = collect(&d.engine, Duration::from_secs(20), |f| !f.failed.is_empty());
    assert_eq!(f.failed[0].cause, FailureCause::Other, "{:?}", f.failed);
    assert!(f.failed[0].reason.contains("rank order"), "{:?}", f.failed);
    // Each prefill rank read heard the abort and freed the request at once (rank 0 was not
    // read for "half": its hold is released).
    assert!(p[0].engine.release("half"));
    for (r, want) in p.iter().zip([1, 2]) {
        let sent = collect(&r.engine, Duration::from_secs(10), |f| {
            f.failed.len() == want
        });
        assert_eq!(sent.failed.len(), want, "prefill {}: {sent:?}", r.tp);
        assert_eq!(r.engine.in_flight(), (0, 0));
    }
    // A decode of TP 3 cannot pair with a prefill of TP 2: the handshake says why.
    let e3 = kvlink::Engine::start(tcp().with(|c| {
        c.tp_rank = 0;
        c.tp_size = 3;
    }))
    .unwrap();
    let mla = ModelShape::DEEPSEEK_V3_MLA;
    let r3 = e3.allocate_host(mla.region_bytes(2), false).unwrap();
    e3.set_layout(mla.layout(r3.id(), 2)).unwrap();
    let pm = rank(&mla, TpRank::new(0, 2), 2, None, false, false, tcp());
    let err = e3
        .connect(
            &pm.engine.handshake_address().to_string(),
            Duration::from_secs(10),
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::Handshake { .. }) && err.to_string().contains("neither is a multiple"),
        "{err}"
    );
    // One engine that this rank does not pair with (decode rank 1 of 2 and prefill rank 0 of
    // 2): refused with the reason, as the prefill would not admit it as a reader.
    let d1 = rank(&mla, TpRank::new(1, 2), 2, None, false, false, tcp());
    pm.engine.hold_blocks("unpaired", &[0]).unwrap();
    d1.engine
        .read_blocks(
            &pm.engine.handshake_address().to_string(),
            "unpaired",
            &[1],
            &[0],
        )
        .unwrap();
    let f = collect(&d1.engine, Duration::from_secs(20), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed[0].cause, FailureCause::Other, "{:?}", f.failed);
    assert!(
        f.failed[0].reason.contains("does not read"),
        "{:?}",
        f.failed
    );
    // A group of sizes that cannot pair is refused at once.
    let err = e3
        .read(ReadRequest {
            id: RequestId::from("x"),
            remote_id: RequestId::from("x"),
            from: ReadFrom::TpGroup(vec![pm.engine.handshake_address().to_string(); 2]),
            local: vec![vec![0]],
            remote: vec![vec![0]],
            remote_tokens_per_block: None,
            first_tokens: Vec::new(),
            hold: None,
        })
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(_))
            && err.to_string().contains("neither is a multiple"),
        "{err}"
    );
}

#[test]
fn one_prefill_rank_failing_fails_the_read_names_it_and_every_rank_hears() {
    let shape = ModelShape::QWEN25_7B;
    let p: Vec<_> = (0..2)
        .map(|r| {
            rank(
                &shape,
                TpRank::new(r, 2),
                16,
                Some(9 + u64::from(r)),
                true,
                false,
                tcp(),
            )
        })
        .collect();
    let d = rank(&shape, TpRank::SOLO, 16, None, true, false, tcp());
    let addrs: Vec<String> = p
        .iter()
        .map(|r| r.engine.handshake_address().to_string())
        .collect();
    // Only rank 1 holds the request: rank 0 refuses its part.
    let blocks: Vec<u32> = (0..16).collect();
    p[1].engine.hold_blocks("half-held", &blocks).unwrap();
    d.engine
        .read(ReadRequest {
            id: RequestId::from("half-held"),
            remote_id: RequestId::from("half-held"),
            from: ReadFrom::TpGroup(addrs),
            local: vec![blocks.clone()],
            remote: vec![blocks],
            remote_tokens_per_block: None,
            first_tokens: Vec::new(),
            hold: None,
        })
        .unwrap();
    let f = collect(&d.engine, Duration::from_secs(20), |f| !f.failed.is_empty());
    let reason = &f.failed[0].reason;
    assert_eq!(f.failed[0].cause, FailureCause::Peer, "{reason}");
    assert!(
        reason.contains("prefill rank 0") && reason.contains("not held"),
        "{reason}"
    );
    // Rank 1 hears how its part ended (done, or aborted if it was still being read) at once,
    // not at its abort timeout.
    let sent = collect(&p[1].engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(sent.sending.len() + sent.failed.len(), 1, "{sent:?}");
    assert_eq!(p[1].engine.in_flight(), (0, 0));
    assert_eq!(d.engine.in_flight(), (0, 0));
}
