//! Progressive reads: a read that follows the prefill's hold as it grows. It asks the prefill
//! to tell it of the hold's parts (`Follow`), reads each part as soon as it is told of it
//! (without confirmation: the hold is not complete), and once the hold is sealed and every
//! part is here confirms the whole read with one `Done`, as a read of a complete hold does: the
//! prefill confirms only a hold that was live, and so held every part, from its first part
//! to the `Done`. Each wait has a deadline: the first part, the next one, the whole read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::outcome::{confirm, done_report, Failure};
use super::{read_sources, ReadJob, ReportGuard, SourceOutcome, SourceReport};
use crate::completion::{Announcement, FailureCause};
use crate::control::messages::Message;
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::session::{PeerConn, Sessions};
use crate::transport::ReadCancel;

/// A progressive read: `read` names one source, this engine's blocks (`local`, all of them)
/// and no remote block (the parts name them).
pub(crate) struct FollowJob {
    pub(crate) read: ReadJob,
    /// Per block group, the prefill's first blocks not read (`FollowRequest::skip`).
    pub(crate) skip: Vec<usize>,
    /// How long to wait for the first part (the prefill may not hold the request yet).
    pub(crate) first_wait: Duration,
    /// How long to wait for each part after the previous one.
    pub(crate) between: Duration,
}

/// The transfer task of progressive read `job` (registered, so `Engine::cancel` finds it, and
/// reported failed if dropped before its end, as a plain read's).
pub(crate) fn run_follow(
    sessions: Arc<Sessions>,
    job: FollowJob,
) -> impl std::future::Future<Output = ()> + Send {
    let cancel = Arc::new(ReadCancel::default());
    let id = job.read.id.clone();
    sessions.state.register_read(id.clone(), cancel.clone());
    let guard = ReportGuard {
        shared: sessions.state.clone(),
        id: Some(id.clone()),
        registered: Some((id, cancel.clone())),
    };
    follow_to_end(sessions, job, guard, cancel)
}

/// What following came to: the parts read, the session, and the hold's token.
struct Followed {
    parts: Vec<SourceOutcome>,
    conn: Arc<PeerConn>,
    token: u64,
}

async fn follow_to_end(
    sessions: Arc<Sessions>,
    job: FollowJob,
    mut guard: ReportGuard,
    cancel: Arc<ReadCancel>,
) {
    let shared = sessions.state.clone();
    let mut conn = None;
    let followed = follow_parts(&sessions, &job, &cancel, &mut conn).await;
    if let Some(c) = &conn {
        c.control.unfollow(&job.read.remote_id);
    }
    let read = &job.read;
    let failure = match followed {
        Ok(f) => match confirm_all(&shared, read, &f).await {
            Ok(held) => {
                guard.unregister();
                guard.id = None;
                let mut last = read.clone_for_report(f.token);
                last.remote = Vec::new();
                let report = done_report(&last, &f.parts, &cancel, Some(held), Instant::now());
                shared.completions().update(|t| t.recv_done(report));
                return;
            }
            Err(f) => f,
        },
        Err(f) => f,
    };
    guard.unregister();
    guard.id = None;
    // Nothing writes into the blocks once the failure is reported.
    for ctl in cancel.attempts() {
        ctl.cancel_async(shared.config().io_timeout).await;
    }
    let by_caller = cancel.by_caller();
    let (cause, reason) = if by_caller {
        (
            FailureCause::Cancelled,
            "the reader cancelled the read (cancel)".to_string(),
        )
    } else if failure.expired {
        (FailureCause::Expired, failure.error.to_string())
    } else {
        (FailureCause::of(&failure.error), failure.error.to_string())
    };
    // The prefill frees the blocks now rather than at its abort timeout.
    if let Some(c) = &conn {
        c.control.notify(Message::Abort {
            request_id: read.remote_id.clone(),
            reason: reason.clone(),
            hold: read.hold,
        });
    }
    tracing::warn!(id = %read.id, %reason, "progressive read failed");
    shared
        .completions()
        .update(|t| t.recv_failed(&read.id, cause, reason));
}

