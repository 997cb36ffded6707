//! GPU runtimes, loaded at run time: CUDA through `cudarc`'s dynamically loaded driver API, HIP
//! through a small `libloading` shim over `libamdhip64`. Nothing here is needed to build kvlink,
//! and a process without either library runs exactly as before: each runtime is probed once per
//! process and, when missing, says why in [`GpuReport`] and in every error that needed it.
//!
//! What kvlink asks of a runtime is small: which memory a pointer is (pointer attributes), plain
//! copies between device memory and host buffers (for staging over TCP), pinning host buffers,
//! allocation (for benchmarks and tests) and a dma-buf file descriptor for a device range (for
//! RDMA registration without a peer-memory driver).
//!
//! Raw FFI stays in [`cuda`] and [`hip`] (and the small [`emulated`] runtime used by tests); the
//! rest of kvlink sees only [`DeviceRuntime`].

#[allow(unsafe_code)]
mod cuda;
#[allow(unsafe_code)]
mod emulated;
#[allow(unsafe_code)]
mod hip;
mod report;

use std::os::fd::OwnedFd;

use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

pub(crate) use emulated::Emulated;
pub use report::GpuReport;

/// A GPU runtime failure: the runtime involved, the error code its call returned, and a
/// message that names the call and, for a missing piece, what to install or load.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuError {
    /// The runtime, when one is involved (none when no runtime is loaded).
    pub api: Option<GpuApi>,
    /// The code a runtime call returned: a `CUresult` for CUDA, a `hipError_t` for HIP.
    pub code: Option<i32>,
    /// What happened and what to do.
    pub message: String,
}

impl GpuError {
    /// A failed call of `api` that returned `code`.
    pub(crate) fn call(api: GpuApi, code: i32, message: String) -> GpuError {
        GpuError {
            api: Some(api),
            code: Some(code),
            message,
        }
    }

    /// The same error, with `context` put before its message.
    pub(crate) fn context(mut self, context: impl std::fmt::Display) -> GpuError {
        self.message = format!("{context}: {}", self.message);
        self
    }
}

impl From<String> for GpuError {
    fn from(message: String) -> GpuError {
        GpuError {
            api: None,
            code: None,
            message,
        }
    }
}

impl From<&str> for GpuError {
    fn from(message: &str) -> GpuError {
        GpuError::from(message.to_string())
    }
}

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GpuError {}

/// The GPU API that owns a device memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GpuApi {
    /// NVIDIA CUDA (driver API, `libcuda.so.1`).
    Cuda,
    /// AMD HIP (`libamdhip64.so`).
    Hip,
    /// Host memory presented to kvlink as device memory, so that the staging code paths can be
    /// tested on machines without a GPU. Never chosen for real memory.
    Emulated,
}

impl std::fmt::Display for GpuApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuApi::Cuda => "cuda",
            GpuApi::Hip => "hip",
            GpuApi::Emulated => "emulated",
        })
    }
}

/// What the loaded GPU runtimes say about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PointerKind {
    /// Unknown to every loaded runtime: ordinary host memory (or no runtime to ask).
    Host,
    /// Host memory allocated or registered (pinned) by a GPU runtime.
    PinnedHost {
        /// The runtime that pinned it.
        api: GpuApi,
    },
    /// Memory of one GPU.
    Device {
        /// The runtime that allocated it.
        api: GpuApi,
        /// The GPU's ordinal in that runtime.
        ordinal: i32,
    },
    /// Managed (unified) memory that migrates between host and device. kvlink does not register
    /// it: RDMA and staging both need a fixed home.
    Managed {
        /// The runtime that allocated it.
        api: GpuApi,
    },
}

