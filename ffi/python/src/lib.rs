//! Python bindings of kvlink: the worker lifecycle of a disaggregated KV connector.
//!
//! Thin by design: every call forwards to `kvlink::Engine` or `kvlink::TpAggregator`. Blocking
//! calls release the GIL; no Rust thread ever calls into Python; Rust errors become exceptions
//! of the `KvlinkError` family whose messages say what to do.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink_core::{
    DeviceMemory, Engine as RsEngine, EngineConfig, Error, ExternalMemory, Finished as RsFinished,
    KvLayout, PointerKind, RegionId, RequestId, Side, TensorLayout, TpAggregator as RsAggregator,
    TransportChoice,
};
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::sync::Mutex;

pyo3::create_exception!(
    kvlink,
    KvlinkError,
    PyException,
    "Base class of kvlink errors."
);
pyo3::create_exception!(
    kvlink,
    InvalidArgument,
    KvlinkError,
    "An argument is unusable (sizes, block ids out of range, unknown region, bad address)."
);
pyo3::create_exception!(
    kvlink,
    KvlinkTimeout,
    KvlinkError,
    "A wait ran past its deadline (connect, handshake, request)."
);
pyo3::create_exception!(
    kvlink,
    IncompatiblePeer,
    KvlinkError,
    "The peer's KV layout, dtype, block size or TP size differs; the message lists each field."
);
pyo3::create_exception!(
    kvlink,
    PeerError,
    KvlinkError,
    "The peer refused, broke the protocol or could not be reached."
);
pyo3::create_exception!(
    kvlink,
    RdmaUnavailable,
    KvlinkError,
    "RDMA was required but cannot be used; the message says why."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidArgument(_) | Error::UnknownRegion(_) | Error::OutOfRange { .. } => {
            InvalidArgument::new_err(msg)
        }
        Error::Timeout { .. } => KvlinkTimeout::new_err(msg),
        Error::Incompatible { .. } | Error::VersionMismatch { .. } => {
            IncompatiblePeer::new_err(msg)
        }
        Error::RdmaUnavailable(_) => RdmaUnavailable::new_err(msg),
        Error::Handshake { .. }
        | Error::Refused { .. }
        | Error::Protocol(_)
        | Error::ConnectionLost { .. }
        | Error::Rdma(_) => PeerError::new_err(msg),
        _ => KvlinkError::new_err(msg),
    }
}

/// Longest duration accepted (as in the C ABI): 7 days.
const MAX_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