/// Confirms the whole read with the prefill (one `Done` for the sealed hold).
async fn confirm_all(
    shared: &crate::state::EngineState,
    read: &ReadJob,
    f: &Followed,
) -> std::result::Result<Duration, Failure> {
    let now = Instant::now();
    let whole = SourceOutcome {
        conn: Some(f.conn.clone()),
        result: Ok(Ok(SourceReport {
            bytes: 0,
            segments: 0,
            blocks: 0,
            work_requests: 0,
            transport: f.conn.transport.name(),
            connected: now,
            done: now,
            confirmed: None,
            tell_received: false,
        })),
    };
    let job = read.clone_for_report(f.token);
    confirm(shared, &job, std::slice::from_ref(&whole)).await
}

fn failed(error: Error, expired: bool) -> Failure {
    Failure {
        source: Some(0),
        expired,
        error,
    }
}

/// A read that ran out of time waiting for `what`.
fn timed_out(read: &ReadJob, what: &str) -> Failure {
    let peer = &read.sources[0].peer;
    let what = format!("{what} of request {} from {peer}", read.remote_id);
    failed(
        Error::Timeout {
            what,
            after: read.started.elapsed(),
        },
        true,
    )
}

/// A read whose control connection to `read`'s source went away.
fn lost(read: &ReadJob, reason: &str) -> Failure {
    let (peer, reason) = (read.sources[0].peer.clone(), reason.to_string());
    failed(Error::ConnectionLost { peer, reason }, false)
}

/// The session to the read's source, within its deadline, unless cancelled first.
async fn connect(
    sessions: &Arc<Sessions>,
    read: &ReadJob,
    ctl: &crate::transport::RequestCtl,
) -> std::result::Result<Arc<PeerConn>, Failure> {
    let peer = &read.sources[0].peer;
    tokio::select! {
        c = tokio::time::timeout_at(read.deadline, sessions.get(peer)) => match c {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(failed(e, false)),
            Err(_) => Err(timed_out(read, "connecting for the parts")),
        },
        _ = ctl.cancelled() => Err(failed(Error::Cancelled("while connecting".into()), false)),
    }
}

/// Follows the hold and reads each part until the sealed one; `conn_out` gets the session.
async fn follow_parts(
    sessions: &Arc<Sessions>,
    job: &FollowJob,
    cancel: &Arc<ReadCancel>,
    conn_out: &mut Option<Arc<PeerConn>>,
) -> std::result::Result<Followed, Failure> {
    let read = &job.read;
    let ctl = cancel.attempt();
    let conn = connect(sessions, read, &ctl).await?;
    *conn_out = Some(conn.clone());
    let id = read.remote_id.clone();
    let Some(mut parts) = conn.control.follow(id, read.hold, job.first_wait) else {
        return Err(lost(
            read,
            "the follow could not be sent (control connection gone or full)",
        ));
    };
    let tensors = sessions
        .state
        .layout()
        .map_or(0, |l| l.tensors.len() as u32);
    let mut progress = Progress::new(&read.local, &job.skip, tensors, read.hold);
    let mut outcomes = Vec::new();
    let mut until = tokio::time::Instant::now() + job.first_wait;
    loop {
        let next = tokio::select! {
            n = tokio::time::timeout_at(until.min(read.deadline), parts.recv()) => n,
            _ = ctl.cancelled() => return Err(failed(Error::Cancelled("while following".into()), false)),
        };
        let what = if progress.told {
            "the next part"
        } else {
            "the first part"
        };
        let step = match next {
            Err(_) => return Err(timed_out(read, &format!("waiting for {what}"))),
            Ok(None) => {
                return Err(lost(
                    read,
                    "the control connection closed while following the hold",
                ))
            }
            Ok(Some(Announcement::Ended { reason })) => {
                let (peer, message) = (
                    read.sources[0].peer.clone(),
                    format!("the hold ended before the read: {reason}"),
                );
                return Err(failed(Error::Refused { peer, message }, false));
            }
            Ok(Some(part)) => progress.take(part).map_err(|e| failed(e, false))?,
        };
        let token = progress.token.unwrap_or_default();
        if let Some(p) = step.read {
            outcomes.push(read_part(sessions, read.part(p, token), cancel).await?);
        }
        if step.sealed {
            return Ok(Followed {
                parts: outcomes,
                conn,
                token,
            });
        }
        until = tokio::time::Instant::now() + job.between;
    }
}

