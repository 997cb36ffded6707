//! Tests of `crate::completion::tracker`.

use super::*;
use crate::completion::{Announcement, Follower};
use crate::error::RefusalKind;

fn rd(engine: &str) -> Reader {
    Reader {
        engine: engine.into(),
        tp: TpRank::SOLO,
    }
}

fn report(id: &str) -> TransferReport {
    TransferReport {
        id: id.into(),
        peer: "127.0.0.1:1".into(),
        bytes: 1,
        segments: 1,
        blocks: 1,
        work_requests: 1,
        transport: "tcp",
        elapsed: Duration::ZERO,
        timeline: Default::default(),
    }
}

#[test]
fn recv_lifecycle_reports_each_id_once() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    t.start_recv("a".into(), t0).unwrap();
    t.start_recv("b".into(), t0).unwrap();
    assert!(t.start_recv("a".into(), t0).is_err());
    assert!(t.recv_done(report("a")));
    assert!(!t.recv_done(report("a")));
    assert!(t.recv_failed(&"b".into(), FailureCause::Expired, "deadline".into()));
    assert!(!t.recv_failed(&"b".into(), FailureCause::Other, "late".into()));
    let f = t.take_finished();
    assert_eq!(f.receiving, vec![RequestId::from("a")]);
    assert_eq!(f.failed.len(), 1);
    assert!(f.failed[0].expired && f.failed[0].side == Side::Recv);
    assert!(t.take_finished().is_empty());
    // The id may be reused once finished.
    t.start_recv("a".into(), t0).unwrap();
}

fn grant() -> Arc<Grant> {
    let l = crate::layout::ModelShape::LLAMA3_8B.layout(crate::ids::RegionId(1), 4);
    Arc::new(Grant::new(Arc::new(l), &[[0, 1]]).unwrap())
}

fn hold(t: &mut CompletionTracker, id: &str, reader: Option<&str>, now: Instant) {
    t.hold_send(
        id.into(),
        grant(),
        reader.map(Into::into),
        now,
        Duration::from_secs(5),
        1,
    )
    .unwrap();
}

#[test]
fn release_ends_a_hold_silently_and_totals_count_outcomes() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    hold(&mut t, "r", None, t0);
    let g = t.grant_for(&"r".into(), None).unwrap();
    assert_eq!(t.release(&"r".into(), t0), Release::Released);
    assert!(g.is_ended(), "the grant ends with the hold");
    assert_eq!(t.release(&"r".into(), t0), Release::NotHeld);
    assert!(t.take_finished().is_empty(), "a release reports nothing");
    assert_eq!(t.totals(), Totals::default());
    // One of each outcome.
    hold(&mut t, "done", None, t0);
    hold(&mut t, "aborted", None, t0);
    hold(&mut t, "expired", None, t0);
    t.handle_notice(&"done".into(), &rd("e"), SendNotice::Done, None)
        .unwrap();
    t.handle_notice(
        &"aborted".into(),
        &rd("e"),
        SendNotice::Aborted("x".into()),
        None,
    )
    .unwrap();
    t.poll(t0 + Duration::from_secs(6));
    for id in ["ok", "failed", "cancelled", "late"] {
        t.start_recv(id.into(), t0).unwrap();
    }
    t.recv_done(report("ok"));
    t.recv_failed(&"failed".into(), FailureCause::Connection, "x".into());
    t.recv_failed(&"cancelled".into(), FailureCause::Cancelled, "x".into());
    t.recv_failed(&"late".into(), FailureCause::Expired, "x".into());
    let want = Totals {
        reads_done: 1,
        reads_failed: 3,
        reads_expired: 1,
        reads_cancelled: 1,
        bytes_read: 1,
        sends_done: 1,
        sends_failed: 2,
        sends_expired: 1,
        sends_lease_expired: 0,
    };
    assert_eq!(t.totals(), want);
}

