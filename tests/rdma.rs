//! RDMA transport tests. They need a verbs device: outside the SoftRoCE VM they print
//! "skipped: no RDMA device (...)" and pass; inside it (`KVLINK_SOFTROCE=1`, set by
//! tools/softroce/run.sh) a missing device is a failure. Sizes are small because the VM's RDMA
//! is emulated (tens of MB/s).

mod common;

use std::time::{Duration, Instant};

use common::rdma::{rdma_available, rdma_config};
use common::*;
use kvlink::internal::{start_with_rdma_fault, RdmaFault};
use kvlink::{Engine, Error, FailureCause, ModelShape, RdmaErrorKind, TransportChoice};

use kvlink::wc_status::REM_ACCESS_ERR as IBV_WC_REM_ACCESS_ERR;

/// The prefill worker of the two-process tests. A helper, not a test: ignored, so that test runs
/// neither run nor count it; `ChildPrefill::spawn` runs it with `--ignored --exact`.
#[test]
#[ignore = "helper: run as a child process by the two-process tests"]
fn prefill_child() {
    prefill_child_main();
}

#[test]
fn rdma_unavailable_is_reported_not_fatal() {
    // A device that does not exist: auto falls back to TCP and says why; rdma-only refuses to
    // start with the reason. Runs everywhere (host and VM).
    let mut c = quick_config();
    c.rdma.device = Some("no-such-device".into());
    let e = Engine::start(c.clone()).unwrap();
    let why = e.rdma_status().unwrap_err();
    assert!(!why.is_empty(), "a reason is given");
    c.transport = TransportChoice::Rdma;
    match Engine::start(c) {
        Err(Error::RdmaUnavailable(r)) => assert!(!r.is_empty()),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("an rdma-only engine started without a device"),
    }
}

fn transfer(shape: ModelShape, blocks: u32, requests: usize, per: usize) {
    let seed = 0xABCD ^ u64::from(shape.layers);
    let prefill = side(&shape, blocks, Some(seed), rdma_config());
    let decode = side(&shape, blocks, None, rdma_config());
    assert_eq!(
        decode.engine.rdma_status().ok(),
        prefill.engine.rdma_status().ok()
    );
    let peer = prefill.engine.handshake_address().to_string();
    let mut rng = Rng(3);
    let reqs = random_requests(&mut rng, blocks, blocks, requests, per);
    for (i, (l, r)) in reqs.iter().enumerate() {
        prefill.engine.hold_blocks(format!("req-{i}"), r).unwrap();
        decode
            .engine
            .read_blocks(&peer, format!("req-{i}"), l, r)
            .unwrap();
    }
    let f = collect(&decode.engine, Duration::from_secs(120), |f| {
        f.receiving.len() + f.failed.len() == requests
    });
    assert!(f.failed.is_empty(), "{:?}", f.failed);
    assert_eq!(f.receiving.len(), requests);
    assert!(
        f.reports.iter().all(|r| r.transport == "rdma"),
        "{:?}",
        f.reports
    );
    f.reports.iter().for_each(check_timeline);
    for (l, r) in &reqs {
        verify(&decode, &prefill.layout, seed, l, r);
    }
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
        f.sending.len() == requests
    });
    assert_eq!(sent.sending.len(), requests);
    // The data went over RDMA: the TCP data server served nothing.
    assert_eq!(prefill.engine.stats().data_requests_served, 0);
}

/// A read between TP sizes over RDMA (`common::tp::run` checks every byte head by head).
fn tp_transfer(shape: ModelShape, prefill: u32, decode: u32, head_major: bool, groups: bool) {
    let ran = common::tp::run(&common::tp::Case {
        shape,
        prefill,
        decode,
        head_major,
        groups,
        requests: 2,
        per: 3,
        blocks: 12,
        config: rdma_config,
    });
    assert!(
        ran.reports.iter().all(|r| r.transport == "rdma"),
        "{:?}",
        ran.reports
    );
    for p in &ran.prefill {
        // The data went over RDMA: the TCP data server served nothing.
        assert_eq!(p.engine.stats().data_requests_served, 0);
    }
}

#[test]
fn rdma_one_prefill_rank_read_by_two_and_four_decode_ranks() {
    if rdma_available() {
        tp_transfer(ModelShape::QWEN25_7B, 1, 2, false, false);
        tp_transfer(ModelShape::QWEN25_7B, 1, 4, true, false);
    }
}

#[test]
fn rdma_two_and_four_prefill_ranks_gathered_by_one_decode_rank() {
    if rdma_available() {
        tp_transfer(ModelShape::QWEN25_7B, 2, 1, true, false);
        tp_transfer(ModelShape::QWEN25_7B, 4, 1, false, false);
    }
}

