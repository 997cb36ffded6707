//! One worker's request state machine.
//!
//! Receive side: `reading` until the transfer driver reports done or failed (the driver enforces
//! the request deadline and reports expiry as a failure with `expired = true`).
//! Send side: `held` until the reading peer's done or abort notice arrives, or until the abort
//! timeout passes, checked in [`poll`](CompletionTracker::poll). A hold whose reader engine is
//! gone (it had control sessions to this engine and lost them all) ends sooner: when that
//! reader's lease ends, unless it comes back first.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::follow::{Announcement, Follower};
use super::presence::Presence;
use super::{FailedRequest, FailureCause, Finished, Side, Totals, TransferReport};
use crate::error::{Error, Refusal, RefusalKind, Result};
use crate::grant::Grant;
use crate::ids::{BlockId, RequestId};
use crate::tp::{self, Reader, TpRank};

mod growing;
mod held;
mod pin;

pub use growing::HoldTerms;
use growing::PendingFollow;
use held::Held;
pub use pin::Release;

/// What a reading peer says about a send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendNotice {
    /// The peer has every byte.
    Done,
    /// The peer gave up; the reason is its own.
    Aborted(String),
}

/// Per-worker completion state. See the module docs for the state machine.
#[derive(Debug)]
pub struct CompletionTracker {
    reading: HashMap<RequestId, Instant>,
    held: HashMap<RequestId, Held>,
    out: Finished,
    totals: Totals,
    /// This worker's TP rank: which decode ranks read its held requests, and how many.
    tp: TpRank,
    /// Which reader engines have control sessions here; the lease of those that lost them.
    presence: Presence,
    /// Moves whenever a hold's end may have come earlier (a new hold, a lease begun), so that
    /// a waiter sleeping until the old next deadline is woken ([`deadline_epoch`]).
    ///
    /// [`deadline_epoch`]: CompletionTracker::deadline_epoch
    deadlines: u64,
    /// Followers of requests not held yet, by request, until their deadline.
    pending: HashMap<RequestId, Vec<PendingFollow>>,
}

impl Default for CompletionTracker {
    fn default() -> Self {
        CompletionTracker::with_tp(TpRank::SOLO)
    }
}

impl CompletionTracker {
    /// An empty tracker of a worker alone in its TP group.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty tracker of the worker at `tp`.
    pub fn with_tp(tp: TpRank) -> Self {
        CompletionTracker {
            reading: HashMap::new(),
            held: HashMap::new(),
            out: Finished::default(),
            totals: Totals::default(),
            tp,
            presence: Presence::new(super::DEFAULT_LEASE),
            deadlines: 0,
            pending: HashMap::new(),
        }
    }

