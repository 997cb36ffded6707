//! Host memory presented as device memory: the "device" addresses are host addresses and the
//! copies are `memcpy`. It lets the tests drive every staging path of the TCP transport (and
//! the device branch of RDMA registration) on machines without a GPU. It is never chosen for
//! memory an engine registers unless the caller asks for it by name.

use super::{DeviceRuntime, DmaBuf, GpuApi, GpuError, PointerKind};

/// The emulated runtime (stateless).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Emulated;

impl DeviceRuntime for Emulated {
    fn api(&self) -> GpuApi {
        GpuApi::Emulated
    }

    fn describe(&self) -> String {
        "emulated device memory (host memory behind the device interface; tests only)".into()
    }

    fn classify(&self, _ptr: u64) -> Result<PointerKind, GpuError> {
        Ok(PointerKind::Host)
    }

    unsafe fn copy_to_host(
        &self,
        _ordinal: i32,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the trait contract makes both ranges valid; for this runtime device addresses
        // are host addresses. `copy` tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst, len) };
        Ok(())
    }

    unsafe fn copy_from_host(
        &self,
        _ordinal: i32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: as in copy_to_host.
        unsafe { std::ptr::copy(src, dst as *mut u8, len) };
        Ok(())
    }

    unsafe fn pin(&self, _ordinal: i32, _ptr: *mut u8, _len: usize) -> Result<(), GpuError> {
        Ok(())
    }

    unsafe fn unpin(&self, _ordinal: i32, _ptr: *mut u8) {}

    fn dmabuf(&self, _ordinal: i32, _ptr: u64, _len: u64) -> Result<DmaBuf, GpuError> {
        Err("emulated device memory has no dma-buf exporter".into())
    }

    fn alloc(&self, _ordinal: i32, _len: usize) -> Result<u64, GpuError> {
        Err("emulated device memory is registered from host memory, not allocated".into())
    }

    unsafe fn free(&self, _ordinal: i32, _ptr: u64) {}
}
