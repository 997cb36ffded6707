//! Tests of growing holds and their followers (`tracker/growing.rs`).

use super::*;

/// A follower that records what it is told (`open`: whether it takes more).
#[derive(Debug, Default)]
struct Heard {
    told: parking_lot::Mutex<Vec<Announcement>>,
    closed: std::sync::atomic::AtomicBool,
}

impl Follower for Heard {
    fn announce(&self, _id: &RequestId, a: Announcement) -> bool {
        if self.closed.load(std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        self.told.lock().push(a);
        true
    }
}

impl Heard {
    fn take(&self) -> Vec<Announcement> {
        std::mem::take(&mut *self.told.lock())
    }
}

fn part(first: u32, blocks: &[BlockId], sealed: bool) -> Announcement {
    Announcement::Part {
        token: 9,
        first: vec![first],
        blocks: vec![blocks.to_vec()],
        tensors: None,
        sealed,
    }
}

/// A growing hold of `blocks` so far (token 9).
fn open(t: &mut CompletionTracker, id: &str, blocks: &[BlockId], now: Instant) {
    let l = crate::layout::ModelShape::LLAMA3_8B.layout(crate::ids::RegionId(1), 8);
    let grant = Arc::new(Grant::open(Arc::new(l), &[blocks]).unwrap());
    let terms = HoldTerms {
        reader: None,
        abort_timeout: Duration::from_secs(5),
        token: 9,
        sealed: false,
    };
    t.open_hold(id.into(), grant, vec![blocks.to_vec()], terms, now)
        .unwrap();
}

#[test]
fn a_follower_hears_every_part_in_order_and_confirms_only_after_the_seal() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let heard = Arc::new(Heard::default());
    // Followed before it is held: told once the hold opens, from its first block.
    let until = t0 + Duration::from_secs(3);
    t.follow(&"r".into(), &rd("d"), Some(9), heard.clone(), until)
        .unwrap();
    assert_eq!(t.next_deadline(), Some(until));
    open(&mut t, "r", &[5, 2], t0);
    assert_eq!(heard.take(), vec![part(0, &[5, 2], false)]);
    t.extend_hold(&"r".into(), &[vec![7]], None).unwrap();
    assert_eq!(heard.take(), vec![part(2, &[7], false)]);
    // A block held already, or a hold of other groups, is refused and changes nothing.
    assert!(t.extend_hold(&"r".into(), &[vec![2]], None).is_err());
    assert!(t
        .extend_hold(&"r".into(), &[vec![3], vec![4]], None)
        .is_err());
    assert!(t.extend_hold(&"r".into(), &[vec![3, 3]], None).is_err());
    let done = |t: &mut CompletionTracker| {
        t.handle_notice(&"r".into(), &rd("d"), SendNotice::Done, Some(9))
    };
    let e = done(&mut t).unwrap_err().into_reason();
    assert!(e.contains("not sealed"), "{e}");
    t.seal_hold(&"r".into()).unwrap();
    assert_eq!(heard.take(), vec![part(3, &[], true)]);
    assert!(t.extend_hold(&"r".into(), &[vec![1]], None).is_err());
    assert!(t.seal_hold(&"r".into()).is_err());
    done(&mut t).unwrap();
    assert_eq!(t.take_finished().sending, vec![RequestId::from("r")]);
    // The grant of every part is served from, and ends with the hold.
    assert!(heard.take().is_empty());
}

#[test]
fn a_late_follower_hears_the_blocks_so_far_and_every_end_is_told() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    open(&mut t, "r", &[1], t0);
    t.extend_hold(&"r".into(), &[vec![4]], None).unwrap();
    let heard = Arc::new(Heard::default());
    t.follow(&"r".into(), &rd("d"), None, heard.clone(), t0)
        .unwrap();
    assert_eq!(heard.take(), vec![part(0, &[1, 4], false)]);
    // Another token, another reader of the same rank: refused.
    let other = Arc::new(Heard::default());
    assert!(t
        .follow(&"r".into(), &rd("d"), Some(8), other.clone(), t0)
        .is_err());
    assert!(t
        .follow(&"r".into(), &rd("e"), None, other.clone(), t0)
        .is_err());
    assert!(other.take().is_empty());
    assert_eq!(t.release(&"r".into(), t0), Release::Released);
    let ended = heard.take();
    assert!(
        matches!(&ended[..], [Announcement::Ended { reason }] if reason.contains("released")),
        "{ended:?}"
    );
    // A follow of a request never held ends at its deadline; one that expires is told why.
    let late = Arc::new(Heard::default());
    t.follow(
        &"q".into(),
        &rd("d"),
        None,
        late.clone(),
        t0 + Duration::from_secs(1),
    )
    .unwrap();
    t.poll(t0 + Duration::from_millis(500));
    assert!(late.take().is_empty());
    t.poll(t0 + Duration::from_secs(1));
    assert!(
        matches!(&late.take()[..], [Announcement::Ended { reason }] if reason.contains("not held within"))
    );
    open(&mut t, "x", &[1], t0);
    t.follow(&"x".into(), &rd("d"), None, late.clone(), t0)
        .unwrap();
    late.take();
    t.poll(t0 + Duration::from_secs(6));
    assert!(
        matches!(&late.take()[..], [Announcement::Ended { reason }] if reason.contains("expired"))
    );
}

