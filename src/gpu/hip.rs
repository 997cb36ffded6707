//! HIP through a small shim over `libamdhip64`, loaded with `libloading`: no ROCm is needed to
//! build kvlink, and only the handful of entry points below are looked up.
//!
//! Every call selects the region's device for the call only and restores the calling thread's
//! device after. Copies go on kvlink's own non-blocking streams and wait for them, so they never
//! serialise with the engine's work on the null stream, and an unpinned host-to-device copy
//! (which recent ROCm releases return from early) has landed when the call returns.
//!
//! ROCm 6 renumbered `hipMemoryType` (to CUDA's values, with `Unregistered = 0`); ROCm 5 used
//! `Host = 0, Device = 1, Array = 2, Unified = 3, Managed = 4`. [`Hip::classify`] reads the
//! field according to the runtime's version. `hipPointerAttribute_t` has the same layout in both.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};

use libloading::Library;

mod ipc;

use super::{
    export_candidates, DeviceRuntime, DmaBuf, GpuApi, GpuError, IpcExport, PointerKind, StreamOps,
    StreamPool,
};

type HipError = c_int;
const HIP_SUCCESS: HipError = 0;
const HIP_ERROR_INVALID_VALUE: HipError = 1;
const MEMCPY_HOST_TO_DEVICE: c_int = 1;
const MEMCPY_DEVICE_TO_HOST: c_int = 2;
const MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
const HOST_REGISTER_PORTABLE: c_uint = 1;
const STREAM_NON_BLOCKING: c_uint = 1;

type HipStream = *mut c_void;

/// `hipPointerAttribute_t` (ROCm 5 and 6), with spare room in case a later release grows it.
#[repr(C)]
struct PointerAttributes {
    memory_type: c_int,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    is_managed: c_int,
    allocation_flags: c_uint,
    _spare: [u64; 8],
}

/// `hipIpcMemHandle_t`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [c_char; 64],
}

/// `hipIpcMemLazyEnablePeerAccess`.
const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `hipMemcpyDeviceToDevice`.
const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;

/// The entry points used, copied out of the library (which lives in `Hip::_lib`).
struct Fns {
    init: unsafe extern "C" fn(c_uint) -> HipError,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> HipError,
    runtime_get_version: unsafe extern "C" fn(*mut c_int) -> HipError,
    pointer_get_attributes: unsafe extern "C" fn(*mut PointerAttributes, *const c_void) -> HipError,
    set_device: unsafe extern "C" fn(c_int) -> HipError,
    get_device: unsafe extern "C" fn(*mut c_int) -> HipError,
    stream_create: unsafe extern "C" fn(*mut HipStream, c_uint) -> HipError,
    stream_synchronize: unsafe extern "C" fn(HipStream) -> HipError,
    stream_destroy: unsafe extern "C" fn(HipStream) -> HipError,
    memcpy_async:
        unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, HipStream) -> HipError,
    address_range: unsafe extern "C" fn(*mut u64, *mut usize, u64) -> HipError,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> HipError,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> HipError,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError,
    free: unsafe extern "C" fn(*mut c_void) -> HipError,
    error_string: unsafe extern "C" fn(HipError) -> *const c_char,
    ipc_get: unsafe extern "C" fn(*mut IpcHandle, *mut c_void) -> HipError,
    ipc_open: unsafe extern "C" fn(*mut *mut c_void, IpcHandle, c_uint) -> HipError,
    ipc_close: unsafe extern "C" fn(*mut c_void) -> HipError,
    /// `hipMemGetHandleForAddressRange`: dma-buf export (new in ROCm 7.0).
    dmabuf: Option<unsafe extern "C" fn(*mut c_void, u64, usize, c_int, c_ulonglong) -> HipError>,
}

/// The loaded HIP runtime.
pub(crate) struct Hip {
    fns: Fns,
    version: i32,
    devices: i32,
    path: String,
    /// Idle copy streams per device.
    streams: StreamPool,
    _lib: Library,
}

impl std::fmt::Debug for Hip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Where `libamdhip64` is looked for: `KVLINK_HIP_LIBRARY`, then the loader's path, then ROCm's
/// install directories.
fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("KVLINK_HIP_LIBRARY") {
        v.push(p);
    }
    for name in [
        "libamdhip64.so",
        "libamdhip64.so.7",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
    ] {
        v.push(name.to_string());
    }
    if let Ok(root) = std::env::var("ROCM_PATH") {
        v.push(format!("{root}/lib/libamdhip64.so"));
    }
    v.push("/opt/rocm/lib/libamdhip64.so".into());
    v
}

