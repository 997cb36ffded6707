//! The publisher's settings ([`PublisherConfig`]), its counters ([`PublisherStats`]) and the
//! replay answer's formats.

use std::time::Duration;

use crate::wire::Encoding;

/// The sequence value that marks the end of a replay answer.
pub const REPLAY_END: u64 = u64::MAX;

/// The frame that asks a replay for a snapshot when its start is gone (third frame of the
/// request), and that tags each message of a snapshot answer (first frame after the empty one).
pub const SNAPSHOT_TAG: &[u8] = b"kvlink-snapshot";

/// How replay answers are framed (as seen by a DEALER, after the ROUTER's identity frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayFormat {
    /// vLLM >= 0.26, SGLang 0.5.23: `["", topic, seq, payload]`, end `["", "", 0xFF*8, ""]`.
    #[default]
    Current,
    /// vLLM <= 0.25: `["", seq, payload]`, end `["", 0xFF*8, ""]`.
    Legacy,
}

/// Publisher settings; the defaults are vLLM's.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Live endpoint (`tcp://*:5557`): bound when it has `*` or `::` or is ipc, else connected.
    pub endpoint: String,
    /// Replay endpoint (off by default), always bound.
    pub replay_endpoint: Option<String>,
    /// Topic frame (prefix-matched by subscribers).
    pub topic: String,
    /// Data-parallel rank: added to tcp ports, appended as `_dp{r}` to ipc paths.
    pub dp_rank: u32,
    /// Event encoding of payloads built from [`EventBatch`](crate::EventBatch)es.
    pub encoding: Encoding,
    /// Framing of replay answers.
    pub replay_format: ReplayFormat,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Payload bytes kept for replay (the newest batch is always kept).
    pub replay_max_bytes: usize,
    /// Batches waiting to be sent before `publish` refuses more (ipc and connected endpoints;
    /// a bound tcp endpoint queues toward each subscriber instead, see `subscriber_hwm`).
    pub max_queue: usize,
    /// Payload bytes waiting to be sent before `publish` refuses more (a batch is always
    /// taken into an empty queue, whatever its size; as `max_queue`).
    pub max_queue_bytes: usize,
    /// Time allowed to send one whole replay answer to a requester.
    pub replay_send_timeout: Duration,
    /// Largest frame a network peer may send to the bound sockets (subscriptions and replay
    /// requests are tiny).
    pub max_inbound_frame: u64,
    /// Most network connections to the bound sockets at once.
    pub max_connections: usize,
    /// Messages waiting toward one subscriber of a bound tcp endpoint before it loses the
    /// next ones (ZeroMQ's SNDHWM; vLLM's default).
    pub subscriber_hwm: usize,
    /// Bytes waiting toward one subscriber of a bound tcp endpoint before it loses the next
    /// messages.
    pub subscriber_hwm_bytes: usize,
    /// This run's incarnation (`None`: drawn at start), stamped on every batch as a fourth
    /// element ([`crate::incarnation_of`]) so that subscribers see a restart even once the new
    /// sequence has passed the old one.
    pub incarnation: Option<u64>,
    /// Whether batches carry the incarnation (consumers that read three elements ignore a
    /// fourth); off, they are the bare `[ts, events, dp_rank]`.
    pub stamp_incarnation: bool,
    /// Most blocks the live set (what a snapshot announces) keeps, when a replay endpoint is
    /// configured (0: no live set, no snapshots). Past it, snapshots are refused until an
    /// `AllBlocksCleared` empties the set.
    pub snapshot_max_blocks: usize,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        PublisherConfig {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            dp_rank: 0,
            encoding: Encoding::Current,
            replay_format: ReplayFormat::Current,
            buffer_steps: 10_000,
            replay_max_bytes: 256 << 20,
            max_queue: 100_000,
            max_queue_bytes: 64 << 20,
            replay_send_timeout: Duration::from_secs(5),
            max_inbound_frame: 64 << 10,
            max_connections: 1024,
            subscriber_hwm: 100_000,
            subscriber_hwm_bytes: 256 << 20,
            incarnation: None,
            stamp_incarnation: true,
            snapshot_max_blocks: 1 << 20,
        }
    }
}

/// Publisher counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Batches numbered, recorded for replay and handed to the PUB socket.
    pub published: u64,
    /// Batches refused because the queue was full (they got no sequence number).
    pub dropped: u64,
    /// Batches waiting in the queue now.
    pub queued: u64,
    /// The sequence number the next batch gets.
    pub next_seq: u64,
    /// Replay requests answered.
    pub replay_requests: u64,
    /// Batches sent in replay answers.
    pub replayed_batches: u64,
    /// Malformed replay requests ignored.
    pub bad_replay_requests: u64,
    /// Replay answers cut short (the requester did not take them in time).
    pub replay_timeouts: u64,
    /// Messages a subscriber of a bound tcp endpoint lost because its queue was full
    /// ([`PublisherConfig::subscriber_hwm`] messages or `subscriber_hwm_bytes`, as a ZeroMQ
    /// PUB at its high-water mark), summed over subscribers.
    pub subscriber_drops: u64,
    /// Snapshots of the live set sent in replay answers.
    pub snapshots: u64,
    /// Snapshots asked for while the live set could not vouch for itself (past its bound, or
    /// after a payload it could not read); the ring was replayed instead.
    pub snapshots_refused: u64,
    /// Blocks in the live set now.
    pub live_blocks: u64,
}
