//! Tests of pins (`tracker/pin.rs`): what a pinned hold outlives, and what ends it.

use super::*;

const PIN: Duration = Duration::from_millis(20);

fn held_for(t: &mut CompletionTracker, timeout: Duration, now: Instant) -> Arc<Grant> {
    let g = grant();
    t.hold_send("r".into(), g.clone(), None, now, timeout, 7)
        .unwrap();
    g
}

#[test]
fn a_release_waits_for_the_pin_until_the_readers_done() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let g = held_for(&mut t, Duration::from_secs(5), t0);
    let d = rd("d");
    t.pin(&"r".into(), &d, Some(7), t0, PIN).unwrap();
    assert_eq!(t.release(&"r".into(), t0), Release::Pinned(t0 + PIN));
    assert!(g.is_ended(), "nothing more is served from a released hold");
    assert_eq!(
        t.release(&"r".into(), t0 + PIN / 2),
        Release::Pinned(t0 + PIN),
        "still pinned"
    );
    // The reader's Done ends the pin; the release then goes on, reporting nothing.
    let epoch = t.deadline_epoch();
    let e = t
        .handle_notice(&"r".into(), &d, SendNotice::Done, Some(7))
        .unwrap_err();
    assert!(e.to_string().contains("released"), "{e}");
    assert_ne!(t.deadline_epoch(), epoch, "a waiting release is woken");
    assert_eq!(t.release(&"r".into(), t0 + PIN / 2), Release::Released);
    assert!(t.take_finished().is_empty(), "a release reports nothing");
}

#[test]
fn a_pin_that_lapses_lets_the_release_go_on() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    held_for(&mut t, Duration::from_secs(5), t0);
    t.pin(&"r".into(), &rd("d"), None, t0, PIN).unwrap();
    assert_eq!(t.release(&"r".into(), t0), Release::Pinned(t0 + PIN));
    assert_eq!(t.next_deadline(), Some(t0 + PIN), "it ends with its pin");
    assert_eq!(t.release(&"r".into(), t0 + PIN), Release::Released);
    // Or the tracker's poll drops it, with nothing to report, when nobody asks again.
    held_for(&mut t, Duration::from_secs(5), t0);
    t.pin(&"r".into(), &rd("d"), None, t0, PIN).unwrap();
    assert!(matches!(t.release(&"r".into(), t0), Release::Pinned(_)));
    t.poll(t0 + PIN);
    assert!(!t.is_holding(&"r".into()));
    assert!(t.take_finished().is_empty());
    assert_eq!(t.release(&"r".into(), t0 + PIN), Release::NotHeld);
}

#[test]
fn a_pinned_hold_outlives_its_timeout_and_its_readers_lease() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new().with_lease(Duration::from_millis(1));
    held_for(&mut t, Duration::from_millis(5), t0);
    t.reader_connected("d");
    t.pin(&"r".into(), &rd("d"), None, t0, PIN).unwrap();
    t.reader_disconnected("d", t0);
    t.poll(t0 + PIN / 2);
    assert!(
        t.is_holding(&"r".into()),
        "past its timeout and lease, pinned"
    );
    assert!(t.take_finished().is_empty());
    assert_eq!(t.next_deadline(), Some(t0 + PIN));
    t.poll(t0 + PIN);
    let f = t.take_finished();
    assert!(f.failed[0].expired, "{f:?}");
    // A reader's Done within its pin finishes the send as any Done does.
    held_for(&mut t, Duration::from_millis(5), t0);
    t.pin(&"r".into(), &rd("e"), None, t0, PIN).unwrap();
    t.handle_notice(&"r".into(), &rd("e"), SendNotice::Done, None)
        .unwrap();
    assert_eq!(t.take_finished().sending, vec![RequestId::from("r")]);
}

#[test]
fn pins_are_refused_where_a_done_would_be_and_given_once() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let id: RequestId = "r".into();
    let refused = |r: std::result::Result<Instant, Refusal>, what: &str| {
        let e = r.expect_err(what).to_string();
        assert!(!e.is_empty(), "{what}");
        e
    };
    refused(t.pin(&id, &rd("d"), None, t0, PIN), "not held");
    held_for(&mut t, Duration::from_secs(5), t0);
    refused(t.pin(&id, &rd("d"), Some(8), t0, PIN), "another hold");
    // A decode of TP 2 reading this prefill alone: two readers confirm, so none may pin.
    let wide = Reader {
        engine: "w".into(),
        tp: TpRank::new(0, 2),
    };
    let e = refused(t.pin(&id, &wide, None, t0, PIN), "several readers");
    assert!(e.contains("2 readers"), "{e}");
    assert_eq!(t.release(&id, t0), Release::Released, "nothing pinned");
    held_for(&mut t, Duration::from_secs(5), t0);
    t.pin(&id, &rd("d"), None, t0, PIN).unwrap();
    refused(t.pin(&id, &rd("d"), None, t0, PIN), "pinned before");
    refused(t.pin(&id, &rd("x"), None, t0, PIN), "another reader");
    assert!(matches!(t.release(&id, t0), Release::Pinned(_)));
    refused(t.pin(&id, &rd("d"), None, t0, PIN), "released");
}
