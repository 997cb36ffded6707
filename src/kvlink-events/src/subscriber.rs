//! The KV-event subscriber: reads vLLM, SGLang, ATOM and kvlink streams without their failure
//! modes. It drives [`StreamState`] with a SUB socket (live) and a DEALER socket (replay):
//! - batches come out strictly in sequence order, each once;
//! - a gap (PUB drops silently at its high-water mark) is filled by replay from the last
//!   sequence + 1, live batches being buffered meanwhile; without a replay endpoint, or when
//!   the replay does not answer within `replay_timeout`, the gap is reported as lost history;
//! - a late join (first sequence above 0) bootstraps with a replay from 0;
//! - a sequence going down (publisher restart) and history the replay no longer holds are
//!   reported as [`SubItem::Resync`]: the consumer must drop what it derived from the stream;
//! - an unreadable batch is reported ([`SubItem::Malformed`]) in its place in the sequence, and
//!   unreadable events inside a readable batch are skipped one by one, with reasons;
//! - messages with a wrong frame layout are counted and dropped;
//! - with `snapshots` on, a replay asked of a kvlink publisher whose ring no longer holds the
//!   history is answered with a snapshot of the publisher's live blocks, handed out whole
//!   ([`SubItem::Snapshot`]) instead of the loss.
//!
//! Each replay uses a fresh DEALER connection, so a late answer to an abandoned replay can
//! never be taken for part of the next one.
//!
//! Trust: framing is handled by the `zeromq` crate, which does not bound frame sizes; connect
//! only to publishers of your own deployment (see docs/architecture.md).

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::error::{EventsError, MessageError, ReplayError};
use super::publisher::{REPLAY_END, SNAPSHOT_TAG};
use super::sequence::{Action, Resync, StreamState};
use super::wire::{
    decode_batch_reusing, incarnation_of, BatchError, Encoding, EventBatch, SkippedEvent,
};

/// Subscriber settings.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The publisher's live endpoint (`tcp://host:5557`); the subscriber connects to it.
    pub endpoint: String,
    /// The publisher's replay endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (empty: everything).
    pub topic: String,
    /// Time allowed for a whole replay answer.
    pub replay_timeout: Duration,
    /// Live batches buffered while a replay runs (beyond that the oldest are dropped and
    /// reported lost).
    pub max_buffered: usize,
    /// Time allowed for the first connection to the publisher.
    pub connect_timeout: Duration,
    /// Replay from this sequence before following the live stream (needs a replay endpoint).
    pub start_from: Option<u64>,
    /// Ask a kvlink publisher (one whose batches carry an incarnation) for a snapshot of its
    /// live blocks when its ring no longer holds the history a replay asks for: the snapshot
    /// comes out as [`SubItem::Snapshot`] instead of [`Resync::HistoryLost`]. Off by default
    /// (the stream then holds only what vLLM's and SGLang's publishers send).
    pub snapshots: bool,
    /// Fault injection for tests: live batches whose sequence this accepts are discarded on
    /// arrival, as if PUB had dropped them.
    #[doc(hidden)]
    pub drop_live: Option<fn(u64) -> bool>,
}

impl SubscriberConfig {
    /// Settings for `endpoint` with defaults: no replay, every topic, 2 s replay timeout,
    /// 10,000 buffered batches, 10 s to connect.
    pub fn new(endpoint: impl Into<String>) -> Self {
        SubscriberConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            replay_timeout: Duration::from_secs(2),
            max_buffered: 10_000,
            connect_timeout: Duration::from_secs(10),
            start_from: None,
            snapshots: false,
            drop_live: None,
        }
    }
}

