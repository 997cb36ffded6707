//! The same-host path: engines of one host read through a shared memfd (host memory) or an
//! IPC handle (device memory; the emulated runtime's memfd here, CUDA's where a GPU is), in
//! one process and across two; every byte checked. The serving engine enforces the grants as
//! its TCP server does; memory that cannot be shared falls back to TCP (auto) or is refused
//! with the reason (local).

mod common;

use std::time::Duration;

use common::*;
use kvlink::{EngineConfig, FailureCause, ModelShape, RequestId, TransportChoice};

fn config(transport: TransportChoice) -> EngineConfig {
    quick_config().with(|c| {
        c.transport = transport;
    })
}

/// Reads `requests` random block lists from a prefill in `from` into a decode in `into`, and
/// checks every byte, the transport used and the bytes the prefill served.
fn run(from: Mem, into: Mem, transport: TransportChoice, want: &str) {
    let shape = ModelShape::LLAMA3_8B;
    let seed = 0x10CA1;
    let prefill = side_in(from, &shape, 40, Some(seed), config(TransportChoice::Tcp));
    let decode = side_in(into, &shape, 48, None, config(transport));
    let peer = prefill.engine.handshake_address().to_string();
    let reqs = random_requests(&mut Rng(7), 48, 40, 6, 7);
    for (i, (_, r)) in reqs.iter().enumerate() {
        prefill.engine.hold_blocks(format!("req-{i}"), r).unwrap();
    }
    for (i, (l, r)) in reqs.iter().enumerate() {
        decode
            .engine
            .read_blocks(&peer, format!("req-{i}"), l, r)
            .unwrap();
    }
    let got = collect(&decode.engine, Duration::from_secs(60), |f| {
        f.receiving.len() + f.failed.len() == reqs.len()
    });
    assert!(got.failed.is_empty(), "failed: {:?}", got.failed);
    for (l, r) in &reqs {
        verify(&decode, &prefill.layout, seed, l, r);
    }
    assert!(
        got.reports.iter().all(|r| r.transport == want),
        "{:?}",
        got.reports.iter().map(|r| r.transport).collect::<Vec<_>>()
    );
    got.reports.iter().for_each(check_timeline);
    let bytes: u64 = got.reports.iter().map(|r| r.bytes).sum();
    assert_eq!(bytes, 42 * shape.region_bytes(1));
    // Host memory on both sides of the same host: the reader copies itself, out of the
    // prefill's shared memory, and the prefill serves no byte; otherwise the prefill copies.
    let readers_copy = want == "local" && matches!((from, into), (Mem::Host, Mem::Host));
    let by_prefill = if readers_copy { 0 } else { bytes };
    assert_eq!(served(&prefill.engine, by_prefill), by_prefill);
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
        f.sending.len() == reqs.len()
    });
    assert_eq!(sent.sending.len(), reqs.len());
}

#[test]
fn host_memory_is_read_through_the_shared_memfd() {
    run(Mem::Host, Mem::Host, TransportChoice::Auto, "local");
}

#[test]
fn device_memory_is_read_through_ipc_in_every_direction() {
    // Emulated device memory allocated by the engines: its IPC is a memfd, so the device
    // branches (device to device, host to device, device to host) run without a GPU.
    run(
        Mem::EmulatedAlloc,
        Mem::EmulatedAlloc,
        TransportChoice::Local,
        "local",
    );
    run(
        Mem::Host,
        Mem::EmulatedAlloc,
        TransportChoice::Local,
        "local",
    );
    run(
        Mem::EmulatedAlloc,
        Mem::Host,
        TransportChoice::Local,
        "local",
    );
}

#[test]
fn memory_that_cannot_be_shared_falls_back_to_tcp_or_is_refused() {
    // Emulated device memory registered from a pointer has no descriptor to share.
    run(Mem::Host, Mem::Emulated, TransportChoice::Auto, "tcp");
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 8, Some(1), config(TransportChoice::Tcp));
    let decode = side_in(
        Mem::Emulated,
        &shape,
        8,
        None,
        config(TransportChoice::Local),
    );
    prefill.engine.hold_blocks("r", &[0, 1]).unwrap();
    let peer = prefill.engine.handshake_address().to_string();
    decode
        .engine
        .read_blocks(&peer, "r", &[0, 1], &[0, 1])
        .unwrap();
    let got = collect(&decode.engine, Duration::from_secs(20), |f| {
        !f.failed.is_empty()
    });
    let reason = &got.failed[0].reason;
    assert_eq!(got.failed[0].cause, kvlink::FailureCause::Other, "{reason}");
    assert!(
        reason.contains("no same-host path") && reason.contains("no IPC export"),
        "{reason}"
    );
}

