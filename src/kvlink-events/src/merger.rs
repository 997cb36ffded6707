//! The merger: several ranks' KV-event streams re-published as one stream, so that a router
//! subscribes to one endpoint for a whole deployment.
//!
//! Each input is read by a [`Subscriber`] (in order, each batch once, gaps filled by replay,
//! duplicates dropped). Its batches are re-published in arrival order under one global
//! sequence by a [`Publisher`] with its own replay ring. Payloads pass through unchanged (their
//! `dp_rank` slot still says which rank they came from); a batch with skipped events is
//! re-encoded without them.
//!
//! When an input resynchronises (its publisher restarted, or history was lost), the rank's
//! blocks known downstream can no longer be trusted: the merger publishes an
//! `AllBlocksCleared` batch carrying that rank's `dp_rank` (the configured one, else the last
//! one seen), then continues with the rank's new batches.
//!
//! Options: each input's own topic frame kept on the merged stream (llm-d's `kv@<pod>@<model>`
//! topics name the pod), and the TP rule of vLLM's `KVEventAggregator` (`tp_size` > 1: inputs
//! come in groups of `tp_size` TP workers of one data-parallel rank, and an event is published
//! once every worker of its group emitted it; see [`super::aggregate`]). No clear is sent for a rank nothing
//! was forwarded from yet, or whose `dp_rank` is unknown (a clear without one would read as
//! every rank's). An input that cannot be reached at start is retried with backoff while the
//! others flow; once connected, its SUB socket reconnects by itself.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::aggregate::{TpAggregator, TpStats};
use super::error::EventsError;
use super::publisher::{block_on_aside, Publisher, PublisherConfig, PublisherStats};
use super::subscriber::{SubItem, Subscriber, SubscriberConfig};
use super::wire::{encode_batch, Encoding, EventBatch, KvEvent};

/// One input stream.
#[derive(Debug, Clone)]
pub struct MergerInput {
    /// The rank's live endpoint.
    pub endpoint: String,
    /// The rank's replay endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// The rank's `dp_rank` for the clears published on its resyncs (default: the last one its
    /// batches carried).
    pub dp_rank: Option<i64>,
}

/// Merger settings.
#[derive(Debug, Clone)]
pub struct MergerConfig {
    /// The ranks' streams.
    pub inputs: Vec<MergerInput>,
    /// The merged stream's publisher.
    pub output: PublisherConfig,
    /// Topic prefix subscribed to on every input.
    pub topic: String,
    /// Replay timeout on the inputs.
    pub replay_timeout: Duration,
    /// Time a batch may wait for room in the output queue before it is dropped (and counted).
    pub publish_timeout: Duration,
    /// Publish each batch under the topic frame it arrived with (llm-d's `kv@<pod>@<model>`),
    /// instead of the output's configured topic.
    pub keep_input_topics: bool,
    /// vLLM's TP rule: inputs `[k * tp_size, (k + 1) * tp_size)` are the TP workers of one
    /// data-parallel rank, and an event is published once all of them emitted it. 1: off.
    pub tp_size: usize,
    /// Events held per TP group waiting for the other workers (beyond it the oldest is
    /// dropped and counted).
    pub tp_max_pending: usize,
    /// Bytes (of their encoding) of the events held per TP group (beyond it the oldest is
    /// dropped and counted).
    pub tp_max_pending_bytes: usize,
}

impl MergerConfig {
    /// Settings with defaults for the rest.
    pub fn new(inputs: Vec<MergerInput>, output: PublisherConfig) -> Self {
        MergerConfig {
            inputs,
            output,
            topic: String::new(),
            replay_timeout: Duration::from_secs(2),
            publish_timeout: Duration::from_secs(5),
            keep_input_topics: false,
            tp_size: 1,
            tp_max_pending: 100_000,
            tp_max_pending_bytes: 256 << 20,
        }
    }
}

/// One input's state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputStats {
    /// The input's endpoint.
    pub endpoint: String,
    /// Whether its first connection succeeded (the SUB socket reconnects by itself after).
    pub connected: bool,
    /// Last sequence received from it (its own numbering).
    pub last_seq: Option<u64>,
    /// Batches forwarded.
    pub batches: u64,
    /// Resynchronisations (restart or lost history), each followed by a clear downstream.
    pub resyncs: u64,
    /// Unreadable batches skipped.
    pub malformed: u64,
    /// Batches lost because the output queue stayed full.
    pub dropped: u64,
}

