//! Registered memory: the only bytes a peer can ever read, and the only bytes a transfer may
//! write.
//!
//! This is one of the few modules allowed `unsafe`: it turns registered (pointer, length) pairs
//! into byte slices for the kernel's vectored I/O. Everything above works with [`RegionSpan`]s,
//! which are bounds-checked when made.
//!
//! Memory is either allocated here (anonymous `mmap`, huge pages on request) or registered by
//! the caller from a pointer it owns (a KV cache allocated by the inference engine). GPU memory
//! regions hold their runtime and are reached only through its copies (`read_at`, `write_at`,
//! staging buffers), never by the CPU or the kernel directly.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gpu::{DeviceRuntime, GpuApi};
use crate::ids::RegionId;

/// What backs a region, and keeps it alive while registered.
enum Backing {
    /// Anonymous mapping owned by the region; unmapped on drop.
    Mapped(#[allow(dead_code)] MmapMut),
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

/// Host memory owned by the caller (an inference engine's KV cache), vouched for by the caller
/// through [`ExternalMemory::new`]'s safety contract. Registered with `Engine::register_host`.
#[derive(Debug)]
pub struct ExternalMemory {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: u64,
}

// SAFETY: ExternalMemory is a (pointer, length) pair the caller vouched for; it is only turned
// into a Region, which has the same sharing rules (see Region's Send/Sync).
unsafe impl Send for ExternalMemory {}

impl ExternalMemory {
    /// Describes caller-owned memory.
    ///
    /// # Safety
    /// `ptr` must point to `len` bytes valid for reads and writes from this call until the
    /// region registered from it is deregistered (`Engine::deregister` returns only once no
    /// transfer uses it) or the engine is dropped. kvlink and its peers read and write those
    /// bytes concurrently with the caller, as a DMA engine would.
    pub unsafe fn new(ptr: *mut u8, len: u64) -> Result<ExternalMemory> {
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::invalid("null pointer registered"))?;
        if len == 0 {
            return Err(Error::invalid("cannot register an empty region"));
        }
        if (ptr.as_ptr() as u64).checked_add(len).is_none() {
            return Err(Error::invalid("region wraps around the address space"));
        }
        Ok(ExternalMemory { ptr, len })
    }
}

/// GPU memory owned by the caller (a KV cache allocated by the inference engine with CUDA or
/// HIP), vouched for through [`DeviceMemory::new`]'s safety contract. Registered with
/// `Engine::register_device`, which asks the loaded GPU runtimes which device it is on.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMemory {
    pub(crate) ptr: u64,
    pub(crate) len: u64,
}

impl DeviceMemory {
    /// Describes caller-owned device memory.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be one live device allocation (or part of one) of the CUDA or HIP
    /// runtime in this process, and stay allocated until the region registered from it is
    /// deregistered (`Engine::deregister` returned) or the engine is dropped. kvlink and its
    /// peers read and write it concurrently with the caller, as a DMA engine would.
    pub unsafe fn new(ptr: u64, len: u64) -> Result<DeviceMemory> {
        if ptr == 0 {
            return Err(Error::invalid("null device pointer registered"));
        }
        if len == 0 {
            return Err(Error::invalid("cannot register an empty region"));
        }
        if ptr.checked_add(len).is_none() {
            return Err(Error::invalid("region wraps around the address space"));
        }
        Ok(DeviceMemory { ptr, len })
    }
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
}

