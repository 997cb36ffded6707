//! RDMA reads and the prefill's holds, in the SoftRoCE VM (outside it they print "skipped: no
//! RDMA device (...)" and pass): one-sided reads do not stop when a hold ends, so what keeps a
//! decode from wrong bytes is the prefill's confirmation; a cancel tells the prefill; a reader
//! that vanishes mid-read has its hold end at its lease, which only its `Reading` notice ties it
//! to (nothing of an RDMA read reaches the prefill's CPU); a read of at most
//! `MAX_PIN_READ_BYTES` pins its hold as it is posted, which the prefill's release waits for,
//! and counts on the pin only when it completed within it.

mod common;

use std::time::{Duration, Instant};

use common::rdma::{rdma_available, rdma_config};
use common::*;
use kvlink::{EngineConfig, FailureCause, ModelShape};

/// Blocks of the caches the tests read: 32 MiB, about a second over the emulated device.
const BLOCKS: u32 = 16;

/// A prefill (filled from `seed`, with `config`) and a decode connected to it over RDMA; starts
/// the read of every block under `id`, held for it, and returns once it is in flight.
fn reading(seed: u64, config: EngineConfig, id: &str) -> (Side, Side, String) {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, BLOCKS, Some(seed), config);
    let decode = side(&shape, BLOCKS, None, rdma_config());
    let peer = prefill.engine.handshake_address().to_string();
    decode
        .engine
        .connect(&peer, Duration::from_secs(30))
        .unwrap();
    let all: Vec<u32> = (0..BLOCKS).collect();
    prefill.engine.hold_blocks(id, &all).unwrap();
    decode.engine.read_blocks(&peer, id, &all, &all).unwrap();
    (prefill, decode, peer)
}

#[test]
fn rdma_cancel_stops_a_read_in_flight_and_tells_the_prefill() {
    if !rdma_available() {
        return;
    }
    // The cancel lands mid-transfer.
    let (prefill, decode, peer) = reading(61, rdma_config(), "rc");
    std::thread::sleep(Duration::from_millis(200));
    assert!(decode.engine.cancel("rc"), "still in flight after 200 ms");
    let f = collect(&decode.engine, Duration::from_secs(30), |f| !f.is_empty());
    assert_eq!(f.failed[0].cause, FailureCause::Cancelled, "{f:?}");
    let s = collect(&prefill.engine, Duration::from_secs(30), |f| !f.is_empty());
    assert_eq!(s.failed[0].cause, FailureCause::Peer, "{s:?}");
    assert!(s.failed[0].reason.contains("cancelled"), "{s:?}");
    // The engine reads again afterwards, over RDMA, every byte right.
    prefill.engine.hold_blocks("after", &[7, 2]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "after", &[1, 3], &[7, 2])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(f.reports[0].transport, "rdma");
    verify(&decode, &prefill.layout, 61, &[1, 3], &[7, 2]);
}

#[test]
fn rdma_a_hold_that_ends_mid_read_is_never_reported_received() {
    if !rdma_available() {
        return;
    }
    // One-sided reads do not stop when a hold ends: 32 MiB (about a second on the emulated
    // device) are read while the prefill releases the hold and its blocks are overwritten,
    // as its scheduler would reuse them. Every byte arrives, but the prefill refuses the Done:
    // the read fails as unconfirmed, never received.
    let (prefill, decode, peer) = reading(67, rdma_config(), "stale");
    std::thread::sleep(Duration::from_millis(100));
    assert!(prefill.engine.release("stale"));
    kvlink::verify::fill(&prefill.region, 99).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert!(f.receiving.is_empty(), "{f:?}");
    assert_eq!(f.failed[0].cause, FailureCause::Unconfirmed, "{f:?}");
    assert!(f.failed[0].reason.contains("no longer held"), "{f:?}");
    // A read of a live hold is confirmed, over RDMA, every byte right.
    prefill.engine.hold_blocks("live", &[5, 9]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "live", &[2, 4], &[5, 9])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(f.reports[0].transport, "rdma");
    verify(&decode, &prefill.layout, 99, &[2, 4], &[5, 9]);
}

/// A prefill (filled from `seed`) and a decode, over RDMA, pinning for `decode_pin` (the
/// prefill grants up to 10 s): starts a read of the first half of the blocks (16 MiB, the most
/// a pinned read reads; half a second over the emulated device) and returns once the prefill
/// pinned its hold.
fn pinned_reading(seed: u64, decode_pin: Duration, id: &str) -> (Side, Side, Vec<u32>) {
    let shape = ModelShape::LLAMA3_8B;
    let pins = |pin| rdma_config().with(|c| c.read_pin = pin);
    let prefill = side(&shape, BLOCKS, Some(seed), pins(Duration::from_secs(10)));
    let decode = side(&shape, BLOCKS, None, pins(decode_pin));
    let peer = prefill.engine.handshake_address().to_string();
    decode
        .engine
        .connect(&peer, Duration::from_secs(30))
        .unwrap();
    let half: Vec<u32> = (0..BLOCKS / 2).collect();
    prefill.engine.hold_blocks(id, &half).unwrap();
    decode.engine.read_blocks(&peer, id, &half, &half).unwrap();
    eventually("the prefill pinned the hold", || {
        prefill.engine.stats().reads_pinned == 1
    });
    (prefill, decode, half)
}