/// A running merger. Dropping it stops it.
pub struct Merger {
    publisher: Arc<Publisher>,
    inputs: Arc<Vec<Mutex<InputStats>>>,
    groups: Arc<Vec<Mutex<TpAggregator>>>,
    tp_size: usize,
    tasks: Vec<JoinHandle<()>>,
    runtime: Option<Runtime>,
}

impl std::fmt::Debug for Merger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Merger")
            .field("publisher", &self.publisher)
            .finish_non_exhaustive()
    }
}

impl Merger {
    /// Starts the output publisher and the inputs on the merger's own thread.
    pub fn start(cfg: MergerConfig) -> Result<Merger, EventsError> {
        if cfg.inputs.is_empty() {
            return Err(EventsError::Config(
                "a merger needs at least one input".into(),
            ));
        }
        let tp = cfg.tp_size.max(1);
        if !cfg.inputs.len().is_multiple_of(tp) || tp > 64 {
            return Err(EventsError::Config(format!(
                "tp_size {tp} must divide the number of inputs ({}) and be at most 64",
                cfg.inputs.len()
            )));
        }
        let groups: Arc<Vec<Mutex<TpAggregator>>> = Arc::new(
            (0..cfg.inputs.len() / tp)
                .map(|_| {
                    Mutex::new(TpAggregator::new(
                        tp,
                        cfg.tp_max_pending,
                        cfg.tp_max_pending_bytes,
                    ))
                })
                .collect(),
        );
        let send_order: Arc<Vec<tokio::sync::Mutex<()>>> = Arc::new(
            (0..groups.len())
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvlink-merger")
            .enable_all()
            .build()
            .map_err(|source| EventsError::Io {
                context: "starting the merger threads".into(),
                source,
            })?;
        let publisher = Arc::new(block_on_aside(
            &runtime,
            Publisher::start_in(cfg.output.clone()),
        )?);
        let inputs: Arc<Vec<Mutex<InputStats>>> = Arc::new(
            cfg.inputs
                .iter()
                .map(|i| {
                    Mutex::new(InputStats {
                        endpoint: i.endpoint.clone(),
                        ..Default::default()
                    })
                })
                .collect(),
        );
        let tasks = cfg
            .inputs
            .iter()
            .enumerate()
            .map(|(i, input)| {
                runtime.spawn(run_input(
                    i,
                    input.clone(),
                    cfg.clone(),
                    publisher.clone(),
                    inputs.clone(),
                    groups.clone(),
                    send_order.clone(),
                ))
            })
            .collect();
        Ok(Merger {
            publisher,
            inputs,
            groups,
            tp_size: tp,
            tasks,
            runtime: Some(runtime),
        })
    }

    /// The merged stream's live endpoint.
    pub fn endpoint(&self) -> &str {
        self.publisher.endpoint()
    }

    /// The merged stream's replay endpoint, when configured.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.publisher.replay_endpoint()
    }

    /// With the TP rule on: each data-parallel group's counters (empty when `tp_size` is 1).
    pub fn tp_stats(&self) -> Vec<TpStats> {
        if self.tp_size == 1 {
            return Vec::new();
        }
        self.groups.iter().map(|g| g.lock().stats()).collect()
    }

    /// How many peers subscribed to the merged stream ([`Publisher::subscribers`]).
    pub fn subscribers(&self) -> Option<usize> {
        self.publisher.subscribers()
    }

    /// The output's counters and each input's state.
    pub fn stats(&self) -> (PublisherStats, Vec<InputStats>) {
        (
            self.publisher.stats(),
            self.inputs.iter().map(|i| i.lock().clone()).collect(),
        )
    }
}