// SAFETY: a Region is a (pointer, length) to memory that is valid for the region's lifetime
// (owned mapping, or the registrant's promise for external memory). Region never hands out Rust
// references that outlive a call; all access is through raw copies or the kernel, which are
// sound to perform from any thread.
#[allow(unsafe_code)]
unsafe impl Send for Region {}
// SAFETY: see Send; shared access performs no unsynchronised Rust-level reads or writes of
// Region's own fields (they are immutable after construction).
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
    /// Allocates `len` bytes of zeroed host memory. With `huge_pages`, asks for 2 MiB huge pages
    /// (`MAP_HUGETLB`) and, when the system has none reserved, falls back to regular pages with
    /// transparent huge pages advised; the result's [`kind`](Region::kind) says which happened.
    pub(crate) fn allocate(id: RegionId, len: u64, huge_pages: bool) -> Result<Region> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate an empty region"));
        }
        let size = usize::try_from(len)
            .map_err(|_| Error::invalid(format!("region length {len} does not fit in memory")))?;
        let mut kind = MemoryKind::HostMapped;
        let map = if huge_pages {
            let huge_len = size.div_ceil(2 << 20) * (2 << 20);
            match MmapOptions::new().len(huge_len).huge(Some(21)).map_anon() {
                Ok(m) => {
                    kind = MemoryKind::HostHugePages;
                    m
                }
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "huge pages unavailable (reserve some with /proc/sys/vm/nr_hugepages); \
                         falling back to regular pages with transparent huge pages advised"
                    );
                    let m = MmapOptions::new()
                        .len(size)
                        .map_anon()
                        .map_err(|e| Error::Memory(format!("mmap of {size} bytes failed: {e}")))?;
                    let _ = m.advise(memmap2::Advice::HugePage);
                    m
                }
            }
        } else {
            MmapOptions::new()
                .len(size)
                .map_anon()
                .map_err(|e| Error::Memory(format!("mmap of {size} bytes failed: {e}")))?
        };
        // Fault every page in now rather than during the first transfer into it.
        let _ = map.advise(memmap2::Advice::PopulateWrite);
        let mut map = map;
        let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap never returns null");
        Ok(Region {
            id,
            ptr,
            len,
            kind,
            _backing: Backing::Mapped(map),
        })
    }

    /// Registers caller-owned memory (validity vouched for by [`ExternalMemory::new`]).
    pub(crate) fn external(id: RegionId, mem: ExternalMemory) -> Region {
        Region {
            id,
            ptr: mem.ptr,
            len: mem.len,
            kind: MemoryKind::HostExternal,
            _backing: Backing::External,
        }
    }

    /// Registers caller-owned device memory of GPU `ordinal`, reached through `rt` (validity
    /// vouched for by [`DeviceMemory::new`]).
    pub(crate) fn device(
        id: RegionId,
        mem: DeviceMemory,
        rt: Arc<dyn DeviceRuntime>,
        ordinal: i32,
    ) -> Region {
        Region {
            id,
            ptr: NonNull::new(mem.ptr as *mut u8).expect("checked non-null by DeviceMemory::new"),
            len: mem.len,
            kind: MemoryKind::Device {
                api: rt.api(),
                ordinal,
            },
            _backing: Backing::Device {
                rt,
                ordinal,
                owned: false,
            },
        }
    }

    /// Allocates `len` bytes of device memory on GPU `ordinal` with `rt`; freed on drop.
    pub(crate) fn allocate_device(
        id: RegionId,
        len: u64,
        rt: Arc<dyn DeviceRuntime>,
        ordinal: i32,
    ) -> Result<Region> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate an empty region"));
        }
        let size = usize::try_from(len)
            .map_err(|_| Error::invalid(format!("region length {len} does not fit in memory")))?;
        let ptr = rt.alloc(ordinal, size).map_err(Error::Gpu)?;
        let ptr = NonNull::new(ptr as *mut u8)
            .ok_or_else(|| Error::Gpu("device allocation returned null".into()))?;
        Ok(Region {
            id,
            ptr,
            len,
            kind: MemoryKind::Device {
                api: rt.api(),
                ordinal,
            },
            _backing: Backing::Device {
                rt,
                ordinal,
                owned: true,
            },
        })
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

/// A bounds-checked byte range of a registered region, holding the region alive.
#[derive(Clone, Debug)]
pub(crate) struct RegionSpan {
    region: Arc<Region>,
    offset: u64,
    len: u64,
}