#[test]
fn held_send_finishes_on_notice_or_expires() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    hold(&mut t, "x", None, t0);
    hold(&mut t, "y", None, t0);
    hold(&mut t, "z", None, t0);
    assert!(t
        .hold_send("x".into(), grant(), None, t0, Duration::from_secs(1), 2)
        .is_err());
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(5)));
    t.handle_notice(&"x".into(), &rd("d"), SendNotice::Done, None)
        .unwrap();
    t.handle_notice(
        &"z".into(),
        &rd("d"),
        SendNotice::Aborted("decode OOM".into()),
        None,
    )
    .unwrap();
    t.poll(t0 + Duration::from_secs(4));
    let f = t.take_finished();
    assert_eq!(f.sending, vec![RequestId::from("x")]);
    assert_eq!(f.failed[0].cause, FailureCause::Peer);
    assert!(f.failed[0].reason.contains("decode OOM"));
    t.poll(t0 + Duration::from_secs(5));
    let f = t.take_finished();
    assert_eq!(f.failed.len(), 1);
    assert!(f.failed[0].expired && f.failed[0].id.as_str() == "y");
    assert_eq!(t.holding(), 0);
    assert_eq!(t.next_deadline(), None);
}

#[test]
fn notices_for_requests_never_held_are_refused_not_stored() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let e = t
        .handle_notice(&"e".into(), &rd("d"), SendNotice::Done, None)
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::NotHeld, "{e}");
    hold(&mut t, "e", None, t0);
    assert!(
        t.take_finished().is_empty(),
        "the refused notice was not kept"
    );
    assert_eq!(t.holding(), 1);
    assert!(t.grant_for(&"nope".into(), None).is_err());
}

#[test]
fn only_the_requests_reader_reads_and_confirms() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    // Named at hold time.
    hold(&mut t, "a", Some("decode-1"), t0);
    assert!(t.grant_for(&"a".into(), Some(&rd("decode-2"))).is_err());
    assert_eq!(
        t.handle_notice(
            &"a".into(),
            &rd("decode-2"),
            SendNotice::Aborted("x".into()),
            None,
        )
        .unwrap_err()
        .kind(),
        RefusalKind::OtherReader
    );
    assert_eq!(t.holding(), 1, "the foreign abort changed nothing");
    assert!(t
        .grant_for(&"a".into(), Some(&rd("decode-1")))
        .unwrap()
        .has(0, 1));
    t.handle_notice(&"a".into(), &rd("decode-1"), SendNotice::Done, None)
        .unwrap();
    // Claimed by the first engine whose read was served, or whose notice was applied.
    hold(&mut t, "b", None, t0);
    let g = t.grant_for(&"b".into(), Some(&rd("decode-3"))).unwrap();
    assert!(
        t.grant_for(&"b".into(), None).is_ok(),
        "anonymous reads claim nothing"
    );
    assert!(
        t.grant_for(&"b".into(), Some(&rd("decode-4"))).is_ok(),
        "not claimed yet"
    );
    t.claim(&"b".into(), &rd("decode-3"));
    let e = t.grant_for(&"b".into(), Some(&rd("decode-4"))).unwrap_err();
    assert_eq!(e.kind(), RefusalKind::OtherReader, "{e}");
    assert!(t
        .handle_notice(&"b".into(), &rd("decode-4"), SendNotice::Done, None)
        .is_err());
    assert!(!g.is_ended());
    t.handle_notice(&"b".into(), &rd("decode-3"), SendNotice::Done, None)
        .unwrap();
    assert!(g.is_ended(), "the grant ends with its hold");
    let f = t.take_finished();
    assert_eq!(f.sending, vec![RequestId::from("a"), RequestId::from("b")]);
    assert!(f.failed.is_empty());
}

fn at(engine: &str, rank: u32, size: u32) -> Reader {
    Reader {
        engine: engine.into(),
        tp: TpRank::new(rank, size),
    }
}