/// Copies a function pointer out of the library, or names the missing symbol.
///
/// # Safety
/// `T` must be the C signature of `name` in `libamdhip64`.
unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, GpuError> {
    // SAFETY: the caller guarantees T matches the symbol's type.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| {
            GpuError::from(format!(
                "libamdhip64 does not export {name} ({e}): ROCm 5.7 or newer needed"
            ))
        })
}

impl Hip {
    /// Loads `libamdhip64`, resolves the entry points and initialises the runtime.
    pub(crate) fn load() -> Result<Hip, GpuError> {
        Hip::load_from(&candidates())
    }

    /// Loads the first of `tried` that opens.
    fn load_from(tried: &[String]) -> Result<Hip, GpuError> {
        let mut found = None;
        for c in tried {
            // SAFETY: opening the library runs its initialisers, as any HIP program does.
            if let Ok(lib) = unsafe { Library::new(c) } {
                found = Some((lib, c.clone()));
                break;
            }
        }
        let Some((lib, path)) = found else {
            return Err(format!(
                "libamdhip64.so not found (no ROCm installed; tried {}; set KVLINK_HIP_LIBRARY)",
                tried.join(", ")
            )
            .into());
        };
        // SAFETY: each type below is the documented C signature of the named HIP function.
        let fns = unsafe {
            Fns {
                init: sym(&lib, "hipInit")?,
                get_device_count: sym(&lib, "hipGetDeviceCount")?,
                runtime_get_version: sym(&lib, "hipRuntimeGetVersion")?,
                pointer_get_attributes: sym(&lib, "hipPointerGetAttributes")?,
                set_device: sym(&lib, "hipSetDevice")?,
                get_device: sym(&lib, "hipGetDevice")?,
                stream_create: sym(&lib, "hipStreamCreateWithFlags")?,
                stream_synchronize: sym(&lib, "hipStreamSynchronize")?,
                stream_destroy: sym(&lib, "hipStreamDestroy")?,
                memcpy_async: sym(&lib, "hipMemcpyAsync")?,
                address_range: sym(&lib, "hipMemGetAddressRange")?,
                host_register: sym(&lib, "hipHostRegister")?,
                host_unregister: sym(&lib, "hipHostUnregister")?,
                malloc: sym(&lib, "hipMalloc")?,
                free: sym(&lib, "hipFree")?,
                error_string: sym(&lib, "hipGetErrorString")?,
                ipc_get: sym(&lib, "hipIpcGetMemHandle")?,
                ipc_open: sym(&lib, "hipIpcOpenMemHandle")?,
                ipc_close: sym(&lib, "hipIpcCloseMemHandle")?,
                dmabuf: sym(&lib, "hipMemGetHandleForAddressRange").ok(),
            }
        };
        let mut hip = Hip {
            fns,
            version: 0,
            devices: 0,
            path,
            streams: Default::default(),
            _lib: lib,
        };
        // SAFETY: hipInit takes flags only.
        hip.check(unsafe { (hip.fns.init)(0) }, "hipInit")?;
        let mut version: c_int = 0;
        // SAFETY: out-pointer to a live local.
        hip.check(
            unsafe { (hip.fns.runtime_get_version)(&mut version) },
            "hipRuntimeGetVersion",
        )?;
        let mut devices: c_int = 0;
        // SAFETY: out-pointer to a live local.
        hip.check(
            unsafe { (hip.fns.get_device_count)(&mut devices) },
            "hipGetDeviceCount",
        )?;
        if devices == 0 {
            return Err(format!(
                "HIP {} found but no GPU is visible (HIP_VISIBLE_DEVICES? /dev/kfd permissions?)",
                fmt_version(version)
            )
            .into());
        }
        hip.version = version;
        hip.devices = devices;
        Ok(hip)
    }

    fn error_text(&self, e: HipError) -> String {
        // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.fns.error_string)(e) };
        if p.is_null() {
            format!("hip error {e}")
        } else {
            // SAFETY: non-null static C string from the runtime.
            format!(
                "hip error {e}: {}",
                unsafe { CStr::from_ptr(p) }.to_string_lossy()
            )
        }
    }

    fn check(&self, e: HipError, what: &str) -> Result<(), GpuError> {
        if e == HIP_SUCCESS {
            Ok(())
        } else {
            Err(GpuError::call(
                GpuApi::Hip,
                e,
                format!("{what} failed: {}", self.error_text(e)),
            ))
        }
    }