fn seconds(name: &str, v: f64) -> PyResult<Duration> {
    if !(v.is_finite() && v > 0.0 && v <= MAX_SECONDS) {
        return Err(InvalidArgument::new_err(format!(
            "{name} must be a positive number of seconds, at most 7 days, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Request ids are `str` end to end: an int id is refused rather than converted, so the ids the
/// scheduler gets back always equal the ones it passed in.
fn request_id(obj: &Bound<'_, PyAny>) -> PyResult<RequestId> {
    let s: String = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "request ids are str (got {}); pass str(request_id)",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let id = RequestId::from(s);
    id.validate().map_err(InvalidArgument::new_err)?;
    Ok(id)
}

fn block_ids(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    // numpy arrays (and tensors) convert to a list in one C call, far faster than extracting
    // element by element.
    let list;
    let obj = if !obj.is_instance_of::<PyList>() && obj.hasattr("tolist")? {
        list = obj.call_method0("tolist")?;
        &list
    } else {
        obj
    };
    obj.extract::<Vec<u32>>().map_err(|_| {
        InvalidArgument::new_err(format!(
            "{name} must be a sequence of non-negative block ids below 2**32"
        ))
    })
}

/// What finished since the last call: `sending`, `receiving` (request ids) and `failed`
/// (tuples `(request_id, side, expired, reason)`, side `"send"` or `"recv"`).
#[pyclass(module = "kvlink", frozen, get_all)]
struct Finished {
    sending: Py<PyList>,
    receiving: Py<PyList>,
    failed: Py<PyList>,
}

#[pymethods]
impl Finished {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Finished(sending={}, receiving={}, failed={})",
            self.sending.bind(py).len(),
            self.receiving.bind(py).len(),
            self.failed.bind(py).len()
        )
    }

    /// True when nothing finished.
    fn is_empty(&self, py: Python<'_>) -> bool {
        self.sending.bind(py).is_empty()
            && self.receiving.bind(py).is_empty()
            && self.failed.bind(py).is_empty()
    }
}

fn finished_to_py(py: Python<'_>, f: &RsFinished) -> PyResult<Finished> {
    let ids = |v: &[RequestId]| PyList::new(py, v.iter().map(|i| i.as_str()));
    let failed = PyList::empty(py);
    for fr in &f.failed {
        let side = match fr.side {
            Side::Send => "send",
            Side::Recv => "recv",
        };
        failed.append(PyTuple::new(
            py,
            [
                fr.id.as_str().into_pyobject(py)?.into_any(),
                side.into_pyobject(py)?.into_any(),
                pyo3::types::PyBool::new(py, fr.expired)
                    .to_owned()
                    .into_any(),
                fr.reason.as_str().into_pyobject(py)?.into_any(),
            ],
        )?)?;
    }
    Ok(Finished {
        sending: ids(&f.sending)?.unbind(),
        receiving: ids(&f.receiving)?.unbind(),
        failed: failed.unbind(),
    })
}

fn finished_from_py(obj: &Bound<'_, PyAny>) -> PyResult<RsFinished> {
    let get = |name: &str| -> PyResult<Bound<'_, PyAny>> { obj.getattr(name) };
    let mut f = RsFinished::default();
    for id in get("sending")?.try_iter()? {
        f.sending.push(request_id(&id?)?);
    }
    for id in get("receiving")?.try_iter()? {
        f.receiving.push(request_id(&id?)?);
    }
    for item in get("failed")?.try_iter()? {
        let (id, side, expired, reason): (Bound<'_, PyAny>, String, bool, String) =
            item?.extract()?;
        let side = match side.as_str() {
            "send" => Side::Send,
            "recv" => Side::Recv,
            s => {
                return Err(InvalidArgument::new_err(format!(
                    "side must be 'send' or 'recv', got {s:?}"
                )))
            }
        };
        f.failed.push(kvlink_core::FailedRequest {
            id: request_id(&id)?,
            side,
            expired,
            reason,
        });
    }
    Ok(f)
}

/// Where an array-like object's bytes are: `(pointer, nbytes, on_gpu)`. Host arrays expose
/// `__array_interface__` (numpy) or are CPU torch tensors; GPU arrays expose
/// `__cuda_array_interface__` (CuPy, Numba; HIP builds use the same name) or are torch tensors
/// on a `cuda` device (ROCm builds of torch use the same name).
fn array_buffer(obj: &Bound<'_, PyAny>) -> PyResult<(usize, u64, bool)> {
    for (attr, on_gpu) in [
        ("__cuda_array_interface__", true),
        ("__array_interface__", false),
    ] {
        let Ok(ai) = obj.getattr(attr) else { continue };
        let ai = ai.downcast_into::<PyDict>()?;
        let (ptr, readonly): (usize, bool) = ai
            .get_item("data")?
            .ok_or_else(|| InvalidArgument::new_err(format!("{attr} has no 'data'")))?
            .extract()?;
        if readonly {
            return Err(InvalidArgument::new_err(
                "the array is read-only; kvlink writes into KV caches",
            ));
        }
        if let Some(strides) = ai.get_item("strides")? {
            if !strides.is_none() {
                return Err(InvalidArgument::new_err(
                    "the array is not C-contiguous; pass a contiguous array",
                ));
            }
        }
        let nbytes: u64 = match obj.getattr("nbytes") {
            Ok(n) => n.extract()?,
            Err(_) => interface_nbytes(&ai, attr)?,
        };
        return Ok((ptr, nbytes, on_gpu));
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("nbytes")? {
        // torch.Tensor: contiguous, on the CPU or a GPU.
        let mut on_gpu = false;
        if let Ok(dev) = obj.getattr("device") {
            let kind: String = dev.getattr("type")?.extract()?;
            on_gpu = match kind.as_str() {
                "cpu" => false,
                "cuda" => true,
                other => {
                    return Err(InvalidArgument::new_err(format!(
                        "the tensor is on {other}; kvlink registers CPU and cuda (CUDA or ROCm) tensors"
                    )))
                }
            };
        }
        if obj.hasattr("is_contiguous")? && !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(InvalidArgument::new_err(
                "the tensor is not contiguous; call .contiguous()",
            ));
        }
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let nbytes: u64 = obj.getattr("nbytes")?.extract()?;
        return Ok((ptr, nbytes, on_gpu));
    }
    Err(InvalidArgument::new_err(
        "expected an array exposing __array_interface__ (numpy), __cuda_array_interface__ \
         (CuPy) or data_ptr()/nbytes (torch)",
    ))
}

/// Bytes of a contiguous array from its interface's `shape` and `typestr` (`"<f2"`: 2 bytes).
fn interface_nbytes(ai: &Bound<'_, PyDict>, attr: &str) -> PyResult<u64> {
    let shape: Vec<u64> = ai
        .get_item("shape")?
        .ok_or_else(|| InvalidArgument::new_err(format!("{attr} has no 'shape'")))?
        .extract()?;
    let typestr: String = ai
        .get_item("typestr")?
        .ok_or_else(|| InvalidArgument::new_err(format!("{attr} has no 'typestr'")))?
        .extract()?;
    let item: u64 = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            InvalidArgument::new_err(format!("{attr} typestr {typestr:?} unreadable"))
        })?;
    shape
        .iter()
        .try_fold(item, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| InvalidArgument::new_err(format!("{attr} describes more than 2^64 bytes")))
}

/// One kvlink engine per worker process (one per tensor-parallel rank).
///
/// Engine(listen="127.0.0.1:0", *, transport="auto", tp_rank=0, tp_size=1, request_timeout=60.0,
/// abort_timeout=480.0, handshake_timeout=5.0, tcp_streams=4, rdma_device=None, engine_id=None,
/// gpu=True, staging_chunk_bytes=2 MiB, staging_buffers=32)
#[pyclass(module = "kvlink", frozen)]
struct Engine {
    inner: Arc<RsEngine>,
    /// Python objects whose memory is registered, kept alive while registered.
    keep: Mutex<Vec<(u32, PyObject)>>,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:0", *, transport = "auto", tp_rank = 0, tp_size = 1,
        request_timeout = 60.0, abort_timeout = 480.0, handshake_timeout = 5.0, tcp_streams = 4,
        rdma_device = None, engine_id = None, gpu = true, staging_chunk_bytes = 2 << 20,
        staging_buffers = 32))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        transport: &str,
        tp_rank: u32,
        tp_size: u32,
        request_timeout: f64,
        abort_timeout: f64,
        handshake_timeout: f64,
        tcp_streams: u16,
        rdma_device: Option<String>,
        engine_id: Option<String>,
        gpu: bool,
        staging_chunk_bytes: u64,
        staging_buffers: usize,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig {
            listen: listen.to_string(),
            engine_id,
            tp_rank,
            tp_size,
            tcp_streams,
            request_timeout: seconds("request_timeout", request_timeout)?,
            abort_timeout: seconds("abort_timeout", abort_timeout)?,
            handshake_timeout: seconds("handshake_timeout", handshake_timeout)?,
            transport: match transport {
                "auto" => TransportChoice::Auto,
                "tcp" => TransportChoice::Tcp,
                "rdma" => TransportChoice::Rdma,
                t => {
                    return Err(InvalidArgument::new_err(format!(
                        "transport must be 'auto', 'tcp' or 'rdma', got {t:?}"
                    )))
                }
            },
            gpu,
            staging_chunk_bytes,
            staging_buffers,
            ..EngineConfig::default()
        };
        cfg.rdma.device = rdma_device;
        let inner = py.allow_threads(|| RsEngine::start(cfg)).map_err(to_py)?;
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

    /// Registers memory given as a raw address and size; returns the region id. The memory
    /// must stay valid until `deregister(region)` has returned. `device=None` asks the loaded
    /// GPU runtimes whether it is GPU memory; `True` or `False` says so.
    #[pyo3(signature = (ptr, size, *, device = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        ptr: usize,
        size: u64,
        device: Option<bool>,
    ) -> PyResult<u32> {
        let on_gpu = match device {
            Some(d) => d,
            None => matches!(
                self.inner.classify_pointer(ptr as u64).map_err(to_py)?,
                PointerKind::Device { .. }
            ),
        };
        self.register_raw(py, ptr, size, on_gpu)
    }

    /// The transports and memory kinds this engine found: `{name: (available, detail)}` for
    /// `rdma`, `tcp`, `cuda` and `hip`, the detail saying why when unavailable.
    fn capabilities(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let c = self.inner.capabilities();
        let d = PyDict::new(py);
        let item = |r: &Result<String, String>| match r {
            Ok(s) => (true, s.clone()),
            Err(s) => (false, s.clone()),
        };
        d.set_item("rdma", item(&c.rdma))?;
        d.set_item("tcp", (true, c.tcp.clone()))?;
        d.set_item("cuda", item(&c.gpu.cuda))?;
        d.set_item("hip", item(&c.gpu.hip))?;
        Ok(d.unbind())
    }

    /// Registers the memory of an array (numpy, CuPy, or a torch tensor on the CPU or a GPU;
    /// contiguous, writable); keeps the array alive while registered. Returns the region id.
    fn register_array(&self, array: &Bound<'_, PyAny>) -> PyResult<u32> {
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
        py.allow_threads(move || inner.deregister(RegionId(region)))
            .map_err(to_py)?;
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
    fn set_layout(
        &self,
        tensors: Vec<(u32, u64, u64, u64, u32)>,
        tokens_per_block: u32,
        dtype: String,
    ) -> PyResult<()> {
        let tensors = tensors
            .into_iter()
            .enumerate()
            .map(
                |(i, (region, offset, block_stride, block_bytes, num_blocks))| TensorLayout {
                    name: format!("t{i}"),
                    region: RegionId(region),
                    offset,
                    block_stride,
                    block_bytes,
                    num_blocks,
                },
            )
            .collect();
        self.inner
            .set_layout(KvLayout {
                tokens_per_block,
                dtype,
                tensors,
            })
            .map_err(to_py)
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
    fn read_blocks(
        &self,
        peer: &str,
        request_id: &Bound<'_, PyAny>,
        local_blocks: &Bound<'_, PyAny>,
        remote_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        let local = block_ids("local_blocks", local_blocks)?;
        let remote = block_ids("remote_blocks", remote_blocks)?;
        self.inner
            .read_blocks(peer, id, &local, &remote)
            .map_err(to_py)
    }

    /// Prefill side: holds a request's blocks until the reader confirms (finished sending), aborts
    /// (failed) or `abort_timeout` seconds pass (failed, expired).
    #[pyo3(signature = (request_id, abort_timeout = None))]
    fn hold_blocks(
        &self,
        request_id: &Bound<'_, PyAny>,
        abort_timeout: Option<f64>,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        match abort_timeout {
            Some(t) => self.inner.hold_blocks_for(id, seconds("abort_timeout", t)?),
            None => self.inner.hold_blocks(id),
        }
        .map_err(to_py)
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
        let f = py.allow_threads(move || inner.wait_finished(t));
        finished_to_py(py, &f)
    }

    /// Connects to `peer` (or reuses the session) and returns a summary of its descriptor
    /// (engine_id, tp_rank, tp_size, tokens_per_block, dtype, num_blocks, transports). Blocks up
    /// to `timeout` seconds with the GIL released.
    #[pyo3(signature = (peer, timeout = 10.0))]
    fn connect(&self, py: Python<'_>, peer: String, timeout: f64) -> PyResult<Py<PyDict>> {
        let t = seconds("timeout", timeout)?;
        let inner = self.inner.clone();
        let d = py
            .allow_threads(move || inner.connect(&peer, t))
            .map_err(to_py)?;
        let out = PyDict::new(py);
        out.set_item("engine_id", &d.engine_id)?;
        out.set_item("tp_rank", d.tp_rank)?;
        out.set_item("tp_size", d.tp_size)?;
        out.set_item("tokens_per_block", d.layout.tokens_per_block)?;
        out.set_item("dtype", &d.layout.dtype)?;
        out.set_item("num_blocks", d.layout.num_blocks())?;
        out.set_item("tensors", d.layout.tensors.len())?;
        let transports: Vec<&str> = [d.tcp().map(|_| "tcp"), d.rdma().map(|_| "rdma")]
            .into_iter()
            .flatten()
            .collect();
        out.set_item("transports", transports)?;
        Ok(out.unbind())
    }

    /// Requests being received and sends being held: `(receiving, holding)`.
    fn in_flight(&self) -> (usize, usize) {
        self.inner.in_flight()
    }

    /// Counters of what this engine served, refused and staged: `handshakes_accepted`,
    /// `handshakes_refused`, `data_requests_served`, `data_requests_refused`, `bytes_served`,
    /// `bytes_staged_out` (GPU bytes copied out to be sent over TCP) and `bytes_staged_in`
    /// (received bytes copied into GPU memory).
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("handshakes_accepted", s.handshakes_accepted)?;
        d.set_item("handshakes_refused", s.handshakes_refused)?;
        d.set_item("data_requests_served", s.data_requests_served)?;
        d.set_item("data_requests_refused", s.data_requests_refused)?;
        d.set_item("bytes_served", s.bytes_served)?;
        d.set_item("bytes_staged_out", s.bytes_staged_out)?;
        d.set_item("bytes_staged_in", s.bytes_staged_in)?;
        Ok(d.unbind())
    }
}

