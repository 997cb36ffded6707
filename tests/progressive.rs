//! Progressive reads in one process: a decode follows a prefill's hold as it grows, reads each
//! part as it is held (over TCP, and over the same-host path), and reports the request received
//! only once the hold is sealed and confirmed; every wait has its deadline, and a hold that
//! ends first fails the read.

mod common;

use std::time::Duration;

use common::*;
use kvlink::{
    EngineConfig, FailureCause, FollowRequest, HoldRequest, ModelShape, RequestId, TransportChoice,
};

const SHAPE: ModelShape = ModelShape::LLAMA3_8B;
const SEED: u64 = 0x5eed;

fn config(transport: TransportChoice) -> EngineConfig {
    quick_config().with(|c| c.transport = transport)
}

/// A seeded prefill and an empty decode.
fn pair(transport: TransportChoice) -> (Side, Side, String) {
    let prefill = side(&SHAPE, 64, Some(SEED), config(transport));
    let decode = side(&SHAPE, 64, None, config(transport));
    let peer = prefill.engine.handshake_address().to_string();
    (prefill, decode, peer)
}

/// Whether the decode's `local` blocks hold the prefill's `remote` ones.
fn holds(decode: &Side, prefill: &Side, local: &[u32], remote: &[u32]) -> bool {
    let r = kvlink::verify::check_blocks(
        &decode.region,
        &decode.layout,
        &prefill.layout,
        SEED,
        local,
        remote,
    );
    r.is_ok()
}

fn failure(decode: &Side, id: &str) -> kvlink::FailedRequest {
    let got = collect(&decode.engine, Duration::from_secs(30), |f| {
        !f.failed.is_empty() || !f.receiving.is_empty()
    });
    assert!(got.receiving.is_empty(), "{id} was received: {got:?}");
    let f = got.failed.into_iter().next().expect("a failure");
    assert_eq!(f.id, RequestId::from(id));
    f
}

#[test]
fn a_read_follows_a_growing_hold_part_by_part_and_confirms_after_the_seal() {
    for transport in [TransportChoice::Tcp, TransportChoice::Auto] {
        let (prefill, decode, peer) = pair(transport);
        let local: Vec<u32> = (0..12).map(|i| 40 + i).collect();
        let remote: Vec<u32> = vec![7, 3, 30, 31, 9, 1, 50, 51, 52, 12, 0, 63];
        // The read starts before the prefill holds anything.
        decode
            .engine
            .follow(FollowRequest::blocks(&peer, "p", &local))
            .unwrap();
        assert!(decode
            .engine
            .wait_finished(Duration::from_millis(200))
            .is_empty());
        let token = prefill
            .engine
            .hold_growing(HoldRequest::blocks("p", &remote[..4]))
            .unwrap();
        // Each part is read while the next is not held yet.
        eventually("the first part read", || {
            holds(&decode, &prefill, &local[..4], &remote[..4])
        });
        prefill.engine.extend_hold("p", &[&remote[4..9]]).unwrap();
        eventually("the second part read", || {
            holds(&decode, &prefill, &local[4..9], &remote[4..9])
        });
        assert!(decode
            .engine
            .wait_finished(Duration::from_millis(100))
            .is_empty());
        prefill.engine.extend_hold("p", &[&remote[9..]]).unwrap();
        prefill.engine.seal_hold("p").unwrap();
        let got = collect(&decode.engine, Duration::from_secs(30), |f| {
            !f.receiving.is_empty() || !f.failed.is_empty()
        });
        assert!(got.failed.is_empty(), "{transport:?}: {:?}", got.failed);
        verify(&decode, &prefill.layout, SEED, &local, &remote);
        let r = &got.reports[0];
        assert_eq!(r.bytes, 12 * SHAPE.region_bytes(1), "{transport:?}");
        let path = if transport == TransportChoice::Tcp {
            "tcp"
        } else {
            "local"
        };
        assert_eq!(r.transport, path);
        assert!(r.timeline.held.is_some());
        let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
            !f.sending.is_empty()
        });
        assert_eq!(sent.sending, vec![RequestId::from("p")]);
        // A hold sealed cannot grow, and its token was the one followed.
        assert!(prefill.engine.extend_hold("p", &[&[5u32][..]]).is_err());
        assert_ne!(token, 0);
    }
}

