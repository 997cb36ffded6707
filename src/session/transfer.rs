//! The transfer task: one receive from plan to report (done, failed with a reason, or expired),
//! with the done/abort notices to the prefill side. A read draws on one source (a peer engine),
//! or on several prefill ranks at once when the prefill has the larger TP size: each source is
//! planned and read on its own session, concurrently, and the read is done when every source
//! is.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::{PeerConn, Sessions};
use crate::completion::FailureCause;
use crate::error::{Error, Result};
use crate::ids::{BlockId, RequestId};
use crate::layout::KvLayout;
use crate::memory::RegionSpan;
use crate::plan::{plan_read_from, tensor_reads, PlanOptions, TensorRead};
use crate::state::EngineState;
use crate::tp::{self, TpRank};
use crate::transport::{ConfirmAsk, Confirmed, ReadCancel, ReadDone, ReadOp, RequestCtl};

mod follow;
mod outcome;
mod pin;

pub(crate) use follow::{run_follow, FollowJob};

use outcome::{
    confirm, done_report, failure_reason, first_failure, tell_received, tell_sources, Failure,
};

/// One engine a read draws on.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    /// Its handshake address.
    pub(crate) peer: String,
    /// For a read from a prefill's TP group: the rank and group size this peer must be, and
    /// the prefill ranks the read draws on (`tp::sources`). `None` for a read from one engine,
    /// whatever its rank, which must then hold every head this engine needs.
    pub(crate) rank: Option<(TpRank, Range<u32>)>,
}

/// Everything a transfer task needs, validated by `Engine::read`.
pub(crate) struct ReadJob {
    /// The engines read from (one, or the prefill ranks of this decode rank).
    pub(crate) sources: Vec<Source>,
    /// The id this engine tracks and reports the read under.
    pub(crate) id: RequestId,
    /// The id the prefill holds the request under (its grant, and the done/abort notices).
    pub(crate) remote_id: RequestId,
    /// Local block ids per block group.
    pub(crate) local: Vec<Vec<BlockId>>,
    /// Remote block ids per block group, paired with `local`.
    pub(crate) remote: Vec<Vec<BlockId>>,
    /// Tokens per block the read expects of the prefill (`ReadRequest::remote_tokens_per_block`,
    /// or this engine's own).
    pub(crate) remote_tokens: u32,
    /// Where the read starts in each group's first remote block, in tokens (empty: 0).
    pub(crate) first_tokens: Vec<u32>,
    /// The prefill's hold token (`ReadRequest::hold`): notices name it.
    pub(crate) hold: Option<u64>,
    /// Whether a read of one data request asks the prefill to confirm it with its data
    /// (`false` for a part of a progressive read, confirmed once the hold is sealed).
    pub(crate) confirm_with_data: bool,
    /// The tensors of the layout read (a part of a progressive read made final a group of
    /// layers at a time); `None`: every tensor.
    pub(crate) tensors: Option<Range<u32>>,
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
    registered: Option<(RequestId, Arc<ReadCancel>)>,
}

impl ReportGuard {
    /// Takes the read out of the registry of reads in flight (only its own entry: the id may
    /// already belong to a new read).
    fn unregister(&mut self) {
        if let Some((id, cancel)) = self.registered.take() {
            self.shared.unregister_read(&id, &cancel);
        }
    }
}