    /// The same tracker with readers' holds on a lease of `lease` (30 s by default).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.presence = Presence::new(lease);
        self
    }

    /// A control session of reader engine `engine` began: if the engine was gone, its holds'
    /// leases stop and they wait for it again (up to their abort timeout).
    pub fn reader_connected(&mut self, engine: &str) {
        if !self.presence.opened(engine) {
            return;
        }
        let presence = &self.presence;
        for h in self.held.values_mut().filter(|h| h.involves(engine)) {
            h.lease_end = h.gone_readers_lease(presence);
        }
    }

    /// A control session of reader engine `engine` ended at `now`. When it was the engine's
    /// last, each hold it reads (named or admitted) ends at `now` plus the lease, unless the
    /// engine connects again before then. Returns how many holds that put on the lease (`None`
    /// when the engine has sessions left).
    pub fn reader_disconnected(&mut self, engine: &str, now: Instant) -> Option<usize> {
        let end = self.presence.closed(engine, now)?;
        self.deadlines += 1;
        let mut leased = 0;
        for h in self.held.values_mut().filter(|h| h.involves(engine)) {
            h.lease_end = Some(h.lease_end.map_or(end, |l| l.min(end)));
            leased += 1;
        }
        Some(leased)
    }

    /// A control session of reader engine `engine` ended in order: the reader closed it idle
    /// (`Bye`). Its holds keep waiting for it up to their abort timeout; none goes on a lease.
    /// Returns whether that was the engine's last session.
    pub fn reader_left(&mut self, engine: &str) -> bool {
        self.presence.left(engine)
    }

    /// Starts tracking a receive. Refuses an id that is already being received.
    pub fn start_recv(&mut self, id: RequestId, now: Instant) -> Result<()> {
        if self.reading.contains_key(&id) {
            return Err(Error::invalid(format!(
                "request {id} is already being received; wait for it to finish"
            )));
        }
        self.reading.insert(id, now);
        Ok(())
    }

    /// Marks a receive done. Ignored (returns false) when the id is not being received.
    pub fn recv_done(&mut self, report: TransferReport) -> bool {
        if self.reading.remove(&report.id).is_none() {
            return false;
        }
        self.totals.reads_done += 1;
        self.totals.bytes_read += report.bytes;
        self.out.receiving.push(report.id.clone());
        self.out.reports.push(report);
        true
    }

    /// Marks a receive failed (expired when `cause` is [`FailureCause::Expired`]). Ignored
    /// (returns false) when not being received.
    pub fn recv_failed(&mut self, id: &RequestId, cause: FailureCause, reason: String) -> bool {
        if self.reading.remove(id).is_none() {
            return false;
        }
        self.totals.reads_failed += 1;
        self.totals.reads_expired += u64::from(cause == FailureCause::Expired);
        self.totals.reads_cancelled += u64::from(cause == FailureCause::Cancelled);
        self.out.failed.push(FailedRequest {
            id: id.clone(),
            side: Side::Recv,
            expired: cause == FailureCause::Expired,
            reason,
            cause,
        });
        true
    }

    /// Holds a send: `grant` is what its readers may read, `reader` (when given) the only
    /// engine allowed to read and confirm it. Otherwise the decode ranks that read this rank
    /// (one, or several when the decode has the larger TP size: `tp::readers`) are its
    /// readers, admitted as they read or confirm. The send finishes when every reader
    /// confirmed, fails when one aborts, and fails when `abort_timeout` passes first. `token`
    /// tells this hold from other holds of the same id (see [`held`](Self::held)).
    pub fn hold_send(
        &mut self,
        id: RequestId,
        grant: Arc<Grant>,
        reader: Option<String>,
        now: Instant,
        abort_timeout: Duration,
        token: u64,
    ) -> Result<()> {
        let order = grant.blocks().to_vec();
        let terms = HoldTerms {
            reader,
            abort_timeout,
            token,
            sealed: true,
        };
        self.open_hold(id, grant, order, terms, now)
    }

    /// What the reader of request `id` may read. `reader` is the reading engine when the data
    /// connection identified it. Refuses a request that is not held, or is held for other
    /// readers, with the same reason (a reader learns nothing about other readers' requests).
    pub fn grant_for(
        &mut self,
        id: &RequestId,
        reader: Option<&Reader>,
    ) -> std::result::Result<Arc<Grant>, Refusal> {
        let own = self.tp;
        let kind = match self.held.get_mut(id) {
            Some(h) => match reader {
                None => return Ok(h.grant.clone()),
                Some(r) if h.admit(own, id, r, false).is_ok() => return Ok(h.grant.clone()),
                Some(_) => RefusalKind::OtherReader,
            },
            None => RefusalKind::NotHeld,
        };
        Err(Refusal::new(
            kind,
            format!(
                "request {id} is not held for this reader (the prefill holds a request with \
                 hold_blocks, granted to its readers, before they read)"
            ),
        ))
    }

    /// `reader` read request `id` (every check passed): it becomes one of the request's
    /// readers.
    pub fn claim(&mut self, id: &RequestId, reader: &Reader) {
        let _ = self.claim_checked(id, reader, None);
    }

    /// Like [`claim`](Self::claim), saying why not when `reader` may not read request `id`
    /// (not held, or held for other readers): a reader announcing a read (RDMA reads reach no
    /// CPU here) becomes one of its readers, so the hold lives on its lease from then on.
    pub fn claim_checked(
        &mut self,
        id: &RequestId,
        reader: &Reader,
        hold: Option<u64>,
    ) -> std::result::Result<(), Refusal> {
        let own = self.tp;
        let h = Self::held(&mut self.held, id, hold)?;
        h.admit(own, id, reader, true)?;
        if h.lease_end.is_none() {
            h.lease_end = h.gone_readers_lease(&self.presence);
            if h.lease_end.is_some() {
                self.deadlines += 1;
            }
        }
        Ok(())
    }

    /// The hold of request `id`, when it is the one `hold` names (any hold of that id when
    /// `hold` is `None`): a read of an earlier hold of a reused request id can neither confirm
    /// nor abort a later one.
    fn held<'a>(
        held: &'a mut HashMap<RequestId, Held>,
        id: &RequestId,
        hold: Option<u64>,
    ) -> std::result::Result<&'a mut Held, Refusal> {
        match held.get_mut(id) {
            Some(h) if hold.is_none_or(|t| t == h.token) => Ok(h),
            Some(_) => Err(Refusal::new(
                RefusalKind::NotHeld,
                format!(
                    "request {id} is held again under another hold than the one read (hold {}): \
                     that hold ended",
                    hold.unwrap_or_default()
                ),
            )),
            None => Err(Refusal::new(
                RefusalKind::NotHeld,
                format!("request {id} is not held by this engine"),
            )),
        }
    }

    /// Applies notice `notice` about send `id` from `reader` (`hold`: the hold it names). Refuses (and stores nothing for)
    /// a request that is not held, or that is held for other readers; an abort of a request
    /// the reader follows before it is held fails that hold once it is opened. A done notice finishes
    /// the send once every reader confirmed; an abort fails it at once. Returns when the hold
    /// began.
    pub fn handle_notice(
        &mut self,
        id: &RequestId,
        reader: &Reader,
        notice: SendNotice,
        hold: Option<u64>,
    ) -> std::result::Result<Instant, Refusal> {
        let own = self.tp;
        let held = match Self::held(&mut self.held, id, hold) {
            Ok(held) => held,
            Err(refused) => {
                // A reader that follows a request not held yet may abort it first.
                if let SendNotice::Aborted(why) = &notice {
                    if self.abort_pending(id, reader, hold, why) {
                        return Ok(Instant::now());
                    }
                }
                return Err(refused);
            }
        };
        if held.released {
            return Err(self.notice_on_released(id, reader));
        }
        if notice == SendNotice::Done && !held.sealed {
            return Err(Refusal::new(
                RefusalKind::NotHeld,
                format!(
                    "request {id} is still being held part by part (not sealed): a read \
                     confirms only once the prefill sealed its hold"
                ),
            ));
        }
        let slot = held.admit(own, id, reader, true)?.expect("admitted");
        let expected = held.expected(own);
        let since = held.deadline - held.timeout;
        let notice = match notice {
            SendNotice::Done => {
                held.readers[slot].done = true;
                if held.confirmed() < expected {
                    return Ok(since);
                }
                SendNotice::Done
            }
            SendNotice::Aborted(why) if expected > 1 => SendNotice::Aborted(format!(
                "{why} (reader {:?}, decode {}; {} of {expected} readers had confirmed)",
                reader.engine,
                reader.tp,
                held.confirmed()
            )),
            aborted => aborted,
        };
        if let Some(h) = self.held.remove(id) {
            h.end_grants();
            if let SendNotice::Aborted(why) = &notice {
                h.tell_ended(id, &format!("a reader aborted the request: {why}"));
            }
        }
        self.finish_send(id.clone(), notice);
        Ok(since)
    }

    fn finish_send(&mut self, id: RequestId, notice: SendNotice) {
        match notice {
            SendNotice::Done => {
                self.totals.sends_done += 1;
                self.out.sending.push(id);
            }
            SendNotice::Aborted(reason) => {
                self.totals.sends_failed += 1;
                self.out.failed.push(FailedRequest {
                    id,
                    side: Side::Send,
                    expired: false,
                    reason: format!("the reading peer aborted: {reason}"),
                    cause: FailureCause::Peer,
                });
            }
        }
    }

    /// Expires held sends whose abort timeout, or whose gone reader's lease, passed.
    pub fn poll(&mut self, now: Instant) {
        let expired: Vec<RequestId> = self
            .held
            .iter()
            .filter(|(_, h)| h.ends() <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let mut h = self.held.remove(&id).expect("listed above");
            if h.released {
                // Its pin lapsed: it ends as released, with nothing to report.
                continue;
            }
            h.end_earlier();
            if self.counted_by_receipts(&id, &mut h) {
                continue;
            }
            let reason = self.expiry_reason(&h, now);
            h.tell_ended(&id, &format!("the prefill's hold expired: {reason}"));
            tracing::warn!(%id, %reason, "held request expired");
            self.totals.sends_failed += 1;
            self.totals.sends_expired += 1;
            self.out.failed.push(FailedRequest {
                id,
                side: Side::Send,
                expired: true,
                reason,
                cause: FailureCause::Expired,
            });
        }
        self.expire_follows(now);
        self.presence.prune(now);
    }

    /// Ends hold `h` of request `id` at its deadline, counting the receipts same-host readers
    /// signed for it (`crate::holds`: a reader that copied the blocks itself while the hold was
    /// live, whose `Done` may have been lost with its control connection) as their `Done`s.
    /// Returns whether that finished the send (reported as sent).
    fn counted_by_receipts(&mut self, id: &RequestId, h: &mut Held) -> bool {
        let Some(ending) = h.grant.end_with_receipts() else {
            return false;
        };
        for reader in &ending.receipts {
            if let Ok(Some(slot)) = h.admit(self.tp, id, reader, true) {
                h.readers[slot].done = true;
            }
        }
        let counted = !ending.receipts.is_empty() && h.confirmed() >= h.expected(self.tp);
        ending.settle(counted);
        if counted {
            tracing::info!(%id, "held request confirmed at its deadline by its readers' receipts (their Done did not arrive)");
            self.finish_send(id.clone(), SendNotice::Done);
        }
        counted
    }

    /// Why hold `h` expired at `now` (counting lease expiries).
    fn expiry_reason(&mut self, h: &Held, now: Instant) -> String {
        let (confirmed, expected) = (h.confirmed(), h.expected(self.tp));
        let who = if confirmed == 0 {
            "no reader confirmed".to_string()
        } else {
            format!("only {confirmed} of {expected} readers confirmed")
        };
        if h.lease_end.is_some_and(|l| l <= now && l < h.deadline) {
            self.totals.sends_lease_expired += 1;
            let gone: Vec<&str> = h
                .named
                .iter()
                .chain(h.readers.iter().map(|r| &r.engine))
                .filter(|e| self.presence.lease_end(e).is_some_and(|l| l <= now))
                .map(String::as_str)
                .collect();
            return format!(
                "{who}: reader {gone:?} lost its control connection and did not come back \
                 within the lease of {:?}; the blocks may be freed",
                self.presence.lease()
            );
        }
        format!(
            "{who} within the abort timeout of {:?}; the blocks may be freed",
            h.timeout
        )
    }

    /// The earliest moment at which [`poll`](Self::poll) has work to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let follows = self.pending.values().flatten().map(|p| p.until);
        self.held.values().map(Held::ends).chain(follows).min()
    }

    /// Whether anything finished since the last [`take_finished`](Self::take_finished).
    pub fn has_finished(&self) -> bool {
        !self.out.is_empty()
    }

    /// How many requests finished since the last [`take_finished`](Self::take_finished).
    pub fn finished_count(&self) -> usize {
        self.out.sending.len() + self.out.receiving.len() + self.out.failed.len()
    }

    /// A number that changes whenever a hold's end may have come earlier (a new hold, a
    /// reader's lease begun): a waiter that slept until [`next_deadline`] must look again.
    ///
    /// [`next_deadline`]: CompletionTracker::next_deadline
    pub fn deadline_epoch(&self) -> u64 {
        self.deadlines
    }

    /// Everything that finished since the last call; each id is returned once.
    pub fn take_finished(&mut self) -> Finished {
        std::mem::take(&mut self.out)
    }

    /// Requests finished since the tracker started, by side and outcome.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// Requests being received.
    pub fn receiving(&self) -> usize {
        self.reading.len()
    }

    /// Sends being held.
    pub fn holding(&self) -> usize {
        self.held.len()
    }

    /// Whether request `id` is held.
    pub fn is_holding(&self, id: &RequestId) -> bool {
        self.held.contains_key(id)
    }
}

#[cfg(test)]
mod tests;