/// A decode that gives up a request it follows before the prefill holds it (its request was
/// aborted) tells the prefill: the hold fails as soon as the prefill opens it, instead of
/// keeping the blocks until its abort timeout.
#[test]
fn a_read_cancelled_before_the_hold_fails_the_hold_at_once() {
    let (prefill, decode, peer) = pair(TransportChoice::Tcp);
    let mut req = FollowRequest::blocks(&peer, "c", &[1, 2]);
    req.hold = Some(77);
    decode.engine.follow(req).unwrap();
    // The follow reaches the prefill before the cancel (its session is up).
    eventually("the session", || {
        decode.engine.session_state(&peer) == kvlink::SessionState::Up
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(decode.engine.cancel("c"));
    let f = failure(&decode, "c");
    assert_eq!(f.cause, FailureCause::Cancelled);
    // The abort arrives; then the prefill holds the request.
    std::thread::sleep(Duration::from_millis(200));
    let mut hold = HoldRequest::blocks("c", &[3, 4]);
    hold.token = Some(77);
    prefill.engine.hold_growing(hold).unwrap();
    let got = collect(&prefill.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(got.failed[0].cause, FailureCause::Peer, "{:?}", got.failed);
    assert_eq!(prefill.engine.in_flight(), (0, 0));
}

/// A decode that has the request's first blocks (a cached prefix) skips them: it reads the
/// blocks after them only, and is confirmed for the whole sealed hold.
#[test]
fn a_read_that_skips_a_cached_prefix_reads_only_the_blocks_after_it() {
    let (prefill, decode, peer) = pair(TransportChoice::Tcp);
    let mut req = FollowRequest::blocks(&peer, "s", &[40, 41, 42]);
    req.skip = vec![2];
    decode.engine.follow(req).unwrap();
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("s", &[7, 3, 30]))
        .unwrap();
    prefill.engine.extend_hold("s", &[&[31u32, 9][..]]).unwrap();
    prefill.engine.seal_hold("s").unwrap();
    let got = collect(&decode.engine, Duration::from_secs(30), |f| {
        !f.receiving.is_empty() || !f.failed.is_empty()
    });
    assert!(got.failed.is_empty(), "{:?}", got.failed);
    verify(&decode, &prefill.layout, SEED, &[40, 41, 42], &[30, 31, 9]);
    assert_eq!(got.reports[0].bytes, 3 * SHAPE.region_bytes(1));
    // A skip of another number of block groups is refused at once.
    let mut bad = FollowRequest::blocks(&peer, "t", &[1]);
    bad.skip = vec![1, 1];
    assert!(decode.engine.follow(bad).is_err());
}

#[test]
fn a_plain_read_of_a_growing_hold_is_refused_until_the_seal() {
    let (prefill, decode, peer) = pair(TransportChoice::Tcp);
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("g", &[1, 2]))
        .unwrap();
    decode
        .engine
        .read_blocks(&peer, "g", &[1, 2], &[1, 2])
        .unwrap();
    let f = failure(&decode, "g");
    assert!(f.reason.contains("not sealed"), "{}", f.reason);
    // A hold of no block cannot be sealed; one sealed is read as any other.
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("h", &[]))
        .unwrap();
    assert!(prefill.engine.seal_hold("h").is_err());
    prefill.engine.extend_hold("h", &[&[4u32, 5][..]]).unwrap();
    prefill.engine.seal_hold("h").unwrap();
    decode
        .engine
        .read_blocks(&peer, "h", &[8, 9], &[4, 5])
        .unwrap();
    let got = collect(&decode.engine, Duration::from_secs(30), |f| {
        !f.receiving.is_empty() || !f.failed.is_empty()
    });
    assert!(got.failed.is_empty(), "{:?}", got.failed);
    verify(&decode, &prefill.layout, SEED, &[8, 9], &[4, 5]);
}

