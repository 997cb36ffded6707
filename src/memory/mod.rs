//! Registered memory: the only bytes a peer can ever read, and the only bytes a transfer may
//! write.
//!
//! This is one of the few modules allowed `unsafe`: it turns registered (pointer, length) pairs
//! into byte slices for the kernel's vectored I/O. Everything above works with [`RegionSpan`]s,
//! which are bounds-checked when made.
//!
//! Memory is either allocated here (a sealed memfd mapping, huge pages on request) or registered by
//! the caller from a pointer it owns (a KV cache allocated by the inference engine). GPU memory
//! regions hold their runtime and are reached only through its copies (`read_at`, `write_at`,
//! staging buffers), never by the CPU or the kernel directly.

use std::ptr::NonNull;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gpu::{DeviceRuntime, GpuApi};
use crate::ids::RegionId;

mod device;
mod host;
mod peer;
mod release;
mod span;

pub use device::DeviceMemory;
pub(crate) use device::StagingBuf;
pub use host::ExternalMemory;
pub(crate) use peer::PeerMemory;
pub(crate) use release::{OnDrop, Release};
pub(crate) use span::{bytes_waiting, readv, recv_now, writev, RegionSpan};

/// What backs a region, and keeps it alive while registered.
enum Backing {
    /// A memfd mapping owned by the region (shareable with another process); unmapped on
    /// drop.
    Shared(crate::shm::SharedMap),
    /// Caller-owned host memory; the caller promised it stays valid while registered.
    External,
    /// GPU memory, reached only through its runtime's copies (never dereferenced on the CPU).
    Device {
        rt: Arc<dyn DeviceRuntime>,
        ordinal: i32,
        /// Allocated by kvlink (freed on drop) rather than registered from the caller.
        owned: bool,
    },
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Backing::Device {
            rt,
            ordinal,
            owned: true,
        } = &self._backing
        {
            // SAFETY: the allocation came from this runtime's alloc (Region::allocate_device)
            // and the region is being dropped: no span, transfer or registration holds it.
            unsafe { rt.free(*ordinal, self.ptr.as_ptr() as u64) };
        }
    }
}

/// Where a region's pages came from, reported to users and in logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Host memory registered from a caller's pointer.
    HostExternal,
    /// Host memory allocated by kvlink with regular pages.
    HostMapped,
    /// Host memory allocated by kvlink with explicit huge pages (`MAP_HUGETLB`).
    HostHugePages,
    /// GPU memory. Read and written by RDMA directly (dma-buf or peer-memory registration) and
    /// by TCP through pinned host staging buffers.
    Device {
        /// The GPU runtime that owns it.
        api: GpuApi,
        /// The GPU's ordinal in that runtime.
        ordinal: i32,
    },
}

/// A registered memory region.
///
/// Its bytes are shared with transports (and, for external memory, with the engine that owns
/// them), so it offers copies in and out rather than references.
pub struct Region {
    id: RegionId,
    ptr: NonNull<u8>,
    len: u64,
    kind: MemoryKind,
    _backing: Backing,
    /// Counted out of a deregistration's wait when the region drops (after its memory was
    /// freed, for memory kvlink allocated).
    on_drop: OnDrop,
}

// SAFETY: a Region is a (pointer, length) to memory that is valid for the region's lifetime
// (owned mapping, or the registrant's promise for external memory). Region never hands out Rust
// references that outlive a call; all access is through raw copies or the kernel, which are
// sound to perform from any thread.
#[allow(unsafe_code)]
unsafe impl Send for Region {}
// SAFETY: see Send; shared access performs no unsynchronised Rust-level reads or writes of
// Region's own fields (immutable after construction, but `on_drop`, which is behind a mutex).
#[allow(unsafe_code)]
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Region {
    /// Counts this region in `release` until it drops.
    pub(crate) fn release_into(&self, release: &Arc<Release>) {
        self.on_drop.arm(release);
    }

    /// The GPU runtime and device of a device region; `None` for host memory.
    pub(crate) fn device_runtime(&self) -> Option<(&Arc<dyn DeviceRuntime>, i32)> {
        match &self._backing {
            Backing::Device { rt, ordinal, .. } => Some((rt, *ordinal)),
            _ => None,
        }
    }

    /// Whether the region is GPU memory (not addressable by the CPU).
    pub fn is_device(&self) -> bool {
        matches!(self._backing, Backing::Device { .. })
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never true for a registered region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's start address (for handing to other libraries; kvlink never exposes it to
    /// peers over TCP). For GPU memory this is a device address: never dereference it on the
    /// CPU.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Where the region's pages came from.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Checks `[offset, offset+len)` lies inside the region.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange {
                region: self.id,
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Copies `data` into the region at `offset` (for device memory, a synchronous copy by its
    /// GPU runtime).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        if let Some((rt, ordinal)) = self.device_runtime() {
            // SAFETY: the range is inside the device allocation (checked above, and the
            // registrant's DeviceMemory contract or our own allocation); `data` is a live
            // host buffer for the call.
            return unsafe {
                rt.copy_from_host(
                    ordinal,
                    self.ptr.as_ptr() as u64 + offset,
                    data.as_ptr(),
                    data.len(),
                )
            }
            .map_err(Error::Gpu);
        }
        // SAFETY: the range is inside the region (checked above), the region memory is valid
        // for writes (allocation or registrant's contract), and `data` is a distinct Rust
        // allocation or another region's bytes accessed by raw copy, so `copy` (memmove) is
        // sound even if they overlap.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                data.len(),
            );
        }
        Ok(())
    }

    /// Copies bytes from the region at `offset` into `out` (for device memory, a synchronous
    /// copy by its GPU runtime).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len() as u64)?;
        if let Some((rt, ordinal)) = self.device_runtime() {
            // SAFETY: range checked above and inside the device allocation; `out` is an
            // exclusive host buffer for the call.
            return unsafe {
                rt.copy_to_host(
                    ordinal,
                    out.as_mut_ptr(),
                    self.ptr.as_ptr() as u64 + offset,
                    out.len(),
                )
            }
            .map_err(Error::Gpu);
        }
        // SAFETY: range checked above; the region is valid for reads; `out` is an exclusive
        // Rust buffer, and `copy` tolerates overlap.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy(
                self.ptr.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }
}

/// What a peer is told about one exported region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// The region's id, used by the peer to name it in read requests.
    pub id: RegionId,
    /// The region's length; every read must lie inside `[0, len)`.
    pub len: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_write_read_and_bounds() {
        let r = Region::allocate(RegionId(1), 4096, false).unwrap();
        assert_eq!(r.kind(), MemoryKind::HostMapped);
        r.write_at(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        r.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(matches!(
            r.write_at(4094, b"abc"),
            Err(Error::OutOfRange { .. })
        ));
        assert!(r.check_range(u64::MAX, 2).is_err());
        assert!(r.check_range(4096, 0).is_ok());
    }
}
