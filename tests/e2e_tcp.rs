//! Two engines in one process over TCP loopback: realistic layouts, random non-contiguous
//! blocks, many concurrent requests, every byte checked; argument refusals; prefill holds.

mod common;

use std::time::Duration;

use common::*;
use kvlink::{EngineConfig, Error, ModelShape, RequestId, Side as Dir};

/// The default configuration with TCP for reads (both engines share this host, where the
/// default would take the same-host path: tests/local.rs covers it).
fn tcp_config() -> EngineConfig {
    EngineConfig::default().with(|c| {
        c.transport = kvlink::TransportChoice::Tcp;
    })
}

fn run_transfer(
    shape: ModelShape,
    prefill_blocks: u32,
    decode_blocks: u32,
    requests: usize,
    per: usize,
) {
    let seed = 0xC0FFEE ^ u64::from(shape.layers);
    let prefill = side(&shape, prefill_blocks, Some(seed), tcp_config());
    let decode = side(&shape, decode_blocks, None, tcp_config());
    let peer = prefill.engine.handshake_address().to_string();
    let mut rng = Rng(42);
    let reqs = random_requests(&mut rng, decode_blocks, prefill_blocks, requests, per);
    for (i, (_, r)) in reqs.iter().enumerate() {
        prefill.engine.hold_blocks(format!("req-{i}"), r).unwrap();
    }
    // All requests start before the first handshake completes: one handshake serves them all.
    for (i, (l, r)) in reqs.iter().enumerate() {
        decode
            .engine
            .read_blocks(&peer, format!("req-{i}"), l, r)
            .unwrap();
    }
    let got = collect(&decode.engine, Duration::from_secs(60), |f| {
        f.receiving.len() + f.failed.len() == requests
    });
    assert!(got.failed.is_empty(), "failed: {:?}", got.failed);
    assert_eq!(got.receiving.len(), requests);
    for (i, (l, r)) in reqs.iter().enumerate() {
        verify(&decode, &prefill.layout, seed, l, r);
        assert!(got.receiving.contains(&RequestId::from(format!("req-{i}"))));
    }
    let bytes: u64 = got.reports.iter().map(|r| r.bytes).sum();
    assert_eq!(bytes, (requests * per) as u64 * shape.region_bytes(1));
    assert!(got
        .reports
        .iter()
        .all(|r| r.transport == "tcp" && r.segments > 0));
    got.reports.iter().for_each(check_timeline);
    // The prefill side hears about every read.
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
        f.sending.len() == requests
    });
    assert_eq!(sent.sending.len(), requests, "prefill saw {:?}", sent);
    let stats = prefill.engine.stats();
    assert_eq!(
        stats.handshakes_accepted, 1,
        "single-flight handshake: {stats:?}"
    );
    assert_eq!(served(&prefill.engine, bytes), bytes);
    assert_eq!(decode.engine.in_flight(), (0, 0));
}

#[test]
fn llama3_8b_random_blocks_concurrent() {
    run_transfer(ModelShape::LLAMA3_8B, 96, 160, 8, 16);
}

#[test]
fn deepseek_mla_random_blocks_concurrent() {
    run_transfer(ModelShape::DEEPSEEK_V3_MLA, 300, 256, 12, 20);
}