#[test]
fn the_serving_engine_enforces_its_grants() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 16, Some(3), config(TransportChoice::Tcp));
    let decode = side(&shape, 16, None, config(TransportChoice::Local));
    let peer = prefill.engine.handshake_address().to_string();
    prefill.engine.hold_blocks("held", &[1, 2]).unwrap();
    prefill.engine.hold_blocks("good", &[1, 2]).unwrap();
    // Blocks the hold does not cover, then a request that is not held at all.
    decode
        .engine
        .read_blocks(&peer, "held", &[0, 1], &[2, 3])
        .unwrap();
    decode
        .engine
        .read_blocks(&peer, "other", &[4], &[1])
        .unwrap();
    let got = collect(&decode.engine, Duration::from_secs(20), |f| {
        f.failed.len() == 2
    });
    assert_eq!(got.failed.len(), 2, "{got:?}");
    for f in &got.failed {
        assert_eq!(f.cause, kvlink::FailureCause::Peer, "{}", f.reason);
        assert!(f.reason.contains("refused"), "{}", f.reason);
    }
    let stats = prefill.engine.stats();
    assert_eq!(stats.bytes_served, 0);
    assert!(stats.data_requests_refused >= 2, "{stats:?}");
    // The refused reads wrote nothing: the decode's blocks are still zero.
    let mut buf = vec![0u8; 64];
    decode.region.read_at(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // The connection survives refusals: blocks held for another request still arrive.
    decode
        .engine
        .read_blocks(&peer, "good", &[5, 6], &[1, 2])
        .unwrap();
    let got = collect(&decode.engine, Duration::from_secs(20), |f| {
        !f.receiving.is_empty()
    });
    assert!(got.receiving.contains(&RequestId::from("good")), "{got:?}");
    verify(&decode, &prefill.layout, 3, &[5, 6], &[1, 2]);
}

#[test]
fn with_a_deployment_key_only_a_proven_session_is_served() {
    let key = kvlink::AuthKey::new(vec![7u8; 32]).unwrap();
    let keyed = |t| {
        config(t).with(|c| {
            c.auth_key = Some(key.clone());
        })
    };
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 8, Some(5), keyed(TransportChoice::Tcp));
    let decode = side(&shape, 8, None, keyed(TransportChoice::Local));
    prefill.engine.hold_blocks("k", &[3]).unwrap();
    let peer = prefill.engine.handshake_address().to_string();
    decode.engine.read_blocks(&peer, "k", &[0], &[3]).unwrap();
    let got = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert!(got.receiving.contains(&RequestId::from("k")), "{got:?}");
    assert_eq!(got.reports[0].transport, "local");
    verify(&decode, &prefill.layout, 5, &[0], &[3]);
}

#[test]
fn two_processes_share_host_memory_and_survive_the_prefill_dying() {
    let shape = ModelShape::LLAMA3_8B;
    let child = ChildPrefill::spawn(shape.name, 32, 11, 4, "tcp");
    let decode = side(&shape, 32, None, config(TransportChoice::Local));
    let blocks: Vec<u32> = (0..32).rev().collect();
    let local: Vec<u32> = (0..32).collect();
    decode
        .engine
        .read_blocks(&child.addr, "req-3", &local, &blocks)
        .unwrap();
    let got = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
    assert!(got.failed.is_empty(), "{got:?}");
    assert_eq!(got.reports[0].transport, "local");
    verify(
        &decode,
        &shape.layout(kvlink::RegionId(1), 32),
        11,
        &local,
        &blocks,
    );
    assert_eq!(
        child
            .wait_lines("KVLINK_SENT", 1, Duration::from_secs(10))
            .len(),
        1
    );

    // The prefill process dies while reads are in flight: every request ends, none hangs.
    let mut child = child;
    let (f, took) =
        kill_peer_mid_transfer(&decode, &mut child, &blocks, 3, Duration::from_secs(30));
    assert_eq!(
        f.receiving.len() + f.failed.len(),
        3,
        "{f:?} after {took:?}"
    );
    assert_eq!(decode.engine.in_flight(), (0, 0));
}

#[test]
fn cuda_ipc_between_two_processes_every_byte_checked() {
    if !cuda_loaded() {
        return;
    }
    // CUDA IPC opens only another process's memory: the prefill runs in a child. Device to
    // device (the prefill opens the decode's allocation and copies on its GPU), host to device
    // and device to host.
    let shape = ModelShape::LLAMA3_8B;
    for (prefill, into) in [("cuda", Mem::Cuda), ("tcp", Mem::Cuda), ("cuda", Mem::Host)] {
        let child = ChildPrefill::spawn(shape.name, 64, 21, 1, prefill);
        let decode = side_in(into, &shape, 64, None, config(TransportChoice::Local));
        let blocks: Vec<u32> = (0..64).rev().collect();
        let local: Vec<u32> = (0..64).collect();
        decode
            .engine
            .read_blocks(&child.addr, "req-0", &local, &blocks)
            .unwrap();
        let got = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
        assert!(got.failed.is_empty(), "{prefill} into {into:?}: {got:?}");
        assert_eq!(got.reports[0].transport, "local");
        verify(
            &decode,
            &shape.layout(kvlink::RegionId(1), 64),
            21,
            &local,
            &blocks,
        );
    }
}

#[test]
#[ignore = "helper: the prefill process of the two-process tests"]
fn prefill_child() {
    prefill_child_main();
}

