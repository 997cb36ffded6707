//! Sessions: one cached connection per remote engine (single-flight connect), and the transfer
//! task that turns a request into a plan, hands it to the transport and reports the outcome.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::completion::TransferReport;
use crate::control::messages::{Descriptor, Message};
use crate::control::ControlClient;
use crate::engine::{Shared, TransportChoice};
use crate::error::{Error, Result};
use crate::ids::{BlockId, RequestId};
use crate::memory::RegionSpan;
use crate::plan::{plan, PlanOptions};
use crate::transport::rdma::RdmaConnection;
use crate::transport::tcp::TcpTransport;
use crate::transport::{ReadOp, RequestCtl, Transport};

/// A live session with one remote engine.
pub(crate) struct PeerConn {
    pub(crate) descriptor: Descriptor,
    pub(crate) control: ControlClient,
    pub(crate) transport: Box<dyn Transport>,
    pub(crate) generation: u64,
}

impl PeerConn {
    fn is_broken(&self) -> bool {
        self.control.is_closed() || self.transport.is_broken()
    }
}

type Outcome = Option<Result<Arc<PeerConn>>>;

enum Slot {
    Connecting(watch::Receiver<Outcome>),
    Ready(Arc<PeerConn>),
    /// A recent failure, returned to callers until the instant passes (so a burst of requests
    /// to a bad peer costs one handshake, and a dead peer is not hammered).
    Failed(Error, std::time::Instant),
}

/// How long a failed connect is remembered.
const FAILURE_MEMORY: std::time::Duration = std::time::Duration::from_millis(500);

/// The cache of sessions, keyed by the peer's handshake address as the caller gave it.
#[derive(Default)]
pub(crate) struct Peers {
    map: Mutex<HashMap<String, Slot>>,
    generation: AtomicU64,
}

impl Peers {
    /// The cached session if it is ready and healthy.
    pub(crate) fn ready_conn(&self, peer: &str) -> Option<Arc<PeerConn>> {
        match self.map.lock().get(peer) {
            Some(Slot::Ready(c)) if !c.is_broken() => Some(c.clone()),
            _ => None,
        }
    }

    /// The session to `peer`, connecting once however many callers ask at the same time. A
    /// failed connect fails every waiting caller with its reason; the next call tries again.
    pub(crate) async fn get(&self, shared: &Arc<Shared>, peer: &str) -> Result<Arc<PeerConn>> {
        let mut rx = {
            let mut map = self.map.lock();
            match map.get(peer) {
                Some(Slot::Ready(c)) if !c.is_broken() => return Ok(c.clone()),
                Some(Slot::Connecting(rx)) => rx.clone(),
                Some(Slot::Failed(e, until)) if std::time::Instant::now() < *until => {
                    return Err(e.clone())
                }
                other => {
                    let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
                    if let Some(Slot::Ready(old)) = other {
                        tracing::warn!(
                            peer,
                            old_generation = old.generation,
                            generation,
                            "session broken; rebuilding it"
                        );
                    }
                    let (tx, rx) = watch::channel(None);
                    map.insert(peer.to_string(), Slot::Connecting(rx.clone()));
                    let shared = shared.clone();
                    let peer = peer.to_string();
                    tokio::spawn(async move {
                        let cfg = &shared.config;
                        // The whole connect (name lookup, handshake, queue pairs or streams) is
                        // bounded, so a slot never stays "connecting" for ever.
                        let limit = cfg.connect_timeout * 2 + cfg.handshake_timeout * 3;
                        let result =
                            match tokio::time::timeout(limit, connect(&shared, &peer, generation))
                                .await
                            {
                                Ok(r) => r.map(Arc::new),
                                Err(_) => Err(Error::Timeout {
                                    what: format!("connecting to {peer} (all steps)"),
                                    after: limit,
                                }),
                            };
                        {
                            let mut map = shared.peers.map.lock();
                            match &result {
                                Ok(c) => {
                                    map.insert(peer.clone(), Slot::Ready(c.clone()));
                                }
                                Err(e) => {
                                    tracing::warn!(%peer, error = %e, "connecting to peer failed");
                                    let until = std::time::Instant::now() + FAILURE_MEMORY;
                                    map.insert(peer.clone(), Slot::Failed(e.clone(), until));
                                }
                            }
                        }
                        let _ = tx.send(Some(result));
                    });
                    rx
                }
            }
        };
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return r;
            }
            if rx.changed().await.is_err() {
                // The connect task ended without an answer (runtime shutting down, or a panic):
                // free the slot so the next call starts afresh.
                let mut map = self.map.lock();
                if matches!(map.get(peer), Some(Slot::Connecting(_))) {
                    map.remove(peer);
                }
                return Err(Error::ConnectionLost {
                    peer: peer.to_string(),
                    reason: "the connection attempt was abandoned".into(),
                });
            }
        }
    }
}

