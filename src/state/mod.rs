//! The state an engine owns, in parts: who it is ([`Identity`]), its RDMA devices and their
//! health towards peers ([`Rdma`]), its registered memory, KV layout and descriptor
//! (`memory.rs`), its completion tracker with the notification built in ([`Completions`]),
//! the reads in flight, the inbox and the counters. It sits below the sessions (which read
//! from it and report into its tracker) and above the transports, the control plane and
//! memory: it implements the handshake service's `ControlHandler` and the data servers'
//! `Exports` and `DataServer` (`handlers.rs`). It never sees a session. Every field is
//! private: the layers above go through its methods.

mod completions;
mod handlers;
mod memory;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub(crate) use completions::Completions;

use crate::completion::{CompletionTracker, HoldTerms};
use crate::config::EngineConfig;
use crate::conn_limit::{ConnLimit, MAX_CONNECTIONS};
use crate::control::ControlTimeouts;
use crate::error::{Error, Result};
use crate::gpu::Runtimes;
use crate::grant::Grant;
use crate::holds::HoldTable;
use crate::ids::{BlockId, RequestId};
use crate::inbox::{Inbox, PeerMessage};
use crate::tp::TpRank;
use crate::transport::rails::RailBook;
use crate::transport::rdma::RdmaDevice;
use crate::transport::stream::access::DataSession;
use crate::transport::stream::staging::StagingPool;
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
    pub(crate) reads_pinned: AtomicU64,
    pub(crate) messages_received: AtomicU64,
    pub(crate) messages_refused: AtomicU64,
    pub(crate) messages_sent: AtomicU64,
    pub(crate) messages_unsent: AtomicU64,
    /// Sessions this engine made to peers (each a handshake it asked for).
    pub(crate) sessions_opened: AtomicU64,
    /// Sessions this engine closed because they were idle past `session_idle`.
    pub(crate) sessions_closed_idle: AtomicU64,
}

/// Who an engine is and where peers reach it.
pub(crate) struct Identity {
    pub(crate) config: EngineConfig,
    pub(crate) engine_id: String,
    /// This start's generation (a nonce): peers tell a restarted engine by it.
    pub(crate) generation: u64,
    /// The data server's address, as peers reach it.
    pub(crate) data_addr: SocketAddr,
    /// This host's id and the same-host socket's name, when the same-host path is served.
    pub(crate) local: Option<(String, String)>,
}

/// The engine's RDMA devices (none when RDMA is not used, with the reason) and the health of
/// their pairs towards peers.
pub(crate) struct Rdma {
    devices: Vec<Arc<RdmaDevice>>,
    unavailable: Option<String>,
    rails: Arc<RailBook>,
}

impl Rdma {
    /// The devices opened (`unavailable`: why there are none), pairs paused for `cooldown`
    /// after a failure.
    pub(crate) fn new(
        devices: Vec<Arc<RdmaDevice>>,
        unavailable: Option<String>,
        cooldown: Duration,
    ) -> Rdma {
        Rdma {
            devices,
            unavailable,
            rails: Arc::new(RailBook::new(cooldown)),
        }
    }
}

/// State shared by the engine's API, its servers and its sessions.
pub(crate) struct EngineState {
    id: Identity,
    // Drop order matters: the RDMA devices (which hold the memory registrations) before the
    // regions themselves. Sessions, which hold RDMA connections, live above this state and go
    // first.
    rdma: Rdma,
    memory: memory::Memory,
    completions: Completions,
    counters: Counters,
    gpus: Runtimes,
    staging: Arc<StagingPool>,
    /// Reads in flight, by id: the controls of their attempts, and whether the caller
    /// cancelled them (`Engine::cancel`).
    reads: Mutex<HashMap<RequestId, Arc<ReadCancel>>>,
    /// Set by `Engine::close` before its tasks stop: reads failing from then on say so, and
    /// control notices are no longer written from the thread that sends them.
    closing: Arc<AtomicBool>,
    /// Authenticated control sessions, by id, with the engine id each reader declared: their
    /// data connections are served, as that engine.
    data_sessions: Mutex<HashMap<[u8; 16], DataSession>>,
    /// Application messages from peers, not yet taken (`Engine::take_messages`).
    inbox: Mutex<Inbox>,
    /// The token of the next hold made without one.
    next_token: AtomicU64,
    /// Admission of control and of TCP data connections (their gauges are in the stats).
    control_slots: Arc<ConnLimit>,
    data_slots: Arc<ConnLimit>,
    /// The table of live holds same-host readers map (`None` when no memfd could be made:
    /// they are then served over the socket only).
    holds: Option<Arc<HoldTable>>,
}

