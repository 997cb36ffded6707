//! The state an engine owns: its registered regions, KV layout and descriptor, completion
//! tracker, RDMA device, staging pool and counters. It sits below the sessions (which read from
//! it and report into its tracker) and above the transports, the control plane and memory: it
//! implements the handshake service's [`ControlHandler`] and the data servers'
//! [`Exports`] and [`DataServer`]. It never sees a session.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::auth::{AuthKey, SessionSecret};
use crate::completion::{CompletionTracker, SendNotice};
use crate::config::EngineConfig;
use crate::control::messages::{Descriptor, TransportInfo};
use crate::control::{frame::PROTOCOL_VERSION, ControlHandler, ControlTimeouts};
use crate::error::{Error, RdmaError, RdmaErrorKind, Result};
use crate::gpu::{DeviceRuntime, GpuApi, Runtimes};
use crate::grant::Grant;
use crate::ids::{BlockId, RegionId, RequestId};
use crate::inbox::{Inbox, PeerMessage, Refused};
use crate::layout::KvLayout;
use crate::memory::{Region, RegionInfo};
use crate::tp::{Reader, TpRank};
use crate::transport::access::{DataServer, DataSession, Exports};
use crate::transport::rails::RailBook;
use crate::transport::rdma::{self, RdmaDevice, RdmaFault, ServerQps};
use crate::transport::tcp::StagingPool;
use crate::transport::ReadCancel;

/// What the data and control servers count.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) handshakes_accepted: AtomicU64,
    pub(crate) handshakes_refused: AtomicU64,
    pub(crate) data_requests_served: AtomicU64,
    pub(crate) data_requests_refused: AtomicU64,
    pub(crate) bytes_served: AtomicU64,
    pub(crate) notices_refused: AtomicU64,
    pub(crate) messages_received: AtomicU64,
    pub(crate) messages_refused: AtomicU64,
    pub(crate) messages_sent: AtomicU64,
    pub(crate) messages_unsent: AtomicU64,
}

/// State shared by the engine's API, its servers and its sessions.
pub(crate) struct EngineState {
    pub(crate) config: EngineConfig,
    pub(crate) engine_id: String,
    generation: u64,
    pub(crate) data_addr: SocketAddr,
    /// This host's id and the same-host socket's name, when the same-host path is served.
    pub(crate) local: Option<(String, String)>,
    // Drop order matters: the RDMA device (which holds the memory registrations) before the
    // regions themselves. Sessions, which hold RDMA connections, live above this state and go
    // first.
    pub(crate) rdma: Vec<Arc<RdmaDevice>>,
    pub(crate) rdma_unavailable: Option<String>,
    /// Health of RDMA device pairs towards peers, and bytes per device.
    pub(crate) rails: Arc<RailBook>,
    /// Test-only fault injection for RDMA connections (see `internal::start_with_rdma_fault`).
    pub(crate) rdma_fault: RdmaFault,
    pub(crate) rdma_fault_budget: Arc<AtomicU32>,
    regions: RwLock<HashMap<RegionId, Arc<Region>>>,
    next_region: AtomicU32,
    layout: RwLock<Option<Arc<KvLayout>>>,
    descriptor: RwLock<Option<Arc<Descriptor>>>,
    pub(crate) tracker: Mutex<CompletionTracker>,
    pub(crate) finished: Condvar,
    pub(crate) counters: Counters,
    pub(crate) gpus: Runtimes,
    pub(crate) staging: Arc<StagingPool>,
    /// Reads in flight, by id: the controls of their attempts, and whether the caller
    /// cancelled them (`Engine::cancel`).
    pub(crate) reads: Mutex<HashMap<RequestId, Arc<ReadCancel>>>,
    /// Set by `Engine::close` before its tasks stop: reads failing from then on say so.
    pub(crate) closing: std::sync::atomic::AtomicBool,
    /// Authenticated control sessions, by id, with the engine id each reader declared: their
    /// data connections are served, as that engine.
    data_sessions: Mutex<HashMap<[u8; 16], DataSession>>,
    /// Application messages from peers, not yet taken (`Engine::take_messages`).
    pub(crate) inbox: Mutex<Inbox>,
    /// The token of the next hold made without one.
    next_token: AtomicU64,
}