/// What the subscriber hands out, in stream order.
#[derive(Debug, Clone, PartialEq)]
pub enum SubItem {
    /// A batch. `seq` is `None` only for old publishers that send no sequence frame.
    Batch {
        /// Sequence number.
        seq: Option<u64>,
        /// The decoded batch (without the skipped events).
        batch: EventBatch,
        /// The events of this batch that were skipped, each with why.
        skipped: Vec<SkippedEvent>,
        /// The payload as received.
        raw: Bytes,
        /// The topic frame it came with (empty for publishers without one; a replayed batch
        /// in the legacy replay format, which has none, takes the live stream's latest).
        topic: Bytes,
        /// The encoding of its events: re-encoding the batch in it keeps their unknown fields.
        encoding: Encoding,
    },
    /// A batch whose payload could not be read at all; it still takes its place in sequence.
    Malformed {
        /// Sequence number.
        seq: Option<u64>,
        /// Why it is unreadable.
        reason: BatchError,
    },
    /// Drop what was derived from this stream, and why.
    Resync(Resync),
    /// The publisher's live blocks as of sequence `seq` (the replay no longer held the
    /// history before it): replace what was derived from this stream with these batches of
    /// `BlockStored` events (one DP rank each, parents before children); the stream goes on
    /// at `seq + 1`.
    Snapshot {
        /// The last sequence the snapshot includes.
        seq: u64,
        /// Its batches.
        batches: Vec<EventBatch>,
        /// Events of its batches that were skipped, each with why (the snapshot is then
        /// incomplete).
        skipped: Vec<SkippedEvent>,
        /// The topic frame it came with.
        topic: Bytes,
    },
    /// A gap (or a late join) was filled by replay: batches `from..=through` were delivered in
    /// order. Nothing to drop; for logs and metrics.
    GapFilled {
        /// First sequence the replay was asked for.
        from: u64,
        /// Last sequence delivered when it ended.
        through: u64,
    },
}

/// Subscriber counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubscriberStats {
    /// Live messages received.
    pub received: u64,
    /// Batches handed out (including malformed ones).
    pub delivered: u64,
    /// Batches dropped as duplicates.
    pub duplicates: u64,
    /// Replay requests sent.
    pub replays: u64,
    /// Replays that failed (could not connect, or no end marker in time).
    pub replay_failures: u64,
    /// Resynchronisation signals handed out.
    pub resyncs: u64,
    /// Batches whose payload was unreadable.
    pub malformed_batches: u64,
    /// Events skipped inside readable batches.
    pub skipped_events: u64,
    /// Messages dropped for their frame layout.
    pub bad_messages: u64,
    /// Snapshots handed out.
    pub snapshots: u64,
}