/// Reads one part (`part`), as a read of its blocks (retried once on a new session when its
/// data connection was lost, as any read).
async fn read_part(
    sessions: &Arc<Sessions>,
    part: ReadJob,
    cancel: &Arc<ReadCancel>,
) -> std::result::Result<SourceOutcome, Failure> {
    let part = Arc::new(part);
    let o = read_sources(sessions, &part, cancel)
        .await
        .pop()
        .expect("one source");
    let late = tokio::time::Instant::now() >= part.deadline;
    match super::outcome::first_failure(std::slice::from_ref(&o), late) {
        Some(f) => Err(f),
        None => Ok(o),
    }
}

/// One read a part asks for: this engine's blocks per group, the prefill's, and the tensors.
#[derive(Debug, PartialEq, Eq)]
struct PartRead {
    local: Vec<Vec<BlockId>>,
    remote: Vec<Vec<BlockId>>,
    tensors: Option<std::ops::Range<u32>>,
}

/// What a part comes to: a read to make (none for a part of nothing new), and whether the
/// hold is complete and read.
#[derive(Debug)]
struct Step {
    read: Option<PartRead>,
    sealed: bool,
}

/// What a progressive read has of the hold, without I/O: the blocks read whole per group, the
/// last part while only some of its tensors are read, and the hold's token. Each part is
/// checked against it: its groups must be this engine's, it must start where the last ended,
/// fit this engine's blocks, name the token followed, and continue a part's tensors in order.
/// The first `skip` blocks of each group are the hold's but not read: `local` pairs with the
/// prefill's blocks after them.
struct Progress<'a> {
    local: &'a [Vec<BlockId>],
    skip: &'a [usize],
    tensors: u32,
    /// The prefill's blocks told per group (skipped ones included).
    got: Vec<usize>,
    /// The prefill's blocks of the last part and its tensors read so far, while incomplete.
    tail: Option<(Vec<Vec<BlockId>>, u32)>,
    token: Option<u64>,
    /// Whether any part was told.
    told: bool,
}

impl<'a> Progress<'a> {
    fn new(local: &'a [Vec<BlockId>], skip: &'a [usize], tensors: u32, token: Option<u64>) -> Self {
        Progress {
            local,
            skip,
            tensors,
            got: vec![0; local.len()],
            tail: None,
            token,
            told: false,
        }
    }

    /// Takes `a` (a part), and says what to read for it.
    fn take(&mut self, a: Announcement) -> Result<Step> {
        let Announcement::Part {
            token,
            first,
            blocks,
            tensors,
            sealed,
        } = a
        else {
            return Err(Error::Protocol("an end where a part was due".into()));
        };
        if self.token.is_some_and(|t| t != token) {
            return Err(Error::Protocol(format!(
                "a part of hold {token} where hold {:?} was followed",
                self.token
            )));
        }
        self.token = Some(token);
        self.told = true;
        check_part(self.local, self.skip, &self.got, &first, &blocks)?;
        let new = blocks.iter().any(|b| !b.is_empty());
        let read = match (self.tail.take(), tensors) {
            (Some((remote, done)), Some((lo, hi))) if !new && lo == done && hi > lo => {
                self.part_tensors(remote, lo..hi)?
            }
            (Some((_, done)), _) => {
                return Err(Error::Protocol(format!(
                    "a part other than tensors {done}.. of the blocks whose tensors are coming"
                )))
            }
            (None, _) if !new => None,
            (None, None) => {
                let read = self.blocks_read(blocks.clone(), None);
                self.advance(&blocks);
                read
            }
            (None, Some((0, hi))) if hi > 0 => self.part_tensors(blocks, 0..hi)?,
            (None, Some((lo, _))) => {
                return Err(Error::Protocol(format!(
                    "a part of new blocks from tensor {lo}, not 0"
                )))
            }
        };
        if sealed {
            if let Some((_, done)) = &self.tail {
                return Err(Error::Protocol(format!(
                    "the hold sealed with tensors {done}.. of its last part to come"
                )));
            }
            let whole = |g: usize| self.skip[g] + self.local[g].len();
            if let Some(g) = (0..self.got.len()).find(|g| self.got[*g] != whole(*g)) {
                return Err(Error::invalid(format!(
                    "the prefill sealed the request with {} blocks in block group {g}, but the \
                     read is into {} after {} skipped",
                    self.got[g],
                    self.local[g].len(),
                    self.skip[g]
                )));
            }
        }
        Ok(Step { read, sealed })
    }

