//! The replay ring and the stream state machine, driven by hand (no sockets, no clock).
use super::*;

fn delivered(a: &[Action<&'static str>]) -> Vec<u64> {
    a.iter()
        .filter_map(|x| match x {
            Action::Deliver(s, _) => Some(*s),
            _ => None,
        })
        .collect()
}

#[test]
fn ring_replays_from_a_sequence_and_forgets_the_oldest() {
    let mut r = ReplayRing::new(3);
    for s in 0..5u64 {
        r.push(s, s * 10);
    }
    assert_eq!(r.bounds(), Some((2, 4)));
    assert_eq!(
        r.replay_from(3).map(|x| x.0).collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert_eq!(
        r.replay_from(0).map(|x| x.0).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    assert_eq!(r.replay_from(9).count(), 0);

    let mut r = ReplayRing::with_max_bytes(10, 100);
    for s in 0..5u64 {
        r.push_sized(s, s, 40);
    }
    assert_eq!(r.bounds(), Some((3, 4)), "at most 100 bytes");
    r.push_sized(5, 5, 500);
    assert_eq!(
        (r.bounds(), r.len_bytes()),
        (Some((5, 5)), (1, 500)),
        "newest kept"
    );
}

#[test]
fn a_filled_gap_is_announced_once_after_its_batches_and_a_lossy_one_is_not() {
    let t = Instant::now();
    let mut s: StreamState<&str> = StreamState::new(Duration::from_secs(2), 100);
    for q in 0..2 {
        s.handle_live(q, "x", t);
    }
    assert_eq!(s.handle_live(4, "e", t), vec![Action::RequestReplay(2)]);
    let mut got = s.handle_replayed(2, "c");
    got.extend(s.handle_replayed(3, "d"));
    got.extend(s.handle_replay_end(t));
    assert_eq!(delivered(&got), vec![2, 3, 4]);
    assert_eq!(
        got.last(),
        Some(&Action::GapFilled {
            from: 2,
            through: 4
        }),
        "after the buffered live batch too"
    );
    // A replay that could not supply everything reports the loss, and no fill.
    assert_eq!(s.handle_live(9, "j", t), vec![Action::RequestReplay(5)]);
    let got = s.handle_replay_end(t);
    assert!(
        !got.iter().any(|a| matches!(a, Action::GapFilled { .. })),
        "{got:?}"
    );
    assert!(got
        .iter()
        .any(|a| matches!(a, Action::Resync(Resync::HistoryLost { .. }))));
}

#[test]
fn in_order_stream_is_delivered_as_is() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    for q in 0..5 {
        assert_eq!(s.handle_live(q, "x", t), vec![Action::Deliver(q, "x")]);
    }
}

#[test]
fn a_gap_is_filled_by_replay_with_live_buffered_and_duplicates_dropped() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.handle_live(0, "a", t);
    s.handle_live(1, "b", t);
    // 2 and 3 were dropped by PUB; 4 arrives.
    assert_eq!(s.handle_live(4, "e", t), vec![Action::RequestReplay(2)]);
    assert!(
        s.handle_live(5, "f", t).is_empty(),
        "buffered during replay"
    );
    let mut got = s.handle_replayed(1, "b"); // overlap: duplicate
    got.extend(s.handle_replayed(2, "c"));
    got.extend(s.handle_replayed(3, "d"));
    got.extend(s.handle_replayed(4, "e"));
    got.extend(s.handle_replay_end(t));
    assert_eq!(delivered(&got), vec![2, 3, 4, 5]);
    assert_eq!(s.duplicates(), 2, "replayed 1 and buffered 4");
    assert!(!s.replaying());
    assert_eq!(s.handle_live(6, "g", t), vec![Action::Deliver(6, "g")]);
}

#[test]
fn history_past_the_ring_is_reported_lost() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.handle_live(0, "a", t);
    assert_eq!(s.handle_live(50, "z", t), vec![Action::RequestReplay(1)]);
    let got = s.handle_replayed(40, "y");
    assert_eq!(
        got[0],
        Action::Resync(Resync::HistoryLost {
            from: 1,
            resumed: 40
        })
    );
    let mut got = s.handle_replay_end(t);
    assert_eq!(
        got.remove(0),
        Action::Resync(Resync::HistoryLost {
            from: 41,
            resumed: 50
        })
    );
    assert_eq!(delivered(&got), vec![50]);
}

