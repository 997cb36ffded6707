//! KV events from Python: `EventPublisher` (an engine publishes its KV-cache events each
//! scheduler step; encoded with the GIL released, queued toward subscribers without waiting),
//! `EventSubscriber` (a
//! router reads decoded batches and resync signals, in sequence order), `EventMerger` (several
//! engines' streams as one) and `PageSplitter` (a stored token run as fixed-size pages with
//! chained hashes).
//!
//! Events cross the boundary as dicts shaped like vLLM's and SGLang's event structs: `"type"`
//! (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `BlockTransferred`) and the fields of
//! that type by their upstream names. `publish` also takes the engines' own event objects
//! (vLLM's msgspec structs, SGLang's dataclasses): the type is the class name, the fields its
//! attributes.

use std::sync::Mutex;

mod fields;
mod index;
mod items;

use kvlink_core::events::{
    encode_batch, Encoding, EventBatch, KvEvent, Merger, MergerConfig, MergerInput, PageHash,
    PageSplitter as RsSplitter, Publisher, PublisherConfig, ReplayFormat, SubItem, Subscriber,
    SubscriberConfig,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert::seconds;
use crate::detach::blocking;
use crate::error::{InvalidArgument, KvlinkError};
use fields::event_from_py;
pub(crate) use fields::event_to_py;
pub(crate) use index::EventIndex;
use items::item_to_py;

fn events_err(e: kvlink_core::events::EventsError) -> PyErr {
    match e {
        kvlink_core::events::EventsError::Endpoint(_)
        | kvlink_core::events::EventsError::Config(_) => InvalidArgument::new_err(e.to_string()),
        e => KvlinkError::new_err(e.to_string()),
    }
}

fn encoding(name: &str) -> PyResult<Encoding> {
    match name {
        "current" => Ok(Encoding::Current),
        "legacy" => Ok(Encoding::Legacy),
        e => Err(InvalidArgument::new_err(format!(
            "encoding must be 'current' or 'legacy', got {e:?}"
        ))),
    }
}

fn replay_format(name: &str) -> PyResult<ReplayFormat> {
    match name {
        "current" => Ok(ReplayFormat::Current),
        "legacy" => Ok(ReplayFormat::Legacy),
        e => Err(InvalidArgument::new_err(format!(
            "replay_format must be 'current' or 'legacy', got {e:?}"
        ))),
    }
}

fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

// ---- EventPublisher ------------------------------------------------------------------------

/// Publishes an engine's KV-cache events, byte-compatible with vLLM's ZmqEventPublisher (and
/// SGLang's): `[topic, seq, payload]` on a PUB socket, a replay ROUTER when configured.
///
/// EventPublisher(endpoint="tcp://*:5557", *, replay_endpoint=None, topic="", dp_rank=0,
/// encoding="current", replay_format="current", buffer_steps=10000, max_queue=100000,
/// snapshot_max_blocks=1048576): with a replay endpoint, the publisher keeps its live blocks
/// (at most `snapshot_max_blocks`; 0: none) and answers a kvlink subscriber whose history the
/// ring no longer holds with a snapshot of them.
#[pyclass(module = "kvlink", frozen)]
pub(crate) struct EventPublisher {
    inner: Mutex<Option<Publisher>>,
    endpoint: String,
    replay_endpoint: Option<String>,
    dp_rank: i64,
    encoding: Encoding,
    incarnation: Option<u64>,
}

#[pymethods]
impl EventPublisher {
    #[new]
    #[pyo3(signature = (endpoint = "tcp://*:5557", *, replay_endpoint = None, topic = "",
        dp_rank = 0, encoding = "current", replay_format = "current", buffer_steps = 10_000,
        max_queue = 100_000, snapshot_max_blocks = 1 << 20))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        replay_endpoint: Option<String>,
        topic: &str,
        dp_rank: u32,
        encoding: &str,
        replay_format: &str,
        buffer_steps: usize,
        max_queue: usize,
        snapshot_max_blocks: usize,
    ) -> PyResult<Self> {
        let cfg = PublisherConfig {
            endpoint: endpoint.to_string(),
            replay_endpoint,
            topic: topic.to_string(),
            dp_rank,
            encoding: self::encoding(encoding)?,
            replay_format: self::replay_format(replay_format)?,
            buffer_steps,
            max_queue,
            snapshot_max_blocks,
            ..PublisherConfig::default()
        };
        let p = blocking(py, || Publisher::start(cfg)).map_err(events_err)?;
        Ok(EventPublisher {
            encoding: p.encoding(),
            endpoint: p.endpoint().to_string(),
            replay_endpoint: p.replay_endpoint().map(str::to_string),
            incarnation: p.incarnation(),
            inner: Mutex::new(Some(p)),
            dp_rank: i64::from(dp_rank),
        })
    }

    /// This run's incarnation, stamped on every batch as a fourth element (kvlink's
    /// subscriber takes a change for a restart; consumers reading three elements ignore it).
    #[getter]
    fn incarnation(&self) -> Option<u64> {
        self.incarnation
    }

    /// The live endpoint subscribers connect to (the real port when port 0 was asked for).
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint, when configured.
    #[getter]
    fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Publishes one batch (one scheduler step): `events` is a list of event dicts or of the
    /// engine's own event objects; `ts` defaults to now, `dp_rank` to the publisher's. The
    /// events are read with the GIL held, encoded with it released, then numbered and queued
    /// toward each subscriber (bound tcp endpoints) or handed to kvlink's thread (ipc and
    /// connected ones); this never blocks. Raises `KvlinkError` when kvlink's queue is full
    /// (ipc and connected endpoints; the batch is dropped and counted) or the publisher is
    /// closed, `InvalidArgument` for an event it cannot read (nothing is sent).
    #[pyo3(signature = (events, ts = None, dp_rank = None))]
    fn publish(
        &self,
        py: Python<'_>,
        events: &Bound<'_, PyAny>,
        ts: Option<f64>,
        dp_rank: Option<i64>,
    ) -> PyResult<()> {
        let mut out = Vec::new();
        for (i, ev) in events.try_iter()?.enumerate() {
            out.push(
                event_from_py(&ev?)
                    .map_err(|e| InvalidArgument::new_err(format!("event {i}: {}", e.value(py))))?,
            );
        }
        let batch = EventBatch {
            ts: ts.unwrap_or_else(now_ts),
            events: out,
            dp_rank: Some(dp_rank.unwrap_or(self.dp_rank)),
        };
        // Encoded without the GIL (and without the lock), in this thread.
        let encoding = self.encoding;
        let payload = blocking(py, move || {
            let mut v = Vec::with_capacity(4096);
            encode_batch(&batch, encoding, &mut v);
            v
        });
        // The push never blocks, so the GIL stays held: releasing it while holding the lock
        // would deadlock against a thread that holds the GIL and waits for the lock (stats).
        let guard = self.inner.lock().expect("publisher lock");
        let p = guard
            .as_ref()
            .ok_or_else(|| KvlinkError::new_err("the KV-event publisher is closed"))?;
        p.publish_encoded(payload).map_err(events_err)
    }

    /// Counters: `published`, `dropped`, `queued`, `next_seq`, `replay_requests`,
    /// `replayed_batches`, `bad_replay_requests`, `replay_timeouts`, `subscriber_drops`.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let guard = self.inner.lock().expect("publisher lock");
        let p = guard
            .as_ref()
            .ok_or_else(|| KvlinkError::new_err("the KV-event publisher is closed"))?;
        pub_stats(py, p.stats())
    }

    /// Sends what is queued (waiting up to `timeout` seconds, GIL released), closes the
    /// sockets and returns the final counters. Idempotent (later calls return None).
    #[pyo3(signature = (timeout = 5.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Py<PyDict>>> {
        let t = seconds("timeout", timeout)?;
        let taken = self.inner.lock().expect("publisher lock").take();
        match taken {
            None => Ok(None),
            Some(mut p) => {
                let s = blocking(py, move || {
                    let s = p.close(t);
                    drop(p);
                    s
                });
                pub_stats(py, s).map(Some)
            }
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py, 5.0)?;
        Ok(false)
    }
}

