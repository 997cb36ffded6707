//! The completion ledger of one queue pair, without verbs or clocks (time is passed in).
//!
//! Work requests are posted in chains; only the last of a chain is signaled. A work request id
//! carries (queue pair, sequence) ([`wr_id`]). A send queue completes in order, so the signaled
//! completion of a chain retires every earlier chain of its queue pair. Credits count free send
//! slots: a chain is posted only when the queue pair has credits for all of it.
//!
//! An error completion fails its chain and every chain before it, records the error (the
//! connection is then moved to the error state by its owner) and fails every later chain as its
//! flush completion arrives. Chains still outstanding once the queue pair is known to be in the
//! error state and a grace period has passed are retired by [`QpLedger::tick`]: a queue pair in
//! the error state no longer writes. Until then, and on a queue pair that could not be moved to
//! the error state, chains stay outstanding: a chain is never reported while it may still write.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::error::RdmaError;

/// Sequence bits of a work request id (the queue pair index takes the rest).
pub(crate) const SEQ_BITS: u32 = 48;

/// The work request id of sequence `seq` on queue pair `qp`.
pub(crate) fn wr_id(qp: usize, seq: u64) -> u64 {
    ((qp as u64) << SEQ_BITS) | (seq & ((1 << SEQ_BITS) - 1))
}

/// The queue pair and sequence of a work request id.
pub(crate) fn split_wr_id(id: u64) -> (usize, u64) {
    ((id >> SEQ_BITS) as usize, id & ((1 << SEQ_BITS) - 1))
}

/// Why a chain cannot be posted now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not enough free send slots: wait for completions.
    NoCredits,
    /// The queue pair failed; the reason.
    Failed(RdmaError),
}

/// A chain that was posted (or may have been partly posted) and not yet retired.
#[derive(Debug)]
struct Posted<T> {
    last: u64,
    wrs: u32,
    token: T,
}

/// A chain retired: its token and, when it failed, why.
pub(crate) type Retired<T> = (T, Option<RdmaError>);

/// The ledger of one queue pair. `T` identifies a chain's request to its owner.
#[derive(Debug)]
pub(crate) struct QpLedger<T> {
    credits: u32,
    next_seq: u64,
    fifo: VecDeque<Posted<T>>,
    error: Option<(RdmaError, Instant)>,
    in_error_state: bool,
}

impl<T> QpLedger<T> {
    /// A ledger with `credits` send slots.
    pub(crate) fn new(credits: u32) -> QpLedger<T> {
        QpLedger {
            credits,
            next_seq: 0,
            fifo: VecDeque::new(),
            error: None,
            in_error_state: false,
        }
    }

    /// Whether a chain of `n` work requests may be posted now; on success, the sequence of its
    /// first work request. The caller posts it and then calls [`record`](Self::record),
    /// whatever the post returned.
    pub(crate) fn reserve(&self, n: u32) -> Result<u64, Refusal> {
        if let Some((why, _)) = &self.error {
            return Err(Refusal::Failed(why.clone()));
        }
        if self.credits < n {
            return Err(Refusal::NoCredits);
        }
        Ok(self.next_seq)
    }

    /// Accounts a chain of `n` work requests starting at the reserved sequence, even when the
    /// post failed: the verbs call may have posted a prefix of it, and those may still write.
    pub(crate) fn record(&mut self, n: u32, token: T) {
        let first = self.next_seq;
        self.next_seq += u64::from(n);
        self.credits -= n;
        self.fifo.push_back(Posted {
            last: first + u64::from(n) - 1,
            wrs: n,
            token,
        });
    }