/// The calls kvlink makes into a GPU runtime. Implemented by the CUDA and HIP loaders and by the
/// emulated runtime of the tests. The unsafe methods take raw addresses; their contracts are
/// written beside each.
#[allow(unsafe_code)]
pub(crate) trait DeviceRuntime: Send + Sync + std::fmt::Debug + 'static {
    /// Which API this is.
    fn api(&self) -> GpuApi;

    /// One line for logs and reports: version and device count.
    fn describe(&self) -> String;

    /// Classifies an address. `Err` only when the runtime itself fails; an address it does not
    /// know is `Ok(PointerKind::Host)`.
    fn classify(&self, ptr: u64) -> Result<PointerKind, GpuError>;

    /// Copies `len` bytes from device address `src` (on GPU `ordinal`) to host memory `dst`,
    /// returning when the bytes are in place.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` bytes and not accessed by anything else during the
    /// call; `[src, src + len)` lies inside a live device allocation of this runtime.
    unsafe fn copy_to_host(
        &self,
        ordinal: i32,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError>;

    /// Copies `len` bytes from host memory `src` to device address `dst` (on GPU `ordinal`),
    /// returning only when the bytes are in device memory (also for pageable `src`).
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes; `[dst, dst + len)` lies inside a live device
    /// allocation of this runtime.
    unsafe fn copy_from_host(
        &self,
        ordinal: i32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError>;

    /// Pins host memory (for every GPU, from GPU `ordinal`'s context) so device copies run at
    /// full speed. Best effort for callers: staging still works with pageable memory, only
    /// slower.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is a live host mapping that stays mapped until [`unpin`] is called.
    ///
    /// [`unpin`]: DeviceRuntime::unpin
    unsafe fn pin(&self, ordinal: i32, ptr: *mut u8, len: usize) -> Result<(), GpuError>;

    /// Undoes [`pin`](DeviceRuntime::pin) (same `ordinal`).
    ///
    /// # Safety
    /// `ptr` was pinned by this runtime and is still mapped.
    unsafe fn unpin(&self, ordinal: i32, ptr: *mut u8);

    /// A dma-buf exporting a page-aligned range that covers `[ptr, ptr + len)`: the whole
    /// allocation holding it when that can be exported (so one export serves every
    /// registration chunk of the allocation), else the page-aligned range around it.
    fn dmabuf(&self, ordinal: i32, ptr: u64, len: u64) -> Result<DmaBuf, GpuError>;

    /// Prepares a device range for access by a NIC (CUDA: synchronous memory operations, so an
    /// RDMA read never sees a copy still in flight). Best effort.
    fn prepare_for_rdma(&self, _ordinal: i32, _ptr: u64) {}

    /// Allocates `len` bytes of device memory on GPU `ordinal`.
    fn alloc(&self, ordinal: i32, len: usize) -> Result<u64, GpuError>;

    /// Frees memory from [`alloc`](DeviceRuntime::alloc).
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this runtime and nothing uses it any more.
    unsafe fn free(&self, ordinal: i32, ptr: u64);

    /// An IPC export of the allocation holding `[ptr, ptr + len)`, for another process of this
    /// host to open with [`ipc_open`](DeviceRuntime::ipc_open) (CUDA/HIP IPC handles).
    fn ipc_export(&self, _ordinal: i32, _ptr: u64, _len: u64) -> Result<IpcExport, GpuError> {
        Err(format!("{} memory has no IPC export", self.api()).into())
    }

    /// Opens a peer process's export on GPU `ordinal` (peer access enabled when it lives on
    /// another GPU): the opened allocation's address here and its length. The handle bytes and
    /// descriptor come from a peer: the runtime checks them.
    fn ipc_open(
        &self,
        _ordinal: i32,
        _handle: &[u8],
        _fd: Option<OwnedFd>,
    ) -> Result<(u64, u64), GpuError> {
        Err(format!(
            "{} memory cannot be opened from another process",
            self.api()
        )
        .into())
    }

    /// Closes what [`ipc_open`](DeviceRuntime::ipc_open) opened.
    ///
    /// # Safety
    /// `base` came from `ipc_open` on this runtime and nothing uses it any more.
    unsafe fn ipc_close(&self, _ordinal: i32, _base: u64) {}

    /// Copies `len` bytes between two device ranges reachable from GPU `ordinal` (its own
    /// memory, or memory opened with `ipc_open`), returning when the bytes are in place.
    ///
    /// # Safety
    /// Both ranges lie inside live device allocations reachable from `ordinal`'s context.
    unsafe fn copy_device(
        &self,
        _ordinal: i32,
        _dst: u64,
        _src: u64,
        _len: usize,
    ) -> Result<(), GpuError> {
        Err(format!("{} has no device-to-device copy", self.api()).into())
    }

    /// Copies every `(dst, src, len)` piece in `kind`'s direction, returning when all are in
    /// place. Runtimes queue them on one stream and wait once (a GPU copy costs microseconds
    /// to wait for, whatever its size); the default copies one at a time.
    ///
    /// # Safety
    /// Each piece's ranges are valid as the single copy of `kind` requires.
    unsafe fn copy_many(
        &self,
        ordinal: i32,
        kind: CopyKind,
        pieces: &[(u64, u64, usize)],
    ) -> Result<(), GpuError> {
        for &(dst, src, len) in pieces {
            // SAFETY: the caller's contract, piece by piece.
            unsafe {
                match kind {
                    CopyKind::ToHost => self.copy_to_host(ordinal, dst as *mut u8, src, len),
                    CopyKind::FromHost => self.copy_from_host(ordinal, dst, src as *const u8, len),
                    CopyKind::Device => self.copy_device(ordinal, dst, src, len),
                }
            }?;
        }
        Ok(())
    }
}

/// The direction of a batch of copies ([`DeviceRuntime::copy_many`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyKind {
    /// Device to host: `dst` is a host address.
    ToHost,
    /// Host to device: `src` is a host address.
    FromHost,
    /// Device to device.
    Device,
}