fn pub_stats(py: Python<'_>, s: kvlink_core::events::PublisherStats) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("published", s.published)?;
    d.set_item("dropped", s.dropped)?;
    d.set_item("queued", s.queued)?;
    d.set_item("next_seq", s.next_seq)?;
    d.set_item("replay_requests", s.replay_requests)?;
    d.set_item("replayed_batches", s.replayed_batches)?;
    d.set_item("bad_replay_requests", s.bad_replay_requests)?;
    d.set_item("replay_timeouts", s.replay_timeouts)?;
    d.set_item("subscriber_drops", s.subscriber_drops)?;
    d.set_item("snapshots", s.snapshots)?;
    d.set_item("snapshots_refused", s.snapshots_refused)?;
    d.set_item("live_blocks", s.live_blocks)?;
    Ok(d.unbind())
}

// ---- EventSubscriber -----------------------------------------------------------------------

/// Reads a vLLM, SGLang, ATOM or kvlink KV-event stream: batches in sequence order, each once;
/// gaps filled by replay; resync signals when the consumer must drop what it derived.
///
/// EventSubscriber(endpoint, *, replay_endpoint=None, topic="", replay_timeout=2.0,
/// connect_timeout=10.0, start_from=None, max_buffered=10000, snapshots=False)
///
/// `next(timeout)` returns one item or None: `{"kind": "batch", "seq", "topic", "ts",
/// "dp_rank", "events", "skipped"}`, `{"kind": "malformed", "seq", "reason"}` or `{"kind": "resync",
/// "reason": "publisher_restart", "last", "now"}` / `{"kind": "resync", "reason":
/// "history_lost", "from", "resumed"}`, or `{"kind": "gap_filled", "from", "through"}` once a
/// replay recovered everything it was asked for. With `snapshots=True`, a kvlink publisher
/// whose ring no longer holds the history asked for answers with its live blocks:
/// `{"kind": "snapshot", "seq", "topic", "batches": [{"ts", "dp_rank", "events"}],
/// "skipped"}` replaces what was derived from the stream. Iterating yields items as they come.
#[pyclass(module = "kvlink", frozen)]
pub(crate) struct EventSubscriber {
    runtime: tokio::runtime::Runtime,
    inner: Mutex<Subscriber>,
}