/// A hold the prefill releases while its read is in flight, its blocks then overwritten (as its
/// scheduler would reuse them): the read fails, never reported received. The grant stops TCP
/// and same-host reads at once; a byte that slipped through would still find its `Done`
/// refused.
fn released_mid_read(transport: TransportChoice) {
    let shape = ModelShape::LLAMA3_8B;
    let blocks = 512;
    // One stream of 64 KiB requests: a 1 GiB read takes long enough to be cut.
    let slow = config(transport).with(|c| {
        c.tcp_streams = 1;
        c.batch_bytes = 64 << 10;
    });
    let prefill = side(&shape, blocks, Some(83), config(transport));
    let decode = side(&shape, blocks, None, slow);
    let peer = prefill.engine.handshake_address().to_string();
    decode
        .engine
        .connect(&peer, Duration::from_secs(10))
        .unwrap();
    let all: Vec<u32> = (0..blocks).collect();
    prefill.engine.hold_blocks("released", &all).unwrap();
    decode
        .engine
        .read_blocks(&peer, "released", &all, &all)
        .unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(decode.engine.in_flight().0, 1, "still reading after 10 ms");
    assert!(prefill.engine.release("released"));
    kvlink::verify::fill(&prefill.region, 5).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
    assert!(f.receiving.is_empty(), "{f:?}");
    // Refused at its next data request (peer), cut mid-response and refused again on its
    // retry (connection: the retry's error names both), or refused at its confirmation
    // (unconfirmed): which, depends on where in a response the release lands.
    let cause = f.failed[0].cause;
    assert!(
        matches!(
            cause,
            FailureCause::Peer | FailureCause::Unconfirmed | FailureCause::Connection
        ),
        "{f:?}"
    );
}

#[test]
fn a_hold_released_mid_read_is_never_reported_received_tcp_and_same_host() {
    released_mid_read(TransportChoice::Tcp);
    released_mid_read(TransportChoice::Local);
}

/// A hold that ends while its bytes are copied on the same host, and is made again under the
/// same id (a reader naming no hold token matches either), is never reported received, on both
/// same-host paths: the reader's own copy out of the prefill's shared memory (host caches on
/// both sides; kept only if the hold's word in the prefill's hold table did not move), and the
/// prefill's copy into the reader's memory (a device cache on the reader's side; the prefill
/// checks the grant after the copy before it confirms). One 256 MiB copy (128 blocks of every
/// tensor, one batch): the hold is released and made again once the copy's first bytes landed.
/// An attempt whose copy ended before the release (the release then finds no hold: the read was
/// confirmed while held) is tried again.
fn made_again_during_a_copy(into: Mem, reason: &str) {
    let shape = ModelShape::LLAMA3_8B;
    let blocks = 128;
    let one_request = config(TransportChoice::Local).with(|c| c.batch_bytes = 256 << 20);
    let prefill = side(&shape, blocks, Some(84), config(TransportChoice::Local));
    let decode = side_in(into, &shape, blocks, None, one_request);
    let peer = prefill.engine.handshake_address().to_string();
    let all: Vec<u32> = (0..blocks).collect();
    for attempt in 0..10 {
        let id = format!("again-{attempt}");
        let zero = vec![0u8; shape.region_bytes(blocks) as usize];
        decode.region.write_at(0, &zero).unwrap();
        prefill.engine.hold_blocks(id.as_str(), &all).unwrap();
        decode
            .engine
            .read_blocks(&peer, id.as_str(), &all, &all)
            .unwrap();
        // Polled without sleeping: the copy runs for milliseconds.
        let end = std::time::Instant::now() + Duration::from_secs(10);
        let mut first = [0u8; 8];
        while first == [0; 8] {
            assert!(std::time::Instant::now() < end, "the copy never started");
            std::thread::yield_now();
            decode.region.read_at(0, &mut first).unwrap();
        }
        if !prefill.engine.release(id.as_str()) {
            // The copy and its confirmation ended first: confirmed while held, as it should.
            let f = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
            assert_eq!(f.reports.len(), 1, "attempt {attempt}: {f:?}");
            collect(&prefill.engine, Duration::from_secs(10), |f| !f.is_empty());
            continue;
        }
        prefill.engine.hold_blocks(id.as_str(), &all).unwrap();
        let f = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
        assert!(
            f.reports.is_empty(),
            "a stale copy reported received: {f:?}"
        );
        assert_eq!(f.failed[0].cause, FailureCause::Unconfirmed, "{f:?}");
        assert!(f.failed[0].reason.contains(reason), "{f:?}");
        // The new hold was not confirmed by the stale read: it is still held.
        assert_eq!(prefill.engine.in_flight().1, 1);
        assert_eq!(decode.engine.stats().totals.reads_done, attempt);
        return;
    }
    panic!("in 10 attempts, every 256 MiB copy ended before the test thread released its hold");
}

#[test]
fn a_hold_made_again_during_a_readers_own_copy_is_never_reported_received() {
    made_again_during_a_copy(Mem::Host, "its word in the prefill's hold table moved");
}

#[test]
fn a_hold_made_again_during_the_prefills_copy_is_never_reported_received() {
    made_again_during_a_copy(Mem::EmulatedAlloc, "while its blocks were being read");
}
