//! An engine's exported memory: its regions, the KV layout over them, and the descriptor
//! peers receive (rebuilt whenever either changes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use super::EngineState;
use crate::control::frame::PROTOCOL_VERSION;
use crate::control::messages::{Descriptor, TransportInfo};
use crate::error::{Error, Result};
use crate::gpu::GpuApi;
use crate::ids::RegionId;
use crate::layout::KvLayout;
use crate::memory::{Region, RegionInfo, Release};

/// Registered regions, the layout and the descriptor made of them.
pub(super) struct Memory {
    regions: RwLock<HashMap<RegionId, Arc<Region>>>,
    next_region: AtomicU32,
    layout: RwLock<Option<Arc<KvLayout>>>,
    descriptor: RwLock<Option<Arc<Descriptor>>>,
}

impl Default for Memory {
    fn default() -> Self {
        Memory {
            regions: RwLock::new(HashMap::new()),
            // Region ids start at 1.
            next_region: AtomicU32::new(1),
            layout: RwLock::new(None),
            descriptor: RwLock::new(None),
        }
    }
}

impl EngineState {
    pub(crate) fn descriptor(&self) -> Option<Arc<Descriptor>> {
        self.memory.descriptor.read().clone()
    }

    pub(crate) fn layout(&self) -> Option<Arc<KvLayout>> {
        self.memory.layout.read().clone()
    }

    pub(crate) fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.memory.regions.read().get(&id).cloned()
    }

    pub(crate) fn next_region_id(&self) -> RegionId {
        RegionId(self.memory.next_region.fetch_add(1, Ordering::Relaxed))
    }

    /// Registers `region` with the RDMA device (when there is one), exports it and publishes
    /// the new descriptor.
    pub(crate) fn add_region(&self, region: Region) -> Result<Arc<Region>> {
        for (i, dev) in self.rdma().iter().enumerate() {
            if let Err(e) = dev.register(&region) {
                for done in &self.rdma()[..i] {
                    done.deregister(region.id());
                }
                return Err(Error::Memory(format!("{}: {e}", dev.name())));
            }
        }
        let region = Arc::new(region);
        self.memory
            .regions
            .write()
            .insert(region.id(), region.clone());
        self.rebuild_descriptor();
        tracing::info!(region = %region.id(), len = region.len(), kind = ?region.kind(), "memory registered");
        Ok(region)
    }

    /// Stops exporting a region and waits until no transfer uses it (see
    /// `Engine::deregister`).
    pub(crate) fn deregister(&self, id: RegionId) -> Result<()> {
        if let Some(l) = self.memory.layout.read().as_ref() {
            if l.tensors.iter().any(|t| t.region == id) {
                return Err(Error::invalid(format!(
                    "{id} is used by the KV layout; set another layout first"
                )));
            }
        }
        let region = self
            .memory
            .regions
            .write()
            .remove(&id)
            .ok_or(Error::UnknownRegion(id))?;
        let mrs: Vec<_> = self
            .rdma()
            .iter()
            .filter_map(|dev| {
                let m = dev.region_mrs(id);
                dev.deregister(id);
                m
            })
            .collect();
        self.rebuild_descriptor();
        // Transfers hold the region (and its registrations) while they use them: each is
        // counted out as it drops, the last one waking this wait.
        let release = Release::new();
        region.release_into(&release);
        for m in &mrs {
            m.release_into(&release);
        }
        drop((region, mrs));
        let limit = Instant::now() + self.id.config.request_timeout + Duration::from_secs(10);
        match release.wait_until(limit) {
            0 => Ok(()),
            left => {
                tracing::error!(region = %id, left, "deregistered region still in use");
                Err(Error::Memory(format!(
                    "{id} is no longer exported but transfers still hold it ({left} of the \
                     region and its registrations); do not free its memory"
                )))
            }
        }
    }

    /// Sets the KV layout (validated against registered regions) and publishes the descriptor.
    pub(crate) fn set_layout(&self, layout: KvLayout) -> Result<()> {
        layout.validate(&self.region_infos())?;
        layout.validate_tp(self.id.config.tp_size)?;
        tracing::info!(
            tensors = layout.tensors.len(),
            blocks = layout.num_blocks(),
            groups = layout.num_groups(),
            bytes_per_block = layout.bytes_per_block(),
            "KV layout set"
        );
        *self.memory.layout.write() = Some(Arc::new(layout));
        self.rebuild_descriptor();
        Ok(())
    }

    /// Why this engine's memory cannot be shared with a peer of this host, if it cannot: every
    /// region must be host memory kvlink allocated or GPU memory its runtime can export.
    pub(crate) fn unshareable(&self) -> Option<String> {
        let regions: Vec<Arc<Region>> = self.memory.regions.read().values().cloned().collect();
        regions
            .iter()
            .find_map(|r| r.export_local().err().map(|why| why.0))
    }

    /// Whether any region is CUDA or HIP memory.
    pub(crate) fn has_gpu_memory(&self) -> bool {
        self.memory.regions.read().values().any(|r| {
            matches!(
                r.kind(),
                crate::memory::MemoryKind::Device {
                    api: GpuApi::Cuda | GpuApi::Hip,
                    ..
                }
            )
        })
    }

    fn region_infos(&self) -> Vec<RegionInfo> {
        let mut v: Vec<RegionInfo> = self
            .memory
            .regions
            .read()
            .values()
            .map(|r| RegionInfo {
                id: r.id(),
                len: r.len(),
            })
            .collect();
        v.sort_by_key(|r| r.id);
        v
    }

    fn transport_infos(&self) -> Vec<TransportInfo> {
        let mut v = vec![TransportInfo::Tcp {
            addr: self.id.data_addr.to_string(),
            streams: self.id.config.tcp_streams,
        }];
        if let Some((host, socket)) = &self.id.local {
            v.push(TransportInfo::Local {
                host: host.clone(),
                socket: socket.clone(),
            });
        }
        for dev in self.rdma() {
            v.push(TransportInfo::Rdma {
                device: dev.name().to_string(),
                gid: dev.gid().octets(),
                lid: dev.lid,
                mtu: dev.mtu_bytes(),
                regions: dev.region_infos(),
            });
        }
        v
    }

    fn rebuild_descriptor(&self) {
        let layout = self.memory.layout.read().clone();
        *self.memory.descriptor.write() = layout.map(|layout| {
            let layout = (*layout).clone();
            Arc::new(Descriptor {
                protocol_version: PROTOCOL_VERSION,
                engine_id: self.id.engine_id.clone(),
                generation: self.id.generation,
                tp_rank: self.id.config.tp_rank,
                tp_size: self.id.config.tp_size,
                layout,
                regions: self.region_infos(),
                transports: self.transport_infos(),
            })
        });
    }

    /// The GPU of this engine's first region of runtime `api` (an engine drives one GPU); 0
    /// when it has none.
    pub(super) fn gpu_ordinal(&self, api: GpuApi) -> i32 {
        self.memory
            .regions
            .read()
            .values()
            .filter_map(|r| match r.kind() {
                crate::memory::MemoryKind::Device { api: a, ordinal } if a == api => {
                    Some((r.id(), ordinal))
                }
                _ => None,
            })
            .min()
            .map_or(0, |(_, o)| o)
    }
}
