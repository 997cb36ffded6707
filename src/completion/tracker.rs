//! One worker's request state machine.
//!
//! Receive side: `reading` until the transfer driver reports done or failed (the driver enforces
//! the request deadline and reports expiry as a failure with `expired = true`).
//! Send side: `held` until the reading peer's done or abort notice arrives, or until the abort
//! timeout passes, checked in [`poll`](CompletionTracker::poll).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{FailedRequest, FailureCause, Finished, Side, Totals, TransferReport};
use crate::error::{Error, Result};
use crate::grant::Grant;
use crate::ids::RequestId;

/// What a reading peer says about a send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendNotice {
    /// The peer has every byte.
    Done,
    /// The peer gave up; the reason is its own.
    Aborted(String),
}

#[derive(Debug)]
struct Held {
    deadline: Instant,
    timeout: Duration,
    grant: Arc<Grant>,
    /// The engine allowed to read and confirm: named at hold time, or the first engine that
    /// identified itself reading or confirming the request.
    reader: Option<String>,
}

impl Held {
    /// Admits `engine` as the request's reader (claiming it when none is set yet).
    fn admit(&mut self, id: &RequestId, engine: &str) -> std::result::Result<(), String> {
        match &self.reader {
            Some(r) if r != engine => Err(format!(
                "request {id} is held for another reader engine, not {engine:?}"
            )),
            Some(_) => Ok(()),
            None => {
                self.reader = Some(engine.to_string());
                Ok(())
            }
        }
    }
}

/// Per-worker completion state. See the module docs for the state machine.
#[derive(Debug, Default)]
pub struct CompletionTracker {
    reading: HashMap<RequestId, Instant>,
    held: HashMap<RequestId, Held>,
    out: Finished,
    totals: Totals,
}

