//! The transfer task: one receive from plan to report (done, failed with a reason, or expired),
//! with the done/abort notices to the prefill side. A read draws on one source (a peer engine),
//! or on several prefill ranks at once when the prefill has the larger TP size: each source is
//! planned and read on its own session, concurrently, and the read is done when every source
//! is.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{PeerConn, Sessions};
use crate::completion::{FailureCause, Timeline, TransferReport};
use crate::control::messages::Message;
use crate::error::{Error, Result};
use crate::ids::{BlockId, RequestId};
use crate::layout::KvLayout;
use crate::memory::RegionSpan;
use crate::plan::{plan_read_from, tensor_reads, PlanOptions};
use crate::state::EngineState;
use crate::tp::{self, TpRank};
use crate::transport::{ReadCancel, ReadOp, RequestCtl};

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

/// Why a read failed: the source that failed (`None`: the read as a whole, as when the caller
/// cancelled it), whether it ran out of time, and the error.
#[derive(Debug)]
struct Failure {
    source: Option<usize>,
    expired: bool,
    error: Error,
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
    // A read that was confirmed (or not) has told every source already.
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
            let cause = if closing {
                FailureCause::Other
            } else if f.expired {
                FailureCause::Expired
            } else {
                FailureCause::of(&f.error)
            };
            shared
                .completions()
                .update(|t| t.recv_failed(&job.id, cause, reason));
        }
    }
}

/// The first real failure among the sources' outcomes (a source stopped because another failed
/// says only that, so another's error is preferred); `late`: the read's deadline has passed.
fn first_failure(outcomes: &[SourceOutcome], late: bool) -> Option<Failure> {
    let mut first: Option<Failure> = None;
    for (i, o) in outcomes.iter().enumerate() {
        let (expired, e) = match &o.result {
            Ok(Ok(_)) => continue,
            Ok(Err(e)) => (late && matches!(e, Error::Timeout { .. }), e.clone()),
            Err(_) => (
                true,
                Error::Timeout {
                    what: "the transport to stop after the request deadline".into(),
                    after: BACKSTOP,
                },
            ),
        };
        let better = first
            .as_ref()
            .is_none_or(|prev| stopped_by_another(&prev.error) && !stopped_by_another(&e));
        if better {
            first = Some(Failure {
                source: Some(i),
                expired,
                error: e,
            });
        }
    }
    first
}

/// What the caller and the prefills are told of a failed read: with several sources, the one
/// that failed; the engine closing, or the request timeout, when either is why.
fn failure_reason(f: &Failure, job: &ReadJob, closing: bool, timeout: Duration) -> String {
    let e = match f.source {
        Some(i) if job.sources.len() > 1 => {
            let s = &job.sources[i];
            let rank = s.rank.as_ref().map_or(i as u32, |(r, _)| r.rank);
            format!("prefill rank {rank} ({}): {}", s.peer, f.error)
        }
        _ => f.error.to_string(),
    };
    if closing {
        format!("engine shutting down ({e})")
    } else if f.expired {
        format!(
            "not complete within the request timeout of {timeout:?} (peer {}): {e}",
            peers(job)
        )
    } else {
        e
    }
}

/// Tells each source how its part ended: done when all its bytes are here (and the caller did
/// not cancel), else aborted with the read's `reason`.
fn tell_sources(
    sessions: &Arc<Sessions>,
    job: &ReadJob,
    outcomes: &[SourceOutcome],
    by_caller: bool,
    reason: Option<&str>,
    closing: bool,
) {
    for (s, o) in job.sources.iter().zip(outcomes) {
        let part_done = matches!(o.result, Ok(Ok(_))) && !by_caller;
        let msg = match (part_done, reason) {
            (true, _) | (false, None) => Message::Done {
                request_id: job.remote_id.clone(),
                hold: job.hold,
            },
            (false, Some(reason)) => Message::Abort {
                request_id: job.remote_id.clone(),
                reason: reason.to_string(),
                hold: job.hold,
            },
        };
        match &o.conn {
            Some(c) => {
                c.control.notify(msg);
            }
            // No session: the read was cancelled before it connected (by the caller, or as
            // another source failed), or the connect failed or was refused. The prefill is told
            // once a session is up, or on a connection of its own when it refused this
            // engine's (`Sessions::post`), so it frees its blocks now rather than at its
            // timeout.
            None if !closing => {
                let _ = sessions.post(&tokio::runtime::Handle::current(), &s.peer, msg);
            }
            None => {}
        }
    }
}

