//! The `Engine`: one per worker process. It owns the registered memory, the handshake service,
//! the data server, the session cache and the completion tracker, and runs them on its own
//! small tokio runtime, so callers use plain blocking-free methods from any thread.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::completion::{CompletionTracker, Finished, SendNotice};
use crate::control::messages::{Descriptor, TransportInfo};
use crate::control::{self, frame::PROTOCOL_VERSION, ControlHandler, ControlTimeouts};
use crate::error::{Error, Result};
use crate::gpu::{GpuApi, GpuReport, PointerKind, Runtimes};
use crate::ids::{BlockId, RegionId, RequestId};
use crate::layout::KvLayout;
use crate::memory::DeviceMemory;
use crate::memory::{ExternalMemory, Region, RegionInfo};
use crate::plan;
use crate::session::{self, Peers, ReadJob};
use crate::transport::rdma::{self, RdmaDevice, RdmaFault, RdmaSettings, ServerQps};
use crate::transport::tcp::{self, RegionLookup, StagingPool};

/// Which transport an engine may use for reading from peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// RDMA when both engines have it, TCP otherwise (logged per peer, with the reason).
    #[default]
    Auto,
    /// TCP only; RDMA is not even probed.
    Tcp,
    /// RDMA only: the engine fails to start without a usable device, and a read from a peer
    /// without RDMA fails with `Error::RdmaUnavailable`.
    Rdma,
}

/// How an engine is set up. `EngineConfig::default()` listens on loopback with ephemeral ports.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Handshake (control) listen address, `ip:port`; port 0 picks a free one.
    pub listen: String,
    /// Host or IP that peers should use to reach this engine, when `listen` is a wildcard
    /// address such as `0.0.0.0`.
    pub advertise_host: Option<String>,
    /// Engine id; defaults to `<hostname>-<pid>-rank<tp_rank>`.
    pub engine_id: Option<String>,
    /// Tensor-parallel rank of this worker.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// TCP streams opened to each peer for data.
    pub tcp_streams: u16,
    /// Bytes per pipelined TCP read request (also the largest planned segment).
    pub batch_bytes: u64,
    /// Deadline of a TCP connect.
    pub connect_timeout: Duration,
    /// Deadline of a handshake exchange.
    pub handshake_timeout: Duration,
    /// Deadline of a whole `read_blocks` request, from the call to the last byte.
    pub request_timeout: Duration,
    /// How long a send is held for its reader before it expires (prefill side).
    pub abort_timeout: Duration,
    /// Longest silence tolerated on a data stream with a request outstanding; also bounds each
    /// GPU staging copy, the wait for a staging buffer, and the wait for a copy in progress when
    /// a request is cancelled.
    pub io_timeout: Duration,
    /// Keep-alive interval of control connections (dead after three silent intervals).
    pub keepalive: Duration,
    /// How long the data server keeps an idle data stream open (readers reconnect after).
    pub idle_timeout: Duration,
    /// Worker threads of the engine's runtime.
    pub runtime_threads: usize,
    /// Transports to use.
    pub transport: TransportChoice,
    /// RDMA device, GID and queue-pair settings.
    pub rdma: RdmaSettings,
    /// Whether to look for GPU runtimes (CUDA, HIP) at start. Without them only host memory can
    /// be registered; `false` skips loading the libraries.
    pub gpu: bool,
    /// Bytes per staging buffer: GPU memory sent or received over TCP moves through pinned host
    /// buffers of this size, one chunk copied while the previous one is on the wire.
    pub staging_chunk_bytes: u64,
    /// Most staging buffers the engine's data server uses to send GPU memory (one pool shared
    /// by all the connections it serves); allocated on first use and kept. Each stream that
    /// reads GPU memory from a peer has two more of its own. 1 to 4,096; `staging_chunk_bytes`
    /// is 4 KiB to 256 MiB.
    pub staging_buffers: usize,
    /// Fault injection for tests of the RDMA error paths; leave at its default.
    #[doc(hidden)]
    pub rdma_fault: RdmaFault,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: "127.0.0.1:0".into(),
            advertise_host: None,
            engine_id: None,
            tp_rank: 0,
            tp_size: 1,
            tcp_streams: 4,
            batch_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(480),
            io_timeout: Duration::from_secs(30),
            keepalive: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(600),
            runtime_threads: 2,
            transport: TransportChoice::Auto,
            rdma: RdmaSettings::default(),
            gpu: true,
            staging_chunk_bytes: 2 << 20,
            staging_buffers: 32,
            rdma_fault: RdmaFault::default(),
        }
    }
}