impl RegionSpan {
    /// Makes a span after checking it lies inside the region.
    pub(crate) fn new(region: Arc<Region>, offset: u64, len: u64) -> Result<Self> {
        region.check_range(offset, len)?;
        Ok(RegionSpan {
            region,
            offset,
            len,
        })
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Whether the span is GPU memory (moved by staging copies, never by `readv`/`writev`).
    pub(crate) fn is_device(&self) -> bool {
        self.region.is_device()
    }

    /// The span's region.
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// The span's start offset in its region.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// `[skip, skip + len)` of this span, as a span of its own.
    pub(crate) fn sub(&self, skip: u64, len: u64) -> Result<RegionSpan> {
        match skip.checked_add(len) {
            Some(end) if end <= self.len => {
                RegionSpan::new(self.region.clone(), self.offset + skip, len)
            }
            _ => Err(Error::invalid(format!(
                "sub-span [{skip}, +{len}) of a {}-byte span",
                self.len
            ))),
        }
    }

    /// The span's region and start offset.
    pub(crate) fn position(&self) -> (RegionId, u64) {
        (self.region.id(), self.offset)
    }
}

/// Most I/O vectors handed to one `readv`/`writev` (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

/// Raw I/O vectors over `head` then `spans`, skipping the first `skip` bytes of their
/// concatenation. Only raw pointers are formed: no Rust reference to region bytes exists, since
/// those bytes may be written or read concurrently by the KV cache's owner, by the kernel or by
/// a NIC.
fn iovecs(head: &[u8], spans: &[RegionSpan], mut skip: u64) -> Vec<libc::iovec> {
    let mut v = Vec::with_capacity(IOV_MAX.min(spans.len() + 1));
    if skip < head.len() as u64 {
        v.push(libc::iovec {
            iov_base: head.as_ptr().wrapping_add(skip as usize) as *mut libc::c_void,
            iov_len: head.len() - skip as usize,
        });
        skip = 0;
    } else {
        skip -= head.len() as u64;
    }
    for span in spans {
        if v.len() == IOV_MAX {
            break;
        }
        // Device memory is never handed to the kernel: callers stage it (see readv/writev).
        assert!(!span.is_device(), "device span given to vectored I/O");
        if skip >= span.len {
            skip -= span.len;
            continue;
        }
        let start = span.offset + skip;
        v.push(libc::iovec {
            iov_base: span.region.ptr.as_ptr().wrapping_add(start as usize) as *mut libc::c_void,
            iov_len: (span.len - skip) as usize,
        });
        skip = 0;
    }
    v
}

/// One `writev(2)` of `head` then the spans' bytes on `fd`, after the first `skip` bytes.
/// Returns the bytes written (0 when nothing is left).
pub(crate) fn writev(fd: RawFd, head: &[u8], spans: &[RegionSpan], skip: u64) -> io::Result<usize> {
    let iov = iovecs(head, spans, skip);
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: every iovec addresses readable bytes: `head` is borrowed for the call, and each
    // span lies inside its region (checked when the span was made) whose Arc `spans` holds for
    // the call. writev only reads them; iov.len() <= IOV_MAX.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One `readv(2)` from `fd` into the spans, after the first `skip` bytes of their
/// concatenation. Returns the bytes read (0 at end of stream).
///
/// Callers uphold the transfer contract: while a request reads into its local spans, nothing
/// else kvlink does writes those bytes (the planner refuses duplicate destination blocks within
/// a request; the scheduler owns a request's blocks until the request ends; cancellation waits
/// out a read in progress, see `RequestCtl`).
pub(crate) fn readv(fd: RawFd, spans: &[RegionSpan], skip: u64) -> io::Result<usize> {
    let iov = iovecs(&[], spans, skip);
    if iov.is_empty() {
        return Ok(0);
    }
    // SAFETY: every iovec addresses writable bytes inside a registered region (bounds-checked
    // span, region kept alive by the Arc in `spans` for the call); no Rust reference to them
    // exists, so the kernel writing them is not an aliasing violation. iov.len() <= IOV_MAX.
    let n = unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// A host buffer that device memory is staged through for TCP, pinned by the GPU runtime when
/// it allows (pageable memory works too, only slower).
pub(crate) struct StagingBuf {
    map: MmapMut,
    pinned: Option<(Arc<dyn DeviceRuntime>, i32)>,
}

impl StagingBuf {
    /// Maps `len` bytes and pins them with `rt` (from GPU `ordinal`'s context). Blocking: call
    /// it off the async runtime.
    pub(crate) fn new(len: usize, rt: &Arc<dyn DeviceRuntime>, ordinal: i32) -> Result<StagingBuf> {
        let mut map = MmapOptions::new()
            .len(len)
            .populate()
            .map_anon()
            .map_err(|e| Error::Memory(format!("mapping a {len}-byte staging buffer: {e}")))?;
        // SAFETY: the mapping is live and stays mapped until this buffer drops, where it is
        // unpinned first.
        let pinned = match unsafe { rt.pin(ordinal, map.as_mut_ptr(), len) } {
            Ok(()) => Some((rt.clone(), ordinal)),
            Err(e) => {
                tracing::warn!("staging buffer not pinned ({e}); device copies will be slower");
                None
            }
        };
        Ok(StagingBuf { map, pinned })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        if let Some((rt, ordinal)) = &self.pinned {
            // SAFETY: pinned by `rt` in new(), still mapped (the map drops after this).
            unsafe { rt.unpin(*ordinal, self.map.as_mut_ptr()) };
        }
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

    #[test]
    fn huge_pages_fall_back_cleanly() {
        // Either explicit huge pages are reserved on this machine or the fallback is taken;
        // both give usable memory of at least the requested size.
        let r = Region::allocate(RegionId(2), 3 << 20, true).unwrap();
        assert!(matches!(
            r.kind(),
            MemoryKind::HostHugePages | MemoryKind::HostMapped
        ));
        r.write_at((3 << 20) - 1, &[7]).unwrap();
    }

    #[test]
    fn readv_and_writev_move_span_bytes_through_a_socket() {
        use std::os::fd::AsRawFd;
        let src = Arc::new(Region::allocate(RegionId(3), 64, false).unwrap());
        let dst = Arc::new(Region::allocate(RegionId(4), 64, false).unwrap());
        src.write_at(0, &(0u8..64).collect::<Vec<_>>()).unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let out = vec![
            RegionSpan::new(src.clone(), 8, 8).unwrap(),
            RegionSpan::new(src.clone(), 40, 8).unwrap(),
        ];
        // Skip the 2-byte head and 3 bytes of the first span.
        assert_eq!(writev(a.as_raw_fd(), b"hh", &out, 5).unwrap(), 13);
        let into = vec![
            RegionSpan::new(dst.clone(), 0, 5).unwrap(),
            RegionSpan::new(dst.clone(), 32, 8).unwrap(),
        ];
        assert_eq!(readv(b.as_raw_fd(), &into, 0).unwrap(), 13);
        let mut got = [0u8; 5];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, [11, 12, 13, 14, 15]);
        let mut got = [0u8; 8];
        dst.read_at(32, &mut got).unwrap();
        assert_eq!(got, [40, 41, 42, 43, 44, 45, 46, 47]);
        assert_eq!(writev(a.as_raw_fd(), b"", &out, 16).unwrap(), 0);
        assert!(RegionSpan::new(src, 60, 8).is_err());
    }
}