    /// A completion for sequence `seq`: `Ok` or the named error status. Returns the chains it
    /// retires and, when it is this queue pair's first error, the failure to break the
    /// connection with.
    pub(crate) fn complete(
        &mut self,
        seq: u64,
        status: Result<(), RdmaError>,
        now: Instant,
    ) -> (Vec<Retired<T>>, Option<RdmaError>) {
        let mut newly_failed = None;
        let failed = status.is_err();
        if let Err(why) = status {
            if self.error.is_none() {
                self.error = Some((why.clone(), now));
                newly_failed = Some(why);
            }
        }
        let failure = self.error.as_ref().map(|e| e.0.clone());
        let mut retired = Vec::new();
        while let Some(front) = self.fifo.front() {
            let first = front.last + 1 - u64::from(front.wrs);
            // A success retires every chain up to its own; an error also retires the chain it
            // belongs to (whose signaled last request will never complete successfully).
            if front.last <= seq || (failed && first <= seq) {
                let p = self.fifo.pop_front().expect("front exists");
                self.credits += p.wrs;
                retired.push((p.token, failure.clone()));
            } else {
                break;
            }
        }
        (retired, newly_failed)
    }

    /// Records a failure of the queue pair not reported by a completion (the connection was
    /// broken from outside: a deadline, a cancellation, a failed post on another queue pair).
    pub(crate) fn fail(&mut self, why: &RdmaError, now: Instant) {
        if self.error.is_none() {
            self.error = Some((why.clone(), now));
        }
    }

    /// The queue pair was moved to the error state: the device stops executing its work
    /// requests and flushes them.
    pub(crate) fn set_error_state(&mut self) {
        self.in_error_state = true;
    }

    /// Whether the queue pair is known to be in the error state.
    pub(crate) fn in_error_state(&self) -> bool {
        self.in_error_state
    }

    /// The recorded failure, if any.
    #[cfg(test)]
    pub(crate) fn failure(&self) -> Option<&RdmaError> {
        self.error.as_ref().map(|e| &e.0)
    }

    /// Retires the chains still outstanding `grace` after a failure, once the queue pair is
    /// in the error state (it no longer writes). Chains of a queue pair that could not be
    /// moved to the error state are never retired here.
    pub(crate) fn tick(&mut self, now: Instant, grace: Duration) -> Vec<Retired<T>> {
        let Some((why, at)) = &self.error else {
            return Vec::new();
        };
        if !self.in_error_state || now.saturating_duration_since(*at) < grace {
            return Vec::new();
        }
        let why = why.clone();
        let mut retired = Vec::new();
        while let Some(p) = self.fifo.pop_front() {
            self.credits += p.wrs;
            retired.push((p.token, Some(why.clone())));
        }
        retired
    }

    /// The queue pair was destroyed (the device no longer executes its work requests): retires
    /// every chain still outstanding, failed with the recorded failure.
    pub(crate) fn retire_all(&mut self, why: &RdmaError) -> Vec<Retired<T>> {
        self.in_error_state = true;
        let why = self.error.as_ref().map_or(why, |e| &e.0).clone();
        let mut retired = Vec::with_capacity(self.fifo.len());
        while let Some(p) = self.fifo.pop_front() {
            self.credits += p.wrs;
            retired.push((p.token, Some(why.clone())));
        }
        retired
    }