#[test]
fn restart_and_late_join_and_silent_replay() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(2), 100);
    // Late join at seq 7: bootstrap from 0.
    assert_eq!(s.handle_live(7, "h", t), vec![Action::RequestReplay(0)]);
    let mut got = Vec::new();
    for q in 5..=7 {
        got.extend(s.handle_replayed(q, "r"));
    }
    got.extend(s.handle_replay_end(t));
    assert_eq!(
        got[0],
        Action::Resync(Resync::HistoryLost {
            from: 0,
            resumed: 5
        })
    );
    assert_eq!(delivered(&got), vec![5, 6, 7]);
    // Publisher restart: the sequence goes back to 0.
    let got = s.handle_live(0, "new", t);
    assert_eq!(
        got[0],
        Action::Resync(Resync::PublisherRestart { last: 7, now: 0 })
    );
    assert_eq!(delivered(&got), vec![0]);
    // A gap whose replay never answers ends at the deadline.
    s.handle_live(1, "b", t);
    assert_eq!(s.handle_live(3, "d", t), vec![Action::RequestReplay(2)]);
    assert!(s.poll(t + Duration::from_secs(1)).is_empty());
    assert_eq!(s.next_deadline(), Some(t + Duration::from_secs(2)));
    let got = s.poll(t + Duration::from_secs(2));
    assert_eq!(
        got[0],
        Action::Resync(Resync::HistoryLost {
            from: 2,
            resumed: 3
        })
    );
    assert_eq!(delivered(&got), vec![3]);
    assert!(
        s.handle_replayed(2, "late").is_empty(),
        "late replay answers are ignored"
    );
}

#[test]
fn a_replay_ahead_of_a_backlogged_live_stream_is_not_a_restart() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.handle_live(0, "a", t);
    assert_eq!(s.handle_live(3, "d", t), vec![Action::RequestReplay(1)]);
    let mut got = Vec::new();
    for q in 1..=6 {
        got.extend(s.handle_replayed(q, "r"));
    }
    got.extend(s.handle_replay_end(t));
    assert_eq!(delivered(&got), vec![1, 2, 3, 4, 5, 6]);
    // The backlogged live stream catches up: 4..=6 are duplicates, 7 is next.
    for q in 4..=6 {
        assert!(s.handle_live(q, "x", t).is_empty());
    }
    assert_eq!(s.handle_live(7, "h", t), vec![Action::Deliver(7, "h")]);
    assert_eq!(s.duplicates(), 4, "buffered 3, then live 4..=6");
    // A restart during a replay is still seen: live goes below its own highest.
    assert_eq!(s.handle_live(9, "j", t), vec![Action::RequestReplay(8)]);
    let got = s.handle_live(2, "new", t);
    assert_eq!(
        got,
        vec![
            Action::Resync(Resync::PublisherRestart { last: 9, now: 2 }),
            Action::RequestReplay(0)
        ]
    );
}

#[test]
fn buffering_during_replay_is_bounded() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 3);
    s.handle_live(0, "a", t);
    s.handle_live(2, "c", t);
    for q in 3..10 {
        s.handle_live(q, "x", t);
    }
    let got = s.handle_replay_end(t);
    assert_eq!(delivered(&got), vec![7, 8, 9]);
    assert!(matches!(
        got[0],
        Action::Resync(Resync::HistoryLost {
            from: 1,
            resumed: 7
        })
    ));
}

#[test]
fn a_repeated_sequence_is_a_duplicate_and_only_a_lower_one_a_restart() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    for q in 0..=5 {
        s.handle_live(q, "x", t);
    }
    assert!(s.handle_live(5, "again", t).is_empty(), "seq 5 twice");
    assert_eq!(s.duplicates(), 1);
    assert_eq!(s.handle_live(6, "g", t), vec![Action::Deliver(6, "g")]);
    // During a replay too.
    assert_eq!(s.handle_live(9, "j", t), vec![Action::RequestReplay(7)]);
    assert!(s.handle_live(9, "j", t).is_empty());
    assert!(s.replaying());
    let got = s.handle_live(4, "new", t);
    assert!(
        matches!(
            got[0],
            Action::Resync(Resync::PublisherRestart { last: 9, now: 4 })
        ),
        "{got:?}"
    );
}

