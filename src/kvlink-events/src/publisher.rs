//! The KV-event publisher: vLLM's ZeroMQ stream, readable by the routers that already read
//! vLLM and SGLang (Dynamo, llm-d, smg).
//!
//! - Live: a PUB socket sends each batch as `[topic, seq (8 bytes, big-endian), payload]`, `seq`
//!   counting from 0 at start.
//! - Replay (optional): a ROUTER socket answers `["", start_seq]` with every batch of the ring
//!   with `seq >= start_seq`, oldest first, then an end marker (formats in [`ReplayFormat`]).
//!   The ring keeps the last `buffer_steps` batches and at most `replay_max_bytes` of them
//!   (only when a replay endpoint is configured).
//! - Sending: [`Publisher::publish`] never blocks the engine. It encodes the batch in the
//!   calling thread (where its memory was allocated and is freed: handing batches to another
//!   thread to encode and free cost more than the encoding itself). For a bound tcp endpoint
//!   (the publisher's own PUB side) the same thread then numbers it, records it for replay and
//!   queues it toward each subscriber, which never waits; for ipc and connected endpoints (the
//!   `zeromq` crate's sockets) the payload goes to a bounded queue (`max_queue` batches)
//!   drained by the publisher's own thread, which numbers, records and sends. When that queue
//!   is full the batch is refused with [`EventsError::QueueFull`] and counted in `dropped`: it
//!   never gets a sequence number, so subscribers see a consistent stream and the caller
//!   knows. [`Publisher::publish_timeout`] waits for room instead, up to a deadline.
//! - Subscribers that fall behind: the PUB socket drops batches for a subscriber whose send
//!   queue is full (as ZeroMQ does at its high-water mark); the sequence shows the gap and the
//!   subscriber fills it by replay.
//!
//! Endpoints follow vLLM's rules ([`super::endpoint`]). Bound TCP endpoints are served through
//! the frame guard ([`super::guard`]) so that no network peer reaches the `zeromq` crate's
//! unbounded frame buffering.

mod batch;
mod config;
mod live;
mod pool;
mod queue;
mod replay;
mod shared;
mod sockets;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use tokio::runtime::Runtime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket};

use super::error::EventsError;
use super::fanout::QueueBound;
use super::guard::{Limits, PrivateDir};
use super::sequence::ReplayRing;
use super::wire::{encode_batch, fresh_u64, stamp, stamped, Encoding, EventBatch};

pub use batch::BatchBuilder;
pub use config::{PublisherConfig, PublisherStats, ReplayFormat, REPLAY_END, SNAPSHOT_TAG};
pub(crate) use live::LiveDelta;
use live::LiveSet;
use pool::BufferPool;
use queue::publish_loop;
use replay::{serve_replay, Answering, History};
use shared::{Counters, Direct, Item, Shared};
use sockets::{attach, attach_pub, PubSink};

