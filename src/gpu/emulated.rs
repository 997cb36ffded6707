//! Host memory presented as device memory: the "device" addresses are host addresses and the
//! copies are `memcpy`. It lets the tests drive every staging path of the TCP transport (and
//! the device branch of RDMA registration) on machines without a GPU. It is never chosen for
//! memory an engine registers unless the caller asks for it by name.
//!
//! Memory it allocates is a sealed memfd, so its IPC calls work between processes as CUDA's do:
//! the export is the memfd (handed over a Unix socket) with the allocation's length as handle.

use std::collections::HashMap;
use std::os::fd::OwnedFd;

use parking_lot::Mutex;

use super::{DeviceRuntime, DmaBuf, GpuApi, GpuError, IpcExport, PointerKind};
use crate::shm::SharedMap;

/// Allocations of this process (`alloc`), and peers' allocations it opened (`ipc_open`), by
/// address.
static ALLOCATED: Mutex<Option<HashMap<u64, SharedMap>>> = Mutex::new(None);
static OPENED: Mutex<Option<HashMap<u64, SharedMap>>> = Mutex::new(None);

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

    fn alloc(&self, _ordinal: i32, len: usize) -> Result<u64, GpuError> {
        let m = SharedMap::create("kvlink-emulated-device", len, false)
            .map_err(|e| GpuError::from(format!("emulated device allocation: {e}")))?;
        let p = m.as_ptr() as u64;
        ALLOCATED
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(p, m);
        Ok(p)
    }

    unsafe fn free(&self, _ordinal: i32, ptr: u64) {
        // Dropping the mapping unmaps it; the caller's contract says nothing uses it.
        ALLOCATED
            .lock()
            .get_or_insert_with(HashMap::new)
            .remove(&ptr);
    }

    fn ipc_export(&self, _ordinal: i32, ptr: u64, len: u64) -> Result<IpcExport, GpuError> {
        let table = ALLOCATED.lock();
        let found = table.as_ref().and_then(|t| {
            t.iter().find(|(base, m)| {
                ptr >= **base && ptr.saturating_add(len) <= **base + m.len() as u64
            })
        });
        let (base, m) = found.ok_or_else(|| {
            GpuError::from(
                "emulated device memory registered from host memory has no IPC export \
                 (allocate it with allocate_device)",
            )
        })?;
        let fd = m
            .fd()
            .ok_or_else(|| GpuError::from("the allocation's memfd is closed"))?
            .try_clone_to_owned()
            .map_err(|e| GpuError::from(format!("duplicating the memfd: {e}")))?;
        Ok(IpcExport {
            handle: (m.len() as u64).to_le_bytes().to_vec(),
            fd: Some(fd),
            offset: ptr - base,
        })
    }

    fn ipc_open(
        &self,
        _ordinal: i32,
        handle: &[u8],
        fd: Option<OwnedFd>,
    ) -> Result<(u64, u64), GpuError> {
        let len: [u8; 8] = handle
            .try_into()
            .map_err(|_| GpuError::from("an emulated IPC handle is 8 bytes"))?;
        let len = u64::from_le_bytes(len);
        let fd = fd.ok_or_else(|| GpuError::from("an emulated IPC handle comes with a memfd"))?;
        let m = SharedMap::open_peer(fd, len).map_err(|why| GpuError::from(why.0))?;
        let p = m.as_ptr() as u64;
        OPENED.lock().get_or_insert_with(HashMap::new).insert(p, m);
        Ok((p, len))
    }

    unsafe fn ipc_close(&self, _ordinal: i32, base: u64) {
        OPENED.lock().get_or_insert_with(HashMap::new).remove(&base);
    }

    unsafe fn copy_device(
        &self,
        _ordinal: i32,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the trait contract makes both ranges valid; device addresses are host
        // addresses here. `copy` tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }
}
