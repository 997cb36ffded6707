//! Combines the per-rank finished sets of a tensor-parallel group for the scheduler.
//!
//! A request is released once every rank reported it: as finished when all ranks succeeded,
//! as failed when any rank failed (the reasons of every failed rank are kept). A rank that never
//! reports fails the request after the rank timeout, so nothing waits forever. Duplicate
//! reports, before or after release, are ignored.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::{FailedRequest, FailureCause, Finished, Side};
use crate::error::{Error, Result};
use crate::ids::RequestId;

/// Released ids remembered to drop late duplicates.
const RELEASED_MEMORY: usize = 65_536;

/// One rank's failure of a request.
#[derive(Debug)]
struct RankFailure {
    rank: usize,
    expired: bool,
    cause: FailureCause,
    reason: String,
}

#[derive(Debug)]
struct Partial {
    reported: Vec<bool>,
    count: usize,
    failures: Vec<RankFailure>,
    first_seen: Instant,
}

/// Aggregates [`Finished`] reports of `world_size` ranks.
#[derive(Debug)]
pub struct TpAggregator {
    world_size: usize,
    rank_timeout: Duration,
    pending: HashMap<(Side, RequestId), Partial>,
    released: HashSet<(Side, RequestId)>,
    released_order: VecDeque<(Side, RequestId)>,
    duplicates: u64,
    out: Finished,
}

