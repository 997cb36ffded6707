//! Device selection, protection domain, memory registration and the completion poller.

use std::collections::HashMap;
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use sideway::ibverbs::address::{Gid, GidType};
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use std::os::fd::AsRawFd;

use crate::gpu::{DeviceRuntime, DmaBuf, GpuApi};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::mr::RegionMrs;
use super::poller::{poll_loop, CqEvents, CqHandler};
use super::RdmaRegionInfo;
use crate::error::RdmaError;
use crate::ids::RegionId;
use crate::memory::Region;

/// RDMA settings of an engine.
#[derive(Debug, Clone)]
pub struct RdmaSettings {
    /// Device names (e.g. `mlx5_0`, `rxe0`), comma-separated for several (`mlx5_0,mlx5_1`),
    /// or `all` for every device with an active port (those on this process's NUMA node
    /// only, when any is). The first device with an active port when `None`.
    pub device: Option<String>,
    /// GID index; when `None`, a RoCE v2 GID is preferred, IPv4-mapped first.
    pub gid_index: Option<u32>,
    /// Queue pairs per peer.
    pub qps: u16,
    /// Largest memory registration; larger regions are registered in chunks of this size.
    pub max_mr_bytes: u64,
    /// Largest RDMA READ work request.
    pub max_wr_bytes: u64,
    /// How long a device that failed towards a peer is left unused before it is tried again;
    /// doubled each time it fails again soon after, up to ten times this.
    pub cooldown: std::time::Duration,
}

impl Default for RdmaSettings {
    fn default() -> Self {
        RdmaSettings {
            device: None,
            gid_index: None,
            qps: 4,
            max_mr_bytes: (2 << 30) - (64 << 10),
            max_wr_bytes: 1 << 20,
            cooldown: std::time::Duration::from_secs(30),
        }
    }
}

/// An opened RDMA device with its protection domain and completion poller.
pub(crate) struct RdmaDevice {
    name: String,
    pub(crate) ctx: Arc<DeviceContext>,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) port: u8,
    pub(crate) gid: Gid,
    pub(crate) gid_index: u32,
    pub(crate) mtu: Mtu,
    pub(crate) lid: u16,
    pub(crate) max_qp_wr: u32,
    pub(crate) max_sge: u32,
    pub(crate) max_rd_atom: u8,
    pub(crate) settings: RdmaSettings,
    /// The completion channel and the connection each completion queue on it belongs to
    /// (shared with the poller thread, which holds it only while handling a round).
    events: Arc<CqEvents>,
    mrs: RwLock<HashMap<RegionId, Arc<RegionMrs>>>,
    next_cq_id: AtomicU64,
    /// Queue pairs of this device that exist now (each [`Qp`](super::qp::Qp) counts itself).
    pub(crate) live_qps: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    poller: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for RdmaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid", &Ipv6Addr::from(self.gid))
            .field("gid_index", &self.gid_index)
            .field("mtu", &mtu_bytes(self.mtu))
            .finish()
    }
}

pub(crate) fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