#[test]
fn a_follower_that_takes_no_more_is_dropped_and_the_hold_grows_on() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    open(&mut t, "r", &[], t0);
    let gone = Arc::new(Heard::default());
    t.follow(&"r".into(), &rd("d"), None, gone.clone(), t0)
        .unwrap();
    // Nothing held yet: nothing told.
    assert!(gone.take().is_empty());
    assert!(
        t.seal_hold(&"r".into()).is_err(),
        "a hold of no block is not sealed"
    );
    gone.closed
        .store(true, std::sync::atomic::Ordering::Relaxed);
    t.extend_hold(&"r".into(), &[vec![0]], None).unwrap();
    t.seal_hold(&"r".into()).unwrap();
    assert!(gone.take().is_empty());
}

#[test]
fn a_part_made_final_tensor_by_tensor_is_told_in_order_and_completed_before_the_next() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    open(&mut t, "r", &[1], t0);
    let heard = Arc::new(Heard::default());
    t.follow(&"r".into(), &rd("d"), None, heard.clone(), t0)
        .unwrap();
    heard.take();
    // LLAMA3_8B's layout has 64 tensors: a step's blocks made final 16 tensors at a time.
    t.extend_hold(&"r".into(), &[vec![4, 5]], Some(0..16))
        .unwrap();
    let tensors = |a: &Announcement| match a {
        Announcement::Part {
            first,
            blocks,
            tensors,
            ..
        } => (first[0], blocks[0].clone(), *tensors),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        heard.take().iter().map(tensors).collect::<Vec<_>>(),
        vec![(1, vec![4, 5], Some((0, 16)))]
    );
    // New blocks, a gap, tensors past the layout, or a seal: refused until the part is whole.
    assert!(t.extend_hold(&"r".into(), &[vec![6]], None).is_err());
    assert!(t.extend_hold(&"r".into(), &[vec![]], Some(17..32)).is_err());
    assert!(t.extend_hold(&"r".into(), &[vec![]], Some(16..65)).is_err());
    assert!(t.seal_hold(&"r".into()).is_err());
    t.extend_hold(&"r".into(), &[vec![]], Some(16..40)).unwrap();
    // A follower that joins now hears the whole blocks, then the part's final tensors.
    let late = Arc::new(Heard::default());
    t.follow(&"r".into(), &rd("d"), None, late.clone(), t0)
        .unwrap();
    assert_eq!(
        late.take().iter().map(tensors).collect::<Vec<_>>(),
        vec![(0, vec![1], None), (1, vec![4, 5], Some((0, 40)))]
    );
    t.extend_hold(&"r".into(), &[vec![]], Some(40..64)).unwrap();
    assert_eq!(
        heard.take().iter().map(tensors).collect::<Vec<_>>(),
        vec![(1, vec![], Some((16, 40))), (1, vec![], Some((40, 64)))]
    );
    t.extend_hold(&"r".into(), &[vec![6]], Some(0..64)).unwrap();
    t.seal_hold(&"r".into()).unwrap();
}

/// A reader that follows a request and aborts it before it is held: the hold fails as soon as
/// it opens (the send reported failed, nothing held), rather than wait its abort timeout for
/// a read that will not come; an abort of a request nobody follows is still refused, and one
/// naming another hold leaves that hold alone.
#[test]
fn an_abort_before_the_hold_fails_the_hold_when_it_opens() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let heard = Arc::new(Heard::default());
    let until = t0 + Duration::from_secs(3);
    t.follow(&"r".into(), &rd("d"), Some(9), heard.clone(), until)
        .unwrap();
    let abort = |t: &mut CompletionTracker, id: &str, hold| {
        t.handle_notice(
            &id.into(),
            &rd("d"),
            SendNotice::Aborted("gone".into()),
            hold,
        )
    };
    abort(&mut t, "r", Some(9)).unwrap();
    assert!(abort(&mut t, "q", None).is_err());
    open(&mut t, "r", &[5, 2], t0);
    assert!(!t.is_holding(&"r".into()));
    let f = t.take_finished();
    assert_eq!(f.failed.len(), 1);
    assert_eq!(f.failed[0].cause, FailureCause::Peer);
    assert!(
        f.failed[0].reason.contains("gone"),
        "{}",
        f.failed[0].reason
    );
    // Aborted for hold 8, opened as hold 9: held.
    t.follow(&"s".into(), &rd("d"), None, heard.clone(), until)
        .unwrap();
    abort(&mut t, "s", Some(8)).unwrap();
    open(&mut t, "s", &[1], t0);
    assert!(t.is_holding(&"s".into()));
}
