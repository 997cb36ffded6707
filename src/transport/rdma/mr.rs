//! Memory registrations of a region with an RDMA device: equal chunks (below the NIC's
//! registration limit), each with its own keys.

use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion;

use super::wr::LocalKeys;
use crate::memory::{OnDrop, Release};

/// Memory registrations of one region, in equal chunks (the last may be shorter).
pub(crate) struct RegionMrs {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) chunk: u64,
    pub(crate) mrs: Vec<Arc<MemoryRegion>>,
    /// Counted out of a deregistration's wait when the registrations drop.
    pub(crate) on_drop: OnDrop,
}

impl RegionMrs {
    /// Counts these registrations in `release` until they drop.
    pub(crate) fn release_into(&self, release: &Arc<Release>) {
        self.on_drop.arm(release);
    }

    /// Local key covering `offset`, and how many bytes from there stay inside its chunk.
    pub(crate) fn lkey(&self, offset: u64) -> (u32, u64) {
        let i = (offset / self.chunk) as usize;
        let end = ((i as u64 + 1) * self.chunk).min(self.len);
        (self.mrs[i].lkey(), end - offset)
    }
}

impl LocalKeys for RegionMrs {
    fn addr(&self) -> u64 {
        self.addr
    }

    fn lkey(&self, offset: u64) -> (u32, u64) {
        RegionMrs::lkey(self, offset)
    }
}