#[test]
fn a_second_gap_behind_the_replayed_range_is_replayed_not_lost() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.handle_live(0, "a", t);
    assert_eq!(s.handle_live(3, "d", t), vec![Action::RequestReplay(1)]);
    // While the replay runs, live loses 5 as well.
    s.handle_live(4, "e", t);
    s.handle_live(6, "g", t);
    let mut got = Vec::new();
    for q in 1..=3 {
        got.extend(s.handle_replayed(q, "r"));
    }
    got.extend(s.handle_replay_end(t));
    assert_eq!(delivered(&got), vec![1, 2, 3, 4]);
    assert_eq!(got.last(), Some(&Action::RequestReplay(5)));
    assert!(!got.iter().any(|a| matches!(a, Action::Resync(_))));
    let mut got = s.handle_replayed(5, "f");
    got.extend(s.handle_replayed(6, "g"));
    got.extend(s.handle_replay_end(t));
    assert_eq!(delivered(&got), vec![5, 6]);
    assert_eq!(
        got.last(),
        Some(&Action::GapFilled {
            from: 5,
            through: 6
        })
    );
}

#[test]
fn a_start_beyond_the_stream_waits_for_it_instead_of_starting_from_zero() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    assert_eq!(s.begin_replay(10, t), vec![Action::RequestReplay(10)]);
    s.handle_live(7, "h", t);
    // The ring holds nothing from 10 yet: the answer is just the end marker.
    let got = s.handle_replay_end(t);
    assert!(delivered(&got).is_empty(), "{got:?}");
    assert!(s.handle_live(8, "i", t).is_empty(), "before the start");
    assert!(s.handle_live(9, "j", t).is_empty());
    assert_eq!(s.handle_live(10, "k", t), vec![Action::Deliver(10, "k")]);
    assert_eq!(s.handle_live(11, "l", t), vec![Action::Deliver(11, "l")]);
}

#[test]
fn a_new_incarnation_is_a_restart_even_past_the_old_sequence() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    for seq in 0..3 {
        assert_eq!(
            delivered(&s.handle_live_from(seq, Some(7), "old", t)),
            [seq]
        );
    }
    // The new process has published 9 batches before this one: its sequence is past the old.
    let a = s.handle_live_from(9, Some(8), "new", t);
    assert_eq!(
        a,
        vec![
            Action::Resync(Resync::PublisherRestart { last: 2, now: 9 }),
            Action::RequestReplay(0)
        ]
    );
    // The new process's replay follows; a replayed batch of the old one is not its history.
    assert!(s.handle_replayed_from(0, Some(7), "old").is_empty());
    assert_eq!(delivered(&s.handle_replayed_from(0, Some(8), "new")), [0]);
    assert_eq!(s.duplicates(), 1);
    // Without incarnations the jump would have been a gap, filled from the new process's
    // history on top of the old one's.
    let mut plain = StreamState::new(Duration::from_secs(1), 100);
    for seq in 0..3 {
        plain.handle_live_from(seq, None, "old", t);
    }
    assert_eq!(
        plain.handle_live_from(9, None, "new", t),
        vec![Action::RequestReplay(3)]
    );
    // The same incarnation again is the same stream.
    let mut same = StreamState::new(Duration::from_secs(1), 100);
    same.handle_live_from(0, Some(5), "a", t);
    assert_eq!(delivered(&same.handle_live_from(1, Some(5), "b", t)), [1]);
}