/// Counters of what an engine has served, refused and staged, for tests, logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Handshakes answered with our descriptor.
    pub handshakes_accepted: u64,
    /// Handshakes refused (bad frame, wrong version, incompatible peer, no layout, silence).
    pub handshakes_refused: u64,
    /// TCP data requests served.
    pub data_requests_served: u64,
    /// TCP data requests refused (range outside exported memory, unknown region).
    pub data_requests_refused: u64,
    /// Bytes served over TCP.
    pub bytes_served: u64,
    /// GPU bytes copied into staging buffers to be sent over TCP.
    pub bytes_staged_out: u64,
    /// Bytes received over TCP and copied from staging buffers into GPU memory.
    pub bytes_staged_in: u64,
}

#[derive(Default)]
struct Counters {
    handshakes_accepted: AtomicU64,
    handshakes_refused: AtomicU64,
    data_requests_served: AtomicU64,
    data_requests_refused: AtomicU64,
    bytes_served: AtomicU64,
}

/// State shared by the engine's API, servers and tasks.
pub(crate) struct Shared {
    pub(crate) config: EngineConfig,
    engine_id: String,
    generation: u64,
    data_addr: SocketAddr,
    // Drop order matters: sessions (which hold RDMA connections), then the RDMA device (which
    // holds the memory registrations), then the regions themselves.
    pub(crate) peers: Peers,
    pub(crate) rdma: Option<Arc<RdmaDevice>>,
    regions: RwLock<HashMap<RegionId, Arc<Region>>>,
    next_region: AtomicU32,
    layout: RwLock<Option<KvLayout>>,
    descriptor: RwLock<Option<Arc<Descriptor>>>,
    tracker: Mutex<CompletionTracker>,
    finished: Condvar,
    counters: Counters,
    pub(crate) rdma_unavailable: Option<String>,
    pub(crate) rdma_fault_budget: Arc<std::sync::atomic::AtomicU32>,
    gpus: Runtimes,
    pub(crate) staging: Arc<StagingPool>,
}

impl Shared {
    pub(crate) fn control_timeouts(&self) -> ControlTimeouts {
        ControlTimeouts {
            connect: self.config.connect_timeout,
            handshake: self.config.handshake_timeout,
            keepalive: self.config.keepalive,
        }
    }

    pub(crate) fn descriptor(&self) -> Option<Arc<Descriptor>> {
        self.descriptor.read().clone()
    }

    pub(crate) fn layout(&self) -> Option<KvLayout> {
        self.layout.read().clone()
    }

    pub(crate) fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.regions.read().get(&id).cloned()
    }

    /// Runs `f` on the tracker and wakes waiters.
    pub(crate) fn with_tracker<R>(&self, f: impl FnOnce(&mut CompletionTracker) -> R) -> R {
        let r = f(&mut self.tracker.lock());
        self.finished.notify_all();
        r
    }

    fn region_infos(&self) -> Vec<RegionInfo> {
        let mut v: Vec<RegionInfo> = self
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
            addr: self.data_addr.to_string(),
            streams: self.config.tcp_streams,
        }];
        if let Some(dev) = &self.rdma {
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
        let layout = self.layout.read().clone();
        *self.descriptor.write() = layout.map(|layout| {
            Arc::new(Descriptor {
                protocol_version: PROTOCOL_VERSION,
                engine_id: self.engine_id.clone(),
                generation: self.generation,
                tp_rank: self.config.tp_rank,
                tp_size: self.config.tp_size,
                layout,
                regions: self.region_infos(),
                transports: self.transport_infos(),
            })
        });
    }
}