#[pymethods]
impl EventSubscriber {
    #[new]
    #[pyo3(signature = (endpoint, *, replay_endpoint = None, topic = "", replay_timeout = 2.0,
        connect_timeout = 10.0, start_from = None, max_buffered = 10_000, snapshots = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        replay_endpoint: Option<String>,
        topic: &str,
        replay_timeout: f64,
        connect_timeout: f64,
        start_from: Option<u64>,
        max_buffered: usize,
        snapshots: bool,
    ) -> PyResult<Self> {
        let mut cfg = SubscriberConfig::new(endpoint);
        cfg.replay_endpoint = replay_endpoint;
        cfg.topic = topic.to_string();
        cfg.replay_timeout = seconds("replay_timeout", replay_timeout)?;
        cfg.connect_timeout = seconds("connect_timeout", connect_timeout)?;
        cfg.start_from = start_from;
        cfg.max_buffered = max_buffered;
        cfg.snapshots = snapshots;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| KvlinkError::new_err(format!("starting the subscriber runtime: {e}")))?;
        let sub =
            blocking(py, || runtime.block_on(Subscriber::connect(cfg))).map_err(events_err)?;
        Ok(EventSubscriber {
            runtime,
            inner: Mutex::new(sub),
        })
    }

    /// The next item, waiting up to `timeout` seconds (GIL released); None when nothing came.
    #[pyo3(signature = (timeout = 1.0))]
    fn next(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Py<PyDict>>> {
        let t = seconds("timeout", timeout)?;
        let item = blocking(py, || {
            let mut sub = self.inner.lock().expect("subscriber lock");
            self.runtime.block_on(sub.next(t))
        })
        .map_err(events_err)?;
        let Some(item) = item else { return Ok(None) };
        let out = item_to_py(py, &item)?.unbind();
        // The batch is in Python objects now: the next one is decoded into its allocations
        // (skipped while another thread waits in next(), rather than waiting with the GIL).
        if let (SubItem::Batch { batch, .. }, Ok(mut sub)) = (item, self.inner.try_lock()) {
            sub.recycle(batch);
        }
        Ok(Some(out))
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Blocks until the next item (checking for Ctrl-C every 100 ms).
    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        loop {
            if let Some(item) = self.next(py, 0.1)? {
                return Ok(item);
            }
            py.check_signals()?;
        }
    }

    /// The last sequence handed out, or None.
    #[getter]
    fn last_seq(&self, py: Python<'_>) -> Option<u64> {
        // next() holds the lock while it waits: wait for it without the GIL.
        blocking(py, || {
            self.inner.lock().expect("subscriber lock").last_seq()
        })
    }

    /// Counters: `received`, `delivered`, `duplicates`, `replays` (gaps and late joins filled
    /// by replay), `replay_failures`, `resyncs`, `malformed_batches`, `skipped_events`,
    /// `bad_messages`, `snapshots`.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        // next() holds the lock while it waits: wait for it without the GIL.
        let s = blocking(py, || self.inner.lock().expect("subscriber lock").stats());
        let d = PyDict::new(py);
        d.set_item("received", s.received)?;
        d.set_item("delivered", s.delivered)?;
        d.set_item("duplicates", s.duplicates)?;
        d.set_item("replays", s.replays)?;
        d.set_item("replay_failures", s.replay_failures)?;
        d.set_item("resyncs", s.resyncs)?;
        d.set_item("malformed_batches", s.malformed_batches)?;
        d.set_item("skipped_events", s.skipped_events)?;
        d.set_item("bad_messages", s.bad_messages)?;
        d.set_item("snapshots", s.snapshots)?;
        Ok(d.unbind())
    }
}