#[test]
fn immediate_refusals_name_the_problem() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 8, Some(1), tcp_config());
    let decode = side(&shape, 8, None, tcp_config());
    let peer = prefill.engine.handshake_address().to_string();
    let e = decode
        .engine
        .read_blocks(&peer, "a", &[1, 2], &[1])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("pair"),
        "{e}"
    );
    let e = decode
        .engine
        .read_blocks(&peer, "a", &[8], &[1])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_))
            && e.to_string().contains("local block id 8 is out of range"),
        "{e}"
    );
    let e = decode
        .engine
        .read_blocks(&peer, "a", &[1, 1], &[1, 2])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("twice"),
        "{e}"
    );
    let e = decode
        .engine
        .read_blocks(&peer, "", &[1], &[1])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("empty"),
        "{e}"
    );
    let long = "x".repeat(300);
    assert!(decode
        .engine
        .read_blocks(&peer, long.as_str(), &[1], &[1])
        .is_err());
    let bare = kvlink::Engine::start(tcp_config()).unwrap();
    let e = bare.read_blocks(&peer, "a", &[1], &[1]).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("set a KV layout"),
        "{e}"
    );

    // Remote ids are checked after the handshake: the request fails with the reason, and the
    // prefill side, holding that request, hears the abort.
    prefill.engine.hold_blocks("far", &[1]).unwrap();
    decode.engine.read_blocks(&peer, "far", &[1], &[9]).unwrap();
    let f = collect(&decode.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Other, "{f:?}");
    assert!(
        f.failed[0]
            .reason
            .contains("remote block id 9 is out of range"),
        "{:?}",
        f
    );
    let p = collect(&prefill.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(p.failed[0].side, Dir::Send);
    assert!(
        p.failed[0].reason.contains("aborted") && !p.failed[0].expired,
        "{:?}",
        p
    );
    assert_eq!(p.failed[0].cause, kvlink::FailureCause::Peer);
    // Once the session is cached, remote ids are checked at the call.
    let e = decode
        .engine
        .read_blocks(&peer, "far2", &[1], &[9])
        .unwrap_err();
    assert!(e.to_string().contains("remote block id 9"), "{e}");
    // A duplicate id while the first is in flight is refused (a silent peer keeps it there).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    decode
        .engine
        .read_blocks(&silent_addr, "dup", &[1], &[1])
        .unwrap();
    let e = decode
        .engine
        .read_blocks(&silent_addr, "dup", &[2], &[2])
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("already being received"),
        "{e}"
    );
    let f = collect(&decode.engine, Duration::from_secs(60), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed[0].id.as_str(), "dup");
    drop(silent);
}

#[test]
fn held_blocks_expire_when_never_read() {
    let prefill = side(&ModelShape::DEEPSEEK_V3_MLA, 4, Some(3), tcp_config());
    prefill
        .engine
        .hold_blocks_for("never-read", &[0], None, Some(Duration::from_millis(200)))
        .unwrap();
    assert!(prefill
        .engine
        .hold_blocks_for("never-read", &[0], None, Some(Duration::from_millis(200)))
        .is_err());
    assert!(prefill.engine.get_finished().is_empty());
    let f = collect(&prefill.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed.len(), 1);
    let fr = &f.failed[0];
    assert!(
        fr.expired && fr.side == Dir::Send && fr.id.as_str() == "never-read",
        "{fr:?}"
    );
    assert!(fr.reason.contains("abort timeout"), "{fr:?}");
    assert_eq!(fr.cause, kvlink::FailureCause::Expired);
    assert!(prefill.engine.get_finished().is_empty());
}

#[test]
fn incompatible_peer_fails_every_waiter_after_one_handshake() {
    let prefill = side(&ModelShape::LLAMA3_8B, 8, Some(5), tcp_config());
    let mut other = ModelShape::LLAMA3_8B;
    other.tokens_per_block = 24;
    let decode = side(&other, 8, None, tcp_config());
    let peer = prefill.engine.handshake_address().to_string();
    for i in 0..6u32 {
        prefill.engine.hold_blocks(format!("m{i}"), &[i]).unwrap();
        decode
            .engine
            .read_blocks(&peer, format!("m{i}"), &[i], &[i])
            .unwrap();
    }
    let f = collect(&decode.engine, Duration::from_secs(10), |f| {
        f.failed.len() == 6
    });
    assert_eq!(f.failed.len(), 6, "{f:?}");
    for fr in &f.failed {
        assert!(
            fr.reason.contains(
                "(its value vs yours): tokens_per_block 16 vs 24 (neither a multiple of the other)"
            ),
            "{fr:?}"
        );
        assert!(!fr.expired);
    }
    // The refused reads still free the prefill's blocks now, not at its abort timeout: their
    // aborts go out on a connection of their own, which the prefill refuses the same way.
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
        f.failed.len() == 6
    });
    assert_eq!(sent.failed.len(), 6, "{sent:?}");
    for fr in &sent.failed {
        assert!(!fr.expired && fr.side == Dir::Send, "{fr:?}");
        assert_eq!(fr.cause, kvlink::FailureCause::Peer, "{fr:?}");
        assert!(fr.reason.contains("handshake was refused"), "{fr:?}");
    }
    let s = prefill.engine.stats();
    assert_eq!(
        (s.handshakes_accepted, s.handshakes_refused),
        (0, 2),
        "{s:?}"
    );
}