#[test]
fn every_wait_of_a_progressive_read_has_its_deadline() {
    let (prefill, decode, peer) = pair(TransportChoice::Tcp);
    // Never held: the first part's timeout.
    let mut req = FollowRequest::blocks(&peer, "never", &[1, 2]);
    req.first_part_timeout = Some(Duration::from_millis(300));
    decode.engine.follow(req).unwrap();
    let f = failure(&decode, "never");
    assert_eq!(f.cause, FailureCause::Expired, "{}", f.reason);
    assert!(f.reason.contains("first part"), "{}", f.reason);
    // Held, grown once, never sealed: the next part's timeout, and the prefill is told.
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("stuck", &[3]))
        .unwrap();
    let mut req = FollowRequest::blocks(&peer, "stuck", &[1, 2]);
    req.part_timeout = Some(Duration::from_millis(300));
    decode.engine.follow(req).unwrap();
    let f = failure(&decode, "stuck");
    assert!(f.reason.contains("next part"), "{}", f.reason);
    let aborted = collect(&prefill.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(aborted.failed[0].id, RequestId::from("stuck"));
    assert_eq!(aborted.failed[0].cause, FailureCause::Peer);
}

#[test]
fn a_hold_that_ends_before_its_seal_fails_its_follower() {
    let (prefill, decode, peer) = pair(TransportChoice::Tcp);
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("r", &[3, 4]))
        .unwrap();
    decode
        .engine
        .follow(FollowRequest::blocks(&peer, "r", &[1, 2, 5]))
        .unwrap();
    eventually("the first part read", || {
        holds(&decode, &prefill, &[1, 2], &[3, 4])
    });
    assert!(prefill.engine.release("r"));
    let f = failure(&decode, "r");
    assert!(f.reason.contains("released"), "{}", f.reason);
    // Sealed with fewer blocks than the read is into: refused by the reader.
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("short", &[6]))
        .unwrap();
    prefill.engine.seal_hold("short").unwrap();
    decode
        .engine
        .follow(FollowRequest::blocks(&peer, "short", &[1, 2]))
        .unwrap();
    let f = failure(&decode, "short");
    assert!(
        f.reason.contains("sealed the request with 1 blocks"),
        "{}",
        f.reason
    );
    // A reader cancelled while it follows ends cancelled.
    decode
        .engine
        .follow(FollowRequest::blocks(&peer, "later", &[1]))
        .unwrap();
    assert!(decode.engine.cancel("later"));
    let f = failure(&decode, "later");
    assert_eq!(f.cause, FailureCause::Cancelled);
}

#[test]
fn a_response_from_a_part_stops_when_the_grown_hold_ends() {
    use kvlink::internal::tcp_wire as wire;
    use std::io::Write;
    // A reader that asks for the first part's blocks of every tensor and does not read the
    // answer: the server stalls on a full socket. The hold grows meanwhile (the response was
    // granted by the hold as it was before), then ends: the rest of the response is not sent,
    // whichever of the hold's grants allowed it.
    let prefill = side(&SHAPE, 16, Some(SEED), quick_config());
    let first: Vec<u32> = (0..8).collect();
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("grown", &first))
        .unwrap();
    let (data, _) = prefill.engine.descriptor().unwrap().tcp().unwrap();
    let mut d = std::net::TcpStream::connect(data).unwrap();
    let entries: Vec<wire::Entry> = prefill
        .layout
        .tensors
        .iter()
        .map(|t| wire::Entry {
            region: t.region,
            offset: t.offset,
            len: t.block_stride * 8,
        })
        .collect();
    let len: u64 = entries.iter().map(|e| e.len).sum();
    let mut req = Vec::new();
    let extras = wire::Extras::default();
    wire::encode_request(1, "grown", &extras, entries.into_iter(), &mut req);
    d.write_all(&req).unwrap();
    d.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(d.peek(&mut [0u8; 1]).unwrap() > 0, "the response started");
    prefill
        .engine
        .extend_hold("grown", &[(8..16).collect::<Vec<u32>>()])
        .unwrap();
    assert!(prefill.engine.release("grown"));
    let got = drain(&mut d);
    let whole = wire::RESPONSE_HEADER as u64 + len;
    assert!(
        got < whole,
        "{got} of {whole} bytes arrived after the hold ended"
    );
}

/// `layout` with only tensors `t` (to check some tensors of blocks and not others).
fn only(layout: &kvlink::KvLayout, t: std::ops::Range<usize>) -> kvlink::KvLayout {
    let mut l = layout.clone();
    l.tensors = l.tensors[t].to_vec();
    l
}