/// A connected subscriber.
pub struct Subscriber {
    cfg: SubscriberConfig,
    sub: SubSocket,
    dealer: Option<DealerSocket>,
    state: StreamState<Frames>,
    /// The topic of the latest live message (for replay answers that carry none).
    topic: Bytes,
    out: VecDeque<SubItem>,
    stats: SubscriberStats,
    /// A batch handed back by [`Subscriber::recycle`], decoded into next.
    spare: Option<EventBatch>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("endpoint", &self.cfg.endpoint)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// A message's topic and payload.
type Frames = (Bytes, Bytes);

/// A live message's `(seq, (topic, payload))`: `[topic, seq, payload]`, or the sequence-less
/// `[topic, payload]` and `[payload]` of old publishers.
fn parse_live(frames: Vec<Bytes>) -> Result<(Option<u64>, Frames), MessageError> {
    let n = frames.len();
    let mut it = frames.into_iter();
    match n {
        3 => {
            let topic = it.next().unwrap_or_default();
            let seq = it.next().unwrap_or_default();
            let seq = <[u8; 8]>::try_from(seq.as_ref())
                .map_err(|_| MessageError::SequenceFrame(seq.len()))?;
            let seq = u64::from_be_bytes(seq);
            if seq == REPLAY_END {
                return Err(MessageError::ReservedSequence);
            }
            Ok((Some(seq), (topic, it.next().unwrap_or_default())))
        }
        2 => {
            let topic = it.next().unwrap_or_default();
            Ok((None, (topic, it.next().unwrap_or_default())))
        }
        1 => Ok((None, (Bytes::new(), it.next().unwrap_or_default()))),
        n => Err(MessageError::Frames(n)),
    }
}

/// One message of a replay answer.
#[derive(Debug, PartialEq)]
enum Replayed {
    /// A batch of the ring: its sequence, topic (none in the legacy format) and payload.
    Batch(u64, Option<Bytes>, Bytes),
    /// A part of a snapshot: the last sequence it includes, its topic and payload.
    Snapshot(u64, Bytes, Bytes),
}

/// A replay answer's message, after the DEALER's empty delimiter: `[topic, seq, payload]`
/// (current), `[seq, payload]` (legacy: no topic), or a snapshot part
/// `["kvlink-snapshot", topic, seq, payload]`.
fn parse_replayed(frames: Vec<Bytes>) -> Result<Replayed, MessageError> {
    let mut frames = frames;
    if frames.first().is_some_and(|f| f.is_empty()) && frames.len() >= 3 {
        frames.remove(0);
    }
    let seq_of = |seq: &Bytes| {
        <[u8; 8]>::try_from(seq.as_ref())
            .map(u64::from_be_bytes)
            .map_err(|_| MessageError::SequenceFrame(seq.len()))
    };
    match frames.len() {
        4 if frames[0].as_ref() == SNAPSHOT_TAG => Ok(Replayed::Snapshot(
            seq_of(&frames[2])?,
            frames[1].clone(),
            frames[3].clone(),
        )),
        3 => Ok(Replayed::Batch(
            seq_of(&frames[1])?,
            Some(frames[0].clone()),
            frames[2].clone(),
        )),
        2 => Ok(Replayed::Batch(
            seq_of(&frames[0])?,
            None,
            frames[1].clone(),
        )),
        n => Err(MessageError::ReplayFrames(n)),
    }
}

async fn recv_dealer(d: &mut Option<DealerSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match d {
        Some(d) => d.recv().await,
        None => std::future::pending().await,
    }
}

impl Subscriber {
    /// Connects to the publisher (waiting up to `connect_timeout` for it) and subscribes.
    pub async fn connect(cfg: SubscriberConfig) -> Result<Subscriber, EventsError> {
        if cfg.start_from.is_some() && cfg.replay_endpoint.is_none() {
            return Err(EventsError::Config(
                "starting from a sequence needs the publisher's replay endpoint".into(),
            ));
        }
        let mut opts = SocketOptions::default();
        opts.connect_timeout(cfg.connect_timeout);
        let mut sub = SubSocket::with_options(opts);
        sub.connect(&cfg.endpoint)
            .await
            .map_err(|source| EventsError::Zmq {
                context: format!("connecting to the KV-event publisher at {}", cfg.endpoint),
                source,
            })?;
        sub.subscribe(&cfg.topic)
            .await
            .map_err(|source| EventsError::Zmq {
                context: format!("subscribing at {}", cfg.endpoint),
                source,
            })?;
        let mut state = StreamState::new(cfg.replay_timeout, cfg.max_buffered);
        state.set_snapshots(cfg.snapshots);
        let mut s = Subscriber {
            state,
            cfg,
            sub,
            dealer: None,
            topic: Bytes::new(),
            out: VecDeque::new(),
            stats: SubscriberStats::default(),
            spare: None,
        };
        if let Some(from) = s.cfg.start_from {
            let actions = s.state.begin_replay(from, std::time::Instant::now());
            s.apply(actions).await;
        }
        Ok(s)
    }

    /// Counters so far.
    pub fn stats(&self) -> SubscriberStats {
        SubscriberStats {
            duplicates: self.state.duplicates(),
            ..self.stats
        }
    }

    /// Hands a delivered batch back once the caller is done with it: the next batch is decoded
    /// into its allocations (its events' vectors and strings), which saves most of the
    /// allocator's work on a steady stream. Optional; one batch is kept.
    pub fn recycle(&mut self, batch: EventBatch) {
        self.spare = Some(batch);
    }

    /// Last sequence handed out.
    pub fn last_seq(&self) -> Option<u64> {
        self.state.last()
    }