/// A running publisher. Dropping it stops it (see [`Publisher::close`] to drain first).
pub struct Publisher {
    shared: Arc<Shared>,
    encoding: Encoding,
    /// The incarnation stamped on every batch (`None`: not stamped).
    incarnation: Option<u64>,
    /// Whether batches change a live set (kept for snapshots).
    track: bool,
    /// The last payload's size, to size the next one's buffer.
    size_hint: AtomicUsize,
    /// Payload buffers for reuse.
    buffers: Arc<BufferPool>,
    endpoint: String,
    replay_endpoint: Option<String>,
    tasks: Vec<JoinHandle<()>>,
    publish_task: Option<JoinHandle<PubSocket>>,
    /// The PUB socket after `close`, kept open (its queues still draining) until drop.
    closed_socket: Option<PubSocket>,
    runtime: Option<Runtime>,
    _dir: PrivateDir,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Starts a publisher on its own thread: binds or connects the PUB socket, binds the
    /// replay socket when configured. Errors name the endpoint and the cause. It may be called
    /// from synchronous or asynchronous code.
    pub fn start(cfg: PublisherConfig) -> Result<Publisher, EventsError> {
        if cfg.max_queue == 0 || cfg.buffer_steps == 0 {
            return Err(EventsError::Config(
                "max_queue and buffer_steps must be at least 1".into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvlink-events")
            .enable_all()
            .build()
            .map_err(|source| EventsError::Io {
                context: "starting the publisher thread".into(),
                source,
            })?;
        let mut p = block_on_aside(&runtime, Self::start_in(cfg))?;
        p.runtime = Some(runtime);
        Ok(p)
    }

    /// Starts a publisher on the current tokio runtime.
    // Long: binds the sockets, relays and tasks in the order each needs the one before, undoing
    //   them on the first failure.
    pub(crate) async fn start_in(cfg: PublisherConfig) -> Result<Publisher, EventsError> {
        let dir = PrivateDir::new().map_err(|source| EventsError::Io {
            context: "creating a private directory for the ZeroMQ sockets".into(),
            source,
        })?;
        let limits = Limits {
            max_frame: cfg.max_inbound_frame,
            max_message: cfg.max_inbound_frame.saturating_mul(4),
            max_frames: 8,
            handshake: Duration::from_secs(10),
            max_connections: cfg.max_connections.max(1),
            max_messages: 1024,
            stall: Duration::from_secs(30),
        };
        let bound = QueueBound {
            messages: cfg.subscriber_hwm.max(1),
            bytes: cfg.subscriber_hwm_bytes,
        };
        let (endpoint, pub_socket) =
            attach_pub(&cfg.endpoint, cfg.dp_rank, &dir, limits, bound).await?;
        // The own PUB side is sent to from the callers' threads; the `zeromq` crate's sockets
        // from the send loop.
        let (direct, loop_socket) = match pub_socket {
            PubSink::Fanout(fanout) => (
                Some(Mutex::new(Some(Direct {
                    fanout,
                    next_seq: 0,
                }))),
                None,
            ),
            PubSink::Zmq(socket) => (None, Some(socket)),
        };
        let track = cfg.replay_endpoint.is_some() && cfg.snapshot_max_blocks > 0;
        let incarnation = cfg
            .stamp_incarnation
            .then(|| cfg.incarnation.unwrap_or_else(fresh_u64));
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            room: Condvar::new(),
            room_async: Notify::new(),
            work: Notify::new(),
            cap: cfg.max_queue,
            queued_bytes: AtomicUsize::new(0),
            cap_bytes: cfg.max_queue_bytes,
            closed: AtomicBool::new(false),
            ring: Mutex::new(History {
                ring: ReplayRing::with_max_bytes(cfg.buffer_steps, cfg.replay_max_bytes),
                live: track.then(|| LiveSet::new(cfg.snapshot_max_blocks)),
            }),
            counters: Counters::default(),
            direct,
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            keep_for_replay: cfg.replay_endpoint.is_some(),
        });
        let mut tasks = Vec::new();
        let mut replay_endpoint = None;
        if let Some(ep) = &cfg.replay_endpoint {
            let mut router = RouterSocket::new();
            let (resolved, front) =
                attach(&mut router, ep, cfg.dp_rank, true, &dir, "replay", limits).await?;
            tasks.extend(front);
            replay_endpoint = Some(resolved);
            let how = Answering {
                format: cfg.replay_format,
                send_timeout: cfg.replay_send_timeout,
                encoding: cfg.encoding,
                incarnation,
            };
            tasks.push(tokio::spawn(serve_replay(shared.clone(), router, how)));
        }
        let publish_task =
            loop_socket.map(|socket| tokio::spawn(publish_loop(shared.clone(), socket)));
        tracing::info!(
            %endpoint,
            replay = replay_endpoint.as_deref().unwrap_or("off"),
            "KV-event publisher started"
        );
        Ok(Publisher {
            shared,
            encoding: cfg.encoding,
            incarnation,
            track,
            size_hint: AtomicUsize::new(4096),
            buffers: Arc::default(),
            endpoint,
            replay_endpoint,
            tasks,
            publish_task,
            closed_socket: None,
            runtime: None,
            _dir: dir,
        })
    }

    /// The live endpoint subscribers use (with the real port when port 0 was configured).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint, when configured.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Queues a batch; never blocks. Fails with [`EventsError::QueueFull`] (ipc and connected
    /// endpoints, whose queue is bounded; the batch is dropped and counted) or
    /// [`EventsError::Closed`].
    pub fn publish(&self, batch: EventBatch) -> Result<(), EventsError> {
        let payload = self.encode(&batch);
        let delta = self.track.then(|| LiveDelta::take(batch));
        self.queue_payload(payload, delta, None)
    }

    /// Queues a batch the caller keeps; never blocks. The batch is encoded in the calling
    /// thread (where its memory was allocated and is freed), and numbered, recorded for replay
    /// and queued toward subscribers there too for a bound tcp endpoint (on the publisher's
    /// thread for the others).
    pub fn publish_batch(&self, batch: &EventBatch) -> Result<(), EventsError> {
        let payload = self.encode(batch);
        let delta = self.track.then(|| LiveDelta::of(batch));
        self.queue_payload(payload, delta, None)
    }

    fn encode(&self, batch: &EventBatch) -> Bytes {
        let mut v = self.buffers.take(self.size_hint.load(Ordering::Relaxed));
        encode_batch(batch, self.encoding, &mut v);
        if let Some(i) = self.incarnation {
            stamp(&mut v, i);
        }
        self.size_hint.store(v.len(), Ordering::Relaxed);
        self.buffers.payload(v)
    }

    /// Starts a batch with timestamp `ts` (seconds since the epoch), to be encoded event by
    /// event in the publisher's encoding into a buffer of its own ([`BatchBuilder`]) and queued
    /// by [`Publisher::publish_built`]: no [`EventBatch`] is built.
    pub fn builder(&self, ts: f64) -> BatchBuilder {
        BatchBuilder::new(
            self.buffers.clone(),
            self.size_hint.load(Ordering::Relaxed),
            self.encoding,
            ts,
            self.track,
        )
    }

    /// Queues a batch built with [`Publisher::builder`] (with the data-parallel rank, if any);
    /// never blocks. Fails as [`Publisher::publish`] does.
    pub fn publish_built(&self, b: BatchBuilder, dp_rank: Option<i64>) -> Result<(), EventsError> {
        self.queue_built(b, dp_rank, None)
    }

    /// Queues a batch built with [`Publisher::builder`], waiting up to `timeout` for room in
    /// the queue.
    pub fn publish_built_timeout(
        &self,
        b: BatchBuilder,
        dp_rank: Option<i64>,
        timeout: Duration,
    ) -> Result<(), EventsError> {
        self.queue_built(b, dp_rank, Some(Instant::now() + timeout))
    }

    fn queue_built(
        &self,
        b: BatchBuilder,
        dp_rank: Option<i64>,
        deadline: Option<Instant>,
    ) -> Result<(), EventsError> {
        let (payload, size, ops) = b.finish(dp_rank, self.incarnation);
        self.size_hint.store(size, Ordering::Relaxed);
        let delta = ops.map(|ops| LiveDelta { dp_rank, ops });
        self.queue_payload(payload, delta, deadline)
    }

    /// Queues a batch, waiting up to `timeout` for room in the queue.
    pub fn publish_timeout(&self, batch: EventBatch, timeout: Duration) -> Result<(), EventsError> {
        let payload = self.encode(&batch);
        let delta = self.track.then(|| LiveDelta::take(batch));
        self.queue_payload(payload, delta, Some(Instant::now() + timeout))
    }

    /// Queues an already-encoded batch payload (published as is), never blocking.
    pub fn publish_encoded(&self, payload: impl Into<Bytes>) -> Result<(), EventsError> {
        let payload = payload.into();
        let delta = self.delta_of(&payload);
        self.queue_payload(payload, delta, None)
    }

    /// An encoded payload's changes to the live set, when one is kept (read back from it).
    fn delta_of(&self, payload: &[u8]) -> Option<LiveDelta> {
        self.track.then(|| LiveDelta::of_payload(payload))
    }

    /// This run's incarnation, stamped on every batch (`None` when
    /// [`PublisherConfig::stamp_incarnation`] is off).
    pub fn incarnation(&self) -> Option<u64> {
        self.incarnation
    }

    /// The encoding of the payloads [`Publisher::publish`] builds.
    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    /// Queues an already-encoded payload under its own topic frame (instead of the configured
    /// one), never blocking.
    pub fn publish_encoded_with_topic(
        &self,
        topic: Bytes,
        payload: Bytes,
    ) -> Result<(), EventsError> {
        let delta = self.delta_of(&payload);
        self.push(
            Item {
                topic: Some(topic),
                payload,
                delta,
            },
            None,
        )
    }

    /// The changes `batch` makes to the live set, when one is kept: for a caller that
    /// publishes an encoding of a batch it holds decoded ([`Publisher::publish_encoded_async`]).
    pub(crate) fn live_delta(&self, batch: &EventBatch) -> Option<LiveDelta> {
        self.track.then(|| LiveDelta::of(batch))
    }

    /// Queues an already-encoded payload from async code (under `topic`, else the configured
    /// one), waiting up to `deadline` for room; `delta` is its changes to the live set
    /// ([`Publisher::live_delta`] of the batch it encodes).
    pub(crate) async fn publish_encoded_async(
        &self,
        topic: Option<Bytes>,
        payload: Bytes,
        delta: Option<LiveDelta>,
        deadline: tokio::time::Instant,
    ) -> Result<(), EventsError> {
        let payload = stamped(payload, self.incarnation);
        let mut item = Item {
            topic,
            payload,
            delta,
        };
        loop {
            let room = self.shared.room_async.notified();
            match self.shared.try_push(item) {
                Ok(()) => return Ok(()),
                Err(Some(back)) => {
                    if tokio::time::timeout_at(deadline, room).await.is_err() {
                        self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                        return Err(self.shared.queue_full());
                    }
                    item = back;
                }
                Err(None) => return Err(EventsError::Closed),
            }
        }
    }

    /// Queues a payload under the configured topic (waiting up to `deadline` for room, if any).
    fn queue_payload(
        &self,
        payload: Bytes,
        delta: Option<LiveDelta>,
        deadline: Option<Instant>,
    ) -> Result<(), EventsError> {
        let item = Item {
            topic: None,
            payload,
            delta,
        };
        self.push(item, deadline)
    }

    fn push(&self, item: Item, deadline: Option<Instant>) -> Result<(), EventsError> {
        let mut item = Item {
            payload: stamped(item.payload, self.incarnation),
            ..item
        };
        loop {
            match self.shared.try_push(item) {
                Ok(()) => return Ok(()),
                Err(Some(back)) => {
                    let mut q = self.shared.queue.lock();
                    let now = Instant::now();
                    match deadline {
                        // Waits while there is no room by either bound (the publisher's thread
                        // signals `room` each time it takes the queue); never spins.
                        Some(d) if now < d => {
                            if self.shared.full(&q, back.payload.len()) {
                                self.shared.room.wait_until(&mut q, d);
                            }
                        }
                        _ => {
                            drop(q);
                            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!("KV-event publish queue full; batch dropped");
                            return Err(self.shared.queue_full());
                        }
                    }
                    item = back;
                }
                Err(None) => return Err(EventsError::Closed),
            }
        }
    }

    /// Current counters.
    pub fn stats(&self) -> PublisherStats {
        let c = &self.shared.counters;
        let published = c.published.load(Ordering::Relaxed);
        PublisherStats {
            published,
            dropped: c.dropped.load(Ordering::Relaxed),
            queued: self.shared.queue.lock().len() as u64,
            next_seq: published,
            replay_requests: c.replay_requests.load(Ordering::Relaxed),
            replayed_batches: c.replayed_batches.load(Ordering::Relaxed),
            bad_replay_requests: c.bad_replay_requests.load(Ordering::Relaxed),
            replay_timeouts: c.replay_timeouts.load(Ordering::Relaxed),
            subscriber_drops: c.subscriber_drops.load(Ordering::Relaxed),
            snapshots: c.snapshots.load(Ordering::Relaxed),
            snapshots_refused: c.snapshots_refused.load(Ordering::Relaxed),
            live_blocks: self
                .shared
                .ring
                .lock()
                .live
                .as_ref()
                .map_or(0, |l| l.len() as u64),
        }
    }

    /// How many peers of a bound tcp endpoint (the publisher's own PUB side) are connected
    /// and subscribed to something; `None` for ipc and connected endpoints, whose PUB socket
    /// does not say.
    pub fn subscribers(&self) -> Option<usize> {
        let direct = self.shared.direct.as_ref()?;
        direct.lock().as_ref().map(|d| d.fanout.subscribers())
    }

    /// Stops taking batches and hands what is queued to the PUB socket (waiting up to
    /// `timeout`). The sockets stay open, so subscribers can still drain and replay, until
    /// the publisher is dropped.
    pub fn close(&mut self, timeout: Duration) -> PublisherStats {
        self.shared.closed.store(true, Ordering::Release);
        // On the direct path nothing is queued: the PUB side stays in `shared` until drop.
        self.shared.work.notify_one();
        if let (Some(task), Some(rt)) = (self.publish_task.take(), &self.runtime) {
            if let Ok(Ok(socket)) =
                block_on_aside(rt, async move { tokio::time::timeout(timeout, task).await })
            {
                self.closed_socket = Some(socket);
            }
        }
        self.stats()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        if let Some(direct) = &self.shared.direct {
            // The PUB side closes now, not when the last task lets `shared` go.
            drop(direct.lock().take());
        }
        self.shared.room.notify_all();
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if let Some(t) = self.publish_task.take() {
            t.abort();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Runs `f` to completion on `rt` from a helper thread, so that callers may themselves be
/// inside an async runtime (where blocking on another one directly would panic).
pub(crate) fn block_on_aside<F>(rt: &Runtime, f: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    std::thread::scope(|s| {
        s.spawn(|| rt.block_on(f))
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}