#[test]
fn a_prefill_rank_read_by_several_decode_ranks_waits_for_each() {
    let t0 = Instant::now();
    // Prefill rank 1 of 2; a decode of TP 4 reads it from ranks 2 and 3.
    let mut t = CompletionTracker::with_tp(TpRank::new(1, 2));
    hold(&mut t, "r", None, t0);
    // Decode rank 0 reads prefill rank 0, not this one.
    let e = t
        .handle_notice(&"r".into(), &at("d0", 0, 4), SendNotice::Done, None)
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::WrongTp, "{e}");
    t.handle_notice(&"r".into(), &at("d2", 2, 4), SendNotice::Done, None)
        .unwrap();
    // The same notice again changes nothing.
    t.handle_notice(&"r".into(), &at("d2", 2, 4), SendNotice::Done, None)
        .unwrap();
    assert_eq!(t.holding(), 1, "one of two readers confirmed");
    // Another decode size, or another engine at a rank already taken, is refused.
    let e = t
        .handle_notice(&"r".into(), &at("x", 1, 2), SendNotice::Done, None)
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::WrongTp, "{e}");
    let e = t
        .handle_notice(&"r".into(), &at("x", 2, 4), SendNotice::Done, None)
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::OtherReader, "{e}");
    assert!(t.grant_for(&"r".into(), Some(&at("d3", 3, 4))).is_ok());
    assert!(t.grant_for(&"r".into(), Some(&at("d1", 1, 4))).is_err());
    t.handle_notice(&"r".into(), &at("d3", 3, 4), SendNotice::Done, None)
        .unwrap();
    assert_eq!(t.take_finished().sending, vec![RequestId::from("r")]);

    // One abort fails the send at once and names the reader; a late notice is refused.
    hold(&mut t, "a", None, t0);
    t.claim(&"a".into(), &at("d2", 2, 4));
    t.handle_notice(
        &"a".into(),
        &at("d3", 3, 4),
        SendNotice::Aborted("oom".into()),
        None,
    )
    .unwrap();
    let f = t.take_finished();
    assert_eq!(f.failed[0].cause, FailureCause::Peer);
    assert!(f.failed[0].reason.contains("oom") && f.failed[0].reason.contains("\"d3\""));
    assert!(t
        .handle_notice(&"a".into(), &at("d2", 2, 4), SendNotice::Done, None)
        .is_err());

    // Expiry says how many confirmed.
    hold(&mut t, "e", None, t0);
    t.handle_notice(&"e".into(), &at("d2", 2, 4), SendNotice::Done, None)
        .unwrap();
    t.poll(t0 + Duration::from_secs(6));
    let f = t.take_finished();
    assert_eq!(f.failed[0].cause, FailureCause::Expired);
    assert!(
        f.failed[0].reason.contains("only 1 of 2"),
        "{}",
        f.failed[0].reason
    );

    // A decode with the smaller TP: one reader per prefill rank.
    let mut t = CompletionTracker::with_tp(TpRank::new(3, 4));
    hold(&mut t, "s", None, t0);
    assert!(t
        .handle_notice(&"s".into(), &at("d0", 0, 2), SendNotice::Done, None)
        .is_err());
    t.handle_notice(&"s".into(), &at("d1", 1, 2), SendNotice::Done, None)
        .unwrap();
    assert_eq!(t.take_finished().sending.len(), 1);
}

/// A hold with a 480 s abort timeout on a tracker whose readers get a lease of 30 s.
fn leased(readers: &[&str]) -> (CompletionTracker, Instant) {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new().with_lease(Duration::from_secs(30));
    for r in readers {
        t.reader_connected(r);
    }
    (t, t0)
}

fn hold_for(t: &mut CompletionTracker, id: &str, reader: Option<&str>, now: Instant) {
    t.hold_send(
        id.into(),
        grant(),
        reader.map(str::to_string),
        now,
        Duration::from_secs(480),
        1,
    )
    .unwrap();
}

#[test]
fn a_gone_readers_hold_ends_when_its_lease_ends_to_the_instant() {
    let (mut t, t0) = leased(&["d"]);
    let s = Duration::from_secs;
    hold_for(&mut t, "named", Some("d"), t0);
    hold_for(&mut t, "claimed", None, t0);
    hold_for(&mut t, "unread", None, t0);
    t.claim_checked(&"claimed".into(), &rd("d"), None).unwrap();
    assert_eq!(t.next_deadline(), Some(t0 + s(480)));
    assert_eq!(
        t.reader_disconnected("d", t0 + s(10)),
        Some(2),
        "named and claimed"
    );
    assert_eq!(t.next_deadline(), Some(t0 + s(40)), "10 s plus the lease");
    t.poll(t0 + s(40) - Duration::from_nanos(1));
    assert!(
        t.take_finished().is_empty(),
        "held until the lease's last instant"
    );
    t.poll(t0 + s(40));
    let f = t.take_finished();
    let mut ids: Vec<&str> = f.failed.iter().map(|f| f.id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["claimed", "named"], "a hold nobody read waits on");
    for f in &f.failed {
        assert!(f.expired && f.cause == FailureCause::Expired);
        assert!(
            f.reason.contains("lease of 30s") && f.reason.contains("\"d\""),
            "{}",
            f.reason
        );
    }
    assert_eq!(t.totals().sends_lease_expired, 2);
    assert_eq!(t.totals().sends_expired, 2);
    assert_eq!(t.next_deadline(), Some(t0 + s(480)));
    t.poll(t0 + s(480));
    let f = t.take_finished();
    assert_eq!(f.failed[0].cause, FailureCause::Expired);
    assert!(f.failed[0].reason.contains("abort timeout of 480s"));
    assert_eq!(
        t.totals().sends_lease_expired,
        2,
        "an abort timeout is no lease"
    );
}