impl Drop for ReportGuard {
    fn drop(&mut self) {
        self.unregister();
        if let Some(id) = self.id.take() {
            self.shared.completions().update(|t| {
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
    let cancel = Arc::new(ReadCancel::default());
    sessions.state.register_read(job.id.clone(), cancel.clone());
    let guard = ReportGuard {
        shared: sessions.state.clone(),
        id: Some(job.id.clone()),
        registered: Some((job.id.clone(), cancel.clone())),
    };
    read_to_end(sessions, job, guard, cancel)
}

/// What reading one source came to.
struct SourceOutcome {
    /// The session the read used (its control connection carries the notice).
    conn: Option<Arc<PeerConn>>,
    /// What the read came to; `Err` when the transport did not stop by the backstop.
    result: std::result::Result<Result<SourceReport>, tokio::time::error::Elapsed>,
}

/// What one source delivered.
struct SourceReport {
    bytes: u64,
    segments: usize,
    blocks: usize,
    work_requests: u64,
    transport: &'static str,
    /// When its session was up, and when its bytes were all in place.
    connected: Instant,
    done: Instant,
    /// The prefill's confirmation, when it came with the data (no `Done` needed then) or
    /// answered the read's `Pin` (`pin.rs`), or this engine's own from the prefill's hold
    /// table (a same-host copy made here).
    confirmed: Option<Confirmed>,
    /// The read was confirmed without the prefill hearing its end (a copy made here, or a
    /// read its pin confirmed): it is sent a `Received`, which it does not answer.
    tell_received: bool,
}

/// Reads one source, retrying once on a new session when its data connection was lost (reads
/// are idempotent) and the read goes on. A failure stops the read's other sources.
async fn read_source(
    sessions: &Arc<Sessions>,
    job: &ReadJob,
    source: &Source,
    cancel: &Arc<ReadCancel>,
) -> SourceOutcome {
    let shared = &sessions.state;
    let mut ctl = cancel.attempt();
    let mut used = None;
    let mut outcome = tokio::time::timeout_at(
        job.deadline + BACKSTOP,
        read_once(sessions, job, source, ctl.clone(), &mut used),
    )
    .await;
    // A data connection lost (a server closing an idle stream just as a request went out, a
    // peer restarting): the read runs once more on a new session, within the same deadline,
    // once the first attempt has stopped writing.
    if let Ok(Err(first @ Error::ConnectionLost { reason, .. })) = &outcome {
        let closing = shared.is_closing();
        if !closing
            && !cancel.is_stopped()
            && tokio::time::Instant::now() < job.deadline
            && ctl.cancel_async(shared.config().io_timeout).await
        {
            tracing::info!(id = %job.id, peer = %source.peer, error = %first, "retrying a read once on a new session");
            let first = reason.clone();
            ctl = cancel.attempt();
            used = None;
            outcome = tokio::time::timeout_at(
                job.deadline + BACKSTOP,
                read_once(sessions, job, source, ctl.clone(), &mut used),
            )
            .await;
            if let Ok(Err(e)) = &mut outcome {
                *e = Error::ConnectionLost {
                    peer: source.peer.clone(),
                    reason: format!("{first}; retried once on a new session: {e}"),
                };
            }
        }
    }
    if !matches!(outcome, Ok(Ok(_))) {
        cancel.stop();
    }
    // The session the read used: even when its transport broke, its control connection can
    // still carry the abort, so the prefill frees its blocks now rather than at its timeout.
    let conn = used.or_else(|| sessions.ready_conn(&source.peer));
    SourceOutcome {
        conn,
        result: outcome,
    }
}

/// Reads every source of `job` concurrently (each on its own task when there are several).
async fn read_sources(
    sessions: &Arc<Sessions>,
    job: &Arc<ReadJob>,
    cancel: &Arc<ReadCancel>,
) -> Vec<SourceOutcome> {
    if let [only] = job.sources.as_slice() {
        return vec![read_source(sessions, job, only, cancel).await];
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..job.sources.len() {
        let (sessions, job, cancel) = (sessions.clone(), job.clone(), cancel.clone());
        tasks.spawn(async move {
            let o = read_source(&sessions, &job, &job.sources[i], &cancel).await;
            (i, o)
        });
    }
    let mut out: Vec<Option<SourceOutcome>> = job.sources.iter().map(|_| None).collect();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok((i, o)) => out[i] = Some(o),
            // A source task that panicked (or the runtime stopping): the other sources stop,
            // and the read waits for every attempt's writes before it is reported.
            Err(e) => {
                tracing::error!(id = %job.id, error = %e, "a source of a read ended without a result");
                cancel.stop();
            }
        }
    }
    out.into_iter()
        .zip(&job.sources)
        .map(|(o, s)| {
            o.unwrap_or_else(|| SourceOutcome {
                conn: None,
                result: Ok(Err(Error::ConnectionLost {
                    peer: s.peer.clone(),
                    reason: "the source's task ended without a result".into(),
                })),
            })
        })
        .collect()
}

/// Reads every source, confirms the read with each prefill when all its bytes are here, tells
/// each source how its part ended, and reports the read done or failed.
async fn read_to_end(
    sessions: Arc<Sessions>,
    job: ReadJob,
    mut guard: ReportGuard,
    cancel: Arc<ReadCancel>,
) {
    let shared = sessions.state.clone();
    let job = Arc::new(job);
    let timeout = job
        .deadline
        .saturating_duration_since(tokio::time::Instant::now());
    let outcomes = read_sources(&sessions, &job, &cancel).await;
    let now = tokio::time::Instant::now();
    // Cancelled by the caller: reported as such, whatever the attempts returned.
    let by_caller = cancel.by_caller();
    let failure = if by_caller {
        let why = "the reader cancelled the read (cancel)".to_string();
        Some(Failure {
            source: None,
            expired: false,
            error: Error::Cancelled(why),
        })
    } else {
        first_failure(&outcomes, now >= job.deadline)
    };
    // Every byte is here: the read counts only once each prefill confirms that it still held
    // the request when the Done arrived (its blocks were then held for the whole read).
    let notified = failure.is_none();
    let (failure, held) = match failure {
        None => match confirm(&shared, &job, &outcomes).await {
            Ok(held) => (None, Some(held)),
            Err(f) => (Some(f), None),
        },
        f => (f, None),
    };
    let confirmed = Instant::now();
    guard.unregister();
    guard.id = None;
    let closing = shared.is_closing();
    let reason = failure
        .as_ref()
        .map(|f| failure_reason(f, &job, closing, timeout));
    // A failed read is reported only once no attempt of any source writes into its blocks.
    if failure.is_some() {
        for ctl in cancel.attempts() {
            ctl.cancel_async(shared.config().io_timeout).await;
        }
    }
    // A read that was confirmed (or not) has told every source already, but those that
    // confirmed without hearing its end (`tell_received`, below).
    if !notified {
        tell_sources(
            &sessions,
            &job,
            &outcomes,
            by_caller,
            reason.as_deref(),
            closing,
        );
    }
    match failure {
        None => {
            let report = done_report(&job, &outcomes, &cancel, held, confirmed);
            shared.completions().update(|t| t.recv_done(report));
        }
        Some(f) => {
            let reason = reason.unwrap_or_default();
            tracing::warn!(id = %job.id, %reason, expired = f.expired, "read failed");
            let cause = f.cause(closing);
            shared
                .completions()
                .update(|t| t.recv_failed(&job.id, cause, reason));
        }
    }
    // The sources that confirmed without hearing the read's end hear it now, off its path.
    if notified {
        tell_received(&job, &outcomes);
    }
}

/// Whether `e` only says the source was stopped (cancelled), as happens to the other sources
/// when one fails: the failing source's own error says more.
fn stopped_by_another(e: &Error) -> bool {
    match e {
        Error::Cancelled(_) => true,
        Error::Rdma(r) => r.kind == crate::error::RdmaErrorKind::Cancelled,
        _ => false,
    }
}

/// The engines a read draws on, for reports and logs.
fn peers(job: &ReadJob) -> String {
    let all: Vec<&str> = job.sources.iter().map(|s| s.peer.as_str()).collect();
    all.join(",")
}

/// Checks that the peer's blocks hold the tokens a read's block ids were given for.
pub(crate) fn check_block_size(theirs: &KvLayout, expected: u32) -> Result<()> {
    if theirs.tokens_per_block == expected {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "the peer's blocks hold {} tokens, but the read gives its block ids for blocks of \
         {expected} (set the prefill's tokens per block on the read)",
        theirs.tokens_per_block
    )))
}

/// Reads one source once; `used` gets the session as soon as there is one.
// Long: one read from one source in its order (session, announce, range, plan, post, wait), each
//   step cancellable and each failure named for the request's report.
async fn read_once(
    sessions: &Arc<Sessions>,
    job: &ReadJob,
    source: &Source,
    ctl: Arc<RequestCtl>,
    used: &mut Option<Arc<PeerConn>>,
) -> Result<SourceReport> {
    let shared = &sessions.state;
    let connect = tokio::time::timeout_at(job.deadline, sessions.get(&source.peer));
    let conn = tokio::select! {
        c = connect => c.map_err(|_| Error::Timeout {
            what: format!("connecting to {}", source.peer),
            after: job.started.elapsed(),
        })??,
        // Nothing is written while connecting: a cancel stops the wait at once.
        _ = ctl.cancelled() => return Err(Error::Cancelled("while connecting".into())),
    };
    *used = Some(conn.clone());
    let connected = Instant::now();
    tracing::debug!(id = %job.id, peer = %source.peer, transport = conn.transport.name(), "reading");
    let d = &conn.descriptor;
    let theirs = TpRank::new(d.tp_rank, d.tp_size);
    let ours = TpRank::new(shared.config().tp_rank, shared.config().tp_size);
    let range = match &source.rank {
        Some((want, range)) => {
            if *want != theirs {
                return Err(Error::invalid(format!(
                    "the engine at {} is {theirs}, but the read lists it as prefill {want}; \
                     list the prefill's handshake addresses in rank order",
                    source.peer
                )));
            }
            range.clone()
        }
        // One engine: it must be a rank this one pairs with, as its hold admits only those.
        None if !tp::reads(ours, theirs) => {
            return Err(Error::invalid(format!(
                "the engine at {} is prefill {theirs}, which this engine ({ours}) does not read: \
                 a decode rank reads the prefill ranks tp_sources names (read from the whole \
                 prefill TP group to have them chosen)",
                source.peer
            )))
        }
        None => theirs.rank..theirs.rank + 1,
    };
    let local_layout = shared
        .layout()
        .ok_or_else(|| Error::invalid("this engine's KV layout was removed"))?;
    check_block_size(&d.layout, job.remote_tokens)?;
    let mut reads = tensor_reads(&local_layout, ours, &d.layout, theirs, range)?;
    if let Some(only) = &job.tensors {
        for (i, r) in reads.iter_mut().enumerate() {
            if !only.contains(&(i as u32)) {
                *r = TensorRead::Skip;
            }
        }
    }
    let opts = PlanOptions {
        max_segment_bytes: shared.config().batch_bytes,
    };
    let plan = plan_read_from(
        &local_layout,
        &d.layout,
        &reads,
        &job.local,
        &job.remote,
        &job.first_tokens,
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
    // The prefill learns who reads, and pins the hold when asked (`pin.rs`).
    let pin = shared.config().read_pin;
    let ask = pin::announce(&conn, job, ours, plan.bytes, pin).await;
    let mut read = if ops.is_empty() {
        ReadDone::unconfirmed(0)
    } else {
        read_while_connected(&conn, &source.peer, job, ops, ctl).await?
    };
    let done = Instant::now();
    if let Some(ask) = ask.filter(|_| read.confirmed.is_none()) {
        let wait = shared.config().handshake_timeout;
        let wait = wait.min(
            job.deadline
                .saturating_duration_since(tokio::time::Instant::now()),
        );
        read.confirmed = pin::pinned(ask, wait).await;
        read.tell_received = read.confirmed.is_some();
    }
    Ok(SourceReport {
        bytes: plan.bytes,
        segments: plan.segments.len(),
        blocks: plan.blocks,
        work_requests: read.work_requests,
        transport: conn.transport.name(),
        connected,
        done,
        confirmed: read.confirmed,
        tell_received: read.tell_received,
    })
}

/// The transport's read of `ops`, stopped as soon as the session's control connection is gone:
/// no confirmation can come after that (the prefill restarted, went away, or counted this
/// engine silent and dropped its queue pairs, whose reads may then never complete). The
/// attempt is cancelled, the transport returns once nothing writes into the blocks any more, and
/// the read fails as a lost connection, which the caller retries once on a new session.
async fn read_while_connected(
    conn: &PeerConn,
    peer: &str,
    job: &ReadJob,
    ops: Vec<ReadOp>,
    ctl: Arc<RequestCtl>,
) -> Result<ReadDone> {
    // Confirmed with the data where the transport can (one data request), and only when the
    // read has one source: a prefill that confirms with its data counts the request sent then,
    // and with several sources another may still fail the read after that (`docs/protocol.md`).
    let ask = (job.sources.len() == 1 && job.confirm_with_data).then(|| ConfirmAsk {
        hold: job.hold,
        blocks: crate::grant::blocks_hash(&job.remote),
    });
    let read = conn
        .transport
        .read(&job.remote_id, ops, ctl.clone(), job.deadline, ask);
    tokio::pin!(read);
    tokio::select! {
        biased;
        r = &mut read => r,
        () = conn.control.gone() => {
            ctl.mark_cancelled();
            let _ = read.await;
            Err(Error::ConnectionLost {
                peer: peer.to_string(),
                reason: "the control connection closed while reading (the prefill restarted, \
                         went away, or counted this engine silent): no confirmation can come"
                    .into(),
            })
        }
    }
}

#[cfg(test)]
mod tests;