#[test]
fn caller_owned_memory_is_served_and_deregistration_waits_for_it() {
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    let blocks = 8;
    // The prefill cache is a plain Vec owned by the test (as an engine's KV cache would be).
    let mut cache = vec![0u8; shape.region_bytes(blocks) as usize];
    kvlink::verify::pattern_into(17, 0, &mut cache);
    let prefill = kvlink::Engine::start(tcp_config()).unwrap();
    // SAFETY: `cache` outlives the engine (dropped after it at the end of this function) and
    // is not touched by the test while registered.
    let mem =
        unsafe { kvlink::ExternalMemory::new(cache.as_mut_ptr(), cache.len() as u64) }.unwrap();
    let region = prefill.register_host(mem).unwrap();
    assert_eq!(region.kind(), kvlink::MemoryKind::HostExternal);
    let layout = shape.layout(region.id(), blocks);
    prefill.set_layout(layout.clone()).unwrap();
    let decode = side(&shape, blocks, None, tcp_config());
    let peer = prefill.handshake_address().to_string();
    prefill.hold_blocks("ext", &[5, 1, 6]).unwrap();
    decode
        .engine
        .read_blocks(&peer, "ext", &[0, 7, 3], &[5, 1, 6])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &layout, 17, &[0, 7, 3], &[5, 1, 6]);
    // The layout's region cannot go; an extra region can, once unused.
    let e = prefill.deregister(region.id()).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("used by the KV layout"),
        "{e}"
    );
    // Deregistration waits while a user (here the handle, as a transfer holds it) remains.
    let prefill = std::sync::Arc::new(prefill);
    let extra = prefill.allocate_host(4096, false).unwrap();
    let id = extra.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let waiter = {
        let prefill = prefill.clone();
        std::thread::spawn(move || {
            let r = prefill.deregister(id);
            done_tx.send(()).unwrap();
            r
        })
    };
    // Not exported any more as soon as deregistration starts...
    let unexported = || {
        !prefill
            .descriptor()
            .unwrap()
            .regions
            .iter()
            .any(|r| r.id == id)
    };
    let t0 = std::time::Instant::now();
    while !unexported() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(unexported());
    // ...but the call does not return while the region is in use.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        done_rx.try_recv().is_err(),
        "deregister returned while the region was still in use"
    );
    drop(extra);
    done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("deregister returns once the last user is gone");
    waiter.join().unwrap().unwrap();
    assert!(matches!(
        prefill.deregister(id),
        Err(Error::UnknownRegion(_))
    ));
    assert!(!prefill
        .descriptor()
        .unwrap()
        .regions
        .iter()
        .any(|r| r.id == id));
    drop(std::sync::Arc::into_inner(prefill).expect("the waiter thread ended"));
    drop(cache);
}