#[test]
fn a_reader_back_within_its_lease_keeps_its_holds() {
    let (mut t, t0) = leased(&["d"]);
    let s = Duration::from_secs;
    hold_for(&mut t, "r", Some("d"), t0);
    t.reader_disconnected("d", t0 + s(1));
    assert_eq!(t.next_deadline(), Some(t0 + s(31)));
    t.reader_connected("d");
    assert_eq!(
        t.next_deadline(),
        Some(t0 + s(480)),
        "renewed: back on the abort timeout"
    );
    t.poll(t0 + s(100));
    assert!(t.take_finished().is_empty());
    // Lost again: a fresh lease from then.
    t.reader_disconnected("d", t0 + s(200));
    assert_eq!(t.next_deadline(), Some(t0 + s(230)));
    t.handle_notice(&"r".into(), &rd("d"), SendNotice::Done, None)
        .unwrap();
    assert_eq!(
        t.take_finished().sending.len(),
        1,
        "a confirmation within the lease"
    );
}

#[test]
fn one_of_several_sessions_ending_leaves_the_lease_alone() {
    let (mut t, t0) = leased(&["d", "d"]);
    hold_for(&mut t, "r", Some("d"), t0);
    assert_eq!(t.reader_disconnected("d", t0), None, "a session left");
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(480)));
    assert_eq!(t.reader_disconnected("d", t0), Some(1));
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(30)));
}

#[test]
fn with_two_readers_the_first_gone_sets_the_lease_until_it_is_back() {
    // A prefill of TP 1 read by a decode of TP 2: both ranks must confirm.
    let (mut t, t0) = leased(&["a", "b"]);
    let s = Duration::from_secs;
    let at = |rank| Reader {
        engine: ["a", "b"][rank as usize].into(),
        tp: TpRank::new(rank, 2),
    };
    hold_for(&mut t, "r", None, t0);
    t.claim_checked(&"r".into(), &at(0), None).unwrap();
    t.claim_checked(&"r".into(), &at(1), None).unwrap();
    t.reader_disconnected("a", t0 + s(1));
    t.reader_disconnected("b", t0 + s(5));
    assert_eq!(t.next_deadline(), Some(t0 + s(31)), "the earlier lease");
    t.reader_connected("a");
    assert_eq!(t.next_deadline(), Some(t0 + s(35)), "b is still gone");
    t.reader_connected("b");
    assert_eq!(t.next_deadline(), Some(t0 + s(480)));
}

#[test]
fn a_hold_for_a_gone_reader_gives_it_a_whole_lease_and_a_claim_may_be_refused() {
    let (mut t, t0) = leased(&["d"]);
    let s = Duration::from_secs;
    t.reader_disconnected("d", t0);
    hold_for(&mut t, "late", Some("d"), t0 + s(20));
    assert_eq!(
        t.next_deadline(),
        Some(t0 + s(50)),
        "20 s plus a whole lease"
    );
    let e = t.claim_checked(&"late".into(), &rd("x"), None).unwrap_err();
    assert_eq!(e.kind(), RefusalKind::OtherReader, "{e}");
    let e = t
        .claim_checked(&"nothing".into(), &rd("d"), None)
        .unwrap_err();
    assert_eq!(e.kind(), RefusalKind::NotHeld, "{e}");
    // Once the engine's lease passed it is forgotten: new holds for it wait the abort timeout.
    t.poll(t0 + s(50));
    assert_eq!(t.take_finished().failed.len(), 1);
    hold_for(&mut t, "later", Some("d"), t0 + s(60));
    assert_eq!(t.next_deadline(), Some(t0 + s(540)));
}

