//! The pair harness's tests: completion, retries, failures, cancels, connects and the aborts of
//! reads without a session, on tokio's paused clock.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_read_completes_and_the_prefill_side_finishes_sending() {
    let p = Pair::new(&[]);
    p.read("r1", &[0, 5, 3], &[9, 1, 15]).await;
    let d = p.decode_finished();
    assert_eq!(d.receiving, vec![RequestId::from("r1")], "{d:?}");
    assert_eq!(d.reports[0].blocks, 3);
    assert_eq!(d.reports[0].transport, "memory");
    assert!(p.holds(&[0, 5, 3], &[9, 1, 15]));
    let s = p.prefill_finished();
    assert_eq!(s.sending, vec![RequestId::from("r1")], "{s:?}");
    assert_eq!(p.connects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_lost_connection_is_retried_once_on_a_new_session() {
    let p = Pair::new(&[Fault::FailAfter(0), Fault::None]);
    p.read("r1", &[0, 2], &[1, 3]).await;
    let d = p.decode_finished();
    assert_eq!(d.receiving, vec![RequestId::from("r1")], "{d:?}");
    assert_eq!(p.connects(), 2);
    assert!(p.holds(&[0, 2], &[1, 3]));
    assert_eq!(p.prefill_finished().sending, vec![RequestId::from("r1")]);
}

#[tokio::test(start_paused = true)]
async fn a_transport_failure_fails_the_read_and_aborts_the_send() {
    // Lost twice: the first attempt and its one retry.
    let p = Pair::new(&[Fault::FailAfter(1), Fault::FailAfter(0)]);
    p.read("r1", &[0, 2, 4], &[1, 3, 5]).await;
    let d = p.decode_finished();
    assert!(d.receiving.is_empty(), "{d:?}");
    let f = &d.failed[0];
    assert_eq!(
        (f.side, f.expired, f.cause),
        (Side::Recv, false, FailureCause::Connection)
    );
    assert!(f.reason.contains("injected failure after 1 reads"), "{f:?}");
    assert!(f.reason.contains("retried once on a new session"), "{f:?}");
    assert_eq!(p.connects(), 2);
    // The prefill learns of it at once (not at its abort timeout), with the reason.
    let s = p.prefill_finished();
    assert_eq!(s.failed.len(), 1, "{s:?}");
    assert_eq!(s.failed[0].cause, FailureCause::Peer);
    assert!(s.failed[0].reason.contains("injected failure"), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_read_stops_at_once_and_tells_the_prefill() {
    let p = Arc::new(Pair::new(&[Fault::Delay(Duration::from_secs(5))]));
    let t0 = tokio::time::Instant::now();
    let reading = {
        let p = p.clone();
        tokio::spawn(async move { p.read("r1", &[0, 1], &[2, 3]).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(p.decode.state.cancel_read(&"r1".into()), "in flight");
    reading.await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let d = p.decode_finished();
    let f = &d.failed[0];
    assert_eq!(
        (f.cause, f.expired),
        (FailureCause::Cancelled, false),
        "{f:?}"
    );
    assert!(f.reason.contains("cancelled"), "{f:?}");
    assert!(!p.holds(&[0, 1], &[2, 3]), "nothing was written");
    let s = p.prefill_finished();
    assert_eq!(s.failed[0].cause, FailureCause::Peer, "{s:?}");
    assert!(s.failed[0].reason.contains("cancelled"), "{s:?}");
    assert!(
        !p.decode.state.cancel_read(&"r1".into()),
        "no longer in flight"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hung_transport_expires_the_read_at_its_deadline() {
    let p = Pair::new(&[Fault::Hang]);
    let t0 = tokio::time::Instant::now();
    p.read("r1", &[0], &[1]).await;
    let took = t0.elapsed();
    let timeout = p.decode.state.config().request_timeout;
    assert!(
        took >= timeout && took < timeout + crate::session::transfer::BACKSTOP,
        "{took:?}"
    );
    let d = p.decode_finished();
    let f = &d.failed[0];
    assert!(f.expired && f.cause == FailureCause::Expired, "{f:?}");
    assert!(f.reason.contains("request timeout of 10s"), "{f:?}");
    assert!(!p.holds(&[0], &[1]), "nothing was written");
    let s = p.prefill_finished();
    assert_eq!(
        s.failed[0].cause,
        FailureCause::Peer,
        "aborted, not left to expire"
    );
}

#[tokio::test(start_paused = true)]
async fn a_slow_transport_within_the_deadline_completes() {
    let p = Pair::new(&[Fault::Delay(Duration::from_secs(9))]);
    let t0 = tokio::time::Instant::now();
    p.read("r1", &[7], &[8]).await;
    assert_eq!(t0.elapsed(), Duration::from_secs(9));
    let d = p.decode_finished();
    assert_eq!(d.receiving.len(), 1, "{d:?}");
    assert!(p.holds(&[7], &[8]));
}

#[tokio::test(start_paused = true)]
async fn a_read_whose_hold_ended_mid_read_fails_unconfirmed_never_received() {
    // The transport delivers every byte (as an RDMA read does, which no grant stops), but the
    // prefill released the hold while the read was in flight: its blocks may hold another
    // request's KV by then. The prefill refuses the Done, and the read fails.
    let p = Arc::new(Pair::new(&[Fault::Delay(Duration::from_secs(4))]));
    let read = {
        let p = p.clone();
        tokio::spawn(async move { p.read("r1", &[7], &[8]).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(p.prefill.completions().release(&RequestId::from("r1")));
    read.await.unwrap();
    let d = p.decode_finished();
    assert!(d.receiving.is_empty(), "{d:?}");
    assert_eq!(d.failed.len(), 1, "{d:?}");
    assert_eq!(d.failed[0].cause, FailureCause::Unconfirmed, "{d:?}");
    assert!(d.failed[0].reason.contains("no longer held"), "{d:?}");
    assert!(!d.failed[0].expired);
}

#[tokio::test(start_paused = true)]
async fn a_release_during_a_pinned_read_waits_for_it_and_the_read_gets_the_held_bytes() {
    // As over RDMA, the transport copies whatever the prefill's blocks hold when it runs (4 s
    // in), and nothing the prefill does stops it. The read pinned the hold as it started; the
    // prefill releases it 2 s in, and overwrites the blocks as soon as the release returns, as
    // its scheduler would reuse them. The release waits for the read's notice, so the read
    // copies the held bytes and is received. (A release that did not wait for the pin let the
    // read copy the new bytes, and the pin confirmed them.)
    let p = Arc::new(Pair::pinning(
        &[Fault::Delay(Duration::from_secs(4))],
        Duration::from_secs(60),
    ));
    let read = {
        let p = p.clone();
        tokio::spawn(async move { p.read("r1", &[7], &[8]).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    // On a thread of its own: the runtime's clock goes on while the release waits.
    let release = {
        let p = p.clone();
        std::thread::spawn(move || {
            let held = p.prefill.completions().release(&RequestId::from("r1"));
            let layout = p.prefill.layout().unwrap();
            let region = p.prefill.region(layout.tensors[0].region).unwrap();
            region
                .write_at(0, &vec![0xEE; region.len() as usize])
                .unwrap();
            held
        })
    };
    // The runtime's clock stands still until the release has begun (its grant ended).
    let id = RequestId::from("r1");
    let ended = || {
        let grant = p.prefill.completions().update(|t| t.grant_for(&id, None));
        grant.is_ok_and(|g| g.is_ended())
    };
    while !ended() {
        std::thread::sleep(Duration::from_millis(1));
    }
    read.await.unwrap();
    let d = p.decode_finished();
    assert_eq!(d.receiving, vec![RequestId::from("r1")], "{d:?}");
    assert!(p.holds(&[7], &[8]), "the bytes held when the read ran");
    assert!(release.join().unwrap(), "it was held");
    assert!(p.prefill_finished().is_empty(), "a release reports nothing");
    assert_eq!(p.prefill.counters().reads_pinned.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_read_longer_than_its_pin_is_confirmed_by_its_done() {
    // The pin lapses before the read's bytes are in (4 s against 1): the read is not counted
    // on it, and its Done confirms it as before, the hold being live.
    let p = Pair::pinning(
        &[Fault::Delay(Duration::from_secs(4))],
        Duration::from_secs(1),
    );
    p.read("r1", &[7], &[8]).await;
    let d = p.decode_finished();
    assert_eq!(d.receiving.len(), 1, "{d:?}");
    assert_eq!(p.prefill_finished().sending.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_confirmed_read_is_received_and_the_send_done() {
    let p = Pair::new(&[]);
    p.read("r1", &[3], &[4]).await;
    assert_eq!(p.decode_finished().receiving.len(), 1);
    assert_eq!(p.prefill_finished().sending.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_broken_session_is_rebuilt_with_a_new_generation() {
    // The first read fails on two sessions (its retry included); the next gets a third.
    let p = Pair::new(&[Fault::FailAfter(0), Fault::FailAfter(0), Fault::None]);
    p.read("r1", &[0], &[1]).await;
    assert_eq!(p.decode_finished().failed.len(), 1);
    let first = p.decode.ready_conn(PEER);
    assert!(first.is_none(), "a broken session is not handed out");
    p.read("r2", &[2], &[3]).await;
    let d = p.decode_finished();
    assert_eq!(d.receiving, vec![RequestId::from("r2")], "{d:?}");
    assert_eq!(p.connects(), 3);
    let conn = p.decode.ready_conn(PEER).unwrap();
    assert_eq!(conn.generation, 3);
    assert!(p.holds(&[2], &[3]));
}

#[tokio::test(start_paused = true)]
async fn concurrent_first_contacts_share_one_connect() {
    let p = Arc::new(Pair::new(&[]));
    let reads: Vec<_> = (0..6u32)
        .map(|i| {
            let p = p.clone();
            tokio::spawn(async move { p.read(&format!("r{i}"), &[i], &[i + 8]).await })
        })
        .collect();
    for r in reads {
        r.await.unwrap();
    }
    assert_eq!(p.decode_finished().receiving.len(), 6);
    assert_eq!(p.connects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_connect_is_remembered_for_500_ms_then_retried() {
    let p = Pair::new(&[]);
    p.script.lock().fail_connects = 1;
    p.read("r1", &[0], &[0]).await;
    tokio::time::sleep(Duration::from_millis(499)).await;
    p.read("r2", &[1], &[1]).await;
    let d = p.decode_finished();
    assert_eq!(d.failed.len(), 2, "{d:?}");
    assert!(d
        .failed
        .iter()
        .all(|f| f.cause == FailureCause::Connection
            && f.reason.contains("injected connect failure")));
    assert_eq!(
        p.connects(),
        1,
        "the second read got the remembered failure"
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    p.read("r3", &[2], &[2]).await;
    assert_eq!(p.decode_finished().receiving.len(), 1);
    assert_eq!(p.connects(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_refused_session_still_frees_the_prefills_blocks() {
    let p = Pair::new(&[]);
    p.script.lock().refuse_connects = true;
    p.read("r1", &[0], &[0]).await;
    p.read("r2", &[1], &[1]).await;
    let d = p.decode_finished();
    assert_eq!(d.failed.len(), 2, "{d:?}");
    assert!(
        d.failed
            .iter()
            .all(|f| f.cause == FailureCause::Connection && f.reason.contains("refused")),
        "{d:?}"
    );
    // The aborts go out together on a connection of their own, once gathered (20 ms).
    tokio::time::sleep(Duration::from_millis(25)).await;
    assert_eq!(p.script.lock().aborts_sent, 2);
    let f = p.prefill_finished();
    assert_eq!(f.failed.len(), 2, "the prefill frees both holds now: {f:?}");
    assert!(f.failed.iter().all(|r| !r.expired), "{f:?}");
    assert_eq!(p.prefill.completions().read(|t| t.holding()), 0);
}

#[tokio::test(start_paused = true)]
async fn a_failed_connect_tells_no_one_but_spends_no_connect() {
    let p = Pair::new(&[]);
    p.script.lock().fail_connects = 1;
    p.read("r1", &[0], &[0]).await;
    tokio::time::sleep(Duration::from_millis(25)).await;
    // Unanswered: no connection of its own is tried, and the remembered failure spares a
    // second connect; the prefill frees the blocks at its abort timeout.
    assert_eq!(p.script.lock().aborts_sent, 0);
    assert_eq!(p.connects(), 1);
    assert_eq!(p.prefill.completions().read(|t| t.holding()), 1);
}

#[tokio::test(start_paused = true)]
async fn a_connect_that_never_finishes_fails_within_its_bound() {
    let p = Pair::new(&[]);
    p.script.lock().hang_connects = true;
    let t0 = tokio::time::Instant::now();
    // The read gives up at its own deadline (10 s)...
    p.read("r1", &[0], &[0]).await;
    let cfg = p.decode.state.config().clone();
    assert_eq!(t0.elapsed(), cfg.request_timeout);
    let d = p.decode_finished();
    assert!(d.failed[0].expired, "{d:?}");
    assert_eq!(d.failed[0].cause, FailureCause::Expired, "{d:?}");
    assert!(
        d.failed[0].reason.contains("connecting to prefill:1"),
        "{d:?}"
    );
    // ...and the connect itself at its bound (25 s): the next read fails at once with that
    // reason instead of waiting on a connect that never ends.
    let bound = cfg.connect_timeout * 2 + cfg.handshake_timeout * 3;
    tokio::time::sleep_until(t0 + bound).await;
    tokio::task::yield_now().await;
    let t1 = tokio::time::Instant::now();
    p.read("r2", &[1], &[1]).await;
    assert_eq!(t1.elapsed(), Duration::ZERO);
    let d = p.decode_finished();
    assert_eq!(d.failed[0].cause, FailureCause::Connection, "{d:?}");
    assert!(d.failed[0].reason.contains("(all steps)"), "{d:?}");
    assert!(!d.failed[0].expired, "{d:?}");
    assert_eq!(p.connects(), 1);
}

#[test]
fn region_ids_in_the_harness_match_the_layout() {
    // The harness relies on both engines numbering their first region 1.
    let e = engine("x", None, Duration::ZERO);
    assert_eq!(e.layout().unwrap().tensors[0].region, RegionId(1));
}

#[tokio::test(start_paused = true)]
async fn a_read_names_its_reader_so_the_hold_ends_on_that_readers_lease() {
    // An unnamed hold learns its reader from the read itself (a `Reading` notice: over RDMA
    // nothing else reaches the prefill). The decode's control session then ends and it does
    // not come back: the hold ends at the lease, and the read, whose bytes arrive later, is
    // refused its confirmation.
    let p = Arc::new(Pair::new(&[Fault::Delay(Duration::from_secs(4))]));
    p.prefill
        .completions()
        .update(|t| t.reader_connected("decode"));
    let read = {
        let p = p.clone();
        tokio::spawn(async move { p.read("r1", &[7], &[8]).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let gone = std::time::Instant::now();
    let lease = p.prefill.config().lease;
    p.prefill.completions().update(|t| {
        t.reader_disconnected("decode", gone);
        assert_eq!(
            t.next_deadline(),
            Some(gone + lease),
            "admitted by its Reading"
        );
        t.poll(gone + lease);
    });
    let s = p.prefill_finished();
    assert_eq!(s.failed.len(), 1, "{s:?}");
    assert!(s.failed[0].expired, "{s:?}");
    assert_eq!(s.failed[0].cause, FailureCause::Expired, "{s:?}");
    assert!(s.failed[0].reason.contains("lease"), "{s:?}");
    read.await.unwrap();
    let d = p.decode_finished();
    assert!(d.receiving.is_empty(), "{d:?}");
    assert_eq!(d.failed[0].cause, FailureCause::Unconfirmed, "{d:?}");
}

/// The pair's decode as the prefill's control server sees it: one session accepted (the
/// harness connects in memory, so the test opens it).
fn session_seen_by_prefill(p: &Pair) {
    p.prefill
        .completions()
        .update(|t| t.reader_connected("decode"));
}

#[tokio::test(start_paused = true)]
async fn an_idle_session_closes_in_order_and_the_next_read_opens_another() {
    let p = Pair::new(&[]);
    let limit = Duration::from_secs(10);
    session_seen_by_prefill(&p);
    p.read("r1", &[0], &[1]).await;
    assert_eq!(p.decode.up(), 1);
    // A hold the decode will read later, after its session closed.
    let made = std::time::Instant::now();
    let abort = Duration::from_secs(60);
    p.prefill
        .hold("r2".into(), &[[2]], Some("decode".into()), abort, None)
        .unwrap();
    p.decode.close_unused(limit).await;
    tokio::time::advance(limit - Duration::from_millis(1)).await;
    p.decode.close_unused(limit).await;
    assert_eq!(p.decode.up(), 1, "not yet idle for the whole limit");
    tokio::time::advance(Duration::from_millis(1)).await;
    p.decode.close_unused(limit).await;
    assert_eq!(p.decode.up(), 0, "closed");
    assert_eq!(p.decode.state(PEER), crate::SessionState::None);
    assert_eq!(p.script.lock().byes, 1, "the prefill was told");
    let closed = &p.decode.state.counters().sessions_closed_idle;
    assert_eq!(closed.load(Ordering::Relaxed), 1);
    // Told in order, the prefill keeps the hold on its abort timeout, not the 30 s lease.
    let deadline = p.prefill.completions().read(|t| t.next_deadline()).unwrap();
    assert!(
        deadline >= made + abort,
        "no lease (30 s) for an idle close: {:?}",
        deadline - made
    );
    // The next read opens a new session and goes through.
    p.read("r3", &[4], &[5]).await;
    assert_eq!(p.connects(), 2, "rebuilt on demand");
    let d = p.decode_finished();
    assert_eq!(d.receiving.len(), 2, "{d:?}");
    assert!(p.holds(&[4], &[5]));
}

#[tokio::test(start_paused = true)]
async fn a_session_a_read_holds_is_never_idle() {
    let p = Arc::new(Pair::new(&[Fault::Delay(Duration::from_secs(8))]));
    let limit = Duration::from_secs(2);
    let reading = {
        let p = p.clone();
        tokio::spawn(async move { p.read("r1", &[0], &[1]).await })
    };
    for _ in 0..14 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        p.decode.close_unused(limit).await;
        assert_eq!(p.decode.up(), 1, "the read holds it");
    }
    reading.await.unwrap();
    assert_eq!(p.decode_finished().receiving.len(), 1);
    assert_eq!(p.script.lock().byes, 0);
    // Idle from the first tick after the read ended: closed a whole limit later.
    p.decode.close_unused(limit).await;
    tokio::time::advance(limit).await;
    p.decode.close_unused(limit).await;
    assert_eq!(p.decode.up(), 0);
    assert_eq!(p.script.lock().byes, 1);
}

#[tokio::test(start_paused = true)]
async fn the_reaper_closes_idle_sessions_on_its_own() {
    let p = Pair::new(&[]);
    let limit = p.decode.state.config().session_idle;
    assert_eq!(limit, Duration::from_secs(120), "the default");
    p.decode.spawn_reaper(&tokio::runtime::Handle::current());
    p.read("r1", &[0], &[1]).await;
    tokio::time::sleep(limit).await;
    assert_eq!(p.decode.up(), 1, "within a tick of the limit");
    tokio::time::sleep(crate::session::idle::tick_period(limit) * 2).await;
    assert_eq!(p.decode.up(), 0);
    assert_eq!(p.script.lock().byes, 1);
}

#[tokio::test(start_paused = true)]
async fn a_broken_session_nothing_uses_is_closed_at_the_next_tick() {
    // Lost on both attempts: the read fails and its session stays broken in the cache.
    let p = Pair::new(&[Fault::FailAfter(0), Fault::FailAfter(0)]);
    p.read("r1", &[0], &[1]).await;
    assert_eq!(p.decode_finished().failed.len(), 1);
    assert!(matches!(p.decode.state(PEER), crate::SessionState::Down(_)));
    // Closed at once, whatever the idle limit (zero: none), and not counted as idle.
    p.decode.close_unused(Duration::ZERO).await;
    assert_eq!(p.decode.state(PEER), crate::SessionState::None);
    assert_eq!(p.script.lock().byes, 1, "told in order");
    let closed = &p.decode.state.counters().sessions_closed_idle;
    assert_eq!(closed.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn without_an_idle_limit_a_healthy_session_stays() {
    let p = Pair::new(&[]);
    p.read("r1", &[0], &[1]).await;
    for _ in 0..10 {
        tokio::time::advance(Duration::from_secs(3600)).await;
        p.decode.close_unused(Duration::ZERO).await;
    }
    assert_eq!(p.decode.up(), 1);
    assert_eq!(p.script.lock().byes, 0);
}

#[tokio::test(start_paused = true)]
async fn a_read_stops_when_its_control_connection_goes_and_is_retried_on_a_new_session() {
    // The first session's transport would take 5 s; its control connection goes after 1 s.
    let p = Arc::new(Pair::new(&[
        Fault::Delay(Duration::from_secs(5)),
        Fault::None,
    ]));
    let t0 = tokio::time::Instant::now();
    let reading = {
        let p = p.clone();
        tokio::spawn(async move { p.read("r1", &[0, 1], &[2, 3]).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first = p.decode.ready_conn(PEER).expect("the first session is up");
    assert!(first.control.close(Duration::from_secs(1)).await);
    reading.await.unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "stopped at once, not at the first transport's 5 s: {:?}",
        t0.elapsed()
    );
    assert_eq!(p.connects(), 2, "retried on a new session");
    let d = p.decode_finished();
    assert_eq!(d.receiving, vec![RequestId::from("r1")], "{d:?}");
    assert!(p.holds(&[0, 1], &[2, 3]));
}