#[test]
fn close_ends_reads_in_flight_and_closes_the_ports() {
    let shape = ModelShape::LLAMA3_8B;
    // A peer that accepts and never answers keeps the read in flight.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let decode = side(&shape, 4, None, tcp_config());
    decode
        .engine
        .read_blocks(&silent_addr, "in-flight", &[0], &[0])
        .unwrap();
    let control = decode.engine.handshake_address();
    decode.engine.close();
    assert!(decode.engine.is_closed());
    let f = collect(&decode.engine, Duration::from_secs(10), |f| !f.is_empty());
    assert_eq!(f.failed.len(), 1, "{f:?}");
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Other, "{f:?}");
    assert!(f.failed[0].reason.contains("shutting down"), "{f:?}");
    assert!(matches!(
        decode.engine.read_blocks(&silent_addr, "late", &[1], &[1]),
        Err(Error::Shutdown)
    ));
    assert!(
        decode.engine.get_finished().is_empty(),
        "a refused call leaves nothing"
    );
    assert!(
        std::net::TcpStream::connect(control).is_err(),
        "the handshake port is closed"
    );
    decode.engine.close(); // idempotent
    drop(silent);
}

#[test]
fn a_cancelled_read_fails_at_once_and_its_id_is_free_again() {
    let shape = ModelShape::DEEPSEEK_V3_MLA;
    // A peer that accepts and never answers: only the cancel (or the 5 s handshake timeout,
    // whose reason differs) can end the read.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let decode = side(&shape, 4, None, tcp_config());
    assert!(!decode.engine.cancel("never-started"));
    for round in 0..2 {
        decode
            .engine
            .read_blocks(&silent_addr, "c1", &[0], &[0])
            .unwrap();
        assert!(decode.engine.cancel("c1"), "round {round}: in flight");
        let f = collect(&decode.engine, Duration::from_secs(10), |f| !f.is_empty());
        let fr = &f.failed[0];
        assert_eq!(fr.cause, kvlink::FailureCause::Cancelled, "{fr:?}");
        assert!(fr.reason.contains("cancelled") && !fr.expired, "{fr:?}");
        assert!(!decode.engine.cancel("c1"), "round {round}: finished");
        assert_eq!(decode.engine.in_flight(), (0, 0));
    }
    drop(silent);
}

#[test]
fn a_decode_reads_under_its_own_id_and_rejects_or_releases_free_a_hold() {
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 8, Some(11), tcp_config());
    let decode = side(&shape, 8, None, tcp_config());
    let peer = prefill.engine.handshake_address().to_string();
    // The prefill holds under its id, the decode tracks, reports and cancels under its own.
    prefill.engine.hold_blocks("prefill-1", &[5, 2]).unwrap();
    decode
        .engine
        .read_blocks_as(&peer, "decode-1", "prefill-1", &[0, 1], &[5, 2])
        .unwrap();
    let got = collect(&decode.engine, Duration::from_secs(30), |f| {
        !f.receiving.is_empty() || !f.failed.is_empty()
    });
    assert_eq!(got.receiving, vec![RequestId::from("decode-1")], "{got:?}");
    assert_eq!(got.reports[0].peer, peer);
    verify(&decode, &prefill.layout, 11, &[0, 1], &[5, 2]);
    let sent = collect(&prefill.engine, Duration::from_secs(10), |f| {
        !f.sending.is_empty()
    });
    assert_eq!(sent.sending, vec![RequestId::from("prefill-1")]);
    assert!(decode
        .engine
        .read_blocks_as(&peer, "decode-2", "", &[0], &[0])
        .is_err());

    // Rejected by the decode: the prefill's send fails at once, long before its timeout.
    prefill
        .engine
        .hold_blocks_for("prefill-2", &[1], None, Some(Duration::from_secs(300)))
        .unwrap();
    decode
        .engine
        .reject(&peer, "prefill-2", None, "refused")
        .unwrap();
    let f = collect(&prefill.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed[0].id.as_str(), "prefill-2");
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Peer);
    assert!(f.failed[0].reason.contains("refused"), "{f:?}");

    // Released by the prefill: nothing reported, and a read is refused.
    prefill.engine.hold_blocks("prefill-3", &[3]).unwrap();
    assert!(prefill.engine.release("prefill-3"));
    assert!(!prefill.engine.release("prefill-3"));
    decode
        .engine
        .read_blocks(&peer, "prefill-3", &[2], &[3])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(10), |f| {
        !f.failed.is_empty()
    });
    assert_eq!(f.failed[0].cause, kvlink::FailureCause::Peer, "{f:?}");
    assert!(f.failed[0].reason.contains("not held"), "{f:?}");
    assert!(prefill.engine.get_finished().is_empty());
    let totals = prefill.engine.stats().totals;
    assert_eq!(
        (totals.sends_done, totals.sends_failed),
        (1, 1),
        "{totals:?}"
    );
    assert_eq!(decode.engine.stats().totals.reads_done, 1);
}