impl EngineState {
    /// A new state with no region and no layout.
    pub(crate) fn new(id: Identity, rdma: Rdma, gpus: Runtimes) -> EngineState {
        let config = &id.config;
        let tracker = CompletionTracker::with_tp(TpRank::new(config.tp_rank, config.tp_size))
            .with_lease(config.lease);
        EngineState {
            rdma,
            memory: memory::Memory::default(),
            completions: Completions::new(tracker, config.spin),
            counters: Counters::default(),
            gpus,
            staging: StagingPool::new(config.staging_chunk_bytes as usize, config.staging_buffers),
            data_sessions: Mutex::new(HashMap::new()),
            inbox: Mutex::new(Inbox::default()),
            closing: Arc::new(AtomicBool::new(false)),
            reads: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(id.generation.rotate_left(32)),
            control_slots: ConnLimit::new(MAX_CONNECTIONS, config.max_connections_per_ip),
            data_slots: ConnLimit::new(MAX_CONNECTIONS, config.max_connections_per_ip),
            holds: match HoldTable::create() {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    tracing::warn!(error = %e, "no hold table for same-host readers (they are served over the socket)");
                    None
                }
            },
            id,
        }
    }

    /// The table of live holds same-host readers map, if this engine has one.
    pub(crate) fn hold_table(&self) -> Option<&Arc<HoldTable>> {
        self.holds.as_ref()
    }

    pub(crate) fn config(&self) -> &EngineConfig {
        &self.id.config
    }

    pub(crate) fn engine_id(&self) -> &str {
        &self.id.engine_id
    }

    /// The data server's address, as peers reach it.
    pub(crate) fn data_addr(&self) -> SocketAddr {
        self.id.data_addr
    }

    /// This host's id and the same-host socket's name, when the same-host path is served.
    pub(crate) fn local(&self) -> Option<&(String, String)> {
        self.id.local.as_ref()
    }

    /// The RDMA devices this engine opened (empty without RDMA).
    pub(crate) fn rdma(&self) -> &[Arc<RdmaDevice>] {
        &self.rdma.devices
    }

    /// Why this engine has no RDMA device, when it has none.
    pub(crate) fn rdma_unavailable(&self) -> Option<&str> {
        self.rdma.unavailable.as_deref()
    }

    /// Health of RDMA device pairs towards peers, and bytes per device.
    pub(crate) fn rails(&self) -> &Arc<RailBook> {
        &self.rdma.rails
    }

    /// The completion tracker; every change through it wakes the waiters.
    pub(crate) fn completions(&self) -> &Completions {
        &self.completions
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    pub(crate) fn gpus(&self) -> &Runtimes {
        &self.gpus
    }

    /// The staging buffers for device memory.
    pub(crate) fn staging(&self) -> &Arc<StagingPool> {
        &self.staging
    }

    /// Admission of control connections.
    pub(crate) fn control_slots(&self) -> &Arc<ConnLimit> {
        &self.control_slots
    }

    /// Admission of TCP data connections.
    pub(crate) fn data_slots(&self) -> &Arc<ConnLimit> {
        &self.data_slots
    }

    pub(crate) fn control_timeouts(&self) -> ControlTimeouts {
        let c = &self.id.config;
        ControlTimeouts {
            connect: c.connect_timeout,
            handshake: c.handshake_timeout,
            keepalive: c.keepalive,
        }
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
        self.hold_as(id, blocks, reader, abort_timeout, token, true)
    }

    /// [`hold`](Self::hold), sealed (complete) or growing: a growing hold may start with no
    /// block, grows by [`extend_hold`](Self::extend_hold), confirms no read before
    /// [`seal_hold`](Self::seal_hold), and is served by the prefill only (not published to
    /// same-host readers, whose own copies check a fixed set of blocks).
    pub(crate) fn hold_as<B: AsRef<[BlockId]>>(
        &self,
        id: RequestId,
        blocks: &[B],
        reader: Option<String>,
        abort_timeout: Duration,
        token: Option<u64>,
        sealed: bool,
    ) -> Result<u64> {
        id.validate().map_err(Error::InvalidArgument)?;
        if let Some(r) = &reader {
            crate::config::check_engine_id("reader", r)?;
        }
        let layout = self
            .layout()
            .ok_or_else(|| Error::invalid("set a KV layout before holding blocks"))?;
        let grant = if sealed {
            Grant::new(layout, blocks)?
        } else {
            Grant::open(layout, blocks)?
        };
        let grant = Arc::new(grant);
        // A growing hold's parts are told by position: a repeated id would shift them.
        if !sealed && grant.len() != blocks.iter().map(|b| b.as_ref().len()).sum::<usize>() {
            return Err(Error::invalid(format!(
                "the blocks held for request {id} repeat a block id"
            )));
        }
        let order = blocks.iter().map(|b| b.as_ref().to_vec()).collect();
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
        // Published to same-host readers under the tracker's lock, where holds end: a hold
        // never shows live in the table after it ended.
        let table = self.holds.clone().filter(|_| sealed);
        let terms = HoldTerms {
            reader,
            abort_timeout,
            token,
            sealed,
        };
        self.completions.update(|t| {
            let now = Instant::now();
            t.open_hold(id.clone(), grant.clone(), order, terms, now)?;
            // (A hold its reader aborted before it was opened ended at once.)
            if let Some(h) = table.as_ref().filter(|_| t.is_holding(&id)) {
                if let Some(slot) = h.insert(&id, token, grant.blocks_hash()) {
                    grant.publish(h.clone(), slot);
                }
            }
            Ok::<_, Error>(())
        })?;
        Ok(token)
    }

    /// Registers read `id` as in flight, with the control its caller cancels it through.
    pub(crate) fn register_read(&self, id: RequestId, cancel: Arc<ReadCancel>) {
        self.reads.lock().insert(id, cancel);
    }

    /// Takes read `id` out of the reads in flight, if `cancel` is still its entry (the id may
    /// already belong to a new read).
    pub(crate) fn unregister_read(&self, id: &RequestId, cancel: &Arc<ReadCancel>) {
        let mut reads = self.reads.lock();
        if reads.get(id).is_some_and(|c| Arc::ptr_eq(c, cancel)) {
            reads.remove(id);
        }
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

    /// From now on, reads that fail say the engine is closing.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Whether [`close`](EngineState::close) was called.
    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// The flag [`close`](EngineState::close) sets, for what must stop writing then.
    pub(crate) fn closing_flag(&self) -> Arc<AtomicBool> {
        self.closing.clone()
    }

    /// The application messages peers sent that were not taken yet.
    pub(crate) fn take_messages(&self) -> Vec<PeerMessage> {
        self.inbox.lock().take()
    }
}