#[test]
fn rdma_mla_across_tp_sizes() {
    if rdma_available() {
        tp_transfer(ModelShape::DEEPSEEK_V3_MLA, 1, 2, false, false);
        tp_transfer(ModelShape::DEEPSEEK_V3_MLA, 2, 1, false, false);
    }
}

#[test]
fn rdma_block_groups_with_their_own_block_ids() {
    if rdma_available() {
        tp_transfer(ModelShape::QWEN25_7B, 1, 1, false, true);
        tp_transfer(ModelShape::QWEN25_7B, 2, 1, true, true);
    }
}

#[test]
fn rdma_llama3_8b_random_blocks_concurrent() {
    if rdma_available() {
        transfer(ModelShape::LLAMA3_8B, 32, 6, 2);
    }
}

#[test]
fn rdma_deepseek_mla_random_blocks_concurrent() {
    if rdma_available() {
        transfer(ModelShape::DEEPSEEK_V3_MLA, 96, 8, 8);
    }
}

#[test]
fn rdma_regions_split_into_chunks_still_transfer() {
    if !rdma_available() {
        return;
    }
    // 1 MiB registrations and 64 KiB work requests: segments cross chunk boundaries on both
    // sides and are split there.
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let mut c = rdma_config();
    c.rdma.max_mr_bytes = 1 << 20;
    c.rdma.max_wr_bytes = 64 << 10;
    let prefill = side(&shape, 64, Some(5), c.clone());
    let decode = side(&shape, 64, None, c);
    let peer = prefill.engine.handshake_address().to_string();
    let l: Vec<u32> = (10..40).collect();
    let r: Vec<u32> = (20..50).collect();
    prefill.engine.hold_blocks("chunks", &r).unwrap();
    decode.engine.read_blocks(&peer, "chunks", &l, &r).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(120), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 5, &l, &r);
}

#[test]
fn rdma_queue_pairs_are_counted_and_an_idle_session_gives_them_back() {
    if !rdma_available() {
        return;
    }
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 4, Some(5), rdma_config());
    let mut config = rdma_config();
    config.session_idle = Duration::from_millis(500);
    let decode = side(&shape, 4, None, config.clone());
    let (p, d) = (&prefill.engine, &decode.engine);
    assert_eq!((p.stats().queue_pairs, d.stats().queue_pairs), (0, 0));
    let peer = p.handshake_address().to_string();
    p.hold_blocks("q", &[2, 3]).unwrap();
    d.read_blocks(&peer, "q", &[0, 1], &[2, 3]).unwrap();
    let f = collect(d, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.reports[0].transport, "rdma", "{f:?}");
    verify(&decode, &prefill.layout, 5, &[0, 1], &[2, 3]);
    // One set per device pair on each side.
    let devices = d.rdma_status().unwrap().split(',').count() as u64;
    let qps = u64::from(config.rdma.qps) * devices;
    assert_eq!((d.stats().queue_pairs, p.stats().queue_pairs), (qps, qps));
    assert_eq!(d.stats().sessions, 1);
    eventually("the idle session closed", || {
        d.stats().sessions_closed_idle == 1
    });
    eventually("both sides' queue pairs destroyed", || {
        (d.stats().queue_pairs, p.stats().queue_pairs) == (0, 0)
    });
    // Rebuilt on demand, with new queue pairs.
    p.hold_blocks("q2", &[1]).unwrap();
    d.read_blocks(&peer, "q2", &[3], &[1]).unwrap();
    let f = collect(d, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(d.stats().sessions_opened, 2);
    assert_eq!(p.stats().queue_pairs, qps);
}

#[test]
fn rdma_transport_negotiation() {
    if !rdma_available() {
        return;
    }
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let mut auto = rdma_config();
    auto.transport = TransportChoice::Auto;
    let prefill = side(&shape, 8, Some(8), auto.clone());
    let peer = prefill.engine.handshake_address().to_string();
    // Both have RDMA and share this host: auto takes the same-host path for memory it can
    // share (host memory kvlink allocated), RDMA for memory it cannot (registered from a
    // pointer).
    let decode = side(&shape, 8, None, auto.clone());
    prefill.engine.hold_blocks("a0", &[2]).unwrap();
    decode.engine.read_blocks(&peer, "a0", &[1], &[2]).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.reports[0].transport, "local");
    let decode = side_in(Mem::Emulated, &shape, 8, None, auto);
    prefill.engine.hold_blocks("a", &[2]).unwrap();
    decode.engine.read_blocks(&peer, "a", &[1], &[2]).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.reports[0].transport, "rdma");
    // The reader forces TCP.
    let mut tcp = quick_config();
    tcp.transport = TransportChoice::Tcp;
    let decode = side(&shape, 8, None, tcp);
    prefill.engine.hold_blocks("b", &[2]).unwrap();
    decode.engine.read_blocks(&peer, "b", &[1], &[2]).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.reports[0].transport, "tcp");
    verify(&decode, &prefill.layout, 8, &[1], &[2]);
    // A TCP-only server and an RDMA-only reader: a clear failure.
    let mut tcp = quick_config();
    tcp.transport = TransportChoice::Tcp;
    let tcp_prefill = side(&shape, 8, Some(8), tcp);
    let decode = side(&shape, 8, None, rdma_config());
    let tcp_peer = tcp_prefill.engine.handshake_address().to_string();
    decode
        .engine
        .read_blocks(&tcp_peer, "c", &[1], &[2])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Connection, "{f:?}");
    assert!(f.failed[0].reason.contains("offers no RDMA"), "{f:?}");
}

