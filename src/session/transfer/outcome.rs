//! How a read ends: the failure it reports (the first that says most) and its reason, the
//! confirmation each prefill gives once every byte is here, the notice each source is sent,
//! and the report of a read that was confirmed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{peers, stopped_by_another, ReadJob, SourceOutcome, BACKSTOP};
use crate::completion::{FailureCause, Timeline, TransferReport};
use crate::control::messages::Message;
use crate::error::Error;
use crate::session::Sessions;
use crate::state::EngineState;
use crate::transport::ReadCancel;

/// Why a read failed: the source that failed (`None`: the read as a whole, as when the caller
/// cancelled it), whether it ran out of time, and the error.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) source: Option<usize>,
    pub(super) expired: bool,
    pub(super) error: Error,
}

impl Failure {
    /// What the read's report says of this failure: the engine closing, the deadline, or what
    /// the error was.
    pub(super) fn cause(&self, closing: bool) -> FailureCause {
        if closing {
            FailureCause::Other
        } else if self.expired {
            FailureCause::Expired
        } else {
            FailureCause::of(&self.error)
        }
    }
}

/// The first real failure among the sources' outcomes (a source stopped because another failed
/// says only that, so another's error is preferred); `late`: the read's deadline has passed.
pub(super) fn first_failure(outcomes: &[SourceOutcome], late: bool) -> Option<Failure> {
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
pub(super) fn failure_reason(
    f: &Failure,
    job: &ReadJob,
    closing: bool,
    timeout: Duration,
) -> String {
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
pub(super) fn tell_sources(
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
pub(super) fn done_report(
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
/// answer) fails the read: the bytes it read may belong to another request by now. A source
/// whose data came with its confirmation (one TCP or same-host data request) is not asked
/// again: the prefill checked its hold after it copied the bytes out.
pub(super) async fn confirm(
    shared: &EngineState,
    job: &ReadJob,
    outcomes: &[SourceOutcome],
) -> std::result::Result<Duration, Failure> {
    let limit = shared.config().handshake_timeout;
    let deadline = tokio::time::Instant::now() + limit;
    let id = &job.remote_id;
    // Confirmed already: with the data, by the hold table or by a pin (`tell_received`).
    let carried = |o: &SourceOutcome| {
        let report = o.result.as_ref().ok()?.as_ref().ok()?;
        report.confirmed.clone()
    };
    let waits: Vec<_> = outcomes
        .iter()
        .map(|o| match carried(o) {
            Some(c) => Ok(c),
            None => {
                let conn = o.conn.as_ref();
                Err(conn.and_then(|c| c.control.done(id.clone(), job.hold)))
            }
        })
        .collect();
    let mut longest = Duration::ZERO;
    for (i, wait) in waits.into_iter().enumerate() {
        let reason = match wait {
            Ok(Ok(held)) => {
                longest = longest.max(held);
                continue;
            }
            Ok(Err(refused)) => {
                format!("the prefill no longer held the request when it was read: {refused}")
            }
            Err(None) => "the done notice could not be sent (control connection gone)".to_string(),
            Err(Some(rx)) => match confirmation_by(deadline, rx).await {
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

/// Tells each source whose part was confirmed without its hearing the read's end (a copy
/// made here, confirmed by the prefill's hold table, or a read its pin confirmed) that the
/// part is in, so it frees the blocks: a `Received`, which it does not answer. Called once
/// the read was reported, off its path; whatever became of the other sources, that part's
/// bytes were read while held.
pub(super) fn tell_received(job: &ReadJob, outcomes: &[SourceOutcome]) {
    for o in outcomes {
        let Some(conn) = &o.conn else { continue };
        let told = o.result.as_ref().ok().and_then(|r| r.as_ref().ok());
        if told.is_some_and(|r| r.tell_received && matches!(r.confirmed, Some(Ok(_)))) {
            conn.control.notify(Message::Received {
                request_id: job.remote_id.clone(),
                hold: job.hold,
            });
        }
    }
}

/// The prefill's answer to a `Done`, or `Err` once `deadline` passed. A process stopped past the
/// deadline (a debugger, a swapped-out host) wakes with its timer and the control connection's
/// bytes ready together: the timer is given one turn of the runtime behind the reader that may
/// be delivering the answer, so an answer that arrived in time is not thrown away.
async fn confirmation_by<T>(
    deadline: tokio::time::Instant,
    mut rx: tokio::sync::oneshot::Receiver<T>,
) -> Result<Result<T, tokio::sync::oneshot::error::RecvError>, tokio::time::error::Elapsed> {
    match tokio::time::timeout_at(deadline, &mut rx).await {
        Ok(answer) => Ok(answer),
        Err(elapsed) => {
            tokio::task::yield_now().await;
            match rx.try_recv() {
                Ok(answer) => Ok(Ok(answer)),
                Err(_) => Err(elapsed),
            }
        }
    }
}
