//! Sequencing of KV-event streams, without I/O: the publisher's replay ring and the
//! subscriber's state machine for gaps, replay, duplicates, restarts and late joins.
//!
//! The subscriber side takes inputs (`handle_live`, `handle_replayed`, `handle_replay_end`,
//! `poll` with the current time) and returns [`Action`]s for the I/O driver to carry out:
//! deliver a batch, ask the publisher's replay socket for a range, or tell the consumer to
//! resynchronise (clear what it derived from this stream) and why.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// The publisher's ring of recent batches, answering replay requests. It keeps at most `cap`
/// batches and, when payload sizes are given, at most `max_bytes` of them (the newest batch is
/// always kept).
#[derive(Debug)]
pub struct ReplayRing<P> {
    cap: usize,
    max_bytes: usize,
    bytes: usize,
    items: VecDeque<(u64, P, usize)>,
}

impl<P: Clone> ReplayRing<P> {
    /// A ring keeping the last `cap` batches (at least 1; vLLM keeps 10,000).
    pub fn new(cap: usize) -> Self {
        Self::with_max_bytes(cap, usize::MAX)
    }

    /// A ring keeping the last `cap` batches and at most `max_bytes` of payload.
    pub fn with_max_bytes(cap: usize, max_bytes: usize) -> Self {
        ReplayRing {
            cap: cap.max(1),
            max_bytes,
            bytes: 0,
            items: VecDeque::new(),
        }
    }

    /// Records a published batch (sequence numbers increase by one).
    pub fn push(&mut self, seq: u64, payload: P) {
        self.push_sized(seq, payload, 0);
    }

    /// Records a published batch of `size` bytes.
    pub fn push_sized(&mut self, seq: u64, payload: P, size: usize) {
        while !self.items.is_empty()
            && (self.items.len() == self.cap || self.bytes.saturating_add(size) > self.max_bytes)
        {
            if let Some((_, _, n)) = self.items.pop_front() {
                self.bytes -= n;
            }
        }
        self.bytes += size;
        self.items.push_back((seq, payload, size));
    }

    /// Batches held and their payload bytes.
    pub fn len_bytes(&self) -> (usize, usize) {
        (self.items.len(), self.bytes)
    }

    /// Batches with `seq >= start`, oldest first: what a replay request for `start` gets. When
    /// `start` is older than the ring, the answer simply starts later (the requester detects
    /// the loss).
    pub fn replay_from(&self, start: u64) -> impl Iterator<Item = (u64, &P)> + '_ {
        let skip = match self.items.front() {
            Some((first, _, _)) if start > *first => (start - first) as usize,
            _ => 0,
        };
        self.items.iter().skip(skip).map(|(s, p, _)| (*s, p))
    }

    /// Oldest and newest sequence held.
    pub fn bounds(&self) -> Option<(u64, u64)> {
        Some((self.items.front()?.0, self.items.back()?.0))
    }
}

/// Why a consumer must resynchronise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resync {
    /// The sequence went down: the publisher restarted (its old state is gone).
    PublisherRestart {
        /// Last sequence seen before.
        last: u64,
        /// The sequence that arrived.
        now: u64,
    },
    /// Replay could not supply everything asked for (the ring no longer held it, or the replay
    /// did not answer in time): batches `[from, resumed)` are lost.
    HistoryLost {
        /// First sequence asked for.
        from: u64,
        /// First sequence delivered after the loss.
        resumed: u64,
    },
}

/// What the I/O driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<P> {
    /// Hand this batch to the consumer (in sequence order, each once).
    Deliver(u64, P),
    /// Send a replay request for batches from this sequence.
    RequestReplay(u64),
    /// Tell the consumer to drop what it derived from this stream, and why.
    Resync(Resync),
    /// A replay recovered everything from `from` on: a gap (or a late join from `from`) was
    /// filled, and every batch up to `through` has been delivered in order. Informational:
    /// nothing derived from the stream needs dropping.
    GapFilled {
        /// First sequence the replay was asked for.
        from: u64,
        /// Last sequence delivered when the replay ended.
        through: u64,
    },
}