#[test]
fn rdma_with_authentication_keys_go_only_to_key_holders() {
    if !rdma_available() {
        return;
    }
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let keyed = || {
        rdma_config().with(|c| {
            c.auth_key =
                Some(kvlink::AuthKey::new(b"rdma-deployment-key-0123456789".to_vec()).unwrap());
        })
    };
    let prefill = side(&shape, 8, Some(31), keyed());
    let peer = prefill.engine.handshake_address().to_string();
    // Key holders: the queue-pair exchange runs on the authenticated session.
    let decode = side(&shape, 8, None, keyed());
    let reader = decode.engine.descriptor().unwrap().engine_id;
    prefill
        .engine
        .hold_blocks_for("k", &[2, 5], Some(&reader), None)
        .unwrap();
    decode
        .engine
        .read_blocks(&peer, "k", &[1, 6], &[2, 5])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.reports[0].transport, "rdma", "{f:?}");
    verify(&decode, &prefill.layout, 31, &[1, 6], &[2, 5]);
    let s = collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(
        s.sending.len(),
        1,
        "the named reader's confirmation counts: {s:?}"
    );
    // Another key holder's read of a request held for someone else: RDMA reads are one-sided,
    // so its bytes arrive, but its Done is refused: the read fails unconfirmed (never reported
    // received), and the send is not released by the wrong engine.
    prefill
        .engine
        .hold_blocks_for("k2", &[3], Some(&reader), None)
        .unwrap();
    let other = side(&shape, 8, None, keyed());
    other.engine.read_blocks(&peer, "k2", &[1], &[3]).unwrap();
    let f = collect(&other.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert!(f.receiving.is_empty(), "{f:?}");
    assert_eq!(f.failed[0].cause, FailureCause::Unconfirmed, "{f:?}");
    assert!(f.failed[0].reason.contains("another reader"), "{f:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(prefill.engine.get_finished().is_empty(), "k2 is still held");
    assert_eq!(prefill.engine.in_flight().1, 1);
    assert!(prefill.engine.stats().notices_refused >= 1);
    // Without the key: no descriptor, so no remote key, and no queue pair.
    let decode = side(&shape, 8, None, rdma_config());
    decode.engine.read_blocks(&peer, "n", &[1], &[2]).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Connection, "{f:?}");
    assert!(
        f.failed[0].reason.contains("requires authentication"),
        "{f:?}"
    );
}

fn faulty_read(fault: RdmaFault, expect: &str, status: u32) {
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let prefill = side(&shape, 16, Some(13), rdma_config());
    let engine = start_with_rdma_fault(rdma_config(), fault).unwrap();
    let decode = side_on(engine, Mem::Host, &shape, 16, None);
    let peer = prefill.engine.handshake_address().to_string();
    let t0 = Instant::now();
    prefill.engine.hold_blocks("bad", &[3, 9]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "bad", &[1, 2], &[3, 9])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.failed.len(), 1, "{f:?}");
    let fr = &f.failed[0];
    assert!(
        !fr.expired,
        "failed by the verbs error, not the deadline: {fr:?}"
    );
    assert!(fr.reason.contains(expect), "{fr:?}");
    // The verbs status, typed: no parsing of the reason needed.
    assert_eq!(
        fr.cause,
        FailureCause::Rdma(RdmaErrorKind::WorkCompletion { status }),
        "{fr:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "no hang: {:?}",
        t0.elapsed()
    );
    // The connection is rebuilt with a new generation and works again.
    prefill.engine.hold_blocks("good", &[6, 7]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "good", &[4, 5], &[6, 7])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(f.reports[0].transport, "rdma");
    verify(&decode, &prefill.layout, 13, &[4, 5], &[6, 7]);
}

#[test]
fn rdma_wrong_remote_key_fails_with_the_verbs_error() {
    if rdma_available() {
        let fault = RdmaFault {
            rkey_xor: 0x00ab_cd00,
            addr_add: 0,
            requests: 1,
        };
        faulty_read(fault, "IBV_WC_REM_ACCESS_ERR", IBV_WC_REM_ACCESS_ERR);
    }
}