    /// Chains posted and not yet retired.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> usize {
        self.fifo.len()
    }

    /// Free send slots.
    #[cfg(test)]
    pub(crate) fn credits(&self) -> u32 {
        self.credits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RdmaErrorKind;

    fn wc(status: u32, m: &str) -> RdmaError {
        RdmaError::new(RdmaErrorKind::WorkCompletion { status }, m)
    }

    fn broken(m: &str) -> RdmaError {
        RdmaError::new(RdmaErrorKind::ConnectionBroken, m)
    }

    fn posted(l: &mut QpLedger<&'static str>, n: u32, token: &'static str) -> u64 {
        let first = l.reserve(n).unwrap();
        l.record(n, token);
        first
    }

    #[test]
    fn wr_ids_round_trip() {
        for (qp, seq) in [(0, 0), (3, 17), (63, (1 << SEQ_BITS) - 1)] {
            assert_eq!(split_wr_id(wr_id(qp, seq)), (qp, seq));
        }
    }

    #[test]
    fn a_signaled_completion_retires_every_earlier_chain_and_returns_credits() {
        let now = Instant::now();
        let mut l = QpLedger::new(64);
        assert_eq!(posted(&mut l, 32, "a"), 0);
        assert_eq!(posted(&mut l, 16, "b"), 32);
        assert_eq!(l.reserve(32), Err(Refusal::NoCredits));
        // Only the last of "b" is signaled; its completion retires "a" too.
        let (r, failed) = l.complete(47, Ok(()), now);
        assert_eq!(r, vec![("a", None), ("b", None)]);
        assert!(failed.is_none());
        assert_eq!((l.credits(), l.outstanding()), (64, 0));
    }

    #[test]
    fn an_error_fails_its_chain_and_later_flushes_fail_the_rest() {
        let now = Instant::now();
        let mut l = QpLedger::new(64);
        posted(&mut l, 4, "a");
        posted(&mut l, 4, "b");
        posted(&mut l, 4, "c");
        // An unsignaled request of "b" (seq 5) fails: "a" completed before it, "b" fails.
        let (r, failed) = l.complete(5, Err(wc(10, "IBV_WC_REM_ACCESS_ERR")), now);
        assert_eq!(
            r,
            vec![
                ("a", Some(wc(10, "IBV_WC_REM_ACCESS_ERR"))),
                ("b", Some(wc(10, "IBV_WC_REM_ACCESS_ERR")))
            ]
        );
        assert_eq!(failed, Some(wc(10, "IBV_WC_REM_ACCESS_ERR")));
        assert_eq!(
            l.reserve(1),
            Err(Refusal::Failed(wc(10, "IBV_WC_REM_ACCESS_ERR")))
        );
        // The flush of "c" names the first error, and is not a new failure.
        let (r, failed) = l.complete(11, Err(wc(5, "IBV_WC_WR_FLUSH_ERR")), now);
        assert_eq!(r, vec![("c", Some(wc(10, "IBV_WC_REM_ACCESS_ERR")))]);
        assert!(failed.is_none());
    }

    #[test]
    fn chains_are_retired_by_the_tick_only_in_the_error_state_after_the_grace() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(1);
        let mut l = QpLedger::new(64);
        posted(&mut l, 8, "a");
        l.fail(&broken("request deadline"), t0);
        // Not yet in the error state: the device may still write, nothing is retired.
        assert!(l.tick(t0 + grace * 10, grace).is_empty());
        l.set_error_state();
        assert!(l.tick(t0 + grace / 2, grace).is_empty());
        assert_eq!(
            l.tick(t0 + grace, grace),
            vec![("a", Some(broken("request deadline")))]
        );
        assert_eq!(l.outstanding(), 0);
    }

    #[test]
    fn a_destroyed_queue_pair_retires_everything_at_once() {
        let mut l = QpLedger::new(16);
        posted(&mut l, 8, "a");
        posted(&mut l, 8, "b");
        l.fail(&broken("request deadline"), Instant::now());
        let r = l.retire_all(&broken("destroyed"));
        assert_eq!(
            r,
            vec![
                ("a", Some(broken("request deadline"))),
                ("b", Some(broken("request deadline")))
            ]
        );
        assert_eq!((l.outstanding(), l.credits()), (0, 16));
    }

    #[test]
    fn a_failed_post_is_still_accounted() {
        let mut l = QpLedger::new(8);
        posted(&mut l, 8, "a");
        // The post of "a" failed after a prefix went out: the chain stays until retired.
        let why = RdmaError::new(RdmaErrorKind::Post, "posting failed");
        l.fail(&why, Instant::now());
        assert_eq!(l.outstanding(), 1);
        assert_eq!(l.failure(), Some(&why));
    }
}
