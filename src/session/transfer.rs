//! The transfer task: one receive from plan to report (done, failed with a reason, or expired),
//! with the done/abort notice to the prefill side.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{PeerConn, Sessions};
use crate::completion::{FailureCause, TransferReport};
use crate::control::messages::Message;
use crate::error::{Error, Result};
use crate::ids::{BlockId, RequestId};
use crate::memory::RegionSpan;
use crate::plan::{plan, PlanOptions};
use crate::state::EngineState;
use crate::transport::{ReadOp, RequestCtl};

/// Everything a transfer task needs, validated by `Engine::read_blocks`.
pub(crate) struct ReadJob {
    pub(crate) peer: String,
    /// The id this engine tracks and reports the read under.
    pub(crate) id: RequestId,
    /// The id the prefill holds the request under (its grant, and the done/abort notices).
    pub(crate) remote_id: RequestId,
    pub(crate) local: Vec<BlockId>,
    pub(crate) remote: Vec<BlockId>,
    pub(crate) started: Instant,
    pub(crate) deadline: tokio::time::Instant,
}

/// Extra time after the request deadline for a transport to stop touching the request's
/// memory (RDMA flushes its queue pairs) before the task gives up waiting for it.
pub(super) const BACKSTOP: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs one receive to its end and reports it: done, failed with a reason, or expired.
/// Reports a receive as failed if its task ends without reporting (a panic, or the runtime
/// shutting down), so no request stays "reading" for ever.
struct ReportGuard {
    shared: Arc<EngineState>,
    id: Option<RequestId>,
    /// The read's entry in the engine's registry of reads in flight (see `Engine::cancel`).
    registered: Option<(RequestId, Arc<AtomicBool>)>,
}

impl ReportGuard {
    /// Takes the read out of the registry of reads in flight (only its own entry: the id may
    /// already belong to a new read).
    fn unregister(&mut self) {
        if let Some((id, flag)) = self.registered.take() {
            let mut reads = self.shared.reads.lock();
            if reads.get(&id).is_some_and(|(_, f)| Arc::ptr_eq(f, &flag)) {
                reads.remove(&id);
            }
        }
    }
}

impl Drop for ReportGuard {
    fn drop(&mut self) {
        self.unregister();
        if let Some(id) = self.id.take() {
            self.shared.with_tracker(|t| {
                t.recv_failed(&id, FailureCause::Other, "the transfer task ended without a result (engine shutting down or internal error)".into())
            });
        }
    }
}

/// The transfer task of `job`. Its guard exists from this call on, so the receive is reported
/// failed even if the task is dropped before it first runs (the engine closing).
pub(crate) fn run_read(
    sessions: Arc<Sessions>,
    job: ReadJob,
) -> impl std::future::Future<Output = ()> + Send {
    // Registered before the task first runs, so `Engine::cancel` finds it at once.
    let ctl = Arc::new(RequestCtl::default());
    let by_caller = Arc::new(AtomicBool::new(false));
    sessions
        .state
        .reads
        .lock()
        .insert(job.id.clone(), (ctl.clone(), by_caller.clone()));
    let guard = ReportGuard {
        shared: sessions.state.clone(),
        id: Some(job.id.clone()),
        registered: Some((job.id.clone(), by_caller.clone())),
    };
    read_to_end(sessions, job, guard, ctl, by_caller)
}