#[derive(Debug)]
struct Replay<P> {
    from: u64,
    deadline: Instant,
    buffered: BTreeMap<u64, P>,
    /// Whether history was lost during this replay (then it did not fill its gap).
    lost: bool,
}

/// One subscriber's view of one publisher stream.
#[derive(Debug)]
pub struct StreamState<P> {
    last: Option<u64>,
    /// Highest sequence seen on the live stream (replays may run ahead of it).
    live_high: Option<u64>,
    replay: Option<Replay<P>>,
    replay_timeout: Duration,
    max_buffered: usize,
    duplicates: u64,
    /// The first sequence wanted before anything was delivered: 0, or `begin_replay`'s start.
    floor: u64,
}

impl<P> StreamState<P> {
    /// A new stream: replays must finish within `replay_timeout`; at most `max_buffered` live
    /// batches are held while one runs (beyond that the oldest are dropped and reported lost).
    pub fn new(replay_timeout: Duration, max_buffered: usize) -> Self {
        StreamState {
            last: None,
            live_high: None,
            replay: None,
            replay_timeout,
            max_buffered: max_buffered.max(1),
            duplicates: 0,
            floor: 0,
        }
    }

    /// Last sequence delivered.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Duplicate batches dropped so far.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Whether a replay is under way.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    fn start_replay(&mut self, from: u64, now: Instant, out: &mut Vec<Action<P>>) {
        self.replay = Some(Replay {
            from,
            deadline: now + self.replay_timeout,
            buffered: BTreeMap::new(),
            lost: false,
        });
        out.push(Action::RequestReplay(from));
    }

    fn deliver(&mut self, seq: u64, payload: P, out: &mut Vec<Action<P>>) {
        self.last = Some(seq);
        out.push(Action::Deliver(seq, payload));
    }

    /// Starts a replay from `from` before (or while) following the live stream: live batches are
    /// buffered until it ends. Used to start at a chosen sequence; batches before it are never
    /// delivered, and when the publisher has not reached it yet the stream starts when it does.
    pub fn begin_replay(&mut self, from: u64, now: Instant) -> Vec<Action<P>> {
        let mut out = Vec::new();
        if self.replay.is_none() {
            if self.last.is_none() {
                self.floor = from;
            }
            self.start_replay(from, now, &mut out);
        }
        out
    }

    /// A batch from the live (PUB/SUB) stream. The I/O driver must not pass `u64::MAX` (the
    /// replay end marker), which no publisher can reach.
    pub fn handle_live(&mut self, seq: u64, payload: P, now: Instant) -> Vec<Action<P>> {
        let mut out = Vec::new();
        match self.live_high {
            // The same batch twice (the wire spec drops duplicates by sequence).
            Some(high) if seq == high => {
                self.duplicates += 1;
                return out;
            }
            // Live batches never go down: the publisher restarted, even in the middle of a
            // replay.
            Some(high) if seq < high => {
                self.live_high = Some(seq);
                let last = self.last.unwrap_or(high).max(high);
                out.push(Action::Resync(Resync::PublisherRestart { last, now: seq }));
                self.last = None;
                self.replay = None;
                self.floor = 0;
                if seq == 0 {
                    self.deliver(seq, payload, &mut out);
                } else {
                    self.start_replay(0, now, &mut out);
                    if let Some(r) = &mut self.replay {
                        r.buffered.insert(seq, payload);
                    }
                }
                return out;
            }
            _ => self.live_high = Some(seq),
        }
        if let Some(r) = &mut self.replay {
            if r.buffered.len() >= self.max_buffered {
                // Bounded: the oldest buffered batch is dropped; the gap shows up as lost
                // history when the replay ends.
                r.buffered.pop_first();
            }
            r.buffered.insert(seq, payload);
            return out;
        }
        match self.last {
            // Before the chosen start: not wanted.
            None if seq < self.floor => self.duplicates += 1,
            // Late join (or a start the stream has passed): bootstrap with a replay.
            None if seq > self.floor => {
                self.start_replay(self.floor, now, &mut out);
                if let Some(r) = &mut self.replay {
                    r.buffered.insert(seq, payload);
                }
            }
            None => self.deliver(seq, payload, &mut out),
            Some(last) if seq == last + 1 => self.deliver(seq, payload, &mut out),
            Some(last) if seq <= last => {
                // Above every earlier live batch but already delivered: a replay ran ahead of
                // the live stream (which was backlogged). Not a restart.
                self.duplicates += 1;
            }
            Some(last) => {
                // A gap (PUB drops silently at its high-water mark): replay it.
                self.start_replay(last + 1, now, &mut out);
                if let Some(r) = &mut self.replay {
                    r.buffered.insert(seq, payload);
                }
            }
        }
        out
    }

    /// A batch answered by the replay socket.
    pub fn handle_replayed(&mut self, seq: u64, payload: P) -> Vec<Action<P>> {
        let mut out = Vec::new();
        let Some(from) = self.replay.as_ref().map(|r| r.from) else {
            return out; // a late answer to a finished replay
        };
        if self.accept_after(from, seq, payload, &mut out) {
            if let Some(r) = &mut self.replay {
                r.lost = true;
            }
        }
        out
    }

    /// Delivers a replayed or buffered batch in sequence: a duplicate (at or before what was
    /// delivered) is dropped, a jump past the next expected sequence is reported as lost history.
    /// Returns whether history was lost.
    fn accept_after(&mut self, from: u64, seq: u64, payload: P, out: &mut Vec<Action<P>>) -> bool {
        let expected = self.last.map_or(from, |l| l + 1).max(from);
        if seq < expected {
            self.duplicates += 1;
            return false;
        }
        let lost = seq > expected;
        if lost {
            out.push(Action::Resync(Resync::HistoryLost {
                from: expected,
                resumed: seq,
            }));
        }
        self.deliver(seq, payload, out);
        lost
    }

    /// The replay's end marker: buffered live batches follow, in order, duplicates dropped. A
    /// gap between buffered batches past the first one (the replay covered up to it) is a
    /// newer live loss: it gets a replay of its own rather than being reported lost.
    pub fn handle_replay_end(&mut self, now: Instant) -> Vec<Action<P>> {
        let mut out = Vec::new();
        let Some(r) = self.replay.take() else {
            return out;
        };
        let mut lost = r.lost;
        let first_buffered = r.buffered.first_key_value().map(|(s, _)| *s);
        let mut rest = r.buffered.into_iter();
        while let Some((seq, payload)) = rest.next() {
            let expected = self.last.map_or(r.from, |l| l + 1).max(r.from);
            let covered = first_buffered.is_some_and(|f| f < expected);
            if seq > expected && covered && !lost {
                // Fill this one by replay too, keeping the rest buffered.
                self.start_replay(expected, now, &mut out);
                if let Some(nr) = &mut self.replay {
                    nr.buffered.insert(seq, payload);
                    nr.buffered.extend(rest);
                }
                return out;
            }
            lost |= self.accept_after(r.from, seq, payload, &mut out);
        }
        if !lost {
            if let Some(through) = self.last.filter(|l| *l >= r.from) {
                out.push(Action::GapFilled {
                    from: r.from,
                    through,
                });
            }
        }
        out
    }

    /// Ends a replay that did not finish by its deadline, as if its end marker had arrived
    /// (publishers that drop malformed requests never answer).
    pub fn poll(&mut self, now: Instant) -> Vec<Action<P>> {
        match &self.replay {
            Some(r) if now >= r.deadline => self.handle_replay_end(now),
            _ => Vec::new(),
        }
    }

    /// When `poll` next has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.replay.as_ref().map(|r| r.deadline)
    }
}

#[cfg(test)]
mod tests {
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
}