pub(crate) fn mtu_from_bytes(b: u32) -> Option<Mtu> {
    Some(match b {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// Opens the RDMA devices the settings name (or the first usable one), or says why none can be
/// used: no verbs library, no device, no active port, no usable GID. Never panics: probing runs
/// under `catch_unwind` because the verbs bindings panic on values they do not know.
pub(crate) fn probe(settings: &RdmaSettings) -> Result<Vec<Arc<RdmaDevice>>, RdmaError> {
    match std::panic::catch_unwind(|| open(settings)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("probing RDMA devices failed: {what}").into())
        }
    }
}

/// Which devices the settings ask for.
#[derive(Debug, PartialEq, Eq)]
enum Wanted {
    /// The first usable one.
    First,
    /// Every usable one (NUMA-local ones only, when any is).
    All,
    /// These, in this order.
    Named(Vec<String>),
}

fn wanted(device: Option<&str>) -> Wanted {
    match device.map(str::trim) {
        None | Some("") => Wanted::First,
        Some("all") => Wanted::All,
        Some(list) => Wanted::Named(
            list.split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
        ),
    }
}

/// The NUMA node of a device's PCI function, when the system says (virtual devices such as
/// rxe have none).
fn numa_node(name: &str) -> Option<i32> {
    std::fs::read_to_string(format!("/sys/class/infiniband/{name}/device/numa_node"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n: &i32| *n >= 0)
}

/// The NUMA node of the CPU this thread runs on.
fn this_numa_node() -> Option<i32> {
    // SAFETY: sched_getcpu takes no arguments and only reads the current CPU.
    let cpu = unsafe { libc::sched_getcpu() };
    if cpu < 0 {
        return None;
    }
    let dir = std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{cpu}")).ok()?;
    dir.filter_map(|e| e.ok())
        .find_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
}

fn open(settings: &RdmaSettings) -> Result<Vec<Arc<RdmaDevice>>, RdmaError> {
    let list = DeviceList::new().map_err(|e| {
        format!("no RDMA verbs library or kernel support ({e}; install libibverbs1 and a provider such as ibverbs-providers)")
    })?;
    if list.is_empty() {
        return Err("no RDMA device found (ibv_get_device_list returned none)".into());
    }
    let names: Vec<String> = list.iter().map(|d| d.name()).collect();
    let mut reasons = Vec::new();
    let mut opened = Vec::new();
    match wanted(settings.device.as_deref()) {
        Wanted::First => {
            for dev in list.iter() {
                let name = dev.name();
                match open_device(&dev, &name, settings) {
                    Ok(d) => return Ok(vec![d]),
                    Err(e) => reasons.push(format!("{name}: {e}")),
                }
            }
        }
        Wanted::Named(want) => {
            for name in &want {
                match list.iter().find(|d| &d.name() == name) {
                    None => reasons.push(format!(
                        "RDMA device {name:?} not found (present: {})",
                        names.join(", ")
                    )),
                    Some(dev) => match open_device(&dev, name, settings) {
                        Ok(d) if opened.iter().any(|o: &Arc<RdmaDevice>| o.name == d.name) => {}
                        Ok(d) => opened.push(d),
                        Err(e) => reasons.push(format!("{name}: {e}")),
                    },
                }
            }
        }
        Wanted::All => {
            for dev in list.iter() {
                let name = dev.name();
                match open_device(&dev, &name, settings) {
                    Ok(d) => opened.push(d),
                    Err(e) => reasons.push(format!("{name}: {e}")),
                }
            }
            // Devices on this process's NUMA node only, when there are any: a NIC across the
            // socket interconnect halves what it delivers.
            if let Some(here) = this_numa_node() {
                if opened.iter().any(|d| numa_node(&d.name) == Some(here)) {
                    opened.retain(|d| {
                        let local = numa_node(&d.name).is_none_or(|n| n == here);
                        if !local {
                            tracing::info!(device = %d.name, node = here, "RDMA device skipped: on another NUMA node");
                        }
                        local
                    });
                }
            }
        }
    }
    if opened.is_empty() {
        return Err(reasons.join("; ").into());
    }
    if opened.len() > super::MAX_DEVICES {
        tracing::warn!(
            "{} RDMA devices usable; using the first {}",
            opened.len(),
            super::MAX_DEVICES
        );
        opened.truncate(super::MAX_DEVICES);
    }
    if !reasons.is_empty() {
        tracing::warn!("RDMA devices not used: {}", reasons.join("; "));
    }
    Ok(opened)
}

// Long: one device's verbs objects in the order verbs needs them, each failure named.
fn open_device(
    dev: &sideway::ibverbs::device::Device<'_>,
    name: &str,
    settings: &RdmaSettings,
) -> Result<Arc<RdmaDevice>, RdmaError> {
    let ctx = dev.open().map_err(|e| format!("open: {e}"))?;
    let attr = ctx
        .query_device()
        .map_err(|e| format!("query device: {e}"))?;
    let mut chosen = None;
    for port in 1..=attr.phys_port_cnt() {
        let pa = ctx
            .query_port(port)
            .map_err(|e| format!("query port {port}: {e}"))?;
        if pa.port_state() == PortState::Active {
            chosen = Some((port, pa));
            break;
        }
    }
    let (port, pa) = chosen.ok_or("no active port")?;
    let gids = ctx
        .query_gid_table()
        .map_err(|e| format!("query GID table: {e}"))?;
    let gids: Vec<_> = gids
        .into_iter()
        .filter(|g| g.port_num() == u32::from(port) && !g.gid().is_zero())
        .collect();
    let entry = match settings.gid_index {
        Some(i) => gids
            .iter()
            .find(|g| g.gid_index() == i)
            .ok_or_else(|| format!("GID index {i} not present on port {port}"))?,
        None => gids
            .iter()
            .max_by_key(|g| {
                let v2 = g.gid_type() == GidType::RoceV2;
                let v4 = Ipv6Addr::from(g.gid()).to_ipv4_mapped().is_some();
                (v2, v4, std::cmp::Reverse(g.gid_index()))
            })
            .ok_or("no GID on the active port (is the netdev up with an address?)")?,
    };
    let pd = ctx.alloc_pd().map_err(|e| format!("alloc PD: {e}"))?;
    let channel = ctx
        .create_comp_channel()
        .map_err(|e| format!("create completion channel: {e}"))?;
    channel
        .set_nonblocking(true)
        .map_err(|e| format!("completion channel: {e}"))?;
    let lid = if pa.link_layer() == LinkLayer::InfiniBand {
        pa.lid()
    } else {
        0
    };
    let dev = Arc::new(RdmaDevice {
        name: name.to_string(),
        port,
        gid: entry.gid(),
        gid_index: entry.gid_index(),
        mtu: pa.active_mtu(),
        lid,
        max_qp_wr: attr.max_qp_wr().clamp(16, 4096) as u32,
        max_sge: attr.max_sge_rd().clamp(1, 16) as u32,
        max_rd_atom: attr
            .max_qp_rd_atom()
            .clamp(1, 16)
            .min(attr.max_qp_init_rd_atom().max(1)) as u8,
        settings: settings.clone(),
        ctx,
        pd,
        events: Arc::new(CqEvents::new(name, channel)),
        mrs: RwLock::new(HashMap::new()),
        next_cq_id: AtomicU64::new(1),
        live_qps: Arc::default(),
        stop: Arc::new(AtomicBool::new(false)),
        poller: Mutex::new(None),
    });
    let weak = Arc::downgrade(&dev.events);
    let stop = dev.stop.clone();
    let handle = std::thread::Builder::new()
        .name(format!("kvlink-cq-{name}"))
        .spawn(move || poll_loop(weak, stop))
        .map_err(|e| format!("starting the completion poller: {e}"))?;
    *dev.poller.lock() = Some(handle);
    tracing::info!(device = name, port, gid = %Ipv6Addr::from(dev.gid), gid_index = dev.gid_index,
        mtu = mtu_bytes(dev.mtu), "RDMA device opened");
    Ok(dev)
}

impl Drop for RdmaDevice {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.poller.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl RdmaDevice {
    /// The device's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Queue pairs of this device that exist now: its readers' and its own sessions'.
    pub(crate) fn queue_pairs(&self) -> u64 {
        self.live_qps.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The active MTU in bytes.
    pub(crate) fn mtu_bytes(&self) -> u32 {
        mtu_bytes(self.mtu)
    }

    /// The GID in use, as an IPv6 address (IPv4-mapped for RoCE v2 over IPv4).
    pub(crate) fn gid(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.gid)
    }

    /// Registers a region with the device, in chunks of at most `max_mr_bytes`. Device memory
    /// is registered through dma-buf when the GPU runtime can export it, else with plain
    /// `ibv_reg_mr` (which works when a peer-memory driver such as nvidia-peermem is loaded),
    /// else the error names both attempts.
    pub(crate) fn register(&self, region: &Region) -> Result<(), RdmaError> {
        let chunk = self.settings.max_mr_bytes.max(4096);
        let mut mrs = Vec::new();
        let mut off = 0u64;
        let flags = AccessFlags::LocalWrite | AccessFlags::RemoteRead;
        let device = region.device_runtime();
        if let Some((rt, ordinal)) = device {
            rt.prepare_for_rdma(ordinal, region.as_ptr() as u64);
        }
        let mut method = "host memory";
        let mut dmabuf: Option<DmaBuf> = None;
        let mut dmabuf_err: Option<String> = None;
        while off < region.len() {
            let n = chunk.min(region.len() - off);
            let addr = region.as_ptr() as u64 + off;
            let mr = match device {
                None => {
                    // SAFETY: [addr, addr+n) lies inside the region (off < len, n <= len - off).
                    // The memory outlives the registration: `Engine::deregister` drops the
                    // registration and waits until no transfer holds it (or the region) before
                    // the caller may free it; in-flight transfers hold both; on engine drop the
                    // registrations (RDMA device) drop before the regions.
                    unsafe { self.pd.reg_mr(addr as usize, n as usize, flags) }.map_err(|e| {
                        format!(
                            "registering {} bytes of {} with {}: {e}",
                            n,
                            region.id(),
                            self.name
                        )
                    })?
                }
                Some((rt, ordinal)) => {
                    let (mr, how) = self.register_device_chunk(
                        &**rt,
                        ordinal,
                        addr,
                        n,
                        flags,
                        &mut dmabuf,
                        &mut dmabuf_err,
                    )?;
                    method = how;
                    mr
                }
            };
            mrs.push(mr);
            off += n;
        }
        tracing::info!(region = %region.id(), device = %self.name, "RDMA registration: {method}");
        self.mrs.write().insert(
            region.id(),
            Arc::new(RegionMrs {
                addr: region.as_ptr() as u64,
                len: region.len(),
                chunk,
                mrs,
                on_drop: crate::memory::OnDrop::default(),
            }),
        );
        Ok(())
    }

    /// Registers `[addr, addr + n)` of GPU memory: dma-buf first, then plain registration.
    ///
    /// `dmabuf` carries the export between the chunks of one region (one export per
    /// allocation); `dmabuf_err` the reason the last export or dma-buf registration failed.
    #[allow(clippy::too_many_arguments)]
    fn register_device_chunk(
        &self,
        rt: &dyn DeviceRuntime,
        ordinal: i32,
        addr: u64,
        n: u64,
        flags: AccessFlags,
        dmabuf: &mut Option<DmaBuf>,
        dmabuf_err: &mut Option<String>,
    ) -> Result<(Arc<MemoryRegion>, &'static str), RdmaError> {
        let cached = dmabuf.as_ref().is_some_and(|d| d.covers(addr, n));
        if !cached {
            *dmabuf = None;
            match rt.dmabuf(ordinal, addr, n) {
                Ok(d) => *dmabuf = Some(d),
                Err(e) => *dmabuf_err = Some(e.to_string()),
            }
        }
        if let Some(d) = dmabuf.as_ref() {
            // SAFETY: `d.fd` is a dma-buf exporting [d.start, d.start + d.len), which covers
            // [addr, addr + n) (checked by `covers` or by the export); `addr - d.start` is the
            // chunk's offset in it and has the same page offset as `iova = addr`, as
            // ibv_reg_dmabuf_mr requires. The device memory outlives the registration (same
            // argument as for host memory in `register`). The MR takes its own reference on
            // the dma-buf, so the descriptor may close afterwards.
            match unsafe {
                self.pd
                    .reg_dmabuf_mr(addr - d.start, n as usize, addr, d.fd.as_raw_fd(), flags)
            } {
                Ok(mr) => return Ok((mr, "GPU memory through dma-buf")),
                Err(e) => {
                    *dmabuf_err = Some(format!(
                        "ibv_reg_dmabuf_mr failed: {e} (needs rdma-core 34 or newer and a NIC driver with dma-buf support)"
                    ))
                }
            }
        }
        let dmabuf_err = dmabuf_err.clone().unwrap_or_default();
        // SAFETY: as for host memory in `register`: the range lies inside the registered
        // device region, which outlives the registration. With a peer-memory driver the kernel
        // pins the GPU pages; without one the call fails and nothing is registered.
        match unsafe { self.pd.reg_mr(addr as usize, n as usize, flags) } {
            Ok(mr) => {
                tracing::info!(
                    "dma-buf unavailable ({dmabuf_err}); GPU memory registered through a peer-memory driver"
                );
                Ok((mr, "GPU memory through a peer-memory driver"))
            }
            Err(e) => Err(format!(
                "cannot register {} memory of GPU {ordinal} with {}: dma-buf: {dmabuf_err}; \
                 plain ibv_reg_mr: {e} ({})",
                rt.api(),
                self.name,
                peer_memory_hint(rt.api())
            )
            .into()),
        }
    }

    /// Drops a region's registrations (in-flight work keeps its own references).
    pub(crate) fn deregister(&self, id: RegionId) {
        self.mrs.write().remove(&id);
    }

    pub(crate) fn region_mrs(&self, id: RegionId) -> Option<Arc<RegionMrs>> {
        self.mrs.read().get(&id).cloned()
    }

    /// What peers need to read our regions.
    pub(crate) fn region_infos(&self) -> Vec<RdmaRegionInfo> {
        let mut v: Vec<RdmaRegionInfo> = self
            .mrs
            .read()
            .iter()
            .map(|(&id, m)| RdmaRegionInfo {
                id,
                addr: m.addr,
                chunk_bytes: m.chunk,
                rkeys: m.mrs.iter().map(|mr| mr.rkey()).collect(),
            })
            .collect();
        v.sort_by_key(|r| r.id);
        v
    }

    /// Makes a completion queue on the device's channel, for one connection; returns its id.
    pub(crate) fn create_cq(
        &self,
        cqe: u32,
    ) -> Result<(u64, Arc<BasicCompletionQueue>), RdmaError> {
        let id = self.next_cq_id.fetch_add(1, Ordering::Relaxed);
        let mut b = self.ctx.create_cq_builder();
        b.setup_cqe(cqe)
            .setup_comp_channel(self.events.channel(), 0)
            .setup_cq_context(id as usize as *mut std::ffi::c_void);
        let cq = b
            .build()
            .map_err(|e| format!("create CQ of {cqe} entries: {e}"))?;
        Ok((id, cq))
    }

    /// Routes a completion queue's events to a connection.
    pub(crate) fn attach(&self, cq_id: u64, conn: &Arc<dyn CqHandler>) {
        self.events.attach(cq_id, conn);
    }

    /// Stops routing a completion queue's events.
    pub(crate) fn detach(&self, cq_id: u64) {
        self.events.detach(cq_id);
    }

    /// A completion queue that never receives completions (for passive queue pairs).
    pub(crate) fn passive_cq(&self) -> Result<Arc<BasicCompletionQueue>, RdmaError> {
        let b = self.ctx.create_cq_builder();
        let mut b = b;
        b.setup_cqe(16);
        Ok(b.build().map_err(|e| format!("create CQ: {e}"))?)
    }
}

/// What to load for plain registration of GPU memory, from what this host has.
fn peer_memory_hint(api: GpuApi) -> String {
    let loaded = |m: &str| std::path::Path::new(&format!("/sys/module/{m}")).exists();
    match api {
        GpuApi::Cuda if loaded("nvidia_peermem") => {
            "nvidia_peermem is loaded but refused the range".into()
        }
        GpuApi::Cuda => "load the nvidia-peermem kernel module (modprobe nvidia-peermem), or use \
                         dma-buf: NVIDIA open kernel modules, Linux 5.12+"
            .into(),
        GpuApi::Hip if loaded("amdgpu") => {
            "amdgpu is loaded; peer memory needs ROCm's peer-direct support in the NIC driver"
                .into()
        }
        GpuApi::Hip => "the amdgpu kernel driver is not loaded".into(),
        _ => "no peer-memory driver applies".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_are_read_from_the_setting() {
        assert_eq!(wanted(None), Wanted::First);
        assert_eq!(wanted(Some(" ")), Wanted::First);
        assert_eq!(wanted(Some("all")), Wanted::All);
        assert_eq!(
            wanted(Some("mlx5_0, mlx5_1,,")),
            Wanted::Named(vec!["mlx5_0".into(), "mlx5_1".into()])
        );
    }
}