/// What a process hands another process of this host so that it can open a device allocation.
#[derive(Debug)]
pub(crate) struct IpcExport {
    /// The runtime's handle (64 bytes for CUDA and HIP; the allocation's length for the
    /// emulated runtime).
    pub(crate) handle: Vec<u8>,
    /// A descriptor that goes with the handle (the emulated runtime's memfd).
    pub(crate) fd: Option<OwnedFd>,
    /// The exported range starts this far into the allocation the handle opens.
    pub(crate) offset: u64,
}

/// Longest IPC handle a peer may send.
pub(crate) const MAX_IPC_HANDLE: usize = 64;

/// The operations of one API's copy streams, for [`StreamPool::run`]. Handles are the API's
/// opaque stream pointers, carried as addresses.
pub(crate) struct StreamOps<'a> {
    /// Creates a non-blocking stream on the current device.
    pub(crate) create: &'a dyn Fn() -> Result<usize, GpuError>,
    /// Waits for the stream's work.
    pub(crate) sync: &'a dyn Fn(usize) -> Result<(), GpuError>,
    /// Destroys a stream.
    pub(crate) destroy: &'a dyn Fn(usize),
}

/// Idle copy streams per device, reused by later copies: one stream per copy in flight.
#[derive(Debug, Default)]
pub(crate) struct StreamPool(parking_lot::Mutex<std::collections::HashMap<i32, Vec<usize>>>);

impl StreamPool {
    /// Queues `copy` on an idle (or new) stream of GPU `ordinal`, whose context or device the
    /// caller has made current, and waits for it. A copy that could not be queued leaves its
    /// stream as it was, so the stream is reused; one that failed while running may leave it
    /// in an error state, so it is destroyed.
    pub(crate) fn run(
        &self,
        ordinal: i32,
        ops: &StreamOps<'_>,
        copy: impl FnOnce(usize) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let idle = self.0.lock().get_mut(&ordinal).and_then(Vec::pop);
        let stream = match idle {
            Some(s) => s,
            None => (ops.create)()?,
        };
        let put = |s| self.0.lock().entry(ordinal).or_default().push(s);
        if let Err(e) = copy(stream) {
            put(stream);
            return Err(e);
        }
        let r = (ops.sync)(stream);
        match r {
            Ok(()) => put(stream),
            Err(_) => (ops.destroy)(stream),
        }
        r
    }
}

/// An exported dma-buf and the device address range it covers.
#[derive(Debug)]
pub(crate) struct DmaBuf {
    /// The dma-buf file descriptor (closed on drop; registrations keep their own reference).
    pub(crate) fd: OwnedFd,
    /// Device address of the dma-buf's first byte (page aligned).
    pub(crate) start: u64,
    /// Bytes covered.
    pub(crate) len: u64,
}