impl EngineState {
    /// A new state with no region and no layout.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: EngineConfig,
        engine_id: String,
        generation: u64,
        data_addr: SocketAddr,
        local: Option<(String, String)>,
        rdma: Vec<Arc<RdmaDevice>>,
        rdma_unavailable: Option<String>,
        rdma_fault: RdmaFault,
        gpus: Runtimes,
    ) -> EngineState {
        EngineState {
            engine_id,
            generation,
            data_addr,
            local,
            rdma,
            rdma_unavailable,
            rails: Arc::new(RailBook::new(config.rdma.cooldown)),
            rdma_fault_budget: Arc::new(AtomicU32::new(rdma_fault.requests)),
            rdma_fault,
            regions: RwLock::new(HashMap::new()),
            next_region: AtomicU32::new(1),
            layout: RwLock::new(None),
            descriptor: RwLock::new(None),
            tracker: Mutex::new(
                CompletionTracker::with_tp(TpRank::new(config.tp_rank, config.tp_size))
                    .with_lease(config.lease),
            ),
            finished: Condvar::new(),
            counters: Counters::default(),
            gpus,
            staging: StagingPool::new(config.staging_chunk_bytes as usize, config.staging_buffers),
            data_sessions: Mutex::new(HashMap::new()),
            inbox: Mutex::new(Inbox::default()),
            closing: std::sync::atomic::AtomicBool::new(false),
            reads: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(generation.rotate_left(32)),
            config,
        }
    }

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

    pub(crate) fn layout(&self) -> Option<Arc<KvLayout>> {
        self.layout.read().clone()
    }

    /// Holds request `id`'s `blocks` (one list per block group) for its readers (`reader`,
    /// when given, is the only engine allowed to read and confirm them) until their notices
    /// or `abort_timeout`, under hold token `token` (non-zero), or a new one when `None`.
    /// Returns the token.
    pub(crate) fn hold<B: AsRef<[BlockId]>>(
        &self,
        id: RequestId,
        blocks: &[B],
        reader: Option<String>,
        abort_timeout: Duration,
        token: Option<u64>,
    ) -> Result<u64> {
        id.validate().map_err(Error::InvalidArgument)?;
        if let Some(r) = &reader {
            crate::config::check_engine_id(r)
                .map_err(|e| Error::invalid(format!("reader: {e}")))?;
        }
        let layout = self
            .layout()
            .ok_or_else(|| Error::invalid("set a KV layout before holding blocks"))?;
        let grant = Arc::new(Grant::new(layout, blocks)?);
        let token = match token {
            Some(0) => return Err(Error::invalid("a hold token is never 0")),
            Some(t) => t,
            // Distinct for every hold of this engine's life, and unlikely to repeat across its
            // restarts (the start's generation is its offset).
            None => match self.next_token.fetch_add(1, Ordering::Relaxed) {
                0 => self.next_token.fetch_add(1, Ordering::Relaxed),
                t => t,
            },
        };
        self.with_tracker(|t| {
            t.hold_send(id, grant, reader, Instant::now(), abort_timeout, token)
        })?;
        Ok(token)
    }

    pub(crate) fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.regions.read().get(&id).cloned()
    }

    /// Cancels read `id` if it is in flight: its transport stops writing into its blocks and
    /// the read is reported failed ("cancelled"), its prefill told. Returns whether it was.
    pub(crate) fn cancel_read(&self, id: &RequestId) -> bool {
        let Some(read) = self.reads.lock().get(id).cloned() else {
            return false;
        };
        read.cancel_by_caller();
        true
    }

    /// Runs `f` on the tracker and wakes waiters.
    pub(crate) fn with_tracker<R>(&self, f: impl FnOnce(&mut CompletionTracker) -> R) -> R {
        let r = f(&mut self.tracker.lock());
        self.finished.notify_all();
        r
    }

    pub(crate) fn next_region_id(&self) -> RegionId {
        RegionId(self.next_region.fetch_add(1, Ordering::Relaxed))
    }

    /// Registers `region` with the RDMA device (when there is one), exports it and publishes
    /// the new descriptor.
    pub(crate) fn add_region(&self, region: Region) -> Result<Arc<Region>> {
        for (i, dev) in self.rdma.iter().enumerate() {
            if let Err(e) = dev.register(&region) {
                for done in &self.rdma[..i] {
                    done.deregister(region.id());
                }
                return Err(Error::Memory(format!("{}: {e}", dev.name())));
            }
        }
        let region = Arc::new(region);
        self.regions.write().insert(region.id(), region.clone());
        self.rebuild_descriptor();
        tracing::info!(region = %region.id(), len = region.len(), kind = ?region.kind(), "memory registered");
        Ok(region)
    }

    /// Stops exporting a region and waits until no transfer uses it (see
    /// `Engine::deregister`).
    pub(crate) fn deregister(&self, id: RegionId) -> Result<()> {
        if let Some(l) = self.layout.read().as_ref() {
            if l.tensors.iter().any(|t| t.region == id) {
                return Err(Error::invalid(format!(
                    "{id} is used by the KV layout; set another layout first"
                )));
            }
        }
        let region = self
            .regions
            .write()
            .remove(&id)
            .ok_or(Error::UnknownRegion(id))?;
        let mrs: Vec<_> = self
            .rdma
            .iter()
            .filter_map(|dev| {
                let m = dev.region_mrs(id);
                dev.deregister(id);
                m
            })
            .collect();
        self.rebuild_descriptor();
        // Transfers hold the region (and its registrations) while they use them.
        let limit = Instant::now() + self.config.request_timeout + Duration::from_secs(10);
        loop {
            let users = Arc::strong_count(&region) - 1
                + mrs.iter().map(|m| Arc::strong_count(m) - 1).sum::<usize>();
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
    pub(crate) fn set_layout(&self, layout: KvLayout) -> Result<()> {
        layout.validate(&self.region_infos())?;
        layout.validate_tp(self.config.tp_size)?;
        tracing::info!(
            tensors = layout.tensors.len(),
            blocks = layout.num_blocks(),
            groups = layout.num_groups(),
            bytes_per_block = layout.bytes_per_block(),
            "KV layout set"
        );
        *self.layout.write() = Some(Arc::new(layout));
        self.rebuild_descriptor();
        Ok(())
    }

    /// Why this engine's memory cannot be shared with a peer of this host, if it cannot: every
    /// region must be host memory kvlink allocated or GPU memory its runtime can export.
    pub(crate) fn unshareable(&self) -> Option<String> {
        let regions: Vec<Arc<Region>> = self.regions.read().values().cloned().collect();
        regions.iter().find_map(|r| r.export_local().err())
    }

    /// Whether any region is CUDA or HIP memory.
    pub(crate) fn has_gpu_memory(&self) -> bool {
        self.regions.read().values().any(|r| {
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
        if let Some((host, socket)) = &self.local {
            v.push(TransportInfo::Local {
                host: host.clone(),
                socket: socket.clone(),
            });
        }
        for dev in &self.rdma {
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
            let layout = (*layout).clone();
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

impl ControlHandler for EngineState {
    fn descriptor(&self) -> Option<Arc<Descriptor>> {
        EngineState::descriptor(self)
    }

    fn notice(
        &self,
        peer: SocketAddr,
        from: &Reader,
        id: RequestId,
        notice: SendNotice,
        hold: Option<u64>,
    ) -> std::result::Result<Duration, String> {
        tracing::debug!(%peer, %id, ?notice, "send notice");
        let done = matches!(notice, SendNotice::Done);
        let r = self.with_tracker(|t| {
            // With open reads (benchmarks) any exported byte is served without a hold, so a
            // read of a request never held is confirmed; one that is held follows its hold.
            if done && self.config.open_reads && !t.is_holding(&id) {
                return Ok(Duration::ZERO);
            }
            t.handle_notice(&id, from, notice, hold)
                .map(|since| since.elapsed())
        });
        if r.is_err() {
            self.counters
                .notices_refused
                .fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn message(
        &self,
        peer: SocketAddr,
        from: &str,
        body: Vec<u8>,
    ) -> std::result::Result<(), String> {
        let len = body.len();
        let m = PeerMessage {
            from: from.to_string(),
            peer,
            body,
        };
        let r = self.inbox.lock().push(m);
        let c = &self.counters;
        match r {
            Ok(()) => {
                c.messages_received.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(why) => {
                c.messages_refused.fetch_add(1, Ordering::Relaxed);
                Err(match why {
                    Refused::TooLarge => format!(
                        "message of {len} bytes is over the {} byte limit",
                        crate::inbox::MAX_MESSAGE_BYTES
                    ),
                    Refused::Full => "inbox full: the application does not take its messages \
                                      (Engine::take_messages)"
                        .to_string(),
                })
            }
        }
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
        device: u32,
        qps: &[rdma::QpEndpoint],
    ) -> std::result::Result<(Vec<rdma::QpEndpoint>, ServerQps), RdmaError> {
        let setup = |why: String| RdmaError::new(RdmaErrorKind::Setup, why);
        if self.rdma.is_empty() {
            return Err(setup(format!(
                "this engine has no RDMA device ({})",
                self.rdma_unavailable.as_deref().unwrap_or("disabled")
            )));
        }
        let dev = self.rdma.get(device as usize).ok_or_else(|| {
            setup(format!(
                "RDMA device {device} asked for, this engine has {}",
                self.rdma.len()
            ))
        })?;
        let (guard, ours) = ServerQps::accept(dev, qps)?;
        tracing::debug!(%peer, qps = ours.len(), "queue pairs created for a reader");
        Ok((ours, guard))
    }

    fn auth_key(&self) -> Option<&AuthKey> {
        self.config.auth_key.as_ref()
    }

    fn session_opened(&self, secret: SessionSecret, reader: Reader) {
        self.data_sessions
            .lock()
            .insert(secret.id, (secret, Arc::new(reader)));
    }

    fn session_closed(&self, id: [u8; 16]) {
        self.data_sessions.lock().remove(&id);
    }

    fn reader_connected(&self, reader: &Reader) {
        self.with_tracker(|t| t.reader_connected(&reader.engine));
    }

    fn reader_disconnected(&self, reader: &Reader) {
        let leased = self.with_tracker(|t| t.reader_disconnected(&reader.engine, Instant::now()));
        if let Some(holds) = leased {
            tracing::info!(engine = %reader.engine, holds, lease = ?self.config.lease, "a reader has no control connection left: its holds end after the lease unless it comes back");
        }
    }

    fn reading(
        &self,
        from: &Reader,
        id: &RequestId,
        hold: Option<u64>,
    ) -> std::result::Result<(), String> {
        if self.config.open_reads {
            return Ok(());
        }
        self.with_tracker(|t| t.claim_checked(id, from, hold))
    }
}

impl Exports for EngineState {
    fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        EngineState::region(self, id)
    }

    fn auth_required(&self) -> bool {
        self.config.auth_key.is_some()
    }

    fn data_session(&self, id: &[u8; 16]) -> Option<DataSession> {
        self.data_sessions.lock().get(id).cloned()
    }

    fn grant(
        &self,
        id: &RequestId,
        reader: Option<&Reader>,
    ) -> std::result::Result<Option<Arc<Grant>>, String> {
        if self.config.open_reads {
            return Ok(None);
        }
        self.tracker.lock().grant_for(id, reader).map(Some)
    }

    fn claim(&self, id: &RequestId, reader: &Reader) {
        self.tracker.lock().claim(id, reader);
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

impl DataServer for EngineState {
    fn device_runtime(&self, api: GpuApi) -> Option<(Arc<dyn DeviceRuntime>, i32)> {
        let rt = self.gpus.get(api).ok()?;
        // The GPU of this engine's first region of that runtime (an engine drives one GPU).
        let ordinal = self
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
            .map_or(0, |(_, o)| o);
        Some((rt, ordinal))
    }

    fn staging(&self) -> &Arc<StagingPool> {
        &self.staging
    }
}