/// The report of a confirmed read: its sources' bytes, pieces and work requests summed, and
/// its timeline (`held`: the longest a prefill had held it when the Done arrived).
fn done_report(
    job: &ReadJob,
    outcomes: &[SourceOutcome],
    cancel: &ReadCancel,
    held: Option<Duration>,
    confirmed: Instant,
) -> TransferReport {
    let since = |t: Instant| Some(t.saturating_duration_since(job.started));
    let first = cancel
        .attempts()
        .iter()
        .filter_map(|c| c.first_data())
        .min();
    let mut report = TransferReport {
        id: job.id.clone(),
        peer: peers(job),
        bytes: 0,
        segments: 0,
        blocks: 0,
        work_requests: 0,
        transport: "",
        elapsed: job.started.elapsed(),
        timeline: Timeline {
            held,
            first_byte: first.and_then(since),
            confirmed: since(confirmed),
            ..Timeline::default()
        },
    };
    for r in outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok()?.as_ref().ok())
    {
        report.bytes += r.bytes;
        report.segments += r.segments;
        report.blocks = report.blocks.max(r.blocks);
        report.work_requests += r.work_requests;
        report.transport = r.transport;
        report.timeline.connected = report.timeline.connected.max(since(r.connected));
        report.timeline.last_byte = report.timeline.last_byte.max(since(r.done));
    }
    report
}