impl DmaBuf {
    /// Whether `[ptr, ptr + len)` lies inside the exported range.
    pub(crate) fn covers(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.start && ptr.saturating_add(len) <= self.start + self.len
    }
}

/// The ranges worth exporting for `[ptr, ptr + len)` inside the allocation `[base, base +
/// size)`, best first: the whole allocation (page-aligned start, size rounded up to a page:
/// drivers allocate whole pages), then the page-aligned range around the request.
pub(crate) fn export_candidates(base: u64, size: u64, ptr: u64, len: u64) -> Vec<(u64, u64)> {
    let page = page_size();
    let mut v = Vec::new();
    if base.is_multiple_of(page) && ptr >= base && ptr + len <= base + size {
        v.push((base, size.div_ceil(page) * page));
    }
    let start = ptr / page * page;
    let around = ((ptr + len).div_ceil(page) * page - start, start);
    if !v.contains(&(around.1, around.0)) {
        v.push((around.1, around.0));
    }
    v
}

type Probe = Result<Arc<dyn DeviceRuntime>, GpuError>;

/// The CUDA runtime, probed once per process.
pub(crate) fn cuda() -> Probe {
    static CUDA: OnceLock<Probe> = OnceLock::new();
    CUDA.get_or_init(|| {
        let r = cuda::Cuda::load().map(|c| Arc::new(c) as Arc<dyn DeviceRuntime>);
        match &r {
            Ok(c) => tracing::debug!("CUDA found: {}", c.describe()),
            Err(why) => tracing::debug!("CUDA unavailable: {why}"),
        }
        r
    })
    .clone()
}

/// The HIP runtime, probed once per process.
pub(crate) fn hip() -> Probe {
    static HIP: OnceLock<Probe> = OnceLock::new();
    HIP.get_or_init(|| {
        let r = hip::Hip::load().map(|h| Arc::new(h) as Arc<dyn DeviceRuntime>);
        match &r {
            Ok(h) => tracing::debug!("HIP found: {}", h.describe()),
            Err(why) => tracing::debug!("HIP unavailable: {why}"),
        }
        r
    })
    .clone()
}

/// The GPU runtimes an engine uses: both probed, or none when disabled by configuration.
#[derive(Debug, Clone)]
pub(crate) struct Runtimes {
    cuda: Probe,
    hip: Probe,
}

impl Runtimes {
    /// Probes CUDA and HIP (once per process), or records that GPUs are disabled.
    pub(crate) fn probe(enabled: bool) -> Runtimes {
        if !enabled {
            let off = || Err(GpuError::from("disabled by configuration (gpu: false)"));
            return Runtimes {
                cuda: off(),
                hip: off(),
            };
        }
        Runtimes {
            cuda: cuda(),
            hip: hip(),
        }
    }

    pub(crate) fn report(&self) -> GpuReport {
        let desc = |p: &Probe| {
            p.as_ref()
                .map(|r| r.describe())
                .map_err(|e| e.message.clone())
        };
        GpuReport {
            cuda: desc(&self.cuda),
            hip: desc(&self.hip),
        }
    }

    /// The loaded runtimes, CUDA first.
    pub(crate) fn loaded(&self) -> impl Iterator<Item = &Arc<dyn DeviceRuntime>> {
        [&self.cuda, &self.hip]
            .into_iter()
            .filter_map(|p| p.as_ref().ok())
    }

    /// The runtime of `api`, or why it is unavailable.
    pub(crate) fn get(&self, api: GpuApi) -> Result<Arc<dyn DeviceRuntime>, GpuError> {
        match api {
            GpuApi::Cuda => self.cuda.clone(),
            GpuApi::Hip => self.hip.clone(),
            GpuApi::Emulated => Ok(Arc::new(Emulated)),
        }
    }

    /// Why no runtime could say what `ptr` is, for errors.
    pub(crate) fn why_none(&self) -> String {
        let e = |p: &Probe| match p {
            Ok(r) => format!("{} loaded", r.api()),
            Err(why) => why.message.clone(),
        };
        format!("CUDA: {}; HIP: {}", e(&self.cuda), e(&self.hip))
    }