    /// The read of tensors `t` of the part of `remote` blocks (the tail's, or new ones), which
    /// is whole once `t` reaches the last tensor.
    fn part_tensors(
        &mut self,
        remote: Vec<Vec<BlockId>>,
        t: std::ops::Range<u32>,
    ) -> Result<Option<PartRead>> {
        if t.end > self.tensors {
            return Err(Error::Protocol(format!(
                "tensors {t:?} of a layout of {}",
                self.tensors
            )));
        }
        let end = t.end;
        let read = self.blocks_read(remote.clone(), Some(t));
        if end == self.tensors {
            self.advance(&remote);
        } else {
            self.tail = Some((remote, end));
        }
        Ok(read)
    }

    /// The read of `remote` blocks from where the read is, into the next of this engine's,
    /// leaving out those skipped; none when all of them are.
    fn blocks_read(
        &self,
        remote: Vec<Vec<BlockId>>,
        tensors: Option<std::ops::Range<u32>>,
    ) -> Option<PartRead> {
        let (mut local, mut read) = (Vec::new(), Vec::new());
        for (g, r) in remote.iter().enumerate() {
            // Of the prefill's blocks at positions got.., those from the first one read.
            let cut = self.skip[g].saturating_sub(self.got[g]).min(r.len());
            let at = (self.got[g] + cut).saturating_sub(self.skip[g]);
            local.push(self.local[g][at..at + r.len() - cut].to_vec());
            read.push(r[cut..].to_vec());
        }
        read.iter().any(|r| !r.is_empty()).then_some(PartRead {
            local,
            remote: read,
            tensors,
        })
    }

    fn advance(&mut self, blocks: &[Vec<BlockId>]) {
        for (g, b) in blocks.iter().enumerate() {
            self.got[g] += b.len();
        }
    }
}

/// Checks a part's shape against what was read so far (`got` blocks per group, into
/// `local` after `skip`): its groups must be this engine's, each must start where the last
/// ended, and the part must fit the read's blocks.
fn check_part(
    local: &[Vec<BlockId>],
    skip: &[usize],
    got: &[usize],
    first: &[u32],
    blocks: &[Vec<BlockId>],
) -> Result<()> {
    if first.len() != local.len() || blocks.len() != local.len() {
        return Err(Error::Protocol(format!(
            "a part of {} block groups for a read of {}",
            blocks.len().max(first.len()),
            local.len()
        )));
    }
    for (g, b) in blocks.iter().enumerate() {
        if first[g] as usize != got[g] {
            return Err(Error::Protocol(format!(
                "a part starting at block {} of group {g}, where {} were read",
                first[g], got[g]
            )));
        }
        if got[g] + b.len() > skip[g] + local[g].len() {
            return Err(Error::invalid(format!(
                "the prefill holds more than the read's {} blocks (after {} skipped) in block \
                 group {g}",
                local[g].len(),
                skip[g]
            )));
        }
    }
    Ok(())
}

impl ReadJob {
    /// The read of one part (`p`) under hold `token`, not confirmed with its data.
    fn part(&self, p: PartRead, token: u64) -> ReadJob {
        ReadJob {
            sources: self.sources.clone(),
            id: self.id.clone(),
            remote_id: self.remote_id.clone(),
            local: p.local,
            remote: p.remote,
            remote_tokens: self.remote_tokens,
            first_tokens: Vec::new(),
            hold: Some(token),
            confirm_with_data: false,
            tensors: p.tensors,
            started: self.started,
            deadline: self.deadline,
        }
    }