impl CompletionTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
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

    /// Holds a send: `grant` is what its reader may read, `reader` (when given) the only
    /// engine allowed to read and confirm it. The send finishes when that reader's notice
    /// arrives, or fails when `abort_timeout` passes first.
    pub fn hold_send(
        &mut self,
        id: RequestId,
        grant: Arc<Grant>,
        reader: Option<String>,
        now: Instant,
        abort_timeout: Duration,
    ) -> Result<()> {
        if self.held.contains_key(&id) {
            return Err(Error::invalid(format!(
                "request {id} is already held for sending"
            )));
        }
        self.held.insert(
            id,
            Held {
                deadline: now + abort_timeout,
                timeout: abort_timeout,
                grant,
                reader,
            },
        );
        Ok(())
    }

    /// What the reader of request `id` may read. `engine` is the reading engine when the data
    /// connection identified it. Refuses a request that is not held, or is held for another
    /// engine, with the same reason (a reader learns nothing about other readers' requests).
    pub fn grant_for(
        &self,
        id: &RequestId,
        engine: Option<&str>,
    ) -> std::result::Result<Arc<Grant>, String> {
        match (self.held.get(id), engine) {
            (Some(h), Some(e)) if h.reader.as_deref().is_some_and(|r| r != e) => {}
            (Some(h), _) => return Ok(h.grant.clone()),
            (None, _) => {}
        }
        Err(format!(
            "request {id} is not held for this reader (the prefill holds a request with \
             hold_blocks, granted to one reader, before that reader reads)"
        ))
    }

    /// `engine` read request `id` (every check passed): a request held without a named reader
    /// becomes that engine's.
    pub fn claim(&mut self, id: &RequestId, engine: &str) {
        if let Some(h) = self.held.get_mut(id) {
            let _ = h.admit(id, engine);
        }
    }

    /// Applies notice `notice` about send `id` from engine `from`. Refuses (and stores
    /// nothing for) a request that is not held, or that is held for another engine.
    pub fn handle_notice(
        &mut self,
        id: &RequestId,
        from: &str,
        notice: SendNotice,
    ) -> std::result::Result<(), String> {
        let held = self
            .held
            .get_mut(id)
            .ok_or_else(|| format!("request {id} is not held by this engine"))?;
        held.admit(id, from)?;
        if let Some(h) = self.held.remove(id) {
            h.grant.end();
        }
        self.finish_send(id.clone(), notice);
        Ok(())
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

    /// Drops the hold of send `id` at the holder's own request (its request was aborted or
    /// preempted): the grant ends and nothing is reported for it. Returns whether it was held.
    pub fn release(&mut self, id: &RequestId) -> bool {
        match self.held.remove(id) {
            Some(h) => {
                h.grant.end();
                true
            }
            None => false,
        }
    }

    /// Expires held sends whose abort timeout passed.
    pub fn poll(&mut self, now: Instant) {
        let expired: Vec<RequestId> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let h = self.held.remove(&id).expect("listed above");
            h.grant.end();
            self.totals.sends_failed += 1;
            self.totals.sends_expired += 1;
            self.out.failed.push(FailedRequest {
                id,
                side: Side::Send,
                expired: true,
                reason: format!(
                    "no reader confirmed within the abort timeout of {:?}; the blocks may be freed",
                    h.timeout
                ),
                cause: FailureCause::Expired,
            });
        }
    }

    /// The earliest moment at which [`poll`](Self::poll) has work to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.held.values().map(|h| h.deadline).min()
    }

    /// Whether anything finished since the last [`take_finished`](Self::take_finished).
    pub fn has_finished(&self) -> bool {
        !self.out.is_empty()
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(id: &str) -> TransferReport {
        TransferReport {
            id: id.into(),
            peer: "127.0.0.1:1".into(),
            bytes: 1,
            segments: 1,
            blocks: 1,
            work_requests: 1,
            transport: "tcp",
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn recv_lifecycle_reports_each_id_once() {
        let t0 = Instant::now();
        let mut t = CompletionTracker::new();
        t.start_recv("a".into(), t0).unwrap();
        t.start_recv("b".into(), t0).unwrap();
        assert!(t.start_recv("a".into(), t0).is_err());
        assert!(t.recv_done(report("a")));
        assert!(!t.recv_done(report("a")));
        assert!(t.recv_failed(&"b".into(), FailureCause::Expired, "deadline".into()));
        assert!(!t.recv_failed(&"b".into(), FailureCause::Other, "late".into()));
        let f = t.take_finished();
        assert_eq!(f.receiving, vec![RequestId::from("a")]);
        assert_eq!(f.failed.len(), 1);
        assert!(f.failed[0].expired && f.failed[0].side == Side::Recv);
        assert!(t.take_finished().is_empty());
        // The id may be reused once finished.
        t.start_recv("a".into(), t0).unwrap();
    }

    fn grant() -> Arc<Grant> {
        let l = crate::layout::ModelShape::LLAMA3_8B.layout(crate::ids::RegionId(1), 4);
        Arc::new(Grant::new(Arc::new(l), &[0, 1]).unwrap())
    }

    fn hold(t: &mut CompletionTracker, id: &str, reader: Option<&str>, now: Instant) {
        t.hold_send(
            id.into(),
            grant(),
            reader.map(Into::into),
            now,
            Duration::from_secs(5),
        )
        .unwrap();
    }

    #[test]
    fn release_ends_a_hold_silently_and_totals_count_outcomes() {
        let t0 = Instant::now();
        let mut t = CompletionTracker::new();
        hold(&mut t, "r", None, t0);
        let g = t.grant_for(&"r".into(), None).unwrap();
        assert!(t.release(&"r".into()));
        assert!(g.is_ended(), "the grant ends with the hold");
        assert!(!t.release(&"r".into()));
        assert!(t.take_finished().is_empty(), "a release reports nothing");
        assert_eq!(t.totals(), Totals::default());
        // One of each outcome.
        hold(&mut t, "done", None, t0);
        hold(&mut t, "aborted", None, t0);
        hold(&mut t, "expired", None, t0);
        t.handle_notice(&"done".into(), "e", SendNotice::Done)
            .unwrap();
        t.handle_notice(&"aborted".into(), "e", SendNotice::Aborted("x".into()))
            .unwrap();
        t.poll(t0 + Duration::from_secs(6));
        for id in ["ok", "failed", "cancelled", "late"] {
            t.start_recv(id.into(), t0).unwrap();
        }
        t.recv_done(report("ok"));
        t.recv_failed(&"failed".into(), FailureCause::Connection, "x".into());
        t.recv_failed(&"cancelled".into(), FailureCause::Cancelled, "x".into());
        t.recv_failed(&"late".into(), FailureCause::Expired, "x".into());
        let want = Totals {
            reads_done: 1,
            reads_failed: 3,
            reads_expired: 1,
            reads_cancelled: 1,
            bytes_read: 1,
            sends_done: 1,
            sends_failed: 2,
            sends_expired: 1,
        };
        assert_eq!(t.totals(), want);
    }

    #[test]
    fn held_send_finishes_on_notice_or_expires() {
        let t0 = Instant::now();
        let mut t = CompletionTracker::new();
        hold(&mut t, "x", None, t0);
        hold(&mut t, "y", None, t0);
        hold(&mut t, "z", None, t0);
        assert!(t
            .hold_send("x".into(), grant(), None, t0, Duration::from_secs(1))
            .is_err());
        assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(5)));
        t.handle_notice(&"x".into(), "d", SendNotice::Done).unwrap();
        t.handle_notice(&"z".into(), "d", SendNotice::Aborted("decode OOM".into()))
            .unwrap();
        t.poll(t0 + Duration::from_secs(4));
        let f = t.take_finished();
        assert_eq!(f.sending, vec![RequestId::from("x")]);
        assert!(f.failed[0].reason.contains("decode OOM"));
        t.poll(t0 + Duration::from_secs(5));
        let f = t.take_finished();
        assert_eq!(f.failed.len(), 1);
        assert!(f.failed[0].expired && f.failed[0].id.as_str() == "y");
        assert_eq!(t.holding(), 0);
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn notices_for_requests_never_held_are_refused_not_stored() {
        let t0 = Instant::now();
        let mut t = CompletionTracker::new();
        let e = t
            .handle_notice(&"e".into(), "d", SendNotice::Done)
            .unwrap_err();
        assert!(e.contains("not held"), "{e}");
        hold(&mut t, "e", None, t0);
        assert!(
            t.take_finished().is_empty(),
            "the refused notice was not kept"
        );
        assert_eq!(t.holding(), 1);
        assert!(t.grant_for(&"nope".into(), None).is_err());
    }

    #[test]
    fn only_the_requests_reader_reads_and_confirms() {
        let t0 = Instant::now();
        let mut t = CompletionTracker::new();
        // Named at hold time.
        hold(&mut t, "a", Some("decode-1"), t0);
        assert!(t.grant_for(&"a".into(), Some("decode-2")).is_err());
        assert!(t
            .handle_notice(&"a".into(), "decode-2", SendNotice::Aborted("x".into()))
            .unwrap_err()
            .contains("another reader"));
        assert_eq!(t.holding(), 1, "the foreign abort changed nothing");
        assert!(t.grant_for(&"a".into(), Some("decode-1")).unwrap().has(1));
        t.handle_notice(&"a".into(), "decode-1", SendNotice::Done)
            .unwrap();
        // Claimed by the first engine whose read was served, or whose notice was applied.
        hold(&mut t, "b", None, t0);
        let g = t.grant_for(&"b".into(), Some("decode-3")).unwrap();
        assert!(
            t.grant_for(&"b".into(), None).is_ok(),
            "anonymous reads claim nothing"
        );
        assert!(
            t.grant_for(&"b".into(), Some("decode-4")).is_ok(),
            "not claimed yet"
        );
        t.claim(&"b".into(), "decode-3");
        let e = t.grant_for(&"b".into(), Some("decode-4")).unwrap_err();
        assert!(e.contains("not held for this reader"), "{e}");
        assert!(t
            .handle_notice(&"b".into(), "decode-4", SendNotice::Done)
            .is_err());
        assert!(!g.is_ended());
        t.handle_notice(&"b".into(), "decode-3", SendNotice::Done)
            .unwrap();
        assert!(g.is_ended(), "the grant ends with its hold");
        let f = t.take_finished();
        assert_eq!(f.sending, vec![RequestId::from("a"), RequestId::from("b")]);
        assert!(f.failed.is_empty());
    }
}
