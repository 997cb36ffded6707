//! Host memory: regions allocated by kvlink (a sealed memfd, huge pages on request) and
//! caller-owned memory registered through [`ExternalMemory`].

use std::ptr::NonNull;

use super::{Backing, MemoryKind, OnDrop, Region};
use crate::error::{Error, Result};
use crate::ids::RegionId;
use crate::shm::SharedMap;

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

impl Region {
    /// Allocates `len` bytes of zeroed host memory, shareable with another process of this host
    /// (a sealed memfd: see [`Region::share_fd`]). With `huge_pages`, asks for 2 MiB huge pages
    /// and, when the system has none reserved, falls back to regular pages with transparent huge
    /// pages advised; the result's [`kind`](Region::kind) says which happened.
    pub(crate) fn allocate(id: RegionId, len: u64, huge_pages: bool) -> Result<Region> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate an empty region"));
        }
        let size = usize::try_from(len)
            .map_err(|_| Error::invalid(format!("region length {len} does not fit in memory")))?;
        let map = SharedMap::create(&format!("kvlink-region-{}", id.0), size, huge_pages)
            .map_err(|e| Error::Memory(format!("shared memory of {size} bytes: {e}")))?;
        let kind = if map.is_huge() {
            MemoryKind::HostHugePages
        } else {
            MemoryKind::HostMapped
        };
        let ptr = NonNull::new(map.as_ptr()).expect("mmap never returns null");
        Ok(Region {
            id,
            ptr,
            len,
            kind,
            _backing: Backing::Shared(map),
            on_drop: OnDrop::default(),
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
            on_drop: OnDrop::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_fall_back_cleanly() {
        // Without free huge pages the fallback must be taken; with some, either may be (a
        // cgroup or another process can still refuse them). Both give usable memory of exactly
        // the requested size, zeroed, readable and writable at both ends.
        let free = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("HugePages_Free:"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
            .unwrap_or(0);
        let len = 3 << 20;
        let r = Region::allocate(RegionId(2), len, true).unwrap();
        if free == 0 {
            assert_eq!(
                r.kind(),
                MemoryKind::HostMapped,
                "no free huge pages: fallback"
            );
        } else {
            assert!(matches!(
                r.kind(),
                MemoryKind::HostHugePages | MemoryKind::HostMapped
            ));
        }
        assert_eq!(r.len(), len);
        let mut b = [1u8; 2];
        r.read_at(len - 2, &mut b).unwrap();
        assert_eq!(b, [0, 0], "zeroed");
        r.write_at(0, &[7]).unwrap();
        r.write_at(len - 1, &[9]).unwrap();
        r.read_at(len - 1, &mut b[..1]).unwrap();
        assert_eq!(b[0], 9);
        assert!(r.write_at(len, &[1]).is_err(), "past the end is refused");
    }
}