// ---- EventMerger ---------------------------------------------------------------------------

/// Merges several publishers' streams (for example the DP ranks of one engine) into one
/// stream of its own, renumbered, with its own replay.
///
/// EventMerger(inputs, endpoint="tcp://*:5557", *, replay_endpoint=None, topic="",
/// encoding="current", input_topic="", keep_topics=False, tp_size=1) where `inputs` is a list
/// of `(endpoint, replay_endpoint or None)`. `topic` is the merged stream's topic frame,
/// `input_topic` the prefix subscribed to on the inputs; `keep_topics` publishes each batch
/// under its input's topic instead (llm-d's `kv@<pod>@<model>`); `tp_size` > 1 applies vLLM's
/// TP rule: inputs come in groups of `tp_size` TP workers, and an event goes out once all of
/// them emitted it.
#[pyclass(module = "kvlink", frozen)]
pub(crate) struct EventMerger {
    inner: Mutex<Option<Merger>>,
    endpoint: String,
    replay_endpoint: Option<String>,
}

#[pymethods]
impl EventMerger {
    #[new]
    #[pyo3(signature = (inputs, endpoint = "tcp://*:5557", *, replay_endpoint = None, topic = "",
        encoding = "current", input_topic = "", keep_topics = false, tp_size = 1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        inputs: Vec<(String, Option<String>)>,
        endpoint: &str,
        replay_endpoint: Option<String>,
        topic: &str,
        encoding: &str,
        input_topic: &str,
        keep_topics: bool,
        tp_size: usize,
    ) -> PyResult<Self> {
        if inputs.is_empty() {
            return Err(PyValueError::new_err(
                "EventMerger needs at least one input",
            ));
        }
        let output = PublisherConfig {
            endpoint: endpoint.to_string(),
            replay_endpoint,
            topic: topic.to_string(),
            encoding: self::encoding(encoding)?,
            ..PublisherConfig::default()
        };
        let inputs = inputs
            .into_iter()
            .map(|(endpoint, replay_endpoint)| MergerInput {
                endpoint,
                replay_endpoint,
                dp_rank: None,
            })
            .collect();
        let cfg = MergerConfig {
            topic: input_topic.to_string(),
            keep_input_topics: keep_topics,
            tp_size,
            ..MergerConfig::new(inputs, output)
        };
        let m = blocking(py, || Merger::start(cfg)).map_err(events_err)?;
        Ok(EventMerger {
            endpoint: m.endpoint().to_string(),
            replay_endpoint: m.replay_endpoint().map(str::to_string),
            inner: Mutex::new(Some(m)),
        })
    }

    /// The merged stream's live endpoint.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The merged stream's replay endpoint, when configured.
    #[getter]
    fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The output publisher's counters, and under `inputs` per input: `endpoint`,
    /// `connected`, `last_seq`, `batches`, `resyncs`, `malformed`, `dropped`.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let guard = self.inner.lock().expect("merger lock");
        let m = guard
            .as_ref()
            .ok_or_else(|| KvlinkError::new_err("the KV-event merger is closed"))?;
        let (out, inputs) = m.stats();
        let d = pub_stats(py, out)?.into_bound(py);
        let l = PyList::empty(py);
        for i in inputs {
            let x = PyDict::new(py);
            x.set_item("endpoint", &i.endpoint)?;
            x.set_item("connected", i.connected)?;
            x.set_item("last_seq", i.last_seq)?;
            x.set_item("batches", i.batches)?;
            x.set_item("resyncs", i.resyncs)?;
            x.set_item("malformed", i.malformed)?;
            x.set_item("dropped", i.dropped)?;
            l.append(x)?;
        }
        d.set_item("inputs", l)?;
        let groups = PyList::empty(py);
        for g in m.tp_stats() {
            let x = PyDict::new(py);
            x.set_item("forwarded", g.forwarded)?;
            x.set_item("held", g.held)?;
            x.set_item("evicted", g.evicted)?;
            groups.append(x)?;
        }
        d.set_item("tp_groups", groups)?;
        Ok(d.unbind())
    }

    /// Stops the merger (GIL released). Idempotent.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.lock().expect("merger lock").take();
        blocking(py, move || drop(taken));
    }
}