    /// The read as a whole under hold `token`, for its `Done` and its report.
    fn clone_for_report(&self, token: u64) -> ReadJob {
        ReadJob {
            sources: self.sources.clone(),
            id: self.id.clone(),
            remote_id: self.remote_id.clone(),
            local: self.local.clone(),
            remote: Vec::new(),
            remote_tokens: self.remote_tokens,
            first_tokens: Vec::new(),
            hold: Some(token),
            confirm_with_data: false,
            tensors: None,
            started: self.started,
            deadline: self.deadline,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(
        first: u32,
        blocks: &[BlockId],
        tensors: Option<(u32, u32)>,
        sealed: bool,
    ) -> Announcement {
        Announcement::Part {
            token: 4,
            first: vec![first],
            blocks: vec![blocks.to_vec()],
            tensors,
            sealed,
        }
    }

    fn read(
        local: &[BlockId],
        remote: &[BlockId],
        t: Option<std::ops::Range<u32>>,
    ) -> Option<PartRead> {
        Some(PartRead {
            local: vec![local.to_vec()],
            remote: vec![remote.to_vec()],
            tensors: t,
        })
    }

    #[test]
    fn parts_are_read_in_order_into_the_next_blocks_and_tensors() {
        let local = [vec![10, 11, 12, 13]];
        let mut p = Progress::new(&local, &[0], 8, None);
        let s = p.take(part(0, &[5, 6], None, false)).unwrap();
        assert_eq!(s.read, read(&[10, 11], &[5, 6], None));
        let s = p.take(part(2, &[7], Some((0, 3)), false)).unwrap();
        assert_eq!(s.read, read(&[12], &[7], Some(0..3)));
        // The next tensors of that part, and nothing else, until its last tensor.
        for bad in [
            part(3, &[8], None, false),
            part(2, &[], Some((4, 8)), false),
            part(2, &[], None, false),
            part(2, &[], Some((3, 9)), false),
            part(2, &[], Some((3, 8)), true),
        ] {
            let mut q = Progress::new(&local, &[0], 8, None);
            q.take(part(0, &[5, 6], None, false)).unwrap();
            q.take(part(2, &[7], Some((0, 3)), false)).unwrap();
            assert!(q.take(bad).is_err());
        }
        let s = p.take(part(2, &[], Some((3, 8)), false)).unwrap();
        assert_eq!(s.read, read(&[12], &[7], Some(3..8)));
        // A part that starts elsewhere, overflows, or names another hold.
        assert!(Progress::new(&local, &[0], 8, None)
            .take(part(1, &[1], None, false))
            .is_err());
        assert!(Progress::new(&local, &[0], 8, None)
            .take(part(0, &[1, 2, 3, 4, 5], None, false))
            .is_err());
        assert!(Progress::new(&local, &[0], 8, Some(3))
            .take(part(0, &[1], None, false))
            .is_err());
        // Sealed with a block to come: refused; with all of them: done.
        let mut q = Progress::new(&local, &[0], 8, None);
        q.take(part(0, &[1, 2], None, false)).unwrap();
        assert!(q.take(part(2, &[], None, true)).is_err());
        let s = p.take(part(3, &[9], None, true)).unwrap();
        assert!(s.sealed && s.read == read(&[13], &[9], None));
    }

    /// Skipped blocks are counted but not read: a part of skipped blocks only reads nothing,
    /// one that straddles the skip reads its blocks after it into the first local ones, and
    /// the seal wants the skipped and the local blocks.
    #[test]
    fn skipped_blocks_are_counted_and_never_read() {
        let local = [vec![20, 21]];
        let mut p = Progress::new(&local, &[3], 8, None);
        let s = p.take(part(0, &[5, 6], None, false)).unwrap();
        assert_eq!(s.read, None);
        let s = p.take(part(2, &[7, 8], Some((0, 4)), false)).unwrap();
        assert_eq!(s.read, read(&[20], &[8], Some(0..4)));
        let s = p.take(part(2, &[], Some((4, 8)), false)).unwrap();
        assert_eq!(s.read, read(&[20], &[8], Some(4..8)));
        let mut q = Progress::new(&local, &[3], 8, None);
        q.take(part(0, &[5, 6, 7, 8], None, false)).unwrap();
        // One block short of skip + local: refused at the seal; one too many: refused.
        assert!(q.take(part(4, &[], None, true)).is_err());
        assert!(Progress::new(&local, &[3], 8, None)
            .take(part(0, &[1, 2, 3, 4, 5, 6], None, false))
            .is_err());
        let s = p.take(part(4, &[9], None, true)).unwrap();
        assert!(s.sealed && s.read == read(&[21], &[9], None));
    }
}