async fn connect(shared: &Arc<Shared>, peer: &str, generation: u64) -> Result<PeerConn> {
    let cfg = &shared.config;
    let addr: SocketAddr = match peer.parse() {
        Ok(a) => a,
        Err(_) => tokio::net::lookup_host(peer)
            .await
            .map_err(|e| Error::invalid(format!("peer address {peer:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::invalid(format!("peer address {peer:?} resolves to nothing")))?,
    };
    let ours = shared.descriptor().ok_or_else(|| {
        Error::invalid("set a KV layout on this engine before reading from peers")
    })?;
    let (mut hs, theirs) = ControlClient::handshake(addr, &ours, shared.control_timeouts()).await?;
    let transport: Box<dyn Transport> = match (&shared.rdma, theirs.rdma(), cfg.transport) {
        (Some(dev), Some((their_dev, regions)), choice) if choice != TransportChoice::Tcp => {
            let (prepared, qps) =
                RdmaConnection::prepare(dev, cfg.rdma.qps).map_err(Error::Rdma)?;
            let reply = hs
                .request(&Message::RdmaConnect { generation, qps })
                .await?;
            let conn = match reply {
                Message::RdmaAccept { generation: g, qps } if g == generation => prepared
                    .connect(
                        peer,
                        &qps,
                        regions.to_vec(),
                        cfg.rdma_fault,
                        shared.rdma_fault_budget.clone(),
                    )
                    .map_err(Error::Rdma)?,
                Message::RdmaAccept { generation: g, .. } => {
                    return Err(Error::Handshake {
                        peer: peer.to_string(),
                        reason: format!(
                            "stale RDMA answer for generation {g}, expected {generation}"
                        ),
                    })
                }
                other => {
                    return Err(Error::Handshake {
                        peer: peer.to_string(),
                        reason: format!("unexpected answer to RdmaConnect: {other:?}"),
                    })
                }
            };
            tracing::info!(
                peer,
                local = dev.name(),
                remote = their_dev,
                qps = cfg.rdma.qps,
                "transport rdma: both engines have RDMA"
            );
            Box::new(conn)
        }
        (ours_dev, their_rdma, choice) => {
            let why = match (ours_dev, their_rdma) {
                _ if choice == TransportChoice::Tcp => "tcp forced by configuration".to_string(),
                (None, _) => format!(
                    "this engine has no RDMA ({})",
                    shared.rdma_unavailable.as_deref().unwrap_or("unknown")
                ),
                _ => "the peer offers no RDMA".to_string(),
            };
            if choice == TransportChoice::Rdma {
                return Err(Error::RdmaUnavailable(format!("to {peer}: {why}")));
            }
            let (data_addr, _) = theirs.tcp().ok_or_else(|| Error::Handshake {
                peer: peer.to_string(),
                reason: "the peer offers no transport this engine can use".into(),
            })?;
            let t = TcpTransport::connect(
                data_addr,
                usize::from(cfg.tcp_streams),
                cfg.connect_timeout,
                cfg.io_timeout,
                cfg.batch_bytes,
                shared.staging.clone(),
            )
            .await?;
            tracing::info!(peer, streams = cfg.tcp_streams, reason = %why, "transport tcp");
            Box::new(t)
        }
    };
    tracing::info!(
        peer,
        engine = %theirs.engine_id,
        peer_generation = theirs.generation,
        generation,
        transport = transport.name(),
        "session ready"
    );
    Ok(PeerConn {
        descriptor: theirs,
        control: hs.start(),
        transport,
        generation,
    })
}

/// Everything a transfer task needs, validated by `Engine::read_blocks`.
pub(crate) struct ReadJob {
    pub(crate) peer: String,
    pub(crate) id: RequestId,
    pub(crate) local: Vec<BlockId>,
    pub(crate) remote: Vec<BlockId>,
    pub(crate) started: Instant,
    pub(crate) deadline: tokio::time::Instant,
}

/// Extra time after the request deadline for a transport to stop touching the request's
/// memory (RDMA flushes its queue pairs) before the task gives up waiting for it.
const BACKSTOP: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs one receive to its end and reports it: done, failed with a reason, or expired.
/// Reports a receive as failed if its task ends without reporting (a panic, or the runtime
/// shutting down), so no request stays "reading" for ever.
struct ReportGuard {
    shared: Arc<Shared>,
    id: Option<RequestId>,
}

impl Drop for ReportGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.shared.with_tracker(|t| {
                t.recv_failed(&id, false, "the transfer task ended without a result (engine shutting down or internal error)".into())
            });
        }
    }
}

