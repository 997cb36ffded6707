//! CUDA through the driver API, loaded at run time by `cudarc` (`dynamic-loading`).
//!
//! `cudarc` panics when the library or a symbol is missing, so [`Cuda::load`] checks that
//! `libcuda` is present and exports every symbol used here before the first call; optional
//! symbols (dma-buf export, CUDA 11.7+) are checked again where used.
//!
//! Every call runs in the device's primary context (the context PyTorch and vLLM allocate from),
//! made current for the call only: the calling thread's own current context is restored after,
//! since callers may be an inference engine's threads. Copies go on kvlink's own non-blocking
//! streams (one per copy in flight, reused) and wait for that stream, so they never serialise
//! with the engine's work on the legacy default stream, and a host-to-device copy from pageable
//! memory has landed when the call returns.

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;

mod ipc;
use parking_lot::Mutex;

use super::{
    export_candidates, CopyKind, DeviceRuntime, DmaBuf, GpuApi, GpuError, IpcExport, PointerKind,
    StreamOps, StreamPool,
};

/// Driver symbols kvlink calls; all exist since CUDA 11.0.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuDeviceGetAttribute",
    "cuPointerGetAttribute",
    "cuPointerSetAttribute",
    "cuMemGetAddressRange_v2",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuGetErrorString",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemcpyDtoDAsync_v2",
];

/// `cuMemHostRegister` flag: pinned for all contexts.
const CU_MEMHOSTREGISTER_PORTABLE: std::ffi::c_uint = 0x01;

/// dma-buf export of device memory (CUDA 11.7+, and a driver built with dma-buf support).
const DMABUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";

/// `cuStreamCreate` flag: no implicit synchronisation with the legacy default stream.
const CU_STREAM_NON_BLOCKING: std::ffi::c_uint = 0x01;

/// A primary context handle. The driver's contexts are process-wide objects usable from any
/// thread once made current there.
#[derive(Clone, Copy)]
struct Ctx(sys::CUcontext);
// SAFETY: CUcontext is an opaque driver handle; the driver allows making one context current on
// any number of threads, and kvlink never dereferences it.
unsafe impl Send for Ctx {}