impl ControlHandler for Shared {
    fn descriptor(&self) -> Option<Arc<Descriptor>> {
        Shared::descriptor(self)
    }

    fn notice(&self, peer: SocketAddr, id: RequestId, notice: SendNotice) {
        tracing::debug!(%peer, %id, ?notice, "send notice");
        let keep = self.config.abort_timeout;
        self.with_tracker(|t| t.handle_notice(id, notice, Instant::now(), keep));
    }

    fn handshake(&self, accepted: bool) {
        let c = if accepted {
            &self.counters.handshakes_accepted
        } else {
            &self.counters.handshakes_refused
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn rdma_accept(
        &self,
        peer: SocketAddr,
        qps: &[rdma::QpEndpoint],
    ) -> std::result::Result<(Vec<rdma::QpEndpoint>, Box<dyn std::any::Any + Send>), String> {
        let dev = self.rdma.as_ref().ok_or_else(|| {
            format!(
                "this engine has no RDMA device ({})",
                self.rdma_unavailable.as_deref().unwrap_or("disabled")
            )
        })?;
        let (guard, ours) = ServerQps::accept(dev, qps)?;
        tracing::debug!(%peer, qps = ours.len(), "queue pairs created for a reader");
        Ok((ours, Box::new(guard)))
    }
}

impl RegionLookup for Shared {
    fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        Shared::region(self, id)
    }

    fn staging(&self) -> &Arc<StagingPool> {
        &self.staging
    }

    fn served(&self, bytes: Option<u64>) {
        let c = &self.counters;
        match bytes {
            Some(b) => {
                c.data_requests_served.fetch_add(1, Ordering::Relaxed);
                c.bytes_served.fetch_add(b, Ordering::Relaxed);
            }
            None => {
                c.data_requests_refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What an engine found at start: its transports and the memory kinds it can register, each
/// with the reason when missing. `Display` prints one line per item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The RDMA device in use, or why RDMA is not used.
    pub rdma: std::result::Result<String, String>,
    /// The TCP data server (always available).
    pub tcp: String,
    /// The GPU runtimes found (device memory), or why each is missing.
    pub gpu: GpuReport,
}

impl Capabilities {
    /// One line: transports and memory kinds, with reasons for what is missing.
    pub fn summary(&self) -> String {
        let mut transports = Vec::new();
        if let Ok(dev) = &self.rdma {
            transports.push(format!("rdma ({dev})"));
        }
        transports.push("tcp".to_string());
        let mut memory = vec!["host".to_string()];
        let mut missing = Vec::new();
        if let Err(why) = &self.rdma {
            missing.push(format!("rdma: {why}"));
        }
        for (name, r) in [("cuda", &self.gpu.cuda), ("hip", &self.gpu.hip)] {
            match r {
                Ok(desc) => memory.push(format!("{name} ({desc})")),
                Err(why) => missing.push(format!("{name}: {why}")),
            }
        }
        let mut line = format!(
            "transports: {}; memory: {}",
            transports.join(", "),
            memory.join(", ")
        );
        if !missing.is_empty() {
            line.push_str(&format!("; unavailable: {}", missing.join("; ")));
        }
        line
    }
}

impl std::fmt::Display for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let line = |r: &std::result::Result<String, String>| match r {
            Ok(s) => format!("yes: {s}"),
            Err(why) => format!("no: {why}"),
        };
        writeln!(f, "transport rdma: {}", line(&self.rdma))?;
        writeln!(f, "transport tcp:  yes: {}", self.tcp)?;
        writeln!(f, "memory host:    yes")?;
        writeln!(f, "memory cuda:    {}", line(&self.gpu.cuda))?;
        write!(f, "memory hip:     {}", line(&self.gpu.hip))
    }
}

/// A kvlink engine: see the crate docs for the life of a transfer.
pub struct Engine {
    shared: Arc<Shared>,
    control_addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

fn default_engine_id(rank: u32) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}-rank{rank}", std::process::id())
}

fn generation_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl Engine {
    /// Starts an engine: binds the handshake service and the data server and starts its
    /// runtime. Register memory and set a layout before peers can read from it.
    pub fn start(config: EngineConfig) -> Result<Engine> {
        if config.tp_size == 0 || config.tp_rank >= config.tp_size {
            return Err(Error::invalid(format!(
                "tp_rank {} must be below tp_size {}",
                config.tp_rank, config.tp_size
            )));
        }
        let durations = [
            ("connect_timeout", config.connect_timeout),
            ("handshake_timeout", config.handshake_timeout),
            ("request_timeout", config.request_timeout),
            ("abort_timeout", config.abort_timeout),
            ("io_timeout", config.io_timeout),
            ("keepalive", config.keepalive),
            ("idle_timeout", config.idle_timeout),
        ];
        for (name, d) in durations {
            if d.is_zero() || d > Duration::from_secs(7 * 24 * 3600) {
                return Err(Error::invalid(format!(
                    "{name} must be between 0 and 7 days, got {d:?}"
                )));
            }
        }
        let r = &config.rdma;
        if r.qps == 0 || r.qps > 64 {
            return Err(Error::invalid("rdma.qps must be 1 to 64"));
        }
        if !(4096..=1 << 30).contains(&r.max_wr_bytes) || r.max_mr_bytes < 4096 {
            return Err(Error::invalid(
                "rdma.max_wr_bytes must be 4 KiB to 1 GiB and rdma.max_mr_bytes at least 4 KiB",
            ));
        }
        if r.gid_index.is_some_and(|g| g > 255) {
            return Err(Error::invalid("rdma.gid_index must be below 256"));
        }
        if config.tcp_streams == 0 || config.tcp_streams > 64 {
            return Err(Error::invalid("tcp_streams must be 1 to 64"));
        }
        if !(4096..=256 << 20).contains(&config.staging_chunk_bytes)
            || config.staging_buffers == 0
            || config.staging_buffers > 4096
        {
            return Err(Error::invalid(
                "staging_chunk_bytes must be 4 KiB to 256 MiB and staging_buffers 1 to 4096",
            ));
        }
        if config.batch_bytes == 0 || config.batch_bytes > tcp::wire::MAX_REQUEST_BYTES {
            return Err(Error::invalid(format!(
                "batch_bytes must be 1 to {}",
                tcp::wire::MAX_REQUEST_BYTES
            )));
        }
        let (rdma, rdma_unavailable) = match config.transport {
            TransportChoice::Tcp => (
                None,
                Some("disabled by configuration (transport: tcp)".to_string()),
            ),
            choice => match rdma::probe(&config.rdma) {
                Ok(dev) => (Some(dev), None),
                Err(why) if choice == TransportChoice::Rdma => {
                    return Err(Error::RdmaUnavailable(why))
                }
                Err(why) => (None, Some(why)),
            },
        };
        let gpus = Runtimes::probe(config.gpu);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.runtime_threads.max(1))
            .thread_name("kvlink")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the engine runtime", &e))?;
        let listen: SocketAddr = config
            .listen
            .parse()
            .map_err(|e| Error::invalid(format!("listen address {:?}: {e}", config.listen)))?;
        let (control, data) = runtime.block_on(async {
            let control = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|e| Error::io(format!("binding the handshake service to {listen}"), &e))?;
            let data = tokio::net::TcpListener::bind(SocketAddr::new(listen.ip(), 0))
                .await
                .map_err(|e| {
                    Error::io(format!("binding the data server on {}", listen.ip()), &e)
                })?;
            Ok::<_, Error>((control, data))
        })?;
        let advertise_ip: IpAddr = match &config.advertise_host {
            Some(h) => h
                .parse()
                .map_err(|e| Error::invalid(format!("advertise_host {h:?}: {e}")))?,
            None if listen.ip().is_unspecified() => {
                tracing::warn!(
                    "listening on a wildcard address without advertise_host; advertising 127.0.0.1"
                );
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            }
            None => listen.ip(),
        };
        let local_control = control
            .local_addr()
            .map_err(|e| Error::io("control address", &e))?;
        let local_data = data
            .local_addr()
            .map_err(|e| Error::io("data address", &e))?;
        let control_addr = SocketAddr::new(advertise_ip, local_control.port());
        let data_addr = SocketAddr::new(advertise_ip, local_data.port());
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| default_engine_id(config.tp_rank));
        let shared = Arc::new(Shared {
            engine_id: engine_id.clone(),
            generation: generation_nonce(),
            data_addr,
            regions: RwLock::new(HashMap::new()),
            next_region: AtomicU32::new(1),
            layout: RwLock::new(None),
            descriptor: RwLock::new(None),
            tracker: Mutex::new(CompletionTracker::new()),
            finished: Condvar::new(),
            peers: Peers::default(),
            counters: Counters::default(),
            rdma,
            rdma_unavailable,
            rdma_fault_budget: Arc::new(std::sync::atomic::AtomicU32::new(
                config.rdma_fault.requests,
            )),
            gpus,
            staging: StagingPool::new(config.staging_chunk_bytes as usize, config.staging_buffers),
            config,
        });
        let timeouts = shared.control_timeouts();
        let io_timeout = shared.config.io_timeout;
        let idle_timeout = shared.config.idle_timeout;
        runtime.spawn(control::serve(control, shared.clone(), timeouts));
        runtime.spawn(tcp::serve(data, shared.clone(), io_timeout, idle_timeout));
        let engine = Engine {
            shared,
            control_addr,
            runtime: Some(runtime),
        };
        let caps = engine.capabilities();
        tracing::info!(
            engine = %engine_id, control = %control_addr, data = %data_addr,
            "kvlink engine started; {}", caps.summary()
        );
        Ok(engine)
    }

    /// The address peers use for the handshake: put it in a request's transfer parameters.
    pub fn handshake_address(&self) -> SocketAddr {
        self.control_addr
    }

    /// The RDMA device in use (`Ok(name)`), or why RDMA is not used (`Err(reason)`).
    pub fn rdma_status(&self) -> std::result::Result<String, String> {
        match (&self.shared.rdma, &self.shared.rdma_unavailable) {
            (Some(d), _) => Ok(d.name().to_string()),
            (None, why) => Err(why.clone().unwrap_or_else(|| "unknown".into())),
        }
    }

    /// The transports and memory kinds this engine found, and why any is missing (also logged
    /// when the engine starts).
    pub fn capabilities(&self) -> Capabilities {
        let sh = &self.shared;
        Capabilities {
            rdma: self.rdma_status(),
            tcp: format!(
                "data server {}, {} streams per peer",
                sh.data_addr, sh.config.tcp_streams
            ),
            gpu: sh.gpus.report(),
        }
    }

    /// What the loaded GPU runtimes say about `ptr`: host memory, pinned host memory, or the
    /// memory of which GPU. Without a GPU runtime every address is [`PointerKind::Host`].
    pub fn classify_pointer(&self, ptr: u64) -> Result<PointerKind> {
        self.shared
            .gpus
            .classify(ptr)
            .map(|(k, _)| k)
            .map_err(Error::Gpu)
    }

    /// This engine's id.
    pub fn engine_id(&self) -> &str {
        &self.shared.engine_id
    }

    /// The descriptor peers receive, once a layout is set.
    pub fn descriptor(&self) -> Option<Descriptor> {
        self.shared.descriptor().map(|d| (*d).clone())
    }

    fn next_region_id(&self) -> RegionId {
        RegionId(self.shared.next_region.fetch_add(1, Ordering::Relaxed))
    }

    fn add_region(&self, region: Region) -> Result<Arc<Region>> {
        if let Some(dev) = &self.shared.rdma {
            dev.register(&region).map_err(Error::Memory)?;
        }
        let region = Arc::new(region);
        self.shared
            .regions
            .write()
            .insert(region.id(), region.clone());
        self.shared.rebuild_descriptor();
        tracing::info!(region = %region.id(), len = region.len(), kind = ?region.kind(), "memory registered");
        Ok(region)
    }

    /// Allocates and registers `len` bytes of zeroed host memory (huge pages on request, with a
    /// logged fallback to regular pages).
    pub fn allocate_host(&self, len: u64, huge_pages: bool) -> Result<Arc<Region>> {
        let region = Region::allocate(self.next_region_id(), len, huge_pages)?;
        self.add_region(region)
    }

    /// Registers caller-owned host memory (see [`ExternalMemory::new`] for the contract).
    /// Refused, with the device named, when a loaded GPU runtime says it is device memory.
    pub fn register_host(&self, mem: ExternalMemory) -> Result<Arc<Region>> {
        match self.classify_pointer(mem.ptr.as_ptr() as u64)? {
            PointerKind::Host | PointerKind::PinnedHost { .. } => {}
            PointerKind::Device { api, ordinal } => {
                return Err(Error::invalid(format!(
                    "{:p} is {api} memory of GPU {ordinal}, not host memory: register it with register_device",
                    mem.ptr
                )))
            }
            PointerKind::Managed { api } => {
                return Err(Error::invalid(format!(
                    "{:p} is {api} managed memory, which migrates between host and GPU; kvlink needs memory with a fixed home",
                    mem.ptr
                )))
            }
        }
        self.add_region(Region::external(self.next_region_id(), mem))
    }

    /// Registers caller-owned GPU memory (see [`DeviceMemory::new`] for the contract). The
    /// loaded runtimes say which GPU it is on; RDMA registers it with dma-buf or a peer-memory
    /// driver, TCP stages it through pinned host buffers. Fails with [`Error::Gpu`] when no GPU
    /// runtime is loaded (naming why each is missing) or a runtime call fails, with
    /// [`Error::InvalidArgument`] when a loaded runtime says the address is not device memory,
    /// and with [`Error::Memory`] when the RDMA device cannot register it (the message names the
    /// dma-buf and peer-memory attempts; `transport: Tcp` avoids RDMA registration).
    pub fn register_device(&self, mem: DeviceMemory) -> Result<Arc<Region>> {
        let (kind, rt) = self.shared.gpus.classify(mem.ptr).map_err(Error::Gpu)?;
        match (kind, rt) {
            (PointerKind::Device { ordinal, .. }, Some(rt)) => {
                self.add_region(Region::device(self.next_region_id(), mem, rt, ordinal))
            }
            (PointerKind::Host, _) if self.shared.gpus.loaded().next().is_none() => {
                Err(Error::Gpu(format!(
                    "cannot register device memory at {:#x}: no GPU runtime is loaded ({})",
                    mem.ptr,
                    self.shared.gpus.why_none()
                )))
            }
            (kind, _) => Err(Error::invalid(format!(
                "{:#x} is not GPU device memory (the GPU runtimes say {kind:?}); use register_host for host memory",
                mem.ptr
            ))),
        }
    }

    /// Allocates and registers `len` bytes of device memory on GPU `ordinal` with `api`'s
    /// runtime (for benchmarks and tests; engines register their own KV caches). Freed when the
    /// region is deregistered and no transfer holds it.
    pub fn allocate_device(&self, api: GpuApi, ordinal: i32, len: u64) -> Result<Arc<Region>> {
        if api == GpuApi::Emulated {
            return Err(Error::invalid(
                "emulated device memory is registered, not allocated",
            ));
        }
        let rt = self
            .shared
            .gpus
            .get(api)
            .map_err(|why| Error::Gpu(format!("cannot allocate {api} memory: {why}")))?;
        self.add_region(Region::allocate_device(
            self.next_region_id(),
            len,
            rt,
            ordinal,
        )?)
    }

    /// Registers host memory as emulated device memory: every transfer into or out of it takes
    /// the device paths (TCP staging, device RDMA registration) with `memcpy` as the "GPU" copy.
    /// For tests of those paths on machines without a GPU.
    #[doc(hidden)]
    pub fn register_emulated_device(&self, mem: ExternalMemory) -> Result<Arc<Region>> {
        let dm = DeviceMemory {
            ptr: mem.ptr.as_ptr() as u64,
            len: mem.len,
        };
        let rt = self.shared.gpus.get(GpuApi::Emulated).map_err(Error::Gpu)?;
        self.add_region(Region::device(self.next_region_id(), dm, rt, 0))
    }

    /// Stops exporting a region and waits until no transfer uses it any more, so its memory may
    /// be freed when this returns `Ok`. Refused while the KV layout uses the region. Waits at
    /// most the request timeout plus 10 s (every request ends by then); if transfers still hold
    /// the region, returns an error and the memory must not be freed.
    pub fn deregister(&self, id: RegionId) -> Result<()> {
        if let Some(l) = self.shared.layout.read().as_ref() {
            if l.tensors.iter().any(|t| t.region == id) {
                return Err(Error::invalid(format!(
                    "{id} is used by the KV layout; set another layout first"
                )));
            }
        }
        let region = self
            .shared
            .regions
            .write()
            .remove(&id)
            .ok_or(Error::UnknownRegion(id))?;
        let mrs = self.shared.rdma.as_ref().and_then(|dev| {
            let m = dev.region_mrs(id);
            dev.deregister(id);
            m
        });
        self.shared.rebuild_descriptor();
        // Transfers hold the region (and its registrations) while they use them.
        let limit = Instant::now() + self.shared.config.request_timeout + Duration::from_secs(10);
        loop {
            let users = Arc::strong_count(&region) - 1
                + mrs.as_ref().map_or(0, |m| Arc::strong_count(m) - 1);
            if users == 0 {
                return Ok(());
            }
            if Instant::now() >= limit {
                tracing::error!(region = %id, users, "deregistered region still in use");
                return Err(Error::Memory(format!(
                    "{id} is no longer exported but {users} transfers still use it; do not free its memory"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sets the KV layout (validated against registered regions) and publishes the descriptor.
    pub fn set_layout(&self, layout: KvLayout) -> Result<()> {
        layout.validate(&self.shared.region_infos())?;
        tracing::info!(
            tensors = layout.tensors.len(),
            blocks = layout.num_blocks(),
            bytes_per_block = layout.bytes_per_block(),
            "KV layout set"
        );
        *self.shared.layout.write() = Some(layout);
        self.shared.rebuild_descriptor();
        Ok(())
    }

    /// Starts reading `remote_blocks` of the engine at `peer` (its handshake address) into
    /// `local_blocks`, pairwise, for every tensor of the layout. Returns at once; the outcome
    /// arrives through [`get_finished`](Engine::get_finished).
    ///
    /// Errors returned here are immediate refusals (bad ids, no layout); everything after the
    /// call (handshake, transfer, deadline) ends as a finished or failed entry.
    pub fn read_blocks(
        &self,
        peer: &str,
        id: impl Into<RequestId>,
        local_blocks: &[BlockId],
        remote_blocks: &[BlockId],
    ) -> Result<()> {
        let id = id.into();
        id.validate().map_err(Error::InvalidArgument)?;
        let layout = self
            .shared
            .layout()
            .ok_or_else(|| Error::invalid("set a KV layout before reading blocks"))?;
        plan::check_local_blocks(&layout, local_blocks, remote_blocks)?;
        if let Some(conn) = self.shared.peers_ready(peer) {
            plan::check_blocks(
                &layout,
                &conn.descriptor.layout,
                local_blocks,
                remote_blocks,
            )?;
        }
        let now = Instant::now();
        self.shared
            .with_tracker(|t| t.start_recv(id.clone(), now))?;
        let job = ReadJob {
            peer: peer.to_string(),
            id,
            local: local_blocks.to_vec(),
            remote: remote_blocks.to_vec(),
            started: now,
            deadline: tokio::time::Instant::from_std(now + self.shared.config.request_timeout),
        };
        let rt = self.runtime.as_ref().ok_or(Error::Shutdown)?;
        rt.spawn(session::run_read(self.shared.clone(), job));
        Ok(())
    }

    /// Connects to `peer` (or reuses the cached session), and returns its descriptor: its KV
    /// layout, block count and TP rank. Blocks up to `timeout`; concurrent first contacts with
    /// `read_blocks` share the same handshake. Call it from outside async contexts.
    pub fn connect(&self, peer: &str, timeout: Duration) -> Result<Descriptor> {
        let rt = self.runtime.as_ref().ok_or(Error::Shutdown)?;
        let shared = self.shared.clone();
        let conn = rt.block_on(async move {
            tokio::time::timeout(timeout, shared.peers.get(&shared, peer))
                .await
                .map_err(|_| Error::Timeout {
                    what: format!("connecting to {peer}"),
                    after: timeout,
                })?
        })?;
        Ok(conn.descriptor.clone())
    }

    /// Holds a request's blocks for a reader (prefill side): the request finishes sending when
    /// the reader confirms, fails when it aborts, and expires after the abort timeout.
    pub fn hold_blocks(&self, id: impl Into<RequestId>) -> Result<()> {
        self.hold_blocks_for(id, self.shared.config.abort_timeout)
    }

    /// [`hold_blocks`](Engine::hold_blocks) with a specific abort timeout.
    pub fn hold_blocks_for(&self, id: impl Into<RequestId>, abort_timeout: Duration) -> Result<()> {
        let id = id.into();
        id.validate().map_err(Error::InvalidArgument)?;
        self.shared
            .with_tracker(|t| t.hold_send(id, Instant::now(), abort_timeout))
    }

    /// Everything that finished since the last call, each request once.
    pub fn get_finished(&self) -> Finished {
        let mut t = self.shared.tracker.lock();
        t.poll(Instant::now());
        t.take_finished()
    }

    /// Like [`get_finished`](Engine::get_finished), but waits up to `timeout` for something to
    /// finish (no spinning: it sleeps until a completion or a hold's deadline).
    pub fn wait_finished(&self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let mut t = self.shared.tracker.lock();
        loop {
            let now = Instant::now();
            t.poll(now);
            if t.has_finished() || now >= deadline {
                return t.take_finished();
            }
            let wake = t.next_deadline().map_or(deadline, |d| d.min(deadline));
            self.shared.finished.wait_until(&mut t, wake);
        }
    }

    /// Counters of what this engine served and refused.
    pub fn stats(&self) -> EngineStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStats {
            handshakes_accepted: get(&c.handshakes_accepted),
            handshakes_refused: get(&c.handshakes_refused),
            data_requests_served: get(&c.data_requests_served),
            data_requests_refused: get(&c.data_requests_refused),
            bytes_served: get(&c.bytes_served),
            bytes_staged_out: self.shared.staging.staged_out(),
            bytes_staged_in: self.shared.staging.staged_in(),
        }
    }

    /// Requests being received and sends being held.
    pub fn in_flight(&self) -> (usize, usize) {
        let t = self.shared.tracker.lock();
        (t.receiving(), t.holding())
    }
}

impl Shared {
    pub(crate) fn peers_ready(&self, peer: &str) -> Option<Arc<session::PeerConn>> {
        self.peers.ready_conn(peer)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}