#[test]
fn rdma_out_of_range_remote_address_fails_with_the_verbs_error() {
    if rdma_available() {
        let fault = RdmaFault {
            rkey_xor: 0,
            addr_add: 1 << 40,
            requests: 1,
        };
        faulty_read(fault, "IBV_WC_REM_ACCESS_ERR", IBV_WC_REM_ACCESS_ERR);
    }
}

#[test]
fn rdma_two_process_llama3_8b() {
    if !rdma_available() {
        return;
    }
    let shape = ModelShape::LLAMA3_8B;
    let (blocks, requests, per) = (32u32, 4usize, 2usize);
    let child = ChildPrefill::spawn(shape.name, blocks, 31, requests, "rdma");
    let decode = side(&shape, blocks, None, rdma_config());
    let remote = shape.layout(kvlink::RegionId(1), blocks);
    let mut rng = Rng(11);
    let reqs = random_requests(&mut rng, blocks, blocks, requests, per);
    for (i, (l, r)) in reqs.iter().enumerate() {
        decode
            .engine
            .read_blocks(&child.addr, format!("req-{i}"), l, r)
            .unwrap();
    }
    let f = collect(&decode.engine, Duration::from_secs(120), |f| {
        f.receiving.len() + f.failed.len() == requests
    });
    assert!(f.failed.is_empty(), "{:?}", f.failed);
    assert!(f.reports.iter().all(|r| r.transport == "rdma"));
    for (l, r) in &reqs {
        verify(&decode, &remote, 31, l, r);
    }
    assert_eq!(
        child
            .wait_lines("KVLINK_SENT ", requests, Duration::from_secs(30))
            .len(),
        requests
    );
}

#[test]
fn rdma_peer_killed_mid_transfer_then_a_new_peer_works() {
    if !rdma_available() {
        return;
    }
    let shape = ModelShape::LLAMA3_8B;
    let blocks = 16u32;
    // Enough work (40 x 32 MiB) that most of it is still in flight when the first request
    // lands and the peer is killed, however fast the emulated device runs.
    let n = 40;
    let mut child = ChildPrefill::spawn(shape.name, blocks, 5, n, "rdma");
    let decode = side(&shape, blocks, None, rdma_config());
    let all: Vec<u32> = (0..blocks).collect();
    let (f, took) = kill_peer_mid_transfer(&decode, &mut child, &all, n, Duration::from_secs(120));
    assert_eq!(
        f.receiving.len() + f.failed.len(),
        n,
        "every request ended: {f:?}"
    );
    assert!(
        !f.failed.is_empty(),
        "killing the peer failed none of the requests"
    );
    // Failed by the RDMA or control connection, or, for a read whose bytes had all arrived,
    // by the missing confirmation of the dead prefill.
    for fr in &f.failed {
        assert!(
            fr.reason.contains("RDMA")
                || fr.reason.contains("lost")
                || fr.cause == FailureCause::Unconfirmed,
            "{fr:?}"
        );
    }
    assert!(took < Duration::from_secs(150), "took {took:?}");
    assert_eq!(decode.engine.in_flight(), (0, 0));
    let child2 = ChildPrefill::spawn(shape.name, blocks, 9, 1, "rdma");
    decode
        .engine
        .read_blocks(&child2.addr, "req-0", &[3, 4], &[7, 1])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(f.reports[0].transport, "rdma");
    verify(
        &decode,
        &shape.layout(kvlink::RegionId(1), blocks),
        9,
        &[3, 4],
        &[7, 1],
    );
}

#[test]
fn rdma_device_regions_take_the_device_registration_path() {
    if !rdma_available() {
        return;
    }
    // Emulated device memory on both sides: registration goes through the device branch
    // (dma-buf refused by the emulated runtime, then plain registration, which succeeds because
    // the memory is really host memory) and the NIC reads it directly: nothing is staged.
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let prefill = side_in(Mem::Emulated, &shape, 48, Some(21), rdma_config());
    let decode = side_in(Mem::Emulated, &shape, 48, None, rdma_config());
    assert!(prefill.region.is_device() && decode.region.is_device());
    let peer = prefill.engine.handshake_address().to_string();
    let (l, r): (Vec<u32>, Vec<u32>) = ((0..24).collect(), (24..48).rev().collect());
    prefill.engine.hold_blocks("dev", &r).unwrap();
    decode.engine.read_blocks(&peer, "dev", &l, &r).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(120), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(f.reports[0].transport, "rdma");
    verify(&decode, &prefill.layout, 21, &l, &r);
    assert_eq!(decode.engine.stats().bytes_staged_in, 0);
    assert_eq!(prefill.engine.stats().bytes_staged_out, 0);
}