/// The loaded CUDA driver.
pub(crate) struct Cuda {
    version: i32,
    devices: i32,
    dmabuf: bool,
    contexts: Mutex<HashMap<i32, Ctx>>,
    /// Idle copy streams per device.
    streams: StreamPool,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The driver's name and text for a result code.
fn error_text(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null for an
    // unknown code); it was checked to exist at load.
    let ok = unsafe { sys::cuGetErrorString(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        let s = unsafe { CStr::from_ptr(p) };
        format!("{r:?}: {}", s.to_string_lossy())
    } else {
        format!("{r:?}")
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::call(
            GpuApi::Cuda,
            r as i32,
            format!("{what} failed: {}", error_text(r)),
        ))
    }
}

fn has_symbol(name: &str) -> bool {
    // SAFETY: culib() is only called after is_culib_present() returned true (so it does not
    // panic); looking a symbol up runs no code.
    unsafe { sys::culib().get::<*const c_void>(name.as_bytes()).is_ok() }
}

impl Cuda {
    /// Loads `libcuda`, checks its symbols and initialises the driver.
    pub(crate) fn load() -> Result<Cuda, GpuError> {
        // SAFETY: trying to open the library runs its initialisers, as any CUDA program does.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcuda.so.1 not found (no NVIDIA driver installed, or it is not on the \
                        library path: set LD_LIBRARY_PATH)"
                    .into(),
            );
        }
        if let Some(missing) = REQUIRED.iter().find(|s| !has_symbol(s)) {
            return Err(format!(
                "libcuda does not export {missing}: the NVIDIA driver is too old (CUDA 11 or newer needed)"
            ).into());
        }
        // SAFETY: all symbols are present (checked above); cuInit has no pointer arguments.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        let mut version: c_int = 0;
        let mut devices: c_int = 0;
        // SAFETY: out-pointers to live locals.
        check(
            unsafe { sys::cuDriverGetVersion(&mut version) },
            "cuDriverGetVersion",
        )?;
        // SAFETY: out-pointer to a live local.
        check(
            unsafe { sys::cuDeviceGetCount(&mut devices) },
            "cuDeviceGetCount",
        )?;
        if devices == 0 {
            return Err(format!(
                "CUDA driver {} found but no CUDA device is visible (CUDA_VISIBLE_DEVICES?)",
                fmt_version(version)
            )
            .into());
        }
        Ok(Cuda {
            version,
            devices,
            dmabuf: has_symbol(DMABUF_SYMBOL),
            contexts: Mutex::new(HashMap::new()),
            streams: StreamPool::default(),
        })
    }

    /// GPU `ordinal`'s primary context (retained once, kept for the life of the process, as
    /// the CUDA runtime does).
    fn context(&self, ordinal: i32) -> Result<Ctx, GpuError> {
        if ordinal < 0 || ordinal >= self.devices {
            return Err(format!(
                "CUDA device {ordinal} does not exist ({} visible)",
                self.devices
            )
            .into());
        }
        let mut map = self.contexts.lock();
        if let Some(c) = map.get(&ordinal) {
            return Ok(*c);
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointer to a live local; ordinal checked above.
        check(
            unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a live local; dev is a valid device handle.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        map.insert(ordinal, Ctx(ctx));
        Ok(Ctx(ctx))
    }

    /// Runs `f` with GPU `ordinal`'s primary context current on this thread, then restores the
    /// thread's previous current context.
    fn in_context<T>(
        &self,
        ordinal: i32,
        f: impl FnOnce() -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        let ctx = self.context(ordinal)?;
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a live local.
        check(
            unsafe { sys::cuCtxGetCurrent(&mut prev) },
            "cuCtxGetCurrent",
        )?;
        // SAFETY: ctx is a retained primary context, never released while the process runs.
        check(unsafe { sys::cuCtxSetCurrent(ctx.0) }, "cuCtxSetCurrent")?;
        let r = f();
        // SAFETY: prev was current on this thread a moment ago (or null, which unbinds).
        let restored = check(
            unsafe { sys::cuCtxSetCurrent(prev) },
            "restoring the thread's CUDA context",
        );
        if let Err(e) = restored {
            tracing::warn!("{e}");
        }
        r
    }

    /// Runs a copy on one of kvlink's streams of GPU `ordinal` and waits for it.
    fn on_stream(
        &self,
        ordinal: i32,
        what: &str,
        copy: impl FnOnce(sys::CUstream) -> sys::CUresult,
    ) -> Result<(), GpuError> {
        let ops = StreamOps {
            create: &|| {
                let mut s: sys::CUstream = std::ptr::null_mut();
                // SAFETY: out-pointer to a live local; the device's context is current.
                check(
                    unsafe { sys::cuStreamCreate(&mut s, CU_STREAM_NON_BLOCKING) },
                    "cuStreamCreate",
                )?;
                Ok(s as usize)
            },
            sync: &|s| {
                // SAFETY: a stream this pool created, used by one copy at a time.
                check(
                    unsafe { sys::cuStreamSynchronize(s as sys::CUstream) },
                    "cuStreamSynchronize",
                )
            },
            destroy: &|s| {
                // SAFETY: a stream with no other user; the driver frees it once its work is
                // done.
                let _ = unsafe { sys::cuStreamDestroy_v2(s as sys::CUstream) };
            },
        };
        self.in_context(ordinal, || {
            self.streams
                .run(ordinal, &ops, |s| check(copy(s as sys::CUstream), what))
        })
    }
}

fn fmt_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

impl DeviceRuntime for Cuda {
    fn api(&self) -> GpuApi {
        GpuApi::Cuda
    }

    fn describe(&self) -> String {
        format!(
            "CUDA driver {}, {} device(s), dma-buf export {}",
            fmt_version(self.version),
            self.devices,
            if self.dmabuf {
                "available"
            } else {
                "missing (driver older than CUDA 11.7)"
            }
        )
    }

    fn classify(&self, ptr: u64) -> Result<PointerKind, GpuError> {
        let mut mem_type: u32 = 0;
        // SAFETY: CU_POINTER_ATTRIBUTE_MEMORY_TYPE is a 4-byte enum; mem_type is a live u32.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut mem_type as *mut u32 as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr,
            )
        };
        match r {
            sys::CUresult::CUDA_SUCCESS => {}
            // Not an address CUDA knows: plain host memory.
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(PointerKind::Host),
            other => {
                return Err(format!("cuPointerGetAttribute failed: {}", error_text(other)).into())
            }
        }
        let mut managed: u32 = 0;
        // SAFETY: CU_POINTER_ATTRIBUTE_IS_MANAGED is a 4-byte boolean; managed is a live u32.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut managed as *mut u32 as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
                ptr,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS && managed != 0 {
            return Ok(PointerKind::Managed { api: GpuApi::Cuda });
        }
        if mem_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
            return Ok(PointerKind::PinnedHost { api: GpuApi::Cuda });
        }
        if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(format!("CUDA memory type {mem_type} is not supported").into());
        }
        let mut ordinal: c_int = -1;
        // SAFETY: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL is a 4-byte int; ordinal is a live c_int.
        check(
            unsafe {
                sys::cuPointerGetAttribute(
                    &mut ordinal as *mut c_int as *mut c_void,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                )
            },
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
        )?;
        Ok(PointerKind::Device {
            api: GpuApi::Cuda,
            ordinal,
        })
    }

    unsafe fn copy_to_host(
        &self,
        ordinal: i32,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "cuMemcpyDtoHAsync", |stream| {
            // SAFETY: the caller guarantees both ranges (trait contract); on_stream waits for
            // the stream before returning, so `dst` is written only during this call.
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream) }
        })
    }

    unsafe fn copy_from_host(
        &self,
        ordinal: i32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "cuMemcpyHtoDAsync", |stream| {
            // SAFETY: the caller guarantees both ranges; on_stream waits for the stream, so the
            // bytes are in device memory (pinned or pageable source alike) when this returns.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream) }
        })
    }

    unsafe fn pin(&self, ordinal: i32, ptr: *mut u8, len: usize) -> Result<(), GpuError> {
        self.in_context(ordinal, || {
            // SAFETY: the caller guarantees the mapping lives until unpin. PORTABLE: pinned
            // in every context, whichever GPU a staged region is on.
            check(
                unsafe {
                    sys::cuMemHostRegister_v2(ptr as *mut c_void, len, CU_MEMHOSTREGISTER_PORTABLE)
                },
                "cuMemHostRegister",
            )
        })
    }

    unsafe fn unpin(&self, ordinal: i32, ptr: *mut u8) {
        let r = self.in_context(ordinal, || {
            // SAFETY: ptr was registered by pin (caller's contract) and is still mapped.
            check(
                unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) },
                "cuMemHostUnregister",
            )
        });
        if let Err(e) = r {
            tracing::warn!("unpinning a staging buffer: {e}");
        }
    }

    fn dmabuf(&self, ordinal: i32, ptr: u64, len: u64) -> Result<DmaBuf, GpuError> {
        if !self.dmabuf {
            return Err(format!(
                "the CUDA driver {} cannot export dma-buf ({DMABUF_SYMBOL} needs CUDA 11.7 or newer)",
                fmt_version(self.version)
            ).into());
        }
        self.in_context(ordinal, || {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: out-pointer to a live local; ordinal was checked by in_context.
            check(
                unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
                "cuDeviceGet",
            )?;
            let mut supported: c_int = 0;
            // SAFETY: out-pointer to a live local, valid device.
            check(
                unsafe {
                    sys::cuDeviceGetAttribute(
                        &mut supported,
                        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                        dev,
                    )
                },
                "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)",
            )?;
            if supported == 0 {
                return Err(format!(
                    "CUDA device {ordinal} does not support dma-buf (needs the NVIDIA open kernel \
                     modules and Linux 5.12 or newer)"
                )
                .into());
            }
            let mut base: sys::CUdeviceptr = 0;
            let mut size: usize = 0;
            // SAFETY: out-pointers to live locals; ptr is an address of this context.
            check(
                unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
                "cuMemGetAddressRange",
            )?;
            let mut tried = Vec::new();
            for (start, n) in export_candidates(base, size as u64, ptr, len) {
                let mut fd: c_int = -1;
                // SAFETY: the symbol exists (checked at load); the handle out-pointer is a live
                // c_int, what the API writes for CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD; start and
                // n are page aligned.
                let r = unsafe {
                    sys::cuMemGetHandleForAddressRange(
                        &mut fd as *mut c_int as *mut c_void,
                        start,
                        n as usize,
                        sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                        0,
                    )
                };
                match check(r, "cuMemGetHandleForAddressRange(DMA_BUF_FD)") {
                    Ok(()) if fd >= 0 => {
                        // SAFETY: the driver handed us a new descriptor that nothing else owns.
                        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                        return Ok(DmaBuf { fd, start, len: n });
                    }
                    Ok(()) => tried.push(format!("[{start:#x}, +{n}): no descriptor returned")),
                    Err(e) => tried.push(format!("[{start:#x}, +{n}): {e}")),
                }
            }
            Err(format!("exporting GPU memory as dma-buf: {}", tried.join("; ")).into())
        })
    }

    fn prepare_for_rdma(&self, ordinal: i32, ptr: u64) {
        let r = self.in_context(ordinal, || {
            let one: u32 = 1;
            // SAFETY: SYNC_MEMOPS takes a 4-byte boolean, read from a live local.
            check(
                unsafe {
                    sys::cuPointerSetAttribute(
                        &one as *const u32 as *const c_void,
                        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                        ptr,
                    )
                },
                "cuPointerSetAttribute(SYNC_MEMOPS)",
            )
        });
        if let Err(e) = r {
            tracing::warn!("{e}: RDMA reads may see device copies still in flight");
        }
    }

    fn alloc(&self, ordinal: i32, len: usize) -> Result<u64, GpuError> {
        self.in_context(ordinal, || {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: out-pointer to a live local.
            check(unsafe { sys::cuMemAlloc_v2(&mut p, len) }, "cuMemAlloc")?;
            Ok(p)
        })
    }

    unsafe fn free(&self, ordinal: i32, ptr: u64) {
        let r = self.in_context(ordinal, || {
            // SAFETY: ptr came from alloc and is unused (caller's contract).
            check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree")
        });
        if let Err(e) = r {
            tracing::warn!("freeing device memory: {e}");
        }
    }

    fn ipc_export(&self, ordinal: i32, ptr: u64, len: u64) -> Result<IpcExport, GpuError> {
        self.export_ipc(ordinal, ptr, len)
    }

    fn ipc_open(
        &self,
        ordinal: i32,
        handle: &[u8],
        fd: Option<OwnedFd>,
    ) -> Result<(u64, u64), GpuError> {
        self.open_ipc(ordinal, handle, fd)
    }

    unsafe fn ipc_close(&self, ordinal: i32, base: u64) {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.close_ipc(ordinal, base) }
    }

    unsafe fn copy_many(
        &self,
        ordinal: i32,
        kind: CopyKind,
        pieces: &[(u64, u64, usize)],
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.queue_copies(ordinal, kind, pieces) }
    }

    unsafe fn copy_device(
        &self,
        ordinal: i32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.copy_on_device(ordinal, dst, src, len) }
    }
}