    /// The next item, waiting up to `timeout`; `None` when nothing arrived in time.
    pub async fn next(&mut self, timeout: Duration) -> Result<Option<SubItem>, EventsError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(item) = self.out.pop_front() {
                return Ok(Some(item));
            }
            let replay_deadline = self.state.next_deadline().map(Instant::from_std);
            tokio::select! {
                m = self.sub.recv() => match m {
                    Ok(m) => {
                        self.stats.received += 1;
                        match parse_live(m.into_vec()) {
                            Ok((Some(seq), _)) if self.cfg.drop_live.is_some_and(|f| f(seq)) => {}
                            Ok((Some(seq), frames)) => {
                                self.topic = frames.0.clone();
                                let inc = incarnation_of(&frames.1);
                                let a = self.state.handle_live_from(seq, inc, frames, std::time::Instant::now());
                                self.apply(a).await;
                            }
                            Ok((None, frames)) => self.deliver(None, frames),
                            Err(why) => self.bad(why),
                        }
                    }
                    Err(e) => {
                        tracing::debug!(endpoint = %self.cfg.endpoint, "KV-event SUB receive: {e}");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
                m = recv_dealer(&mut self.dealer) => match m.map(|m| parse_replayed(m.into_vec())) {
                    Ok(Ok(Replayed::Batch(REPLAY_END, _, _))) => {
                        self.dealer = None;
                        let a = self.state.handle_replay_end(std::time::Instant::now());
                        self.apply(a).await;
                    }
                    Ok(Ok(Replayed::Snapshot(seq, topic, payload))) => {
                        let inc = incarnation_of(&payload);
                        self.state.handle_snapshot_from(seq, inc, (topic, payload));
                    }
                    Ok(Ok(Replayed::Batch(seq, topic, payload))) => {
                        let topic = topic.unwrap_or_else(|| self.topic.clone());
                        let inc = incarnation_of(&payload);
                        let a = self.state.handle_replayed_from(seq, inc, (topic, payload));
                        self.apply(a).await;
                    }
                    Ok(Err(why)) => self.bad(why),
                    Err(e) => {
                        tracing::debug!("KV-event replay receive: {e}");
                        self.dealer = None;
                    }
                },
                _ = tokio::time::sleep_until(replay_deadline.unwrap_or(deadline)), if replay_deadline.is_some() => {
                    if self.state.replaying() {
                        self.stats.replay_failures += 1;
                        tracing::warn!(
                            endpoint = ?self.cfg.replay_endpoint,
                            "KV-event replay did not finish within {:?}", self.cfg.replay_timeout
                        );
                    }
                    self.dealer = None;
                    let a = self.state.poll(std::time::Instant::now());
                    self.apply(a).await;
                }
                _ = tokio::time::sleep_until(deadline) => return Ok(None),
            }
        }
    }

    fn bad(&mut self, why: MessageError) {
        self.stats.bad_messages += 1;
        tracing::debug!(endpoint = %self.cfg.endpoint, "KV-event message dropped: {why}");
    }

    fn deliver(&mut self, seq: Option<u64>, (topic, raw): Frames) {
        self.stats.delivered += 1;
        let spare = self.spare.take().unwrap_or_default();
        match decode_batch_reusing(&raw, spare) {
            Ok(d) => {
                self.stats.skipped_events += d.skipped.len() as u64;
                self.out.push_back(SubItem::Batch {
                    seq,
                    batch: d.batch,
                    skipped: d.skipped,
                    raw,
                    topic,
                    encoding: d.encoding,
                });
            }
            Err(e) => {
                self.stats.malformed_batches += 1;
                self.out.push_back(SubItem::Malformed { seq, reason: e });
            }
        }
    }

    /// Hands out a snapshot whole: its parts decoded; an unreadable part follows it as
    /// [`SubItem::Malformed`] (what was derived is then incomplete).
    fn deliver_snapshot(&mut self, seq: u64, parts: Vec<Frames>) {
        self.stats.snapshots += 1;
        let topic = parts.first().map(|p| p.0.clone()).unwrap_or_default();
        let (mut batches, mut skipped, mut bad) = (Vec::new(), Vec::new(), Vec::new());
        for (_, raw) in parts {
            match decode_batch_reusing(&raw, EventBatch::default()) {
                Ok(d) => {
                    batches.push(d.batch);
                    skipped.extend(d.skipped);
                }
                Err(e) => bad.push(e),
            }
        }
        tracing::info!(endpoint = %self.cfg.endpoint, seq, batches = batches.len(), "KV-event snapshot loaded");
        self.stats.skipped_events += skipped.len() as u64;
        self.out.push_back(SubItem::Snapshot {
            seq,
            batches,
            skipped,
            topic,
        });
        for reason in bad {
            self.stats.malformed_batches += 1;
            let seq = Some(seq);
            self.out.push_back(SubItem::Malformed { seq, reason });
        }
    }