/// Waits until `engine` has taken at least `n` messages (or `limit` passed).
fn take_messages(engine: &kvlink::Engine, n: usize, limit: Duration) -> Vec<kvlink::PeerMessage> {
    let end = std::time::Instant::now() + limit;
    let mut got = Vec::new();
    while got.len() < n && std::time::Instant::now() < end {
        got.extend(engine.take_messages());
        std::thread::sleep(Duration::from_millis(5));
    }
    got
}

#[test]
fn application_messages_arrive_in_order_both_ways_with_the_senders_engine_id() {
    let shape = ModelShape::LLAMA3_8B;
    let a = side(&shape, 4, None, tcp_config());
    let b = side(&shape, 4, None, tcp_config());
    let (a_addr, b_addr) = (
        a.engine.handshake_address().to_string(),
        b.engine.handshake_address().to_string(),
    );
    // A first contact: the first messages wait for the session, later ones queue behind them.
    for i in 0..300u32 {
        a.engine
            .send_message(&b_addr, i.to_be_bytes().to_vec())
            .unwrap();
    }
    let big = vec![0xabu8; kvlink::MAX_MESSAGE_BYTES];
    a.engine.send_message(&b_addr, big.clone()).unwrap();
    b.engine.send_message(&a_addr, b"back".to_vec()).unwrap();
    let got = take_messages(&b.engine, 301, Duration::from_secs(20));
    assert_eq!(got.len(), 301);
    for (i, m) in got.iter().take(300).enumerate() {
        assert_eq!(m.body, (i as u32).to_be_bytes(), "message {i} out of order");
        assert_eq!(m.from, a.engine.engine_id());
    }
    assert_eq!(got[300].body, big);
    let back = take_messages(&a.engine, 1, Duration::from_secs(20));
    assert_eq!(back[0].body, b"back");
    assert_eq!(back[0].from, b.engine.engine_id());
    let s = a.engine.stats();
    assert_eq!((s.messages_sent, s.messages_unsent), (301, 0));
    assert_eq!(b.engine.stats().messages_received, 301);

    // Too large: refused on the spot. Unreachable peer: counted as unsent, nothing blocks.
    let e = a
        .engine
        .send_message(&b_addr, vec![0; kvlink::MAX_MESSAGE_BYTES + 1])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    a.engine.send_message(&dead_addr, b"lost".to_vec()).unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(20);
    while a.engine.stats().messages_unsent == 0 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(a.engine.stats().messages_unsent, 1);
}

#[test]
fn open_reads_are_confirmed_without_a_hold() {
    // Benchmarks serve any exported byte without a hold (`kvlink-bench serve`): a read of a
    // request never held is still confirmed, so it is reported received.
    let shape = ModelShape::LLAMA3_8B;
    let open = tcp_config().with(|c| {
        c.open_reads = true;
    });
    let prefill = side(&shape, 8, Some(3), open);
    let decode = side(&shape, 8, None, tcp_config());
    let peer = prefill.engine.handshake_address().to_string();
    decode
        .engine
        .read_blocks(&peer, "open", &[1, 2], &[5, 6])
        .unwrap();
    let f = collect(&decode.engine, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 3, &[1, 2], &[5, 6]);
}