pub(crate) async fn run_read(shared: Arc<Shared>, job: ReadJob) {
    let mut guard = ReportGuard {
        shared: shared.clone(),
        id: Some(job.id.clone()),
    };
    let ctl = Arc::new(RequestCtl::default());
    let timeout = job
        .deadline
        .saturating_duration_since(tokio::time::Instant::now());
    let outcome = tokio::time::timeout_at(
        job.deadline + BACKSTOP,
        read_once(&shared, &job, ctl.clone()),
    )
    .await;
    let conn = shared.peers.ready_conn(&job.peer);
    let (expired, result) = match outcome {
        Ok(Ok(done)) => (false, Ok(done)),
        Ok(Err(e)) => {
            let late = tokio::time::Instant::now() >= job.deadline;
            (late && matches!(e, Error::Timeout { .. }), Err(e))
        }
        Err(_) => (
            true,
            Err(Error::Timeout {
                what: "the transport to stop after the request deadline".into(),
                after: BACKSTOP,
            }),
        ),
    };
    guard.id = None;
    match result {
        Ok((report, conn)) => {
            conn.control.notify(Message::Done {
                request_id: job.id.clone(),
            });
            shared.with_tracker(|t| t.recv_done(report));
        }
        Err(e) => {
            ctl.cancel_async(shared.config.io_timeout).await;
            let reason = if expired {
                format!(
                    "not complete within the request timeout of {timeout:?} (peer {}): {e}",
                    job.peer
                )
            } else {
                e.to_string()
            };
            tracing::warn!(id = %job.id, %reason, expired, "read failed");
            if let Some(c) = &conn {
                c.control.notify(Message::Abort {
                    request_id: job.id.clone(),
                    reason: reason.clone(),
                });
            }
            shared.with_tracker(|t| t.recv_failed(&job.id, expired, reason));
        }
    }
}

async fn read_once(
    shared: &Arc<Shared>,
    job: &ReadJob,
    ctl: Arc<RequestCtl>,
) -> Result<(TransferReport, Arc<PeerConn>)> {
    let conn = tokio::time::timeout_at(job.deadline, shared.peers.get(shared, &job.peer))
        .await
        .map_err(|_| Error::Timeout {
            what: format!("connecting to {}", job.peer),
            after: std::time::Duration::ZERO,
        })??;
    let local_layout = shared
        .layout()
        .ok_or_else(|| Error::invalid("this engine's KV layout was removed"))?;
    let opts = PlanOptions {
        max_segment_bytes: shared.config.batch_bytes,
    };
    let plan = plan(
        &local_layout,
        &conn.descriptor.layout,
        &job.local,
        &job.remote,
        opts,
    )?;
    let mut ops = Vec::with_capacity(plan.segments.len());
    for s in &plan.segments {
        let region = shared
            .region(s.local_region)
            .ok_or(Error::UnknownRegion(s.local_region))?;
        ops.push(ReadOp {
            local: RegionSpan::new(region, s.local_offset, s.len)?,
            remote_region: s.remote_region,
            remote_offset: s.remote_offset,
        });
    }
    let work_requests = conn.transport.read(ops, ctl, job.deadline).await?;
    let report = TransferReport {
        id: job.id.clone(),
        bytes: plan.bytes,
        segments: plan.segments.len(),
        blocks: plan.blocks,
        work_requests,
        transport: conn.transport.name(),
        elapsed: job.started.elapsed(),
    };
    Ok((report, conn))
}
