//! Registration of memory with an engine: raw host or GPU pointers and the arrays of a model's
//! KV caches.

use kvlink_core::{DeviceMemory, ExternalMemory, KvLayout, RegionId};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::array_buffer;
use crate::detach::blocking;
use crate::engine::Engine;
use crate::error::{to_py, InvalidArgument};

impl Engine {
    /// Registers `size` bytes at `ptr` as host or GPU memory.
    pub(crate) fn register_raw(
        &self,
        py: Python<'_>,
        ptr: usize,
        size: u64,
        on_gpu: bool,
    ) -> PyResult<u32> {
        let inner = self.inner.clone();
        // Registration may pin memory with an RDMA NIC (slow for large caches): release the GIL.
        let region = if on_gpu {
            // SAFETY: the caller (the inference engine, or register_array holding the array)
            // owns this device allocation and keeps it alive until deregistered, as documented.
            let mem = unsafe { DeviceMemory::new(ptr as u64, size) }.map_err(to_py)?;
            blocking(py, move || inner.register_device(mem))
        } else {
            // SAFETY: as above, for host memory; kvlink accesses it like a DMA engine would.
            let mem = unsafe { ExternalMemory::new(ptr as *mut u8, size) }.map_err(to_py)?;
            blocking(py, move || inner.register_host(mem))
        };
        Ok(region.map_err(to_py)?.id().0)
    }

    pub(crate) fn register_all(
        &self,
        arrays: &Bound<'_, PyList>,
        tokens_per_block: u32,
        dtype: String,
        regions: &mut Vec<u32>,
    ) -> PyResult<()> {
        let mut tensors = Vec::new();
        for a in arrays.iter() {
            let shape: Vec<u64> = a.getattr("shape")?.extract()?;
            let blocks = *shape
                .first()
                .ok_or_else(|| InvalidArgument::new_err("a KV cache array has no dimensions"))?;
            let (_, nbytes, _) = array_buffer(&a)?;
            let (block_bytes, blocks) = KvLayout::split_buffer(nbytes, blocks).map_err(to_py)?;
            let region = self.register_array(&a)?;
            regions.push(region);
            tensors.push((RegionId(region), 0, block_bytes, block_bytes, blocks));
        }
        self.apply_layout(KvLayout::numbered(tokens_per_block, dtype, tensors))
    }
}