impl Drop for Merger {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn clear_batch(dp_rank: Option<i64>) -> EventBatch {
    EventBatch {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        events: vec![KvEvent::all_cleared(None)],
        dp_rank,
    }
}

/// One input's life: connect (again after a failure, with backoff), then forward each item.
// Long: each item is forwarded under its TP group's send lock, taken in the aggregation and
// held until the batch is queued; kept in one function so the guard's span stays visible.
async fn run_input(
    index: usize,
    input: MergerInput,
    cfg: MergerConfig,
    out: Arc<Publisher>,
    stats: Arc<Vec<Mutex<InputStats>>>,
    groups: Arc<Vec<Mutex<TpAggregator>>>,
    send_order: Arc<Vec<tokio::sync::Mutex<()>>>,
) {
    let st = &stats[index];
    let tp = cfg.tp_size.max(1);
    let (group, tp_rank) = (&groups[index / tp], index % tp);
    let order = &send_order[index / tp];
    let mut dp_rank = input.dp_rank;
    let mut backoff = Duration::from_millis(100);
    let encode = |b: &EventBatch, enc: Encoding| {
        let mut v = Vec::new();
        encode_batch(b, enc, &mut v);
        Bytes::from(v)
    };
    let mut topic = Bytes::new();
    loop {
        let sc = SubscriberConfig {
            replay_endpoint: input.replay_endpoint.clone(),
            topic: cfg.topic.clone(),
            replay_timeout: cfg.replay_timeout,
            ..SubscriberConfig::new(input.endpoint.clone())
        };
        let mut sub = match Subscriber::connect(sc).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(input = %input.endpoint, "merger input unavailable, retrying in {backoff:?}: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        st.lock().connected = true;
        tracing::info!(input = %input.endpoint, "merger input connected");
        loop {
            let item = match sub.next(Duration::from_secs(1)).await {
                Ok(Some(item)) => item,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(input = %input.endpoint, "merger input failed: {e}");
                    break;
                }
            };
            // With the TP rule, a group's events go out in the order they completed: the
            // group's send lock is held from the aggregation until the batch is queued.
            let mut in_order = None;
            let (payload, delta) = match item {
                SubItem::Batch {
                    seq,
                    mut batch,
                    skipped,
                    raw,
                    topic: t,
                    encoding,
                } => {
                    if input.dp_rank.is_none() && batch.dp_rank.is_some() {
                        dp_rank = batch.dp_rank;
                    }
                    topic = t;
                    {
                        let mut s = st.lock();
                        s.last_seq = seq.or(s.last_seq);
                        s.batches += 1;
                    }
                    let payload = if tp > 1 {
                        // Only what every TP worker of the group emitted goes out.
                        let events = std::mem::take(&mut batch.events);
                        in_order = Some(order.lock().await);
                        batch.events = group.lock().add(tp_rank, events);
                        if batch.events.is_empty() {
                            continue;
                        }
                        encode(&batch, encoding)
                    } else if skipped.is_empty() {
                        raw
                    } else {
                        // Re-encoded in its own encoding: its events keep their unknown fields.
                        encode(&batch, encoding)
                    };
                    // What the payload holds, for the output's live set (already decoded).
                    let delta = out.live_delta(&batch);
                    // The input's next batch is decoded into this one's allocations.
                    sub.recycle(batch);
                    (payload, delta)
                }
                SubItem::Resync(r) => {
                    if tp > 1 {
                        group.lock().forget(tp_rank);
                    }
                    let forwarded = {
                        let mut s = st.lock();
                        s.resyncs += 1;
                        s.batches > 0
                    };
                    // A clear only makes sense for a rank whose blocks were forwarded, and
                    // only with its dp_rank (a clear without one reads as every rank's).
                    if !forwarded || dp_rank.is_none() {
                        tracing::warn!(input = %input.endpoint, "rank resynchronised ({r:?}); nothing of it forwarded under a known dp_rank, so no clear");
                        continue;
                    }
                    tracing::warn!(input = %input.endpoint, ?dp_rank, "rank resynchronised ({r:?}); publishing AllBlocksCleared for it");
                    let clear = clear_batch(dp_rank);
                    (encode(&clear, cfg.output.encoding), out.live_delta(&clear))
                }
                // Its batches came through in order: nothing to forward or clear.
                SubItem::GapFilled { .. } => continue,
                // Never asked for: inputs subscribe without snapshots (a rank's lost history
                // is a resync above, forwarded as a clear).
                SubItem::Snapshot { .. } => continue,
                SubItem::Malformed { seq, reason } => {
                    let mut s = st.lock();
                    s.last_seq = seq.or(s.last_seq);
                    s.malformed += 1;
                    tracing::warn!(input = %input.endpoint, ?seq, "unreadable batch skipped: {reason}");
                    continue;
                }
            };
            let deadline = tokio::time::Instant::now() + cfg.publish_timeout;
            let topic = cfg.keep_input_topics.then(|| topic.clone());
            let published = out.publish_encoded_async(topic, payload, delta, deadline);
            if let Err(e) = published.await {
                st.lock().dropped += 1;
                tracing::warn!(input = %input.endpoint, "merged batch dropped: {e}");
            }
            drop(in_order);
        }
        st.lock().connected = false;
    }
}