#[test]
fn session_state_follows_a_peer_up_and_down() {
    use kvlink::SessionState;
    let shape = ModelShape::LLAMA3_8B;
    let prefill = side(&shape, 4, None, tcp_config());
    let decode = side(&shape, 4, None, tcp_config());
    let peer = prefill.engine.handshake_address().to_string();
    assert_eq!(decode.engine.session_state(&peer), SessionState::None);
    decode
        .engine
        .connect(&peer, Duration::from_secs(10))
        .unwrap();
    assert_eq!(decode.engine.session_state(&peer), SessionState::Up);
    // The prefill goes away: its connections close, and the decode's session is down, with a
    // reason, without anyone waiting on it. The reaper closes a broken session nothing uses at
    // its next tick (every 5 s here), which may come before this loop looks again: then the
    // engine knows no session at all (None). Either way it is no longer up.
    prefill.engine.close();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let state = loop {
        let s = decode.engine.session_state(&peer);
        if s != SessionState::Up || std::time::Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        matches!(&state, SessionState::Down(why) if why.contains("session ended"))
            || state == SessionState::None,
        "{state:?}"
    );
    // A connect that fails says why.
    assert!(decode
        .engine
        .connect(&peer, Duration::from_secs(5))
        .is_err());
    assert!(
        matches!(decode.engine.session_state(&peer), SessionState::Down(why) if !why.is_empty())
    );
}

#[test]
fn an_idle_session_closes_in_order_and_the_readers_holds_keep_their_abort_timeout() {
    use kvlink::SessionState;
    let shape = ModelShape::LLAMA3_8B;
    let lease = Duration::from_millis(500);
    let prefill = side(
        &shape,
        8,
        Some(3),
        tcp_config().with(|c| {
            c.lease = lease;
        }),
    );
    let decode_config = tcp_config().with(|c| {
        c.engine_id = Some("idle-decode".into());
        c.session_idle = Duration::from_millis(300);
    });
    let decode = side(&shape, 8, None, decode_config);
    let (p, d) = (&prefill.engine, &decode.engine);
    let peer = p.handshake_address().to_string();
    p.hold_blocks_for("first", &[1, 2], Some("idle-decode"), None)
        .unwrap();
    d.read_blocks(&peer, "first", &[1, 2], &[1, 2]).unwrap();
    let f = collect(d, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    assert_eq!((d.stats().sessions, d.stats().sessions_opened), (1, 1));
    p.hold_blocks_for("later", &[3], Some("idle-decode"), None)
        .unwrap();
    eventually("the idle session closed", || {
        d.stats().sessions_closed_idle == 1
    });
    assert_eq!(d.stats().sessions, 0);
    assert_eq!(d.session_state(&peer), SessionState::None);
    eventually("the prefill's control connection closed", || {
        p.stats().control_connections == 0
    });
    // Closed in order, the reader is not gone: its hold outlives the lease many times over.
    std::thread::sleep(lease * 4);
    let f = p.get_finished();
    assert!(f.failed.is_empty(), "no lease for an idle close: {f:?}");
    assert_eq!(p.in_flight().1, 1, "later is still held");
    // The next read opens a new session.
    d.read_blocks(&peer, "later", &[3], &[3]).unwrap();
    let f = collect(d, Duration::from_secs(20), |f| !f.is_empty());
    assert_eq!(f.receiving.len(), 1, "{f:?}");
    verify(&decode, &prefill.layout, 3, &[3], &[3]);
    assert_eq!(d.stats().sessions_opened, 2, "rebuilt on demand");
    let f = collect(p, Duration::from_secs(10), |f| !f.sending.is_empty());
    assert_eq!(f.sending, ["later".into()], "{f:?}");
}