    /// Runs `f` with GPU `ordinal` selected on this thread, then selects the thread's previous
    /// device again.
    fn on_device<T>(
        &self,
        ordinal: i32,
        f: impl FnOnce() -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        if ordinal < 0 || ordinal >= self.devices {
            return Err(format!(
                "HIP device {ordinal} does not exist ({} visible)",
                self.devices
            )
            .into());
        }
        let mut prev: c_int = 0;
        // SAFETY: out-pointer to a live local.
        self.check(unsafe { (self.fns.get_device)(&mut prev) }, "hipGetDevice")?;
        // SAFETY: a valid ordinal (checked above).
        self.check(unsafe { (self.fns.set_device)(ordinal) }, "hipSetDevice")?;
        let r = f();
        // SAFETY: prev was this thread's device a moment ago.
        let restored = self.check(
            unsafe { (self.fns.set_device)(prev) },
            "restoring the thread's HIP device",
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
        copy: impl FnOnce(HipStream) -> HipError,
    ) -> Result<(), GpuError> {
        let ops = StreamOps {
            create: &|| {
                let mut s: HipStream = std::ptr::null_mut();
                // SAFETY: out-pointer to a live local; the device is selected.
                self.check(
                    unsafe { (self.fns.stream_create)(&mut s, STREAM_NON_BLOCKING) },
                    "hipStreamCreateWithFlags",
                )?;
                Ok(s as usize)
            },
            sync: &|s| {
                // SAFETY: a stream this pool created, used by one copy at a time.
                self.check(
                    unsafe { (self.fns.stream_synchronize)(s as HipStream) },
                    "hipStreamSynchronize",
                )
            },
            destroy: &|s| {
                // SAFETY: a stream with no other user; HIP frees it once its work is done.
                let _ = unsafe { (self.fns.stream_destroy)(s as HipStream) };
            },
        };
        self.on_device(ordinal, || {
            self.streams
                .run(ordinal, &ops, |s| self.check(copy(s as HipStream), what))
        })
    }

    /// ROCm 6 and later use CUDA's memory type numbering.
    fn rocm6(&self) -> bool {
        self.version >= 60_000_000
    }
}

fn fmt_version(v: i32) -> String {
    format!("{}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000)
}

impl DeviceRuntime for Hip {
    fn api(&self) -> GpuApi {
        GpuApi::Hip
    }

    fn describe(&self) -> String {
        format!(
            "HIP {} ({}), {} device(s), dma-buf export {}",
            fmt_version(self.version),
            self.path,
            self.devices,
            if self.fns.dmabuf.is_some() {
                "available"
            } else {
                "missing (ROCm too old)"
            }
        )
    }

    fn classify(&self, ptr: u64) -> Result<PointerKind, GpuError> {
        // SAFETY: PointerAttributes is plain data; all-zero is a valid value.
        let mut a: PointerAttributes = unsafe { std::mem::zeroed() };
        // SAFETY: `a` is a live struct at least as large as hipPointerAttribute_t; the runtime
        // only reads the address value of `ptr`.
        let e = unsafe { (self.fns.pointer_get_attributes)(&mut a, ptr as *const c_void) };
        if e == HIP_ERROR_INVALID_VALUE {
            // ROCm 5 answers this for memory it does not know.
            return Ok(PointerKind::Host);
        }
        self.check(e, "hipPointerGetAttributes")?;
        let api = GpuApi::Hip;
        if a.is_managed != 0 {
            return Ok(PointerKind::Managed { api });
        }
        let (host, device, managed, unregistered) = if self.rocm6() {
            (1, 2, 3, Some(0))
        } else {
            (0, 1, 4, None)
        };
        match a.memory_type {
            t if Some(t) == unregistered => Ok(PointerKind::Host),
            t if t == host => Ok(PointerKind::PinnedHost { api }),
            t if t == device => Ok(PointerKind::Device {
                api,
                ordinal: a.device,
            }),
            t if t == managed => Ok(PointerKind::Managed { api }),
            t => Err(format!("HIP memory type {t} is not supported").into()),
        }
    }

    unsafe fn copy_to_host(
        &self,
        ordinal: i32,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "hipMemcpyAsync(DeviceToHost)", |stream| {
            // SAFETY: ranges guaranteed by the caller; on_stream waits for the stream before
            // returning.
            unsafe {
                (self.fns.memcpy_async)(
                    dst as *mut c_void,
                    src as *const c_void,
                    len,
                    MEMCPY_DEVICE_TO_HOST,
                    stream,
                )
            }
        })
    }

    unsafe fn copy_from_host(
        &self,
        ordinal: i32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "hipMemcpyAsync(HostToDevice)", |stream| {
            // SAFETY: ranges guaranteed by the caller; on_stream waits for the stream, so the
            // bytes have landed (pinned or pageable source) when this returns.
            unsafe {
                (self.fns.memcpy_async)(
                    dst as *mut c_void,
                    src as *const c_void,
                    len,
                    MEMCPY_HOST_TO_DEVICE,
                    stream,
                )
            }
        })
    }

