//! One worker's request state machine.
//!
//! Receive side: `reading` until the transfer driver reports done or failed (the driver enforces
//! the request deadline and reports expiry as a failure with `expired = true`).
//! Send side: `held` until the reading peer's done or abort notice arrives, or until the abort
//! timeout passes, checked in [`poll`](CompletionTracker::poll).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::{FailedRequest, FailureCause, Finished, Side, TransferReport};
use crate::error::{Error, Result};
use crate::ids::RequestId;

/// Notices kept for sends that are not held yet (the peer's notice overtook the scheduler).
const EARLY_NOTICE_CAP: usize = 4096;

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
}

/// Per-worker completion state. See the module docs for the state machine.
#[derive(Debug, Default)]
pub struct CompletionTracker {
    reading: HashMap<RequestId, Instant>,
    held: HashMap<RequestId, Held>,
    early: HashMap<RequestId, (SendNotice, Instant)>,
    early_order: VecDeque<RequestId>,
    out: Finished,
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
        self.out.failed.push(FailedRequest {
            id: id.clone(),
            side: Side::Recv,
            expired: cause == FailureCause::Expired,
            reason,
            cause,
        });
        true
    }

    /// Holds a send until the peer's notice arrives or `abort_timeout` passes. If the peer's
    /// notice already arrived, the send finishes at once.
    pub fn hold_send(
        &mut self,
        id: RequestId,
        now: Instant,
        abort_timeout: Duration,
    ) -> Result<()> {
        if self.held.contains_key(&id) {
            return Err(Error::invalid(format!(
                "request {id} is already held for sending"
            )));
        }
        if let Some((notice, _)) = self.early.remove(&id) {
            self.early_order.retain(|e| e != &id);
            self.finish_send(id, notice);
            return Ok(());
        }
        self.held.insert(
            id,
            Held {
                deadline: now + abort_timeout,
                timeout: abort_timeout,
            },
        );
        Ok(())
    }

    /// Applies a peer's notice about a send. A notice for a send not (yet) held is kept for a
    /// while, bounded, so a scheduler that holds late still sees it.
    pub fn handle_notice(
        &mut self,
        id: RequestId,
        notice: SendNotice,
        now: Instant,
        keep: Duration,
    ) {
        if self.held.remove(&id).is_some() {
            self.finish_send(id, notice);
            return;
        }
        if self.early.len() >= EARLY_NOTICE_CAP {
            if let Some(old) = self.early_order.pop_front() {
                self.early.remove(&old);
            }
        }
        if self
            .early
            .insert(id.clone(), (notice, now + keep))
            .is_none()
        {
            self.early_order.push_back(id);
        }
    }

    fn finish_send(&mut self, id: RequestId, notice: SendNotice) {
        match notice {
            SendNotice::Done => self.out.sending.push(id),
            SendNotice::Aborted(reason) => self.out.failed.push(FailedRequest {
                id,
                side: Side::Send,
                expired: false,
                reason: format!("the reading peer aborted: {reason}"),
                cause: FailureCause::Peer,
            }),
        }
    }

    /// Expires held sends whose abort timeout passed, and forgets stale early notices.
    pub fn poll(&mut self, now: Instant) {
        let expired: Vec<RequestId> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let h = self.held.remove(&id).expect("listed above");
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
        while let Some(front) = self.early_order.front() {
            match self.early.get(front) {
                Some((_, until)) if *until > now => break,
                _ => {
                    let id = self.early_order.pop_front().expect("front exists");
                    self.early.remove(&id);
                }
            }
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

    #[test]
    fn held_send_finishes_on_notice_or_expires() {
        let t0 = Instant::now();
        let keep = Duration::from_secs(60);
        let mut t = CompletionTracker::new();
        t.hold_send("x".into(), t0, Duration::from_secs(5)).unwrap();
        t.hold_send("y".into(), t0, Duration::from_secs(5)).unwrap();
        t.hold_send("z".into(), t0, Duration::from_secs(5)).unwrap();
        assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(5)));
        t.handle_notice("x".into(), SendNotice::Done, t0, keep);
        t.handle_notice(
            "z".into(),
            SendNotice::Aborted("decode OOM".into()),
            t0,
            keep,
        );
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
    fn early_notice_is_applied_when_held_and_is_bounded() {
        let t0 = Instant::now();
        let keep = Duration::from_secs(10);
        let mut t = CompletionTracker::new();
        t.handle_notice("e".into(), SendNotice::Done, t0, keep);
        t.hold_send("e".into(), t0, Duration::from_secs(1)).unwrap();
        assert_eq!(t.take_finished().sending, vec![RequestId::from("e")]);
        // Stale notices are forgotten.
        t.handle_notice("s".into(), SendNotice::Done, t0, keep);
        t.poll(t0 + keep);
        t.hold_send("s".into(), t0 + keep, Duration::from_secs(1))
            .unwrap();
        assert!(t.take_finished().is_empty());
        for i in 0..(EARLY_NOTICE_CAP + 10) {
            t.handle_notice(format!("n{i}").into(), SendNotice::Done, t0, keep);
        }
        assert!(t.early.len() <= EARLY_NOTICE_CAP);
        assert_eq!(t.early.len(), t.early_order.len());
    }
}