    /// Asks each loaded runtime about `ptr`; the first that knows it answers.
    pub(crate) fn classify(
        &self,
        ptr: u64,
    ) -> Result<(PointerKind, Option<Arc<dyn DeviceRuntime>>), GpuError> {
        for rt in self.loaded() {
            match rt.classify(ptr)? {
                PointerKind::Host => continue,
                kind => return Ok((kind, Some(rt.clone()))),
            }
        }
        Ok((PointerKind::Host, None))
    }
}

/// The host page size, for aligning dma-buf ranges.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    #[allow(unsafe_code)]
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_streams_are_reused_unless_their_copy_failed_while_running() {
        use std::cell::{Cell, RefCell};
        let created = Cell::new(0usize);
        let destroyed = RefCell::new(Vec::new());
        let sync_fails = Cell::new(false);
        let ops = StreamOps {
            create: &|| {
                created.set(created.get() + 1);
                Ok(100 + created.get())
            },
            sync: &|_| {
                if sync_fails.get() {
                    Err("sync failed".into())
                } else {
                    Ok(())
                }
            },
            destroy: &|s| destroyed.borrow_mut().push(s),
        };
        let pool = StreamPool::default();
        let used = Cell::new(0usize);
        let ok = |s: usize| {
            used.set(s);
            Ok(())
        };
        pool.run(0, &ops, ok).unwrap();
        pool.run(0, &ops, ok).unwrap();
        assert_eq!((created.get(), used.get()), (1, 101), "idle stream reused");
        // A copy that could not be queued: the stream goes back to the pool.
        assert!(pool.run(0, &ops, |_| Err("queue".into())).is_err());
        pool.run(0, &ops, ok).unwrap();
        assert_eq!(created.get(), 1);
        // Another device gets its own stream.
        pool.run(1, &ops, ok).unwrap();
        assert_eq!((created.get(), used.get()), (2, 102));
        // A copy that failed while running: its stream is destroyed, the next copy makes one.
        sync_fails.set(true);
        assert!(pool.run(0, &ops, ok).is_err());
        assert_eq!(*destroyed.borrow(), vec![101]);
        sync_fails.set(false);
        pool.run(0, &ops, ok).unwrap();
        assert_eq!((created.get(), used.get()), (3, 103));
    }

    #[test]
    fn dma_buf_export_candidates() {
        let p = page_size();
        // A page-aligned allocation: the whole of it first (size rounded up to a page), then
        // the pages around the chunk.
        assert_eq!(
            export_candidates(10 * p, 8 * p - 100, 11 * p + 7, p),
            vec![(10 * p, 8 * p), (11 * p, 2 * p)]
        );
        // The chunk is the whole allocation: one candidate.
        assert_eq!(
            export_candidates(4 * p, 2 * p, 4 * p, 2 * p),
            vec![(4 * p, 2 * p)]
        );
        // An allocation that does not start on a page, or does not hold the chunk: only the
        // pages around the chunk.
        assert_eq!(export_candidates(p + 8, 4 * p, p + 8, 16), vec![(p, p)]);
        assert_eq!(export_candidates(p, p, 3 * p, 16), vec![(3 * p, p)]);
    }

    #[test]
    fn absent_runtimes_say_why_and_classify_as_host() {
        // On machines without a GPU both probes fail with a reason; with one, they describe it.
        let rt = Runtimes::probe(true);
        let report = rt.report();
        for (name, r) in [("cuda", &report.cuda), ("hip", &report.hip)] {
            match r {
                Ok(desc) => assert!(!desc.is_empty(), "{name} loaded without a description"),
                Err(why) => assert!(!why.is_empty(), "{name} missing without a reason"),
            }
        }
        let host = [0u8; 64];
        let (kind, _) = rt.classify(host.as_ptr() as u64).unwrap();
        assert_eq!(kind, PointerKind::Host);

        let off = Runtimes::probe(false);
        assert!(off.report().cuda.unwrap_err().contains("disabled"));
        assert_eq!(off.loaded().count(), 0);
        assert!(off.why_none().contains("disabled"));
    }
}