async fn read_to_end(
    sessions: Arc<Sessions>,
    job: ReadJob,
    mut guard: ReportGuard,
    mut ctl: Arc<RequestCtl>,
    by_caller: Arc<AtomicBool>,
) {
    let shared = sessions.state.clone();
    let timeout = job
        .deadline
        .saturating_duration_since(tokio::time::Instant::now());
    let mut used = None;
    let mut outcome = tokio::time::timeout_at(
        job.deadline + BACKSTOP,
        read_once(&sessions, &job, ctl.clone(), &mut used),
    )
    .await;
    // A data connection lost (a server closing an idle stream just as a request went out, a
    // peer restarting): reads are idempotent, so the read runs once more on a new session,
    // within the same deadline, once the first attempt has stopped writing.
    if let Ok(Err(first @ Error::ConnectionLost { reason, .. })) = &outcome {
        let closing = shared.closing.load(std::sync::atomic::Ordering::Acquire);
        if !closing
            && !by_caller.load(Ordering::Acquire)
            && tokio::time::Instant::now() < job.deadline
            && ctl.cancel_async(shared.config.io_timeout).await
        {
            tracing::info!(id = %job.id, error = %first, "retrying a read once on a new session");
            let first = reason.clone();
            ctl = Arc::new(RequestCtl::default());
            if let Some((c, _)) = shared.reads.lock().get_mut(&job.id) {
                *c = ctl.clone();
            }
            // A cancel that took the old control just before the swap still counts.
            if by_caller.load(Ordering::Acquire) {
                ctl.mark_cancelled();
            }
            used = None;
            outcome = tokio::time::timeout_at(
                job.deadline + BACKSTOP,
                read_once(&sessions, &job, ctl.clone(), &mut used),
            )
            .await;
            if let Ok(Err(e)) = &mut outcome {
                *e = Error::ConnectionLost {
                    peer: job.peer.clone(),
                    reason: format!("{first}; retried once on a new session: {e}"),
                };
            }
        }
    }
    // The session the read used: even when its transport broke, its control connection can
    // still carry the abort, so the prefill frees its blocks now rather than at its timeout.
    let conn = used.or_else(|| sessions.ready_conn(&job.peer));
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
    // Cancelled by the caller: reported as such, whatever the attempt returned.
    let (expired, result) = if by_caller.load(Ordering::Acquire) {
        let why = "the reader cancelled the read (cancel)".to_string();
        (false, Err(Error::Cancelled(why)))
    } else {
        (expired, result)
    };
    guard.unregister();
    guard.id = None;
    match result {
        Ok(report) => {
            if let Some(c) = &conn {
                c.control.notify(Message::Done {
                    request_id: job.remote_id.clone(),
                });
            }
            shared.with_tracker(|t| t.recv_done(report));
        }
        Err(e) => {
            ctl.cancel_async(shared.config.io_timeout).await;
            let closing = shared.closing.load(std::sync::atomic::Ordering::Acquire);
            let reason = if closing {
                format!("engine shutting down ({e})")
            } else if expired {
                format!(
                    "not complete within the request timeout of {timeout:?} (peer {}): {e}",
                    job.peer
                )
            } else {
                e.to_string()
            };
            tracing::warn!(id = %job.id, %reason, expired, "read failed");
            let abort = Message::Abort {
                request_id: job.remote_id.clone(),
                reason: reason.clone(),
            };
            match &conn {
                Some(c) => {
                    c.control.notify(abort);
                }
                // Cancelled before the session was up: the prefill is told once it is (within
                // the connect timeout), so it frees its blocks now rather than at its timeout.
                None if matches!(e, Error::Cancelled(_)) && !closing => {
                    let (sessions, peer) = (sessions.clone(), job.peer.clone());
                    let wait = shared.config.connect_timeout + shared.config.handshake_timeout;
                    tokio::spawn(async move {
                        if let Ok(Ok(c)) = tokio::time::timeout(wait, sessions.get(&peer)).await {
                            c.control.notify(abort);
                        }
                    });
                }
                None => {}
            }
            let cause = if closing {
                FailureCause::Other
            } else if expired {
                FailureCause::Expired
            } else {
                FailureCause::of(&e)
            };
            shared.with_tracker(|t| t.recv_failed(&job.id, cause, reason));
        }
    }
}

/// Reads once; `used` gets the session as soon as there is one.
async fn read_once(
    sessions: &Arc<Sessions>,
    job: &ReadJob,
    ctl: Arc<RequestCtl>,
    used: &mut Option<Arc<PeerConn>>,
) -> Result<TransferReport> {
    let shared = &sessions.state;
    let connect = tokio::time::timeout_at(job.deadline, sessions.get(&job.peer));
    let conn = tokio::select! {
        c = connect => c.map_err(|_| Error::Timeout {
            what: format!("connecting to {}", job.peer),
            after: job.started.elapsed(),
        })??,
        // Nothing is written while connecting: a cancel stops the wait at once.
        _ = ctl.cancelled() => return Err(Error::Cancelled("while connecting".into())),
    };
    *used = Some(conn.clone());
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
    let work_requests = conn
        .transport
        .read(&job.remote_id, ops, ctl, job.deadline)
        .await?;
    let report = TransferReport {
        id: job.id.clone(),
        peer: job.peer.clone(),
        bytes: plan.bytes,
        segments: plan.segments.len(),
        blocks: plan.blocks,
        work_requests,
        transport: conn.transport.name(),
        elapsed: job.started.elapsed(),
    };
    Ok(report)
}
