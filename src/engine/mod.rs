//! The `Engine`: one per worker process, the API every binding and tool calls. It starts the
//! engine's state (`crate::state`), the handshake service and the data server on a small private
//! tokio runtime, owns the session cache (`crate::session`), and answers API calls by delegating
//! to them, so callers use plain blocking-free methods from any thread.

mod report;
mod requests;
mod start;
mod submit;

pub use report::{Capabilities, EngineStats};
pub use requests::{tp_sources, FollowRequest, HoldRequest, ReadFrom, ReadRequest};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use crate::completion::Finished;
use crate::config::EngineConfig;
use crate::control::messages::{Descriptor, Message};
use crate::error::{Error, Result};
use crate::gpu::{GpuApi, PointerKind, Runtimes};
use crate::ids::RegionId;
use crate::inbox::{Body, PeerMessage, MAX_MESSAGE_BYTES};
use crate::layout::KvLayout;
use crate::memory::{DeviceMemory, ExternalMemory, Region};
pub use crate::session::SessionState;
use crate::session::Sessions;
use crate::state::{self, EngineState, Identity};
use crate::transport::rdma::RdmaFault;

/// A kvlink engine: see the crate docs for the life of a transfer.
pub struct Engine {
    // Sessions (which hold RDMA connections) go before the state (which holds the device and
    // the regions).
    sessions: Arc<Sessions>,
    shared: Arc<EngineState>,
    control_addr: SocketAddr,
    /// `None` once closed.
    runtime: RwLock<Option<tokio::runtime::Runtime>>,
}

impl Engine {
    /// Starts an engine: binds the handshake service and the data server and starts its
    /// runtime. Register memory and set a layout before peers can read from it.
    pub fn start(config: EngineConfig) -> Result<Engine> {
        Engine::start_inner(config, None)
    }

    /// [`start`](Engine::start) with RDMA fault injection, for the tests of the RDMA error
    /// paths (`kvlink::internal`).
    pub(crate) fn start_with_rdma_fault(config: EngineConfig, fault: RdmaFault) -> Result<Engine> {
        Engine::start_inner(config, Some(fault))
    }