#[test]
fn rdma_a_release_waits_for_the_pinned_read_which_gets_the_held_bytes() {
    if !rdma_available() {
        return;
    }
    // The prefill releases a pinned hold while its reads are in flight and overwrites its
    // blocks as soon as the release returns, as its scheduler would reuse them. The release
    // waits for the reader's notice, so every byte read is the held one: received, verified.
    // (A release that did not wait let the reads fetch the new bytes, which the pin confirmed.)
    let (prefill, decode, half) = pinned_reading(79, Duration::from_secs(10), "pinned");
    assert_eq!(decode.engine.in_flight(), (1, 0), "the read is in flight");
    assert!(prefill.engine.release("pinned"));
    kvlink::verify::fill(&prefill.region, 99).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 79, &half, &half);
    assert_eq!(decode.engine.stats().notices_refused, 0);
}

#[test]
fn rdma_a_read_that_outlasts_its_pin_counts_only_on_its_done() {
    if !rdma_available() {
        return;
    }
    // The decode asks for a pin of 50 ms; its reads take longer. Past the pin the prefill
    // releases the hold (at once: the pin lapsed) and overwrites its blocks. The pin said
    // held, but the reads completed after it lapsed: the Done decides, and is refused.
    // (Counting on the pin whatever the reads took would report the new bytes received.)
    let (prefill, decode, _) = pinned_reading(83, Duration::from_millis(50), "lapsed");
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(
        decode.engine.in_flight(),
        (1, 0),
        "still reading past the pin"
    );
    assert!(prefill.engine.release("lapsed"));
    kvlink::verify::fill(&prefill.region, 97).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert!(f.receiving.is_empty(), "{f:?}");
    assert_eq!(f.failed[0].cause, FailureCause::Unconfirmed, "{f:?}");
}

#[test]
fn rdma_a_reader_gone_mid_read_has_its_hold_end_at_its_lease() {
    if !rdma_available() {
        return;
    }
    // A hold that names no reader learns its reader from the read's Reading notice (the RDMA
    // reads themselves never reach the prefill's CPU). The decode then vanishes mid-read (its
    // engine closed: its tasks stop where they are and its connections close, no abort sent):
    // the hold ends at the decode's lease, not at the 480 s abort timeout.
    let lease = Duration::from_secs(2);
    let config = rdma_config().with(|c| {
        c.lease = lease;
    });
    let (prefill, decode, _) = reading(71, config, "gone");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        decode.engine.in_flight(),
        (1, 0),
        "still reading after 200 ms"
    );
    decode.engine.close();
    let closed = Instant::now();
    let s = collect(&prefill.engine, lease + Duration::from_secs(10), |f| {
        !f.is_empty()
    });
    let took = closed.elapsed();
    assert_eq!(s.failed.len(), 1, "{s:?}");
    let f = &s.failed[0];
    assert!(f.expired && f.cause == FailureCause::Expired, "{f:?}");
    assert!(
        f.reason.contains("lease") && f.reason.contains(decode.engine.engine_id()),
        "{f:?}"
    );
    assert!(
        took >= lease - Duration::from_millis(100) && took < lease + Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(prefill.engine.stats().totals.sends_lease_expired, 1);
}

#[test]
fn rdma_a_progressive_read_is_received_only_from_a_hold_live_to_its_seal() {
    if !rdma_available() {
        return;
    }
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, BLOCKS, Some(73), rdma_config());
    let decode = side(&shape, BLOCKS, None, rdma_config());
    let peer = prefill.engine.handshake_address().to_string();
    // A hold that grows by two parts and is sealed: read part by part over RDMA, every byte
    // right, received once sealed.
    let local = [0, 1, 2, 3];
    let remote = [9, 4, 12, 6];
    let req = kvlink::FollowRequest::blocks(&peer, "grown", &local);
    decode.engine.follow(req).unwrap();
    let hold = kvlink::HoldRequest::blocks("grown", &remote[..2]);
    prefill.engine.hold_growing(hold).unwrap();
    prefill
        .engine
        .extend_hold("grown", &[&remote[2..]])
        .unwrap();
    prefill.engine.seal_hold("grown").unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!(f.reports[0].transport, "rdma");
    verify(&decode, &prefill.layout, 73, &local, &remote);
    // A hold released while its second part is being read (16 MiB, half a second over the
    // emulated device), its blocks overwritten: never received, whatever the reads brought.
    let all: Vec<u32> = (0..BLOCKS).collect();
    let req = kvlink::FollowRequest::blocks(&peer, "cut", &all);
    decode.engine.follow(req).unwrap();
    let hold = kvlink::HoldRequest::blocks("cut", &all[..8]);
    prefill.engine.hold_growing(hold).unwrap();
    prefill.engine.extend_hold("cut", &[&all[8..]]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(prefill.engine.release("cut"));
    kvlink::verify::fill(&prefill.region, 98).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(60), |f| !f.is_empty());
    assert!(f.receiving.is_empty(), "{f:?}");
    assert!(f.failed[0].reason.contains("released"), "{f:?}");
}
