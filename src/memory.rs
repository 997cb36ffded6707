//! Registered memory: the only bytes a peer can ever read, and the only bytes a transfer may
//! write.
//!
//! This is one of the few modules allowed `unsafe`: it turns registered (pointer, length) pairs
//! into byte slices for the kernel's vectored I/O. Everything above works with [`RegionSpan`]s,
//! which are bounds-checked when made.
//!
//! Memory is either allocated here (anonymous `mmap`, huge pages on request) or registered by
//! the caller from a pointer it owns (a KV cache allocated by the inference engine).

use std::io::{IoSlice, IoSliceMut};
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::RegionId;

/// What backs a region, and keeps it alive while registered.
enum Backing {
    /// Anonymous mapping owned by the region; unmapped on drop.
    Mapped(#[allow(dead_code)] MmapMut),
    /// Caller-owned memory; the caller promised it stays valid while registered.
    External,
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

    /// Registers caller-owned memory.
    ///
    /// # Safety
    /// `ptr` must point to `len` bytes that are valid for reads and writes, and stay so until
    /// the region is deregistered and every transfer using it has ended (the engine drops its
    /// last reference then).
    #[allow(unsafe_code)]
    pub(crate) unsafe fn external(id: RegionId, ptr: *mut u8, len: u64) -> Result<Region> {
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::invalid("null pointer registered"))?;
        if len == 0 {
            return Err(Error::invalid("cannot register an empty region"));
        }
        if (ptr.as_ptr() as u64).checked_add(len).is_none() {
            return Err(Error::invalid("region wraps around the address space"));
        }
        Ok(Region {
            id,
            ptr,
            len,
            kind: MemoryKind::HostExternal,
            _backing: Backing::External,
        })
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
    /// peers over TCP).
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

    /// Copies `data` into the region at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
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

    /// Copies bytes from the region at `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len() as u64)?;
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

    /// The span's region and start offset.
    pub(crate) fn position(&self) -> (RegionId, u64) {
        (self.region.id(), self.offset)
    }

    /// The span's bytes as an I/O slice for a vectored write to a socket.
    pub(crate) fn io_slice(&self) -> IoSlice<'_> {
        // SAFETY: the range was checked at construction and the Arc keeps the region alive for
        // the borrow's lifetime. The bytes may be written concurrently by the engine that owns
        // the KV cache (as with any DMA engine reading it); the slice is only handed to the
        // kernel's writev and never read by Rust code.
        #[allow(unsafe_code)]
        let bytes = unsafe {
            std::slice::from_raw_parts(
                self.region.ptr.as_ptr().add(self.offset as usize),
                self.len as usize,
            )
        };
        IoSlice::new(bytes)
    }
}

/// Builds mutable I/O slices over `spans`, skipping the first `skip` bytes of their
/// concatenation, at most `max_slices` of them, and passes them to `f` (a vectored socket read).
///
/// The slices live only for the call. Callers uphold the transfer contract: while a request
/// reads into local spans, no other kvlink transfer writes the same bytes (the planner refuses
/// duplicate destination blocks within a request, and the engine's scheduler owns the blocks it
/// hands to a request until the request ends).
pub(crate) fn with_io_slices_mut<R>(
    spans: &[RegionSpan],
    mut skip: u64,
    max_slices: usize,
    f: impl FnOnce(&mut [IoSliceMut<'_>]) -> R,
) -> R {
    let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(max_slices.min(spans.len()));
    for span in spans {
        if slices.len() == max_slices {
            break;
        }
        if skip >= span.len {
            skip -= span.len;
            continue;
        }
        let start = span.offset + skip;
        let len = span.len - skip;
        skip = 0;
        // SAFETY: [start, start+len) lies inside the span, which was bounds-checked against the
        // region at construction; the Arc in `spans` keeps the region alive for the slices'
        // lifetime (they do not outlive this call). Exclusivity of these bytes for the duration
        // of the call is the transfer contract stated above; the kernel's readv is the only
        // writer through them.
        #[allow(unsafe_code)]
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                span.region.ptr.as_ptr().add(start as usize),
                len as usize,
            )
        };
        slices.push(IoSliceMut::new(bytes));
    }
    f(&mut slices)
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
    fn io_slices_skip_and_cap() {
        let r = Arc::new(Region::allocate(RegionId(3), 64, false).unwrap());
        let spans = vec![
            RegionSpan::new(r.clone(), 0, 8).unwrap(),
            RegionSpan::new(r.clone(), 16, 8).unwrap(),
            RegionSpan::new(r.clone(), 32, 8).unwrap(),
        ];
        with_io_slices_mut(&spans, 10, 8, |s| {
            assert_eq!(s.len(), 2);
            assert_eq!(s[0].len(), 6);
            s[0][0] = 0xAB;
        });
        let mut b = [0u8; 1];
        r.read_at(18, &mut b).unwrap();
        assert_eq!(b[0], 0xAB);
        with_io_slices_mut(&spans, 0, 1, |s| assert_eq!(s.len(), 1));
        assert!(RegionSpan::new(r, 60, 8).is_err());
    }
}
