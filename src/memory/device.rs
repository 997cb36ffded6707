//! GPU memory: caller-owned device memory registered through [`DeviceMemory`], device regions
//! allocated by kvlink, and the pinned host buffers device memory is staged through for TCP.

use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};

use super::{Backing, MemoryKind, OnDrop, Region};
use crate::error::{Error, Result};
use crate::gpu::DeviceRuntime;
use crate::ids::RegionId;

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

impl Region {
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
            on_drop: OnDrop::default(),
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
            on_drop: OnDrop::default(),
        })
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