    async fn apply(&mut self, actions: Vec<Action<Frames>>) {
        let mut pending = VecDeque::from(actions);
        while let Some(a) = pending.pop_front() {
            match a {
                Action::Deliver(seq, payload) => self.deliver(Some(seq), payload),
                Action::Resync(r) => {
                    self.stats.resyncs += 1;
                    tracing::info!(endpoint = %self.cfg.endpoint, "KV-event stream resync: {r:?}");
                    self.out.push_back(SubItem::Resync(r));
                }
                Action::GapFilled { from, through } => {
                    tracing::debug!(endpoint = %self.cfg.endpoint, from, through, "KV-event gap filled by replay");
                    self.out.push_back(SubItem::GapFilled { from, through });
                }
                Action::Snapshot(seq, parts) => self.deliver_snapshot(seq, parts),
                Action::RequestReplay(from) => {
                    self.stats.replays += 1;
                    if let Err(why) = self.request_replay(from).await {
                        self.stats.replay_failures += 1;
                        tracing::warn!(endpoint = %self.cfg.endpoint, "KV-event replay from {from}: {why}");
                        self.dealer = None;
                        pending.extend(self.state.handle_replay_end(std::time::Instant::now()));
                    }
                }
            }
        }
    }

    async fn request_replay(&mut self, from: u64) -> Result<(), ReplayError> {
        let Some(ep) = self.cfg.replay_endpoint.clone() else {
            return Err(ReplayError::NoEndpoint);
        };
        let mut opts = SocketOptions::default();
        opts.connect_timeout(self.cfg.replay_timeout);
        let mut dealer = DealerSocket::with_options(opts);
        dealer
            .connect(&ep)
            .await
            .map_err(|source| ReplayError::Connect {
                endpoint: ep.clone(),
                source,
            })?;
        let mut frames = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        // Only a kvlink publisher (its batches carry an incarnation) is asked: vLLM's would
        // log a malformed request and never answer.
        if self.state.replay_wants_snapshot() {
            frames.push(Bytes::from_static(SNAPSHOT_TAG));
        }
        let req = ZmqMessage::try_from(frames).expect("two or three frames");
        tokio::time::timeout(self.cfg.replay_timeout, dealer.send(req))
            .await
            .map_err(|_| ReplayError::SendTimeout {
                endpoint: ep.clone(),
            })?
            .map_err(|source| ReplayError::Send {
                endpoint: ep.clone(),
                source,
            })?;
        self.dealer = Some(dealer);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[u8]) -> Bytes {
        Bytes::copy_from_slice(v)
    }

    #[test]
    fn frame_layouts() {
        let seq = 5u64.to_be_bytes();
        assert_eq!(
            parse_live(vec![b(b"t"), b(&seq), b(b"p")]).unwrap(),
            (Some(5), (b(b"t"), b(b"p")))
        );
        assert_eq!(
            parse_live(vec![b(b"t"), b(b"p")]).unwrap(),
            (None, (b(b"t"), b(b"p")))
        );
        assert!(parse_live(vec![b(b"t"), b(&[1, 2]), b(b"p")]).is_err());
        assert!(parse_live(vec![b(b""); 4]).is_err());
        assert!(parse_live(vec![]).is_err());
        assert_eq!(
            parse_replayed(vec![b(b""), b(b"t"), b(&seq), b(b"p")]).unwrap(),
            Replayed::Batch(5, Some(b(b"t")), b(b"p"))
        );
        assert_eq!(
            parse_replayed(vec![b(b""), b(&seq), b(b"p")]).unwrap(),
            Replayed::Batch(5, None, b(b"p"))
        );
        assert_eq!(
            parse_replayed(vec![b(b""), b(SNAPSHOT_TAG), b(b"t"), b(&seq), b(b"p")]).unwrap(),
            Replayed::Snapshot(5, b(b"t"), b(b"p"))
        );
        assert!(parse_replayed(vec![b(b""), b(b"x"), b(b"t"), b(&seq), b(b"p")]).is_err());
        assert!(parse_replayed(vec![b(b""), b(b"p")]).is_err());
        assert!(parse_replayed(vec![b(b""), b(b"t"), b(b"short"), b(b"p")]).is_err());
    }
}