impl TpAggregator {
    /// An aggregator for `world_size` ranks; a request some ranks reported is failed when the
    /// others have not reported within `rank_timeout` of the first report.
    pub fn new(world_size: usize, rank_timeout: Duration) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::invalid("world_size must be at least 1"));
        }
        Ok(TpAggregator {
            world_size,
            rank_timeout,
            pending: HashMap::new(),
            released: HashSet::new(),
            released_order: VecDeque::new(),
            duplicates: 0,
            out: Finished::default(),
        })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Duplicate reports ignored so far.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Requests some but not all ranks have reported.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes one rank's report.
    pub fn handle_report(&mut self, rank: usize, report: &Finished, now: Instant) -> Result<()> {
        if rank >= self.world_size {
            return Err(Error::invalid(format!(
                "rank {rank} reported, but the world size is {}",
                self.world_size
            )));
        }
        for id in &report.sending {
            self.record(rank, Side::Send, id, None, now);
        }
        for id in &report.receiving {
            self.record(rank, Side::Recv, id, None, now);
        }
        for f in &report.failed {
            self.record(
                rank,
                f.side,
                &f.id,
                Some((f.expired, f.cause, f.reason.as_str())),
                now,
            );
        }
        Ok(())
    }

    fn record(
        &mut self,
        rank: usize,
        side: Side,
        id: &RequestId,
        failure: Option<(bool, FailureCause, &str)>,
        now: Instant,
    ) {
        let key = (side, id.clone());
        if self.released.contains(&key) {
            self.duplicates += 1;
            return;
        }
        let world = self.world_size;
        let p = self.pending.entry(key.clone()).or_insert_with(|| Partial {
            reported: vec![false; world],
            count: 0,
            failures: Vec::new(),
            first_seen: now,
        });
        if p.reported[rank] {
            self.duplicates += 1;
            return;
        }
        p.reported[rank] = true;
        p.count += 1;
        if let Some((expired, cause, reason)) = failure {
            p.failures.push(RankFailure {
                rank,
                expired,
                cause,
                reason: reason.to_string(),
            });
        }
        if p.count == world {
            let p = self.pending.remove(&key).expect("present");
            self.release(key, p.failures);
        }
    }

    fn release(&mut self, key: (Side, RequestId), failures: Vec<RankFailure>) {
        let reasons: Vec<String> = failures
            .iter()
            .map(|f| format!("rank {}: {}", f.rank, f.reason))
            .collect();
        let expired = failures.iter().all(|f| f.expired);
        // The cause of the lowest failed rank (ranks report in any order).
        let cause = failures
            .iter()
            .min_by_key(|f| f.rank)
            .map_or(FailureCause::Other, |f| f.cause);
        self.emit(key, reasons, expired, cause);
    }

    fn emit(
        &mut self,
        key: (Side, RequestId),
        reasons: Vec<String>,
        expired: bool,
        cause: FailureCause,
    ) {
        let (side, id) = key.clone();
        if reasons.is_empty() {
            match side {
                Side::Send => self.out.sending.push(id),
                Side::Recv => self.out.receiving.push(id),
            }
        } else {
            self.out.failed.push(FailedRequest {
                id,
                side,
                expired,
                reason: reasons.join("; "),
                cause,
            });
        }
        if self.released_order.len() == RELEASED_MEMORY {
            if let Some(old) = self.released_order.pop_front() {
                self.released.remove(&old);
            }
        }
        self.released.insert(key.clone());
        self.released_order.push_back(key);
    }

    /// Fails requests whose missing ranks ran past the rank timeout.
    pub fn poll(&mut self, now: Instant) {
        let late: Vec<(Side, RequestId)> = self
            .pending
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.first_seen) >= self.rank_timeout)
            .map(|(k, _)| k.clone())
            .collect();
        for key in late {
            let p = self.pending.remove(&key).expect("listed above");
            let missing: Vec<String> = p
                .reported
                .iter()
                .enumerate()
                .filter(|(_, r)| !**r)
                .map(|(i, _)| i.to_string())
                .collect();
            let mut reasons: Vec<String> = p
                .failures
                .iter()
                .map(|f| format!("rank {}: {}", f.rank, f.reason))
                .collect();
            let cause = p
                .failures
                .iter()
                .min_by_key(|f| f.rank)
                .map_or(FailureCause::Expired, |f| f.cause);
            reasons.push(format!(
                "ranks [{}] never reported within {:?}",
                missing.join(", "),
                self.rank_timeout
            ));
            self.emit(key, reasons, true, cause);
        }
    }

    /// The earliest moment at which [`poll`](Self::poll) may fail a request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending
            .values()
            .map(|p| p.first_seen + self.rank_timeout)
            .min()
    }

    /// Requests released since the last call (finished on every rank, or failed).
    pub fn take_finished(&mut self) -> Finished {
        std::mem::take(&mut self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fin(send: &[&str], recv: &[&str], failed: &[(&str, Side)]) -> Finished {
        Finished {
            sending: send.iter().map(|s| RequestId::from(*s)).collect(),
            receiving: recv.iter().map(|s| RequestId::from(*s)).collect(),
            failed: failed
                .iter()
                .map(|(s, side)| FailedRequest {
                    id: (*s).into(),
                    side: *side,
                    expired: false,
                    reason: "boom".into(),
                    cause: FailureCause::Peer,
                })
                .collect(),
            reports: vec![],
        }
    }

    #[test]
    fn eight_ranks_out_of_order_with_duplicates() {
        let t0 = Instant::now();
        let mut a = TpAggregator::new(8, Duration::from_secs(30)).unwrap();
        let order = [5, 2, 7, 0, 3, 3, 1, 6, 2, 4];
        for (i, &rank) in order.iter().enumerate() {
            assert!(a.take_finished().is_empty(), "released early at report {i}");
            a.handle_report(rank, &fin(&["p"], &["d"], &[]), t0)
                .unwrap();
        }
        let f = a.take_finished();
        assert_eq!(f.sending, vec![RequestId::from("p")]);
        assert_eq!(f.receiving, vec![RequestId::from("d")]);
        assert_eq!(a.duplicates(), 4);
        // Late duplicates after release are dropped, not restarted.
        a.handle_report(1, &fin(&["p"], &[], &[]), t0).unwrap();
        assert_eq!(a.pending(), 0);
        assert!(a.take_finished().is_empty());
    }

    #[test]
    fn a_failure_on_one_rank_fails_the_request() {
        let t0 = Instant::now();
        let mut a = TpAggregator::new(8, Duration::from_secs(30)).unwrap();
        for rank in 0..8 {
            let r = if rank == 6 {
                fin(&[], &[], &[("q", Side::Recv)])
            } else {
                fin(&[], &["q"], &[])
            };
            a.handle_report(rank, &r, t0).unwrap();
        }
        let f = a.take_finished();
        assert!(f.receiving.is_empty());
        assert_eq!(f.failed.len(), 1);
        assert_eq!(f.failed[0].reason, "rank 6: boom");
    }

    #[test]
    fn missing_ranks_fail_after_the_timeout() {
        let t0 = Instant::now();
        let mut a = TpAggregator::new(4, Duration::from_secs(10)).unwrap();
        a.handle_report(0, &fin(&[], &["r"], &[]), t0).unwrap();
        a.handle_report(2, &fin(&[], &["r"], &[]), t0).unwrap();
        assert_eq!(a.next_deadline(), Some(t0 + Duration::from_secs(10)));
        a.poll(t0 + Duration::from_secs(9));
        assert!(a.take_finished().is_empty());
        a.poll(t0 + Duration::from_secs(10));
        let f = a.take_finished();
        assert_eq!(f.failed[0].cause, FailureCause::Expired);
        assert!(
            f.failed[0].reason.contains("ranks [1, 3] never reported"),
            "{:?}",
            f
        );
        assert!(a.handle_report(4, &Finished::default(), t0).is_err());
        assert!(TpAggregator::new(0, Duration::ZERO).is_err());
    }

    #[test]
    fn the_cause_is_the_lowest_failed_ranks_whatever_the_report_order() {
        use crate::error::RdmaErrorKind;
        let now = Instant::now();
        let mut a = TpAggregator::new(3, Duration::from_secs(5)).unwrap();
        let failed = |cause| Finished {
            failed: vec![FailedRequest {
                id: "r".into(),
                side: Side::Recv,
                expired: false,
                reason: format!("{cause:?}"),
                cause,
            }],
            ..Finished::default()
        };
        let wc = FailureCause::Rdma(RdmaErrorKind::WorkCompletion { status: 12 });
        a.handle_report(2, &failed(FailureCause::Connection), now)
            .unwrap();
        a.handle_report(1, &failed(wc), now).unwrap();
        a.handle_report(0, &fin(&[], &["r"], &[]), now).unwrap();
        let out = a.take_finished();
        assert_eq!(out.failed.len(), 1, "{out:?}");
        assert_eq!(out.failed[0].cause, wc);
        assert!(
            out.failed[0].reason.starts_with("rank 2:") || out.failed[0].reason.contains("rank 1:")
        );
    }

    #[test]
    fn a_rank_that_never_reports_makes_the_request_expire() {
        let t0 = Instant::now();
        let mut a = TpAggregator::new(2, Duration::from_secs(5)).unwrap();
        a.handle_report(0, &fin(&[], &["r"], &[]), t0).unwrap();
        a.poll(t0 + Duration::from_secs(5));
        let out = a.take_finished();
        assert_eq!(out.failed.len(), 1, "{out:?}");
        assert_eq!(out.failed[0].cause, FailureCause::Expired);
        assert!(out.failed[0].expired);
    }
}