#[test]
fn a_step_made_final_a_group_of_layers_at_a_time_is_read_group_by_group() {
    for transport in [TransportChoice::Tcp, TransportChoice::Auto] {
        let (prefill, decode, peer) = pair(transport);
        let n = prefill.layout.tensors.len();
        let (local, remote) = ([3u32, 4, 5], [20u32, 21, 22]);
        decode
            .engine
            .follow(FollowRequest::blocks(&peer, "layers", &local))
            .unwrap();
        // One step: its blocks, the first quarter of the layers final.
        prefill
            .engine
            .hold_growing(HoldRequest::blocks("layers", &[]))
            .unwrap();
        let q = (n / 4) as u32;
        prefill
            .engine
            .extend_hold_tensors("layers", &[&remote[..]], 0..q)
            .unwrap();
        let tensors_hold = |t: std::ops::Range<usize>| {
            kvlink::verify::check_blocks(
                &decode.region,
                &only(&decode.layout, t.clone()),
                &only(&prefill.layout, t),
                SEED,
                &local,
                &remote,
            )
            .is_ok()
        };
        eventually("the first layers read", || tensors_hold(0..q as usize));
        // Only what was told is read: the other layers' bytes are not here yet.
        assert!(!tensors_hold(q as usize..n));
        assert!(
            prefill.engine.seal_hold("layers").is_err(),
            "layers to come"
        );
        let none: [&[u32]; 1] = [&[]];
        prefill
            .engine
            .extend_hold_tensors("layers", &none, q..n as u32)
            .unwrap();
        prefill.engine.seal_hold("layers").unwrap();
        let got = collect(&decode.engine, Duration::from_secs(30), |f| {
            !f.receiving.is_empty() || !f.failed.is_empty()
        });
        assert!(got.failed.is_empty(), "{transport:?}: {:?}", got.failed);
        verify(&decode, &prefill.layout, SEED, &local, &remote);
        assert_eq!(got.reports[0].bytes, 3 * SHAPE.region_bytes(1));
    }
}

/// The prefill worker of the test below, in a child process (`ChildPrefill`).
#[test]
#[ignore = "helper: run as a child process by the two-process tests"]
fn prefill_child() {
    prefill_child_main();
}

#[test]
fn a_prefill_killed_mid_prompt_fails_the_read_that_follows_it() {
    // A prefill in its own process holds the first half of the request's blocks and is
    // killed before the rest: the decode reads that half, then fails the read once the
    // prefill's control connection is gone (never received; the decode recomputes).
    let child = ChildPrefill::spawn(SHAPE.name, 8, SEED, 1, "tcp growing");
    let decode = side(&SHAPE, 8, None, config(TransportChoice::Tcp));
    let all: Vec<u32> = (0..8).collect();
    let req = FollowRequest::blocks(&child.addr, "req-0", &all);
    decode.engine.follow(req).unwrap();
    let layout = SHAPE.layout(kvlink::RegionId(1), 8);
    eventually("the first half read", || {
        let r = kvlink::verify::check_blocks(
            &decode.region,
            &decode.layout,
            &layout,
            SEED,
            &all[..4],
            &all[..4],
        );
        r.is_ok()
    });
    drop(child);
    let f = failure(&decode, "req-0");
    assert_eq!(f.cause, FailureCause::Connection, "{}", f.reason);
}

#[test]
fn a_hold_grows_on_after_its_reader_went_away_and_ends_at_its_lease() {
    let leased = config(TransportChoice::Tcp).with(|c| c.lease = Duration::from_secs(1));
    let prefill = side(&SHAPE, 16, Some(SEED), leased);
    let decode = side(&SHAPE, 16, None, config(TransportChoice::Tcp));
    let peer = prefill.engine.handshake_address().to_string();
    prefill
        .engine
        .hold_growing(HoldRequest::blocks("gone", &[1]))
        .unwrap();
    let req = FollowRequest::blocks(&peer, "gone", &[2, 3]);
    decode.engine.follow(req).unwrap();
    eventually("the first part read", || {
        holds(&decode, &prefill, &[2], &[1])
    });
    // The reader goes away (its engine closed, no abort sent): the hold grows on, and ends
    // at the reader's lease rather than its abort timeout.
    decode.engine.close();
    prefill.engine.extend_hold("gone", &[&[4u32][..]]).unwrap();
    prefill.engine.seal_hold("gone").unwrap();
    let f = collect(&prefill.engine, Duration::from_secs(20), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed[0].cause, FailureCause::Expired, "{f:?}");
    assert!(f.failed[0].reason.contains("lease"), "{f:?}");
}