    fn start_inner(config: EngineConfig, rdma_fault: Option<RdmaFault>) -> Result<Engine> {
        let config = start::settle(config)?;
        let (rdma, rdma_unavailable) = start::open_rdma(&config)?;
        let gpus = Runtimes::probe(config.gpu);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.runtime_threads.max(1))
            .thread_name("kvlink")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the engine runtime", &e))?;
        let listen = start::listen_addr(&config)?;
        let generation = start::generation_nonce();
        let local = start::bind_same_host(&runtime, generation);
        let (control, data) = start::bind_servers(&runtime, listen)?;
        let advertise = start::advertise_ip(&config, listen)?;
        let control_addr = SocketAddr::new(advertise, start::port(&control, "control")?);
        let data_addr = SocketAddr::new(advertise, start::port(&data, "data")?);
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| start::default_engine_id(config.tp_rank));
        let cooldown = config.rdma.cooldown;
        let id = Identity {
            config,
            engine_id: engine_id.clone(),
            generation,
            data_addr,
            local: local.as_ref().map(|(h, n, _)| (h.clone(), n.clone())),
        };
        let rdma = state::Rdma::new(rdma, rdma_unavailable, cooldown);
        let shared = Arc::new(EngineState::new(id, rdma, gpus));
        start::spawn_servers(&runtime, &shared, control, data, local.map(|(_, _, l)| l));
        let engine = Engine {
            sessions: Arc::new(match rdma_fault {
                None => Sessions::new(shared.clone()),
                Some(f) => Sessions::with_rdma_fault(shared.clone(), f),
            }),
            shared,
            control_addr,
            runtime: RwLock::new(Some(runtime)),
        };
        if let Some(rt) = &*engine.runtime.read() {
            engine.sessions.spawn_reaper(rt.handle());
        }
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

    /// The RDMA devices in use (`Ok(names)`, comma-separated), or why RDMA is not used
    /// (`Err(reason)`).
    // A String error kept: the devices in use or why none, for people; public (Python).
    pub fn rdma_status(&self) -> std::result::Result<String, String> {
        let devs = self.shared.rdma();
        if devs.is_empty() {
            return Err(self
                .shared
                .rdma_unavailable()
                .unwrap_or("unknown")
                .to_string());
        }
        Ok(devs
            .iter()
            .map(|d| d.name().to_string())
            .collect::<Vec<_>>()
            .join(","))
    }

    /// Bytes this engine read through each of its RDMA devices, by device name (several
    /// devices share a read in proportion to what each delivers).
    pub fn rdma_device_bytes(&self) -> Vec<(String, u64)> {
        self.shared.rails().device_bytes()
    }

    /// The transports and memory kinds this engine found, and why any is missing (also logged
    /// when the engine starts).
    pub fn capabilities(&self) -> Capabilities {
        let sh = &self.shared;
        Capabilities {
            rdma: self.rdma_status(),
            tcp: format!(
                "data server {}, {} streams per peer",
                sh.data_addr(),
                sh.config().tcp_streams
            ),
            local: sh
                .local()
                .map(|(_, socket)| format!("abstract Unix socket @{socket}"))
                .ok_or_else(|| "no same-host socket (see the log at start)".to_string()),
            gpu: sh.gpus().report(),
        }
    }

    /// What the loaded GPU runtimes say about `ptr`: host memory, pinned host memory, or the
    /// memory of which GPU. Without a GPU runtime every address is [`PointerKind::Host`].
    pub fn classify_pointer(&self, ptr: u64) -> Result<PointerKind> {
        self.shared
            .gpus()
            .classify(ptr)
            .map(|(k, _)| k)
            .map_err(Error::Gpu)
    }

    /// This engine's id.
    pub fn engine_id(&self) -> &str {
        self.shared.engine_id()
    }

    /// The descriptor peers receive, once a layout is set.
    pub fn descriptor(&self) -> Option<Descriptor> {
        self.shared.descriptor().map(|d| (*d).clone())
    }

    fn next_region_id(&self) -> RegionId {
        self.shared.next_region_id()
    }

    fn add_region(&self, region: Region) -> Result<Arc<Region>> {
        self.shared.add_region(region)
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
        let (kind, rt) = self.shared.gpus().classify(mem.ptr).map_err(Error::Gpu)?;
        match (kind, rt) {
            (PointerKind::Device { ordinal, .. }, Some(rt)) => {
                self.add_region(Region::device(self.next_region_id(), mem, rt, ordinal))
            }
            (PointerKind::Host, _) if self.shared.gpus().loaded().next().is_none() => {
                Err(Error::Gpu(
                    format!(
                        "cannot register device memory at {:#x}: no GPU runtime is loaded ({})",
                        mem.ptr,
                        self.shared.gpus().why_none()
                    )
                    .into(),
                ))
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
        let rt = self
            .shared
            .gpus()
            .get(api)
            .map_err(|why| Error::Gpu(why.context(format!("cannot allocate {api} memory"))))?;
        self.add_region(Region::allocate_device(
            self.next_region_id(),
            len,
            rt,
            ordinal,
        )?)
    }

    /// Registers host memory as emulated device memory (`internal::register_emulated_device`).
    pub(crate) fn register_emulated_device(&self, mem: ExternalMemory) -> Result<Arc<Region>> {
        let dm = DeviceMemory {
            ptr: mem.ptr.as_ptr() as u64,
            len: mem.len,
        };
        let rt = self
            .shared
            .gpus()
            .get(GpuApi::Emulated)
            .map_err(Error::Gpu)?;
        self.add_region(Region::device(self.next_region_id(), dm, rt, 0))
    }

    /// Stops exporting a region and waits until no transfer uses it any more, so its memory may
    /// be freed when this returns `Ok`. Refused while the KV layout uses the region. Waits at
    /// most the request timeout plus 10 s (every request ends by then); if transfers still hold
    /// the region, returns an error and the memory must not be freed.
    pub fn deregister(&self, id: RegionId) -> Result<()> {
        self.shared.deregister(id)
    }

    /// Sets the KV layout (validated against registered regions) and publishes the descriptor.
    pub fn set_layout(&self, layout: KvLayout) -> Result<()> {
        self.shared.set_layout(layout)
    }

    /// Connects to `peer` (or reuses the cached session), and returns its descriptor: its KV
    /// layout, block count and TP rank. Blocks up to `timeout`; concurrent first contacts with
    /// `read_blocks` share the same handshake. Call it from outside async contexts.
    pub fn connect(&self, peer: &str, timeout: Duration) -> Result<Descriptor> {
        let rt = self.runtime.read();
        let rt = rt.as_ref().ok_or(Error::Shutdown)?;
        let sessions = self.sessions.clone();
        let conn = rt.block_on(async move {
            tokio::time::timeout(timeout, sessions.get(peer))
                .await
                .map_err(|_| Error::Timeout {
                    what: format!("connecting to {peer}"),
                    after: timeout,
                })?
        })?;
        Ok(conn.descriptor.clone())
    }

    /// Sends `body` to the engine at `peer` (a handshake address) over the authenticated
    /// control connection, for its application ([`take_messages`](Engine::take_messages)):
    /// connectors use it to announce what a reader may read (SGLang's chunks). Returns at once;
    /// messages to one peer go out in call order once its session is up (a first contact
    /// connects within the connect and handshake timeouts). A message that cannot be sent
    /// (peer unreachable, its queue full) is logged and counted in `messages_unsent`: the
    /// application's protocol must time out on its own. `body` is at most
    /// [`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES).
    pub fn send_message(&self, peer: &str, body: Vec<u8>) -> Result<()> {
        if body.len() > MAX_MESSAGE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes is over the {MAX_MESSAGE_BYTES} byte limit",
                body.len()
            )));
        }
        let rt = self.runtime.read();
        let rt = rt.as_ref().ok_or(Error::Shutdown)?;
        let msg = Message::AppMessage { body: Body(body) };
        self.sessions.post(rt.handle(), peer, msg)
    }

    /// What this engine knows of its session with `peer` (a handshake address, as given to
    /// reads and messages), without waiting or connecting: connectors watch the peers their
    /// requests wait on, and fail those requests when a peer stays down (a dead prefill is
    /// then noticed within the keep-alive's three silent periods, not at a request timeout).
    pub fn session_state(&self, peer: &str) -> SessionState {
        self.sessions.state(peer)
    }

    /// The messages peers sent this engine since the last call, in arrival order: each with
    /// the sender's engine id (from its authenticated handshake). The inbox keeps at most 4,096
    /// messages or 16 MiB; beyond that new ones are refused (counted in `messages_refused`,
    /// logged), so take them every scheduler step. Never blocks.
    pub fn take_messages(&self) -> Vec<PeerMessage> {
        self.shared.take_messages()
    }

    /// Everything that finished since the last call, each request once.
    pub fn get_finished(&self) -> Finished {
        self.shared.completions().take_finished()
    }

    /// Like [`get_finished`](Engine::get_finished), but waits up to `timeout` for something to
    /// finish (no spinning: it sleeps until a completion or a hold's deadline).
    pub fn wait_finished(&self, timeout: Duration) -> Finished {
        self.shared.completions().wait_finished(timeout)
    }

    /// Counters of what this engine served and refused.
    pub fn stats(&self) -> EngineStats {
        let c = &self.shared.counters();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStats {
            handshakes_accepted: get(&c.handshakes_accepted),
            handshakes_refused: get(&c.handshakes_refused),
            data_requests_served: get(&c.data_requests_served),
            data_requests_refused: get(&c.data_requests_refused),
            bytes_served: get(&c.bytes_served),
            bytes_staged_out: self.shared.staging().staged_out(),
            bytes_staged_in: self.shared.staging().staged_in(),
            notices_refused: get(&c.notices_refused),
            reads_pinned: get(&c.reads_pinned),
            messages_received: get(&c.messages_received),
            messages_refused: get(&c.messages_refused),
            messages_sent: get(&c.messages_sent),
            messages_unsent: get(&c.messages_unsent),
            rdma_pairs_paused: self.shared.rails().pauses(),
            control_connections: self.shared.control_slots().open_now() as u64,
            data_connections: self.shared.data_slots().open_now() as u64,
            sessions: self.sessions.up() as u64,
            sessions_opened: get(&c.sessions_opened),
            sessions_closed_idle: get(&c.sessions_closed_idle),
            queue_pairs: self.shared.rdma().iter().map(|d| d.queue_pairs()).sum(),
            totals: self.shared.completions().read(|t| t.totals()),
        }
    }

    /// Requests being received and sends being held.
    pub fn in_flight(&self) -> (usize, usize) {
        self.shared
            .completions()
            .read(|t| (t.receiving(), t.holding()))
    }
}

impl Engine {
    /// Closes the engine: its handshake and data ports close, its sessions to peers end, reads
    /// in flight fail ("engine shutting down"), and later calls that need the network return
    /// [`Error::Shutdown`]. What finished stays readable with
    /// [`get_finished`](Engine::get_finished). Idempotent; dropping the engine closes it too.
    /// Waits for calls in progress on other threads (a [`connect`](Engine::connect) up to its
    /// timeout), then at most a second for the engine's tasks to stop.
    pub fn close(&self) {
        self.shared.close();
        let rt = self.runtime.write().take();
        if let Some(rt) = rt {
            rt.shutdown_timeout(Duration::from_secs(1));
            tracing::info!(engine = %self.shared.engine_id(), "kvlink engine closed");
        }
    }

    /// Whether [`close`](Engine::close) was called.
    pub fn is_closed(&self) -> bool {
        self.runtime.read().is_none()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}