    unsafe fn pin(&self, ordinal: i32, ptr: *mut u8, len: usize) -> Result<(), GpuError> {
        self.on_device(ordinal, || {
            // SAFETY: mapping lifetime guaranteed by the caller; hipHostRegisterPortable:
            // pinned for every device, whichever GPU a staged region is on.
            let e = unsafe {
                (self.fns.host_register)(ptr as *mut c_void, len, HOST_REGISTER_PORTABLE)
            };
            self.check(e, "hipHostRegister")
        })
    }

    unsafe fn unpin(&self, ordinal: i32, ptr: *mut u8) {
        let r = self.on_device(ordinal, || {
            // SAFETY: ptr was registered by pin (caller's contract) and is still mapped.
            let e = unsafe { (self.fns.host_unregister)(ptr as *mut c_void) };
            self.check(e, "hipHostUnregister")
        });
        if let Err(e) = r {
            tracing::warn!("unpinning a staging buffer: {e}");
        }
    }

    fn dmabuf(&self, ordinal: i32, ptr: u64, len: u64) -> Result<DmaBuf, GpuError> {
        let Some(export) = self.fns.dmabuf else {
            return Err(format!(
                "HIP {} cannot export dma-buf (hipMemGetHandleForAddressRange is new in ROCm 7.0)",
                fmt_version(self.version)
            )
            .into());
        };
        self.on_device(ordinal, || {
            let mut base: u64 = 0;
            let mut size: usize = 0;
            // SAFETY: out-pointers to live locals.
            self.check(
                unsafe { (self.fns.address_range)(&mut base, &mut size, ptr) },
                "hipMemGetAddressRange",
            )?;
            let mut tried = Vec::new();
            for (start, n) in export_candidates(base, size as u64, ptr, len) {
                let mut fd: c_int = -1;
                // SAFETY: the handle out-pointer is a live c_int, what HIP writes for a dma-buf
                // descriptor; start and n are page aligned.
                let e = unsafe {
                    export(
                        &mut fd as *mut c_int as *mut c_void,
                        start,
                        n as usize,
                        MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                        0,
                    )
                };
                match self.check(e, "hipMemGetHandleForAddressRange(DMA_BUF_FD)") {
                    Ok(()) if fd >= 0 => {
                        // SAFETY: a new descriptor owned by nobody else.
                        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                        return Ok(DmaBuf { fd, start, len: n });
                    }
                    Ok(()) => tried.push(format!("[{start:#x}, +{n}): no descriptor returned")),
                    Err(e) => tried.push(format!("[{start:#x}, +{n}): {e}")),
                }
            }
            Err(format!(
                "exporting GPU memory as dma-buf: {} (needs the amdgpu kernel driver with dma-buf \
                 export, Linux 5.12 or newer)",
                tried.join("; ")
            )
            .into())
        })
    }

    fn alloc(&self, ordinal: i32, len: usize) -> Result<u64, GpuError> {
        self.on_device(ordinal, || {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: out-pointer to a live local.
            self.check(unsafe { (self.fns.malloc)(&mut p, len) }, "hipMalloc")?;
            Ok(p as u64)
        })
    }

    unsafe fn free(&self, ordinal: i32, ptr: u64) {
        let r = self.on_device(ordinal, || {
            // SAFETY: ptr came from alloc and is unused (caller's contract).
            self.check(unsafe { (self.fns.free)(ptr as *mut c_void) }, "hipFree")
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

// SAFETY: the function pointers are plain code addresses into a library that stays loaded for
// the life of the Hip value; the HIP runtime is thread-safe.
unsafe impl Send for Hip {}
// SAFETY: see Send; Hip has no interior mutability.
unsafe impl Sync for Hip {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_and_missing_symbols_are_clear_errors() {
        let e = Hip::load_from(&["/nonexistent/libamdhip64.so".into()]).unwrap_err();
        assert!(e.message.contains("libamdhip64.so not found"), "{e}");
        // A library that is not HIP: the first entry point is reported missing, nothing runs.
        let e = Hip::load_from(&["libc.so.6".into()]).unwrap_err();
        assert!(e.message.contains("does not export hipInit"), "{e}");
    }

    #[test]
    fn versions_print_as_rocm_does() {
        assert_eq!(fmt_version(60_241_134), "6.2.41134");
        assert_eq!(fmt_version(50_731_921), "5.7.31921");
    }
}