/// Sends each source its `Done` and waits, at most the handshake timeout, for every prefill to
/// confirm that it still held the request when the notice arrived, and returns the longest any
/// had held it then. The first source that does not (its hold ended: expired, released; or no
/// answer) fails the read: the bytes it read may belong to another request by now.
async fn confirm(
    shared: &EngineState,
    job: &ReadJob,
    outcomes: &[SourceOutcome],
) -> std::result::Result<Duration, Failure> {
    let limit = shared.config().handshake_timeout;
    let deadline = tokio::time::Instant::now() + limit;
    let id = &job.remote_id;
    let waits: Vec<_> = outcomes
        .iter()
        .map(|o| {
            let conn = o.conn.as_ref();
            conn.and_then(|c| c.control.done(id.clone(), job.hold))
        })
        .collect();
    let mut longest = Duration::ZERO;
    for (i, wait) in waits.into_iter().enumerate() {
        let reason = match wait {
            None => "the done notice could not be sent (control connection gone)".to_string(),
            Some(rx) => match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(Ok(held))) => {
                    longest = longest.max(held);
                    continue;
                }
                Ok(Ok(Err(refused))) => {
                    format!("the prefill no longer held the request when it was read: {refused}")
                }
                Ok(Err(_)) => "the control connection closed before the prefill confirmed".into(),
                Err(_) => format!("no confirmation from the prefill within {limit:?}"),
            },
        };
        let peer = job.sources[i].peer.clone();
        return Err(Failure {
            source: Some(i),
            expired: false,
            error: Error::Unconfirmed { peer, reason },
        });
    }
    Ok(longest)
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
    // The prefill learns who reads (RDMA reads reach no CPU there): its hold then ends on
    // this engine's lease should this engine go away. Best effort: the Done says the rest.
    conn.control.notify(Message::Reading {
        request_id: job.remote_id.clone(),
        hold: job.hold,
    });
    // The writer task that sends it was woken on this worker thread, where it would wait until
    // this task next yields; posting RDMA reads may not yield for a long time (SoftRoCE posts
    // in the caller's thread), so let it go out first.
    tokio::task::yield_now().await;
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
    let reads = tensor_reads(&local_layout, ours, &d.layout, theirs, range)?;
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
    let work_requests = if ops.is_empty() {
        0
    } else {
        conn.transport
            .read(&job.remote_id, ops, ctl, job.deadline)
            .await?
    };
    Ok(SourceReport {
        bytes: plan.bytes,
        segments: plan.segments.len(),
        blocks: plan.blocks,
        work_requests,
        transport: conn.transport.name(),
        connected,
        done: Instant::now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(result: Result<()>) -> SourceOutcome {
        SourceOutcome {
            conn: None,
            result: Ok(result.map(|()| SourceReport {
                bytes: 1,
                segments: 1,
                blocks: 1,
                work_requests: 1,
                transport: "tcp",
                connected: Instant::now(),
                done: Instant::now(),
            })),
        }
    }

    fn lost(peer: &str) -> Error {
        Error::ConnectionLost {
            peer: peer.into(),
            reason: "reset".into(),
        }
    }

    fn job(peers: &[&str]) -> ReadJob {
        ReadJob {
            sources: peers
                .iter()
                .enumerate()
                .map(|(i, p)| Source {
                    peer: p.to_string(),
                    rank: Some((TpRank::new(i as u32, peers.len() as u32), 0..1)),
                })
                .collect(),
            id: "r".into(),
            remote_id: "r".into(),
            local: vec![],
            remote: vec![],
            remote_tokens: 16,
            first_tokens: vec![],
            hold: None,
            started: Instant::now(),
            deadline: tokio::time::Instant::now(),
        }
    }

    #[test]
    fn the_first_failure_is_the_one_that_says_most() {
        assert!(first_failure(&[outcome(Ok(())), outcome(Ok(()))], false).is_none());
        // A source stopped because another failed says only that: the other's error wins.
        let stopped = Error::Cancelled("stopped".into());
        let f = first_failure(
            &[
                outcome(Ok(())),
                outcome(Err(stopped)),
                outcome(Err(lost("b"))),
            ],
            false,
        )
        .unwrap();
        assert_eq!((f.source, f.expired), (Some(2), false));
        assert!(matches!(f.error, Error::ConnectionLost { .. }));
        // A timeout is an expiry only once the read's deadline passed.
        let timeout = || Error::Timeout {
            what: "x".into(),
            after: Duration::from_secs(1),
        };
        assert!(
            !first_failure(&[outcome(Err(timeout()))], false)
                .unwrap()
                .expired
        );
        assert!(
            first_failure(&[outcome(Err(timeout()))], true)
                .unwrap()
                .expired
        );
    }

    #[test]
    fn the_reason_names_the_failed_rank_and_why_it_ended() {
        let f = |source, expired| Failure {
            source,
            expired,
            error: lost("b:1"),
        };
        let two = job(&["a:1", "b:1"]);
        let r = failure_reason(&f(Some(1), false), &two, false, Duration::from_secs(9));
        assert!(
            r.starts_with("prefill rank 1 (b:1): connection to b:1 lost"),
            "{r}"
        );
        let one = job(&["a:1"]);
        let r = failure_reason(&f(Some(0), false), &one, false, Duration::from_secs(9));
        assert!(
            r.starts_with("connection to b:1 lost"),
            "one source is not named: {r}"
        );
        let r = failure_reason(&f(Some(0), true), &one, false, Duration::from_secs(9));
        assert!(
            r.starts_with("not complete within the request timeout of 9s (peer a:1)"),
            "{r}"
        );
        let r = failure_reason(&f(None, true), &one, true, Duration::from_secs(9));
        assert!(
            r.starts_with("engine shutting down ("),
            "closing says so first: {r}"
        );
    }
}
