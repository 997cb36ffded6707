//! HIP IPC (exporting an allocation to another process of this host, opening a peer's) and
//! device-to-device copies: what the same-host transport asks of the runtime.

use std::ffi::{c_char, c_void};
use std::os::fd::OwnedFd;

use super::{Hip, IpcHandle, IPC_LAZY_ENABLE_PEER_ACCESS, MEMCPY_DEVICE_TO_DEVICE};
use crate::gpu::{GpuError, IpcExport};

impl Hip {
    pub(super) fn export_ipc(
        &self,
        ordinal: i32,
        ptr: u64,
        len: u64,
    ) -> Result<IpcExport, GpuError> {
        self.on_device(ordinal, || {
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers to live locals.
            self.check(
                unsafe { (self.fns.address_range)(&mut base, &mut size, ptr) },
                "hipMemGetAddressRange",
            )?;
            if ptr.saturating_add(len) > base + size as u64 {
                return Err(GpuError::from(format!(
                    "{len} bytes at {ptr:#x} run past their allocation"
                )));
            }
            let mut h = IpcHandle { reserved: [0; 64] };
            // SAFETY: out-pointer to a live local; base is the allocation's start.
            self.check(
                unsafe { (self.fns.ipc_get)(&mut h, base as *mut c_void) },
                "hipIpcGetMemHandle",
            )?;
            Ok(IpcExport {
                handle: h.reserved.iter().map(|&b| b as u8).collect(),
                fd: None,
                offset: ptr - base,
            })
        })
    }

    pub(super) fn open_ipc(
        &self,
        ordinal: i32,
        handle: &[u8],
        _fd: Option<OwnedFd>,
    ) -> Result<(u64, u64), GpuError> {
        let mut h = IpcHandle { reserved: [0; 64] };
        if handle.len() != h.reserved.len() {
            return Err(GpuError::from(format!(
                "a HIP IPC handle is 64 bytes, not {}",
                handle.len()
            )));
        }
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as c_char;
        }
        self.on_device(ordinal, || {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: out-pointer to a live local; the runtime validates the handle.
            self.check(
                unsafe { (self.fns.ipc_open)(&mut p, h, IPC_LAZY_ENABLE_PEER_ACCESS) },
                "hipIpcOpenMemHandle",
            )?;
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers to live locals.
            let r = self.check(
                unsafe { (self.fns.address_range)(&mut base, &mut size, p as u64) },
                "hipMemGetAddressRange",
            );
            match r {
                Ok(()) => Ok((p as u64, size as u64 - (p as u64 - base))),
                Err(e) => {
                    // SAFETY: opened just above, unused.
                    let _ = unsafe { (self.fns.ipc_close)(p) };
                    Err(e)
                }
            }
        })
    }

    pub(super) unsafe fn close_ipc(&self, ordinal: i32, base: u64) {
        let r = self.on_device(ordinal, || {
            // SAFETY: base came from ipc_open and is unused (caller's contract).
            self.check(
                unsafe { (self.fns.ipc_close)(base as *mut c_void) },
                "hipIpcCloseMemHandle",
            )
        });
        if let Err(e) = r {
            tracing::warn!("closing a peer's device memory: {e}");
        }
    }

    pub(super) unsafe fn copy_on_device(
        &self,
        ordinal: i32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "hipMemcpyAsync(DeviceToDevice)", |stream| {
            // SAFETY: ranges guaranteed by the caller; on_stream waits for the stream.
            unsafe {
                (self.fns.memcpy_async)(
                    dst as *mut c_void,
                    src as *const c_void,
                    len,
                    MEMCPY_DEVICE_TO_DEVICE,
                    stream,
                )
            }
        })
    }
}
