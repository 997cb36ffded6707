//! The `Engine` class: one kvlink engine per worker process.

use std::sync::{Arc, Mutex};

use kvlink_core::{
    Engine as RsEngine, EngineConfig, FollowRequest, KvLayout, PointerKind, ReadFrom, ReadRequest,
    RegionId, TransportChoice,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::aggregator::{finished_to_py, Finished};
use crate::convert::{
    array_buffer, block_groups, hold_request, request_id, seconds, tensor_layout,
};
use crate::detach::blocking;
use crate::error::{to_py, InvalidArgument};
use crate::report::{capabilities_dict, stats_dict};

/// One kvlink engine per worker process (one per tensor-parallel rank).
///
/// Engine(listen="127.0.0.1:0", *, transport="auto", tp_rank=0, tp_size=1, request_timeout=None,
/// abort_timeout=None, handshake_timeout=None, tcp_streams=None, rdma_device=None, engine_id=None,
/// gpu=True, staging_chunk_bytes=None, staging_buffers=None, auth_key=None, insecure=False,
/// lease=None, session_idle=None, spin_us=None)
///
/// A setting left None takes the engine's default (`EngineConfig::default()`, the one place
/// they are written): request_timeout 60 s, abort_timeout 480 s, handshake_timeout 5 s,
/// tcp_streams 4, staging_chunk_bytes 2 MiB, staging_buffers 32, lease 30 s, session_idle
/// 120 s, spin_us 50.
///
/// `spin_us` (microseconds, at most 10,000): how long `wait_finished` polls while reads are in
/// flight before it sleeps, so a read that finishes meanwhile is seen without a thread
/// wake-up; a small TCP read polls its socket and a small RDMA read its completion queue as
/// long, and a TCP data connection serving this engine's memory polls for its reader's next
/// request as long after each; 0 never polls.
///
/// `lease` (seconds): a held request whose reader engine lost every control connection to this
/// one ends this long after, unless the reader comes back (`abort_timeout` bounds a reader that
/// never comes).
///
/// `session_idle` (seconds): a session to a peer that no read or message used for this long
/// closes in order (the peer keeps this engine's holds on their abort timeouts), and the next
/// read to that peer opens a new one; 0 keeps sessions open.
///
/// `auth_key` (str or bytes, at least 16 bytes) is the deployment key every engine shares; None
/// reads KVLINK_AUTH_KEY or KVLINK_AUTH_KEY_FILE. Without a key the engine only listens on
/// loopback unless `insecure=True` (or KVLINK_INSECURE=1).
#[pyclass(module = "kvlink", frozen)]
pub(crate) struct Engine {
    pub(crate) inner: Arc<RsEngine>,
    /// Python objects whose memory is registered, kept alive while registered.
    keep: Mutex<Vec<(u32, PyObject)>>,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:0", *, transport = "auto", tp_rank = 0, tp_size = 1,
        request_timeout = None, abort_timeout = None, handshake_timeout = None, tcp_streams = None,
        rdma_device = None, engine_id = None, gpu = true, staging_chunk_bytes = None,
        staging_buffers = None, auth_key = None, insecure = false, lease = None,
        session_idle = None, spin_us = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        transport: &str,
        tp_rank: u32,
        tp_size: u32,
        request_timeout: Option<f64>,
        abort_timeout: Option<f64>,
        handshake_timeout: Option<f64>,
        tcp_streams: Option<u16>,
        rdma_device: Option<String>,
        engine_id: Option<String>,
        gpu: bool,
        staging_chunk_bytes: Option<u64>,
        staging_buffers: Option<usize>,
        auth_key: Option<&Bound<'_, PyAny>>,
        insecure: bool,
        lease: Option<f64>,
        session_idle: Option<f64>,
        spin_us: Option<u64>,
    ) -> PyResult<Self> {
        let auth_key = auth_key.map(crate::convert::auth_key).transpose()?;
        // Outside the engine crate a config is built from its defaults (it is non-exhaustive);
        // a setting left None keeps the default.
        let secs = |name, v: Option<f64>, default| v.map_or(Ok(default), |v| seconds(name, v));
        let mut cfg = EngineConfig::default();
        cfg.listen = listen.to_string();
        cfg.engine_id = engine_id;
        cfg.tp_rank = tp_rank;
        cfg.tp_size = tp_size;
        cfg.tcp_streams = tcp_streams.unwrap_or(cfg.tcp_streams);
        cfg.request_timeout = secs("request_timeout", request_timeout, cfg.request_timeout)?;
        cfg.abort_timeout = secs("abort_timeout", abort_timeout, cfg.abort_timeout)?;
        cfg.lease = secs("lease", lease, cfg.lease)?;
        cfg.session_idle = match session_idle {
            Some(0.0) => std::time::Duration::ZERO,
            v => secs("session_idle", v, cfg.session_idle)?,
        };
        if let Some(us) = spin_us {
            cfg.spin = std::time::Duration::from_micros(us);
        }
        cfg.handshake_timeout = secs(
            "handshake_timeout",
            handshake_timeout,
            cfg.handshake_timeout,
        )?;
        cfg.transport = transport
            .parse::<TransportChoice>()
            .map_err(|e| InvalidArgument::new_err(e.to_string()))?;
        cfg.gpu = gpu;
        cfg.staging_chunk_bytes = staging_chunk_bytes.unwrap_or(cfg.staging_chunk_bytes);
        cfg.staging_buffers = staging_buffers.unwrap_or(cfg.staging_buffers);
        cfg.auth_key = auth_key;
        cfg.insecure = insecure;
        cfg.rdma.device = rdma_device;
        let inner = blocking(py, || RsEngine::start(cfg)).map_err(to_py)?;
        Ok(Engine {
            inner: Arc::new(inner),
            keep: Mutex::new(Vec::new()),
        })
    }

    /// The address peers use for the handshake: put it into a request's transfer parameters.
    #[getter]
    fn handshake_address(&self) -> String {
        self.inner.handshake_address().to_string()
    }

    /// This engine's id.
    #[getter]
    fn engine_id(&self) -> String {
        self.inner.engine_id().to_string()
    }

    /// The RDMA device in use, or None (see `rdma_unavailable_reason`).
    #[getter]
    fn rdma_device(&self) -> Option<String> {
        self.inner.rdma_status().ok()
    }

    /// Why RDMA is not used, or None when it is.
    #[getter]
    fn rdma_unavailable_reason(&self) -> Option<String> {
        self.inner.rdma_status().err()
    }

    /// Registers memory given as a raw address and size; returns the region id. `owner` (the
    /// object that owns the memory: an array, a tensor, an mmap) is kept alive until
    /// `deregister(region)` has returned. Without an owner the caller guarantees the memory
    /// stays valid until then: freed earlier, peers would read whatever reuses it.
    /// `device=None` asks the loaded GPU runtimes whether it is GPU memory; `True` or `False`
    /// says so.
    #[pyo3(signature = (ptr, size, *, device = None, owner = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        ptr: usize,
        size: u64,
        device: Option<bool>,
        owner: Option<PyObject>,
    ) -> PyResult<u32> {
        let on_gpu = match device {
            Some(d) => d,
            None => matches!(
                self.inner.classify_pointer(ptr as u64).map_err(to_py)?,
                PointerKind::Device { .. }
            ),
        };
        let id = self.register_raw(py, ptr, size, on_gpu)?;
        if let Some(owner) = owner {
            self.keep.lock().expect("keep list").push((id, owner));
        }
        Ok(id)
    }

    /// The transports and memory kinds this engine found: `{name: (available, detail)}` for
    /// `rdma`, `tcp`, `cuda` and `hip`, the detail saying why when unavailable.
    fn capabilities(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        capabilities_dict(py, &self.inner.capabilities())
    }

    /// Registers the memory of an array (numpy, CuPy, or a torch tensor on the CPU or a GPU;
    /// contiguous, writable); keeps the array alive while registered. Returns the region id.
    pub(crate) fn register_array(&self, array: &Bound<'_, PyAny>) -> PyResult<u32> {
        let (ptr, nbytes, on_gpu) = array_buffer(array)?;
        // The array's buffer is valid while the array lives; `keep` holds a reference to the
        // array until the region is deregistered (or the engine dropped).
        let id = self.register_raw(array.py(), ptr, nbytes, on_gpu)?;
        self.keep
            .lock()
            .expect("keep list")
            .push((id, array.clone().unbind()));
        Ok(id)
    }

    /// Stops exporting a region, waiting (GIL released) until no transfer uses it; then releases
    /// the array it came from.
    fn deregister(&self, py: Python<'_>, region: u32) -> PyResult<()> {
        let inner = self.inner.clone();
        blocking(py, move || inner.deregister(RegionId(region))).map_err(to_py)?;
        // Take the array out under the lock and release it after: dropping it may run Python
        // code that calls back into this engine.
        let released: Vec<(u32, PyObject)> = {
            let mut keep = self.keep.lock().expect("keep list");
            let (gone, stay) = std::mem::take(&mut *keep)
                .into_iter()
                .partition(|(id, _)| *id == region);
            *keep = stay;
            gone
        };
        drop(released);
        Ok(())
    }

    /// Sets the KV layout. `tensors` is a list of `(region, offset, block_stride, block_bytes,
    /// num_blocks)` tuples, one per tensor (per layer K and V, MLA latent, scales...), in the
    /// order both sides agree on.
    #[pyo3(signature = (tensors, tokens_per_block, dtype))]
    pub(crate) fn set_layout(
        &self,
        tensors: Vec<Bound<'_, PyAny>>,
        tokens_per_block: u32,
        dtype: String,
    ) -> PyResult<()> {
        let mut layout = KvLayout::numbered(tokens_per_block, dtype, []);
        for (i, t) in tensors.iter().enumerate() {
            layout.tensors.push(tensor_layout(i, t)?);
        }
        self.apply_layout(layout)
    }

    /// Registers each array (numpy, CuPy, or torch on the CPU or a GPU; first axis = blocks,
    /// C-contiguous) and sets the layout to one tensor per array, in order: the usual per-layer K/V caches. Returns the
    /// region ids (for `deregister`); on any error the regions this call registered are
    /// deregistered again.
    #[pyo3(signature = (arrays, tokens_per_block, dtype))]
    fn register_kv_caches(
        &self,
        py: Python<'_>,
        arrays: &Bound<'_, PyList>,
        tokens_per_block: u32,
        dtype: String,
    ) -> PyResult<Vec<u32>> {
        let mut regions = Vec::new();
        let result = self.register_all(arrays, tokens_per_block, dtype, &mut regions);
        if result.is_err() {
            for r in regions.drain(..) {
                let _ = self.deregister(py, r);
            }
        }
        result.map(|()| regions)
    }

    /// Starts reading `remote_blocks` of the engine at `peer` (its handshake address) into
    /// `local_blocks`, pairwise, for every tensor. Returns at once; the outcome arrives through
    /// get_finished(). Raises InvalidArgument for bad ids, duplicate local blocks or a missing
    /// layout.
    ///
    /// `remote_request_id` is the id the prefill holds the request under when it differs from
    /// `request_id`, this engine's own id (the one get_finished() and cancel() use).
    ///
    /// `remote_tokens_per_block`: the prefill's tokens per block when they differ from this
    /// engine's (one a multiple of the other); the block lists then cover the same tokens, each
    /// in its own size. `first_tokens`: per block group, the tokens of the first block of the
    /// larger size (either side's) before the first one read; `None`: 0.
    ///
    /// `hold`: the token of the prefill's hold (what its hold_blocks() returned, sent with the
    /// transfer parameters): only that hold confirms the read, never a later hold of a reused
    /// request id. `None`: whichever hold of the id the prefill has.
    #[pyo3(signature = (peer, request_id, local_blocks, remote_blocks, remote_request_id = None, remote_tokens_per_block = None, first_tokens = None, hold = None))]
    #[allow(clippy::too_many_arguments)]
    fn read_blocks(
        &self,
        peer: &Bound<'_, PyAny>,
        request_id: &Bound<'_, PyAny>,
        local_blocks: &Bound<'_, PyAny>,
        remote_blocks: &Bound<'_, PyAny>,
        remote_request_id: Option<&Bound<'_, PyAny>>,
        remote_tokens_per_block: Option<u32>,
        first_tokens: Option<Vec<u32>>,
        hold: Option<u64>,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        let remote_id = match remote_request_id {
            Some(r) => self::request_id(r)?,
            None => id.clone(),
        };
        let from = if let Ok(one) = peer.extract::<String>() {
            ReadFrom::Engine(one)
        } else {
            let group: Vec<String> = peer.extract().map_err(|_| {
                InvalidArgument::new_err(
                    "peer must be a handshake address, or the prefill TP group's addresses in rank order",
                )
            })?;
            ReadFrom::TpGroup(group)
        };
        let local = block_groups("local_blocks", local_blocks)?;
        let remote = block_groups("remote_blocks", remote_blocks)?;
        self.inner
            .read(ReadRequest {
                id,
                remote_id,
                from,
                local,
                remote,
                remote_tokens_per_block,
                first_tokens: first_tokens.unwrap_or_default(),
                hold,
            })
            .map_err(to_py)
    }

    /// Prefill side: drops the hold of `request_id` (aborted or preempted before its reader was
    /// told): the grant ends at once and nothing is reported for it. Returns whether it was
    /// held, once its blocks may be reused: a hold an RDMA reader pinned as it posted its
    /// reads is waited for, at most the engine's read pin, 20 ms (the GIL released meanwhile).
    fn release(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = self::request_id(request_id)?;
        Ok(py.allow_threads(|| self.inner.release(id)))
    }

    /// Decode side: tells the prefill at `peer` that this engine will not read its request
    /// `remote_request_id`, so it frees the blocks now rather than at its abort timeout (a
    /// request rejected or aborted before its read started; a read in flight is cancel()led
    /// instead). Returns at once; the notice leaves once the session to `peer` is up. `hold`
    /// names the hold rejected (its token); `None`: whichever hold of that id the prefill has.
    #[pyo3(signature = (peer, remote_request_id, reason = "rejected", hold = None))]
    fn reject(
        &self,
        peer: &str,
        remote_request_id: &Bound<'_, PyAny>,
        reason: &str,
        hold: Option<u64>,
    ) -> PyResult<()> {
        let id = self::request_id(remote_request_id)?;
        self.inner.reject(peer, id, hold, reason).map_err(to_py)
    }

    /// Sends `body` (bytes, at most 64 KiB) to the engine at `peer` over the authenticated
    /// control connection, for its application (`messages()`): connectors announce what a
    /// reader may read with it. Returns at once; messages to one peer arrive in call order. One
    /// that cannot be delivered (peer unreachable) is logged and counted in `stats()`
    /// (`messages_unsent`): the application's own protocol must time out.
    fn send_message(&self, peer: &str, body: &[u8]) -> PyResult<()> {
        self.inner.send_message(peer, body.to_vec()).map_err(to_py)
    }

    /// The messages peers sent since the last call, oldest first, as ``(sender engine id,
    /// body bytes)``: the engine id is the one the sender proved in its handshake. The inbox
    /// holds at most 4,096 messages or 16 MiB (further ones are refused and counted), so call
    /// it every scheduler step. Never blocks.
    fn messages<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        Ok(self
            .inner
            .take_messages()
            .into_iter()
            .map(|m| (m.from, PyBytes::new(py, &m.body)))
            .collect())
    }

    /// Prefill side: holds `blocks` of a request for its reader and grants them to it (over
    /// TCP the reader may read those blocks, and only those, under this request id). The send
    /// finishes when the reader confirms, fails when it aborts, and expires after
    /// `abort_timeout` seconds. `reader` names the only engine allowed to read and confirm;
    /// without it, the first engine that does becomes that reader.
    ///
    /// Returns the hold's token (an int): `token` when given (non-zero; a scheduler gives every
    /// TP rank's hold of one request the same one), else one the engine picks. Send it with the
    /// transfer parameters; the reader passes it to read_blocks(hold=...), so a reused request
    /// id never confirms an earlier read.
    #[pyo3(signature = (request_id, blocks, reader = None, abort_timeout = None, token = None))]
    fn hold_blocks(
        &self,
        request_id: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        reader: Option<&str>,
        abort_timeout: Option<f64>,
        token: Option<u64>,
    ) -> PyResult<u64> {
        let req = hold_request(request_id, blocks, reader, abort_timeout, token)?;
        self.inner.hold(req).map_err(to_py)
    }

    /// Prefill side: holds a request whose blocks are not all final yet (a progressive
    /// transfer): as hold_blocks(), but `blocks` may be empty, the hold grows by extend_hold()
    /// as blocks become final, and confirms no read before seal_hold(). Readers that follow
    /// the request (follow_blocks()) read each part as it is held. Returns the hold's token.
    #[pyo3(signature = (request_id, blocks, reader = None, abort_timeout = None, token = None))]
    fn hold_growing(
        &self,
        request_id: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        reader: Option<&str>,
        abort_timeout: Option<f64>,
        token: Option<u64>,
    ) -> PyResult<u64> {
        let req = hold_request(request_id, blocks, reader, abort_timeout, token)?;
        self.inner.hold_growing(req).map_err(to_py)
    }

    /// Prefill side: adds `blocks` (final from now on; after those held so far, in order) to
    /// the growing hold of `request_id`, and tells its followers. `tensors`: `(start, end)`
    /// of the layout's tensors (in the order registered) when only those are final, for a
    /// step whose layers become final a group at a time: new blocks with `(0, end)`, then no
    /// block (`[]`) with the next tensors of the same blocks until the last. Raises for a
    /// request not held, a sealed hold, blocks it holds already, tensors out of order. Never
    /// blocks.
    #[pyo3(signature = (request_id, blocks, tensors = None))]
    fn extend_hold(
        &self,
        request_id: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        tensors: Option<(u32, u32)>,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        let blocks = block_groups("blocks", blocks)?;
        let r = match tensors {
            Some((start, end)) => self.inner.extend_hold_tensors(id, &blocks, start..end),
            None => self.inner.extend_hold(id, &blocks),
        };
        r.map_err(to_py)
    }

    /// Prefill side: seals the growing hold of `request_id`: it is complete, its readers may
    /// confirm their reads, and its followers are told. Never blocks.
    fn seal_hold(&self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        self.inner.seal_hold(id).map_err(to_py)
    }

    /// Decode side: starts a progressive read of the request the prefill at `peer` holds (or
    /// will hold) under `remote_request_id` (default: `request_id`) into `local_blocks`, all
    /// of the request's blocks here, paired in order with the prefill's as it holds them. Each
    /// part is read as soon as the prefill holds it; the read ends in get_finished() once the
    /// prefill sealed its hold, every part is here and the prefill confirmed it held them
    /// throughout, or fails (the hold ended first, a part did not come in time, the request
    /// timeout). `first_part_timeout` and `part_timeout` (seconds; default the request
    /// timeout) bound the wait for the first part and for each later one. `skip`: per block
    /// group, how many of the prefill's first blocks are not read (a prefix this engine has;
    /// `local_blocks` then pair with those after them). Returns at once.
    #[pyo3(signature = (peer, request_id, local_blocks, remote_request_id = None, hold = None, first_part_timeout = None, part_timeout = None, skip = None))]
    #[allow(clippy::too_many_arguments)]
    fn follow_blocks(
        &self,
        peer: &str,
        request_id: &Bound<'_, PyAny>,
        local_blocks: &Bound<'_, PyAny>,
        remote_request_id: Option<&Bound<'_, PyAny>>,
        hold: Option<u64>,
        first_part_timeout: Option<f64>,
        part_timeout: Option<f64>,
        skip: Option<Vec<u32>>,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        let remote_id = match remote_request_id {
            Some(r) => self::request_id(r)?,
            None => id.clone(),
        };
        let secs = |what, t: Option<f64>| t.map(|t| seconds(what, t)).transpose();
        self.inner
            .follow(FollowRequest {
                peer: peer.to_string(),
                id,
                remote_id,
                local: block_groups("local_blocks", local_blocks)?,
                skip: skip.unwrap_or_default(),
                remote_tokens_per_block: None,
                hold,
                first_part_timeout: secs("first_part_timeout", first_part_timeout)?,
                part_timeout: secs("part_timeout", part_timeout)?,
            })
            .map_err(to_py)
    }

    /// Decode side: cancels the read `request_id`. Nothing more is written into its blocks once
    /// in-flight data is drained, it ends in `failed` with a reason saying it was cancelled, and
    /// the prefill is told so it frees its blocks at once. Returns whether such a read was in
    /// flight; never blocks.
    fn cancel(&self, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.cancel(self::request_id(request_id)?))
    }

    /// Everything that finished since the last call, each request once. Never blocks.
    fn get_finished(&self, py: Python<'_>) -> PyResult<Finished> {
        let f = self.inner.get_finished();
        finished_to_py(py, &f)
    }

    /// Like get_finished(), but waits up to `timeout` seconds (GIL released) for something to
    /// finish.
    fn wait_finished(&self, py: Python<'_>, timeout: f64) -> PyResult<Finished> {
        let t = seconds("timeout", timeout)?;
        let inner = self.inner.clone();
        let f = blocking(py, move || inner.wait_finished(t));
        finished_to_py(py, &f)
    }

    /// Connects to `peer` (or reuses the session) and returns a summary of its descriptor
    /// (engine_id, tp_rank, tp_size, tokens_per_block, dtype, num_blocks, transports). Blocks up
    /// to `timeout` seconds with the GIL released.
    #[pyo3(signature = (peer, timeout = 10.0))]
    fn connect(&self, py: Python<'_>, peer: String, timeout: f64) -> PyResult<Py<PyDict>> {
        let t = seconds("timeout", timeout)?;
        let inner = self.inner.clone();
        let d = blocking(py, move || inner.connect(&peer, t)).map_err(to_py)?;
        let out = PyDict::new(py);
        out.set_item("engine_id", &d.engine_id)?;
        out.set_item("tp_rank", d.tp_rank)?;
        out.set_item("tp_size", d.tp_size)?;
        out.set_item("tokens_per_block", d.layout.tokens_per_block)?;
        out.set_item("dtype", &d.layout.dtype)?;
        out.set_item("num_blocks", d.layout.num_blocks())?;
        out.set_item("groups", d.layout.num_groups())?;
        out.set_item("tensors", d.layout.tensors.len())?;
        let transports: Vec<&str> = [
            d.tcp().map(|_| "tcp"),
            (!d.rdma().is_empty()).then_some("rdma"),
            d.local().map(|_| "local"),
        ]
        .into_iter()
        .flatten()
        .collect();
        out.set_item("transports", transports)?;
        Ok(out.unbind())
    }

    /// What this engine knows of its session with `peer`, without waiting or connecting:
    /// `("none" | "connecting" | "up" | "down", reason or None)`.
    fn session_state(&self, peer: &str) -> (&'static str, Option<String>) {
        match self.inner.session_state(peer) {
            kvlink_core::SessionState::None => ("none", None),
            kvlink_core::SessionState::Connecting => ("connecting", None),
            kvlink_core::SessionState::Up => ("up", None),
            kvlink_core::SessionState::Down(why) => ("down", Some(why)),
        }
    }

    /// Requests being received and sends being held: `(receiving, holding)`.
    fn in_flight(&self) -> (usize, usize) {
        self.inner.in_flight()
    }

    /// Closes the engine (GIL released): its ports close, its sessions end, reads in flight
    /// fail ("engine shutting down"), and later network calls raise. What finished stays
    /// readable with get_finished(). Registered arrays are kept until the engine is freed.
    /// Idempotent; also called when the engine is garbage-collected, and by `with`.
    fn close(&self, py: Python<'_>) {
        let inner = self.inner.clone();
        blocking(py, move || inner.close());
    }

    /// Whether close() was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// Counters of what this engine served, refused and staged: `handshakes_accepted`,
    /// `handshakes_refused`, `data_requests_served`, `data_requests_refused`, `bytes_served`,
    /// `bytes_staged_out` (GPU bytes copied out to be sent over TCP), `bytes_staged_in`
    /// (received bytes copied into GPU memory) and `notices_refused` (readers' confirmations
    /// of requests not held, or held for another reader), `messages_received`,
    /// `messages_refused`, `messages_sent`, `messages_unsent`, `rdma_pairs_paused`; then the requests finished since
    /// the engine started: `reads_done`, `reads_failed` (of which `reads_expired` and
    /// `reads_cancelled`), `bytes_read`, `sends_done`, `sends_failed` (of which
    /// `sends_expired`, of which `sends_lease_expired`: the reader was gone for its whole lease),
    /// `sessions_opened` and `sessions_closed_idle` (sessions to peers made, and closed after
    /// `session_idle` unused). Those are monotonic counters; `control_connections`,
    /// `data_connections` (served now), `sessions` (open to peers now) and `queue_pairs` (RDMA
    /// queue pairs held now) are gauges.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        stats_dict(py, &self.inner.stats())
    }
}

impl Engine {
    /// Sets a layout built by the bindings.
    pub(crate) fn apply_layout(&self, layout: KvLayout) -> PyResult<()> {
        self.inner.set_layout(layout).map_err(to_py)
    }
}