// ---- PageSplitter --------------------------------------------------------------------------

/// Splits a stored run of tokens into `BlockStored` events of `block_size` tokens each (a
/// partial tail page allowed), each page chained to the previous one by SHA-256 digests, with
/// `token_offset` set: for consumers that understand fixed-size blocks only.
///
/// PageSplitter(block_size, hash="vllm") where `hash` is "vllm" (low 64 bits of the digest,
/// unsigned) or "sglang" (first 8 bytes, signed).
#[pyclass(module = "kvlink", frozen)]
pub(crate) struct PageSplitter {
    inner: RsSplitter,
}

#[pymethods]
impl PageSplitter {
    #[new]
    #[pyo3(signature = (block_size, hash = "vllm"))]
    fn new(block_size: u32, hash: &str) -> PyResult<Self> {
        let h = match hash {
            "vllm" => PageHash::VllmU64,
            "sglang" => PageHash::SglangI64,
            h => {
                return Err(InvalidArgument::new_err(format!(
                    "hash must be 'vllm' or 'sglang', got {h:?}"
                )))
            }
        };
        if block_size == 0 {
            return Err(InvalidArgument::new_err("block_size must be at least 1"));
        }
        Ok(PageSplitter {
            inner: RsSplitter::new(block_size, h),
        })
    }

    /// `(events, last_digest)`: one BlockStored dict per page of `tokens` (which start at
    /// position `token_offset` and follow the page whose digest is `parent`, None for a
    /// root), and the digest to pass as `parent` for the run that follows.
    #[pyo3(signature = (tokens, parent = None, token_offset = 0, medium = None))]
    fn split<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        parent: Option<&[u8]>,
        token_offset: u64,
        medium: Option<&str>,
    ) -> PyResult<(Bound<'py, PyList>, Option<Bound<'py, PyBytes>>)> {
        let parent: Option<[u8; 32]> = parent
            .map(|p| {
                p.try_into().map_err(|_| {
                    InvalidArgument::new_err(format!(
                        "parent is a 32-byte digest, got {} bytes",
                        p.len()
                    ))
                })
            })
            .transpose()?;
        let pages = self
            .inner
            .split(parent.as_ref(), &tokens, token_offset, medium);
        let events = PyList::empty(py);
        for e in pages.events {
            events.append(event_to_py(py, &KvEvent::BlockStored(e))?)?;
        }
        Ok((events, pages.last_digest.map(|d| PyBytes::new(py, &d))))
    }
}
