//! CUDA IPC (exporting an allocation to another process of this host, opening a peer's) and
//! batches of copies queued on one stream: what the same-host transport asks of the driver.

use std::ffi::c_void;
use std::os::fd::OwnedFd;

use cudarc::driver::sys;

use super::{check, Cuda};
use crate::gpu::{CopyKind, GpuError, IpcExport};

impl Cuda {
    pub(super) fn export_ipc(
        &self,
        ordinal: i32,
        ptr: u64,
        len: u64,
    ) -> Result<IpcExport, GpuError> {
        self.in_context(ordinal, || {
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: out-pointers to live locals; the driver checks ptr.
            check(
                unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
                "cuMemGetAddressRange",
            )?;
            if ptr.saturating_add(len) > base + size as u64 {
                return Err(GpuError::from(format!(
                    "{len} bytes at {ptr:#x} run past their allocation"
                )));
            }
            // SAFETY: the handle is plain data the driver fills in.
            let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
            // SAFETY: out-pointer to a live local; base is the allocation's start.
            check(
                unsafe { sys::cuIpcGetMemHandle(&mut h, base) },
                "cuIpcGetMemHandle (memory from cuMemAlloc/cudaMalloc only, not VMM or pool \
                 allocations)",
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
        // SAFETY: the handle is plain data.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        if handle.len() != h.reserved.len() {
            return Err(GpuError::from(format!(
                "a CUDA IPC handle is {} bytes, not {}",
                h.reserved.len(),
                handle.len()
            )));
        }
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as std::ffi::c_char;
        }
        self.in_context(ordinal, || {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: out-pointer to a live local; the driver validates the handle's bytes.
            check(
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut p,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                },
                "cuIpcOpenMemHandle",
            )?;
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: out-pointers to live locals.
            let r = check(
                unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) },
                "cuMemGetAddressRange",
            );
            match r {
                Ok(()) => Ok((p, size as u64 - (p - base))),
                Err(e) => {
                    // SAFETY: p was opened just above and is not used.
                    let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
                    Err(e)
                }
            }
        })
    }

    pub(super) unsafe fn close_ipc(&self, ordinal: i32, base: u64) {
        let r = self.in_context(ordinal, || {
            // SAFETY: base came from ipc_open and is unused (caller's contract).
            check(
                unsafe { sys::cuIpcCloseMemHandle(base) },
                "cuIpcCloseMemHandle",
            )
        });
        if let Err(e) = r {
            tracing::warn!("closing a peer's device memory: {e}");
        }
    }

    pub(super) unsafe fn queue_copies(
        &self,
        ordinal: i32,
        kind: CopyKind,
        pieces: &[(u64, u64, usize)],
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "cuMemcpyAsync (batch)", |stream| {
            for &(dst, src, len) in pieces {
                // SAFETY: each piece's ranges are valid for its direction (caller's contract);
                // the stream is synchronised before returning, so the host buffers outlive the
                // copies.
                let r = unsafe {
                    match kind {
                        CopyKind::ToHost => {
                            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream)
                        }
                        CopyKind::FromHost => {
                            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream)
                        }
                        CopyKind::Device => sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream),
                    }
                };
                if r != sys::CUresult::CUDA_SUCCESS {
                    // Copies queued before this one may still run: wait for them before the
                    // failure is reported (their memory is released after it).
                    // SAFETY: the stream is ours and live.
                    let _ = unsafe { sys::cuStreamSynchronize(stream) };
                    return r;
                }
            }
            sys::CUresult::CUDA_SUCCESS
        })
    }

    pub(super) unsafe fn copy_on_device(
        &self,
        ordinal: i32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.on_stream(ordinal, "cuMemcpyDtoDAsync", |stream| {
            // SAFETY: both ranges are live device memory reachable from this context (caller's
            // contract); the stream is synchronised before returning.
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream) }
        })
    }
}