impl Engine {
    /// Registers `size` bytes at `ptr` as host or GPU memory.
    fn register_raw(&self, py: Python<'_>, ptr: usize, size: u64, on_gpu: bool) -> PyResult<u32> {
        let inner = self.inner.clone();
        // Registration may pin memory with an RDMA NIC (slow for large caches): release the GIL.
        let region = if on_gpu {
            // SAFETY: the caller (the inference engine, or register_array holding the array)
            // owns this device allocation and keeps it alive until deregistered, as documented.
            let mem = unsafe { DeviceMemory::new(ptr as u64, size) }.map_err(to_py)?;
            py.allow_threads(move || inner.register_device(mem))
        } else {
            // SAFETY: as above, for host memory; kvlink accesses it like a DMA engine would.
            let mem = unsafe { ExternalMemory::new(ptr as *mut u8, size) }.map_err(to_py)?;
            py.allow_threads(move || inner.register_host(mem))
        };
        Ok(region.map_err(to_py)?.id().0)
    }

    fn register_all(
        &self,
        arrays: &Bound<'_, PyList>,
        tokens_per_block: u32,
        dtype: String,
        regions: &mut Vec<u32>,
    ) -> PyResult<()> {
        let mut tensors = Vec::new();
        for a in arrays.iter() {
            let shape: Vec<u64> = a.getattr("shape")?.extract()?;
            let blocks = *shape
                .first()
                .ok_or_else(|| InvalidArgument::new_err("a KV cache array has no dimensions"))?;
            let (_, nbytes, _) = array_buffer(&a)?;
            if blocks == 0 || nbytes % blocks != 0 || blocks > u64::from(u32::MAX) {
                return Err(InvalidArgument::new_err(format!(
                    "a KV cache array of {nbytes} bytes cannot be split into {blocks} blocks"
                )));
            }
            let region = self.register_array(&a)?;
            regions.push(region);
            let block_bytes = nbytes / blocks;
            tensors.push((region, 0, block_bytes, block_bytes, blocks as u32));
        }
        self.set_layout(tensors, tokens_per_block, dtype)
    }
}