#[test]
fn a_snapshot_answer_replaces_lost_history_and_the_stream_goes_on_after_it() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.handle_live_from(0, Some(7), "a", t);
    assert_eq!(
        s.handle_live_from(50, Some(7), "z", t),
        vec![Action::RequestReplay(1)]
    );
    // Live batches go on while the answer is under way, some before the snapshot's point.
    s.handle_live_from(51, Some(7), "z1", t);
    s.handle_live_from(53, Some(7), "z3", t);
    s.handle_snapshot_from(52, Some(7), "p0");
    s.handle_snapshot_from(52, Some(7), "p1");
    // A part of another incarnation is not this stream's.
    s.handle_snapshot_from(52, Some(8), "other");
    let got = s.handle_replay_end(t);
    assert_eq!(
        got,
        vec![
            Action::Snapshot(52, vec!["p0", "p1"]),
            Action::Deliver(53, "z3")
        ],
        "no loss and no gap-filled notice: the snapshot stands for the history"
    );
    assert_eq!(s.last(), Some(52 + 1));
    assert_eq!(
        s.duplicates(),
        3,
        "50 and 51 are inside the snapshot; one other part"
    );
}

#[test]
fn a_snapshot_cut_short_by_the_deadline_is_dropped_and_the_loss_reported() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_millis(10), 100);
    s.handle_live_from(0, Some(7), "a", t);
    s.handle_live_from(50, Some(7), "z", t);
    s.handle_snapshot_from(49, Some(7), "p0");
    let got = s.poll(t + Duration::from_millis(20));
    assert_eq!(
        got,
        vec![
            Action::Resync(Resync::HistoryLost {
                from: 1,
                resumed: 50
            }),
            Action::Deliver(50, "z")
        ]
    );
    // A snapshot part with no replay under way is dropped.
    s.handle_snapshot_from(60, Some(7), "late");
    assert!(s.handle_replay_end(t).is_empty());
}

#[test]
fn a_replay_that_finds_its_start_gone_asks_a_kvlink_publisher_again_for_a_snapshot() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.set_snapshots(true);
    // Started from 0 before anything was heard: the publisher's kind is not known yet.
    assert_eq!(s.begin_replay(0, t), vec![Action::RequestReplay(0)]);
    assert!(!s.replay_wants_snapshot());
    // Its first replayed batch says kvlink (an incarnation) and that 0..5 is gone.
    let a = s.handle_replayed_from(5, Some(7), "five");
    assert_eq!(a, vec![Action::RequestReplay(0)]);
    assert!(s.replay_wants_snapshot());
    s.handle_snapshot_from(6, Some(7), "snap");
    let got = s.handle_replay_end(t);
    assert_eq!(got, vec![Action::Snapshot(6, vec!["snap"])]);
    // Asked once: a tagged replay that still finds its start gone reports the loss.
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.set_snapshots(true);
    s.handle_live_from(0, Some(7), "a", t);
    assert_eq!(
        s.handle_live_from(9, Some(7), "z", t),
        vec![Action::RequestReplay(1)]
    );
    assert!(s.replay_wants_snapshot());
    let got = s.handle_replayed_from(5, Some(7), "five");
    assert_eq!(
        got,
        vec![
            Action::Resync(Resync::HistoryLost {
                from: 1,
                resumed: 5
            }),
            Action::Deliver(5, "five")
        ]
    );
    // Without snapshots on, never asked.
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.handle_live_from(0, Some(7), "a", t);
    s.handle_live_from(9, Some(7), "z", t);
    assert!(!s.replay_wants_snapshot());
}

#[test]
fn ring_batches_after_a_snapshot_follow_it_in_order() {
    let t = Instant::now();
    let mut s = StreamState::new(Duration::from_secs(1), 100);
    s.set_snapshots(true);
    s.handle_live_from(0, Some(7), "a", t);
    s.handle_live_from(50, Some(7), "z", t);
    // A snapshot built at 47, then the ring's 48..=50.
    s.handle_snapshot_from(47, Some(7), "snap");
    for (seq, p) in [(48, "b48"), (49, "b49"), (50, "b50")] {
        assert!(s.handle_replayed_from(seq, Some(7), p).is_empty());
    }
    assert_eq!(
        s.handle_replay_end(t),
        vec![
            Action::Snapshot(47, vec!["snap"]),
            Action::Deliver(48, "b48"),
            Action::Deliver(49, "b49"),
            Action::Deliver(50, "b50"),
        ]
    );
}
