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
    /// The publisher's snapshot of its live blocks as of sequence `.0` (its parts, in order),
    /// which the replay answered with because it no longer held the history asked for: the
    /// consumer replaces what it derived from this stream with it; the stream goes on at
    /// `.0 + 1`.
    Snapshot(u64, Vec<P>),
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
    /// The snapshot the answer holds, if any: its sequence and the parts so far.
    snapshot: Option<(u64, Vec<P>)>,
    /// Whether this replay asks for a snapshot should its start be gone.
    tagged: bool,
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
    /// The publisher's incarnation, once a batch carried one.
    incarnation: Option<u64>,
    /// Whether replays may ask a kvlink publisher for a snapshot.
    snapshots: bool,
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
            incarnation: None,
            snapshots: false,
        }
    }

    /// Lets replays ask for a snapshot of the publisher's live blocks when the history they
    /// ask for is gone, once the publisher is known to be kvlink's (its batches carry an
    /// incarnation); see [`Action::Snapshot`].
    pub fn set_snapshots(&mut self, on: bool) {
        self.snapshots = on;
    }

    /// Whether the replay under way asks for a snapshot should its start be gone (the
    /// request's third frame).
    pub fn replay_wants_snapshot(&self) -> bool {
        self.replay.as_ref().is_some_and(|r| r.tagged)
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
            snapshot: None,
            tagged: self.snapshots && self.incarnation.is_some(),
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
            Some(high) if seq < high => return self.restarted(seq, payload, now),
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

    /// [`handle_live`](Self::handle_live) for a batch that says which incarnation of its
    /// publisher sent it (`crate::incarnation_of`): another incarnation than the one seen
    /// before means the publisher restarted, whatever the sequence says (a new process may
    /// have passed the old one's sequence before this subscriber heard from it).
    pub fn handle_live_from(
        &mut self,
        seq: u64,
        incarnation: Option<u64>,
        payload: P,
        now: Instant,
    ) -> Vec<Action<P>> {
        match (incarnation, self.incarnation) {
            (Some(i), Some(old)) if i != old => {
                self.incarnation = Some(i);
                self.restarted(seq, payload, now)
            }
            (Some(i), _) => {
                self.incarnation = Some(i);
                self.handle_live(seq, payload, now)
            }
            (None, _) => self.handle_live(seq, payload, now),
        }
    }

    /// [`handle_replayed`](Self::handle_replayed) for a batch that says which incarnation sent
    /// it: one of another incarnation than the live stream's is not this stream's history
    /// (the publisher restarted since), and is dropped; the live stream reports the restart.
    pub fn handle_replayed_from(
        &mut self,
        seq: u64,
        incarnation: Option<u64>,
        payload: P,
    ) -> Vec<Action<P>> {
        match (incarnation, self.incarnation) {
            (Some(i), Some(live)) if i != live => {
                self.duplicates += 1;
                Vec::new()
            }
            (Some(i), None) => {
                self.incarnation = Some(i);
                self.handle_replayed(seq, payload)
            }
            _ => self.handle_replayed(seq, payload),
        }
    }

    /// The publisher restarted (its sequence went down, or its incarnation changed): the
    /// consumer drops what it derived, and the new process's stream is followed from its
    /// start (replayed from 0 when this batch is not the first).
    fn restarted(&mut self, seq: u64, payload: P, now: Instant) -> Vec<Action<P>> {
        let mut out = Vec::new();
        let high = self.live_high.unwrap_or(0);
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
        out
    }

    /// A part of a snapshot the replay socket answered with (sequence `seq`, the last batch it
    /// includes), with the incarnation it says sent it: kept until the answer's end marker,
    /// when the whole snapshot is handed over; one of another incarnation than the live
    /// stream's is dropped.
    pub fn handle_snapshot_from(&mut self, seq: u64, incarnation: Option<u64>, payload: P) {
        let other = matches!((incarnation, self.incarnation), (Some(i), Some(live)) if i != live);
        let Some(r) = self.replay.as_mut().filter(|_| !other) else {
            self.duplicates += 1;
            return;
        };
        match &mut r.snapshot {
            Some((s, parts)) if *s == seq => parts.push(payload),
            _ => r.snapshot = Some((seq, vec![payload])),
        }
    }

    /// A batch answered by the replay socket.
    pub fn handle_replayed(&mut self, seq: u64, payload: P) -> Vec<Action<P>> {
        let mut out = Vec::new();
        let Some(from) = self.replay.as_ref().map(|r| r.from) else {
            return out; // a late answer to a finished replay
        };
        let expected = self.last.map_or(from, |l| l + 1).max(from);
        let may_ask = self.snapshots && self.incarnation.is_some();
        if let Some(r) = self.replay.as_mut() {
            if r.snapshot.is_some() {
                // The ring's batches after a snapshot: they follow it at the end marker.
                r.buffered.insert(seq, payload);
                return out;
            }
            if seq > expected && !r.tagged && may_ask {
                // The history is gone, and the publisher (now known to be kvlink's) can stand
                // for it with a snapshot: asked again, for one, within the same deadline (on a
                // fresh connection: the rest of this answer is not read).
                r.from = expected;
                r.tagged = true;
                r.buffered.insert(seq, payload);
                out.push(Action::RequestReplay(expected));
                return out;
            }
        }
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
        let mut snapshot = false;
        if let Some((seq, parts)) = r.snapshot {
            // Only past what was delivered (a snapshot never goes back).
            if self.last.is_none_or(|l| seq > l) {
                self.last = Some(seq);
                out.push(Action::Snapshot(seq, parts));
                snapshot = true;
            }
        }
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
        if !lost && !snapshot {
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
    /// (publishers that drop malformed requests never answer); a snapshot it was receiving is
    /// incomplete, and dropped.
    pub fn poll(&mut self, now: Instant) -> Vec<Action<P>> {
        match &mut self.replay {
            Some(r) if now >= r.deadline => {
                r.snapshot = None;
                self.handle_replay_end(now)
            }
            _ => Vec::new(),
        }
    }

    /// When `poll` next has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.replay.as_ref().map(|r| r.deadline)
    }
}

#[cfg(test)]
mod tests;