/// Combines the finished sets of `world_size` TP ranks for the scheduler: a request is released
/// once every rank reported it, failed if any rank failed, and failed after `rank_timeout`
/// seconds if some rank never reports.
#[pyclass(module = "kvlink")]
struct TpAggregator {
    inner: RsAggregator,
}

#[pymethods]
impl TpAggregator {
    #[new]
    #[pyo3(signature = (world_size, rank_timeout = 60.0))]
    fn new(world_size: usize, rank_timeout: f64) -> PyResult<Self> {
        Ok(TpAggregator {
            inner: RsAggregator::new(world_size, seconds("rank_timeout", rank_timeout)?)
                .map_err(to_py)?,
        })
    }

    /// Takes one rank's Finished (as returned by Engine.get_finished()).
    fn add(&mut self, rank: usize, finished: &Bound<'_, PyAny>) -> PyResult<()> {
        let f = finished_from_py(finished)?;
        self.inner
            .handle_report(rank, &f, Instant::now())
            .map_err(to_py)
    }

    /// Requests released since the last call (finished on every rank, or failed).
    fn take(&mut self, py: Python<'_>) -> PyResult<Finished> {
        self.inner.poll(Instant::now());
        let f = self.inner.take_finished();
        finished_to_py(py, &f)
    }

    /// Requests some but not all ranks have reported.
    #[getter]
    fn pending(&self) -> usize {
        self.inner.pending()
    }
}

/// kvlink: moves LLM KV-cache blocks between inference engines.
#[pymodule]
fn kvlink(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<TpAggregator>()?;
    m.add_class::<Finished>()?;
    m.add("KvlinkError", py.get_type::<KvlinkError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("KvlinkTimeout", py.get_type::<KvlinkTimeout>())?;
    m.add("IncompatiblePeer", py.get_type::<IncompatiblePeer>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("RdmaUnavailable", py.get_type::<RdmaUnavailable>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