#[test]
fn a_reused_request_id_is_told_apart_by_its_hold_token() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let first = |t: &mut CompletionTracker| {
        t.hold_send("r".into(), grant(), None, t0, Duration::from_secs(5), 7)
            .unwrap()
    };
    first(&mut t);
    t.release(&"r".into(), t0);
    // The id is held again, under a new hold.
    t.hold_send("r".into(), grant(), None, t0, Duration::from_secs(5), 8)
        .unwrap();
    for notice in [SendNotice::Done, SendNotice::Aborted("late".into())] {
        let e = t
            .handle_notice(&"r".into(), &rd("d"), notice, Some(7))
            .unwrap_err();
        assert_eq!(e.kind(), RefusalKind::NotHeld, "{e}");
    }
    assert!(t.claim_checked(&"r".into(), &rd("d"), Some(7)).is_err());
    assert_eq!(t.holding(), 1, "the earlier hold's reader changed nothing");
    t.claim_checked(&"r".into(), &rd("d"), Some(8)).unwrap();
    t.handle_notice(&"r".into(), &rd("d"), SendNotice::Done, Some(8))
        .unwrap();
    assert_eq!(t.take_finished().sending, [RequestId::from("r")]);
}

#[test]
fn a_reader_that_leaves_in_order_keeps_its_holds_on_the_abort_timeout() {
    let (mut t, t0) = leased(&["d"]);
    let s = Duration::from_secs;
    hold_for(&mut t, "named", Some("d"), t0);
    hold_for(&mut t, "claimed", None, t0);
    t.claim_checked(&"claimed".into(), &rd("d"), None).unwrap();
    assert!(t.reader_left("d"), "its only session");
    assert_eq!(
        t.next_deadline(),
        Some(t0 + s(480)),
        "no lease: an idle session closed in order is no dead reader"
    );
    hold_for(&mut t, "later", Some("d"), t0 + s(10));
    assert_eq!(t.next_deadline(), Some(t0 + s(480)), "nor for a new hold");
    t.poll(t0 + s(479));
    assert!(t.take_finished().is_empty());
    // Back on a new session, then lost: the lease applies as ever.
    t.reader_connected("d");
    t.reader_disconnected("d", t0 + s(100));
    assert_eq!(t.next_deadline(), Some(t0 + s(130)));
    t.poll(t0 + s(130));
    assert_eq!(t.take_finished().failed.len(), 3);
    assert_eq!(t.totals().sends_lease_expired, 3);
}

#[test]
fn a_receipt_signed_while_held_counts_as_its_readers_done_at_the_deadline() {
    use crate::holds::{HoldTable, ReceiptPage};
    use crate::shm::SharedMap;
    let t0 = Instant::now();
    let owner = Arc::new(HoldTable::create().unwrap());
    let view = {
        let fd = owner.map().fd().unwrap().try_clone_to_owned().unwrap();
        let len = crate::holds::TABLE_BYTES as u64;
        HoldTable::reader(SharedMap::open_peer_readonly(fd, len).unwrap()).unwrap()
    };
    let page = |r: &Reader| {
        let (fd, len) = owner.receipts_for(r).unwrap();
        ReceiptPage::reader(SharedMap::open_peer(fd, len).unwrap()).unwrap()
    };
    let (d, other) = (page(&rd("d")), page(&rd("other")));
    let mut t = CompletionTracker::new();
    for (id, named) in [
        ("signed", None),
        ("by-another", Some("d")),
        ("unsigned", None),
    ] {
        let g = grant();
        let slot = owner.insert(&id.into(), 1, g.blocks_hash()).unwrap();
        g.publish(owner.clone(), slot);
        t.hold_send(
            id.into(),
            g,
            named.map(Into::into),
            t0,
            Duration::from_secs(5),
            1,
        )
        .unwrap();
    }
    let found = |id: &str| {
        view.find(&id.into(), Some(1), grant().blocks_hash())
            .unwrap()
    };
    let (signed, by_another, unsigned) = (found("signed"), found("by-another"), found("unsigned"));
    d.sign(signed);
    other.sign(by_another);
    t.poll(t0 + Duration::from_secs(5));
    let f = t.take_finished();
    assert_eq!(
        f.sending,
        vec![RequestId::from("signed")],
        "its receipt counted"
    );
    let mut failed: Vec<&str> = f.failed.iter().map(|x| x.id.as_str()).collect();
    failed.sort_unstable();
    assert_eq!(
        failed,
        ["by-another", "unsigned"],
        "a reader the hold is not for counts for nothing"
    );
    assert_eq!(view.outcome(signed), Some(true));
    assert_eq!(view.outcome(by_another), Some(false));
    assert_eq!(view.outcome(unsigned), Some(false));
    assert_eq!((t.totals().sends_done, t.totals().sends_expired), (1, 2));
}

/// Growing holds and their followers (`growing.rs`).
mod growing;
mod pin;
