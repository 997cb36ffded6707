//! The decisions of reading over several RDMA devices, without I/O (time is passed in): how a
//! read is cut among devices in proportion to what each delivers, which failures mean a
//! device's path is down (and which mean the request itself is wrong), and when a device that
//! failed is tried again.

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{wc_status as wc, Error, RdmaError, RdmaErrorKind};

/// Cuts `lens` (the ops of a read, in order) into one contiguous run per weight, each run's
/// bytes close to its weight's share of the total. Weights that are all zero (or not finite)
/// count as equal. Every op is in exactly one run; runs may be empty.
pub(crate) fn split(lens: &[u64], weights: &[f64]) -> Vec<Range<usize>> {
    let n = weights.len().max(1);
    let usable = |w: f64| if w.is_finite() && w > 0.0 { w } else { 0.0 };
    let sum: f64 = weights.iter().map(|&w| usable(w)).sum();
    let share = |i: usize| {
        if sum > 0.0 {
            usable(weights[i]) / sum
        } else {
            1.0 / n as f64
        }
    };
    let total: u64 = lens.iter().sum();
    let mut runs = Vec::with_capacity(n);
    let mut start = 0;
    let mut done = 0u64;
    let mut target = 0.0;
    for i in 0..n {
        target += share(i) * total as f64;
        let mut end = start;
        if i + 1 == n {
            end = lens.len();
        } else {
            // Take ops while the run's end stays nearer the target than without the op.
            while end < lens.len() {
                let with = (done + lens[end]) as f64;
                if with <= target || (with - target) < (target - done as f64) {
                    done += lens[end];
                    end += 1;
                } else {
                    break;
                }
            }
        }
        runs.push(start..end);
        start = end;
    }
    runs
}

/// What becomes of the part of a request a device pair failed to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The pair's path is down: pause the pair, read the part on another pair or over TCP.
    Pause,
    /// The pair's connection was broken under this request by another request's cancel or
    /// deadline: read the part elsewhere without pausing the pair (its session is rebuilt
    /// for later requests).
    Reroute,
    /// The request itself failed (its deadline, its cancel, a wrong key or address): the
    /// error is the request's answer.
    Fail,
}

/// Judges a device pair's failure `e` of part of a request: `first` is the error that broke
/// the pair's connection first, `cancelled` whether the request was cancelled, `broken`
/// whether the connection is broken.
pub(crate) fn judge(
    e: &Error,
    first: Option<&RdmaError>,
    cancelled: bool,
    broken: bool,
) -> Verdict {
    if cancelled || matches!(e, Error::Timeout { .. } | Error::Cancelled(_)) {
        Verdict::Fail
    } else if is_path_failure(first, e) {
        Verdict::Pause
    } else if broken && matches!(first, Some(f) if f.kind == RdmaErrorKind::ConnectionBroken) {
        Verdict::Reroute
    } else {
        Verdict::Fail
    }
}

/// Whether a device pair's failure says its path is down, judged by the error that broke its
/// connection first (`first`) when there is one: a queue pair broken by another request's
/// cancel or deadline, or by a bad key, flushes the reads of every request on it, and those
/// flushes are no reason to pause the pair.
pub(crate) fn is_path_failure(first: Option<&RdmaError>, e: &Error) -> bool {
    match first {
        Some(first) => is_path_error(&Error::Rdma(first.clone())),
        None => is_path_error(e),
    }
}

/// Whether an error says the path through a device is down (its link, its port, the peer's
/// NIC), so the read may be re-run on another device or over TCP. Errors that say the request
/// is wrong (a bad key, an address outside the peer's memory), a deadline or a cancel are not.
pub(crate) fn is_path_error(e: &Error) -> bool {
    match e {
        Error::ConnectionLost { .. } => true,
        Error::Rdma(r) => match r.kind {
            RdmaErrorKind::WorkCompletion { status } => matches!(
                status,
                wc::LOC_QP_OP_ERR
                    | wc::WR_FLUSH_ERR
                    | wc::BAD_RESP_ERR
                    | wc::RETRY_EXC_ERR
                    | wc::RNR_RETRY_EXC_ERR
                    | wc::GENERAL_ERR
            ),
            RdmaErrorKind::Post | RdmaErrorKind::Poll | RdmaErrorKind::Setup => true,
            // Broken by a cancel or a deadline (its first error), or earlier for a cause this
            // error does not carry: `is_path_failure` looks at that cause.
            RdmaErrorKind::ConnectionBroken | RdmaErrorKind::Cancelled => false,
        },
        _ => false,
    }
}

/// What is known of one device pair towards one peer.
#[derive(Debug, Clone)]
struct Entry {
    /// Not used before this instant.
    paused_until: Option<Instant>,
    /// The pause its next failure costs.
    next_pause: Duration,
    /// Its last failure.
    last_failure: Option<Instant>,
    /// Bytes per second it delivered, smoothed.
    rate: Option<f64>,
}

/// Health of device pairs (by key, e.g. `peer rxe0>rxe1`) across sessions: a failure pauses a
/// pair for a cool-down, doubled at each failure that follows within the longest pause, up to
/// ten times the first; a pair that has been quiet that long starts again from the first.
#[derive(Debug)]
pub(crate) struct HealthBook {
    cooldown: Duration,
    entries: HashMap<String, Entry>,
}

/// Smoothing of measured rates: the weight of the newest sample.
const RATE_WEIGHT: f64 = 0.3;
/// Most pairs remembered (older quiet ones are forgotten first).
const MAX_ENTRIES: usize = 4096;

impl HealthBook {
    /// A book whose first pause is `cooldown`.
    pub(crate) fn new(cooldown: Duration) -> HealthBook {
        HealthBook {
            cooldown,
            entries: HashMap::new(),
        }
    }

    fn max_pause(&self) -> Duration {
        self.cooldown * 10
    }

    fn entry(&mut self, key: &str) -> &mut Entry {
        if self.entries.len() >= MAX_ENTRIES && !self.entries.contains_key(key) {
            let quiet = self
                .entries
                .iter()
                .filter(|(_, e)| e.paused_until.is_none())
                .map(|(k, _)| k.clone())
                .next();
            if let Some(k) = quiet {
                self.entries.remove(&k);
            }
        }
        let cooldown = self.cooldown;
        self.entries.entry(key.to_string()).or_insert(Entry {
            paused_until: None,
            next_pause: cooldown,
            last_failure: None,
            rate: None,
        })
    }

    /// When the pair may be used again: `None` when it may be now.
    pub(crate) fn paused_until(&self, key: &str, now: Instant) -> Option<Instant> {
        self.entries
            .get(key)
            .and_then(|e| e.paused_until)
            .filter(|&t| t > now)
    }

    /// The pair failed on its path at `now`: it is paused; returns for how long.
    pub(crate) fn failed(&mut self, key: &str, now: Instant) -> Duration {
        let (base, max) = (self.cooldown, self.max_pause());
        let e = self.entry(key);
        if e.last_failure
            .is_none_or(|t| now.saturating_duration_since(t) > max)
        {
            e.next_pause = base;
        }
        let pause = e.next_pause;
        e.paused_until = Some(now + pause);
        e.last_failure = Some(now);
        e.next_pause = (pause * 2).min(max);
        pause
    }

    /// The pair delivered `bytes` in `took`.
    pub(crate) fn delivered(&mut self, key: &str, bytes: u64, took: Duration) {
        if bytes == 0 || took.is_zero() {
            return;
        }
        let sample = bytes as f64 / took.as_secs_f64();
        let e = self.entry(key);
        e.rate = Some(match e.rate {
            None => sample,
            Some(r) => r * (1.0 - RATE_WEIGHT) + sample * RATE_WEIGHT,
        });
    }

    /// The pair's smoothed rate, bytes per second, once measured.
    pub(crate) fn rate(&self, key: &str) -> Option<f64> {
        self.entries.get(key).and_then(|e| e.rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RdmaError;

    #[test]
    fn splits_follow_the_weights_and_cover_every_op_once() {
        let lens = vec![10u64; 100];
        let runs = split(&lens, &[1.0, 1.0]);
        assert_eq!(runs, vec![0..50, 50..100]);
        let runs = split(&lens, &[3.0, 1.0]);
        assert_eq!(runs, vec![0..75, 75..100]);
        // Zero or broken weights: equal shares.
        assert_eq!(split(&lens, &[0.0, 0.0]), vec![0..50, 50..100]);
        assert_eq!(split(&lens, &[f64::NAN, 2.0]), vec![0..0, 0..100]);
        // One big op and small ones: contiguous runs, nothing lost.
        let lens = [1000, 1, 1, 1, 1000, 1];
        for w in [[1.0, 1.0, 1.0], [5.0, 1.0, 0.1], [0.0, 0.0, 1.0]] {
            let runs = split(&lens, &w);
            assert_eq!(runs.len(), 3);
            assert_eq!(runs[0].start, 0);
            assert_eq!(runs[2].end, lens.len());
            assert!(runs.windows(2).all(|p| p[0].end == p[1].start));
        }
        assert_eq!(split(&[], &[1.0, 1.0]), vec![0..0, 0..0]);
        assert_eq!(split(&[5, 5], &[1.0]), vec![0..2]);
    }

    #[test]
    fn a_failed_part_is_paused_rerouted_or_the_answer() {
        let wc = |status| RdmaError::new(RdmaErrorKind::WorkCompletion { status }, "wc");
        let broken = RdmaError::new(RdmaErrorKind::ConnectionBroken, "another's deadline");
        let retry = Error::Rdma(wc(wc::RETRY_EXC_ERR));
        let flush = Error::Rdma(wc(wc::WR_FLUSH_ERR));
        let access = Error::Rdma(wc(wc::REM_ACCESS_ERR));
        let timeout = Error::Timeout {
            what: "read".into(),
            after: Duration::from_secs(1),
        };
        let cases: [(&Error, Option<&RdmaError>, bool, bool, Verdict); 10] = [
            // The path is down, judged by the first error when there is one.
            (&retry, None, false, false, Verdict::Pause),
            (
                &flush,
                Some(&wc(wc::LOC_QP_OP_ERR)),
                false,
                true,
                Verdict::Pause,
            ),
            // Flushed because another request broke the connection: read elsewhere.
            (&flush, Some(&broken), false, true, Verdict::Reroute),
            // ... but only while the connection is broken.
            (&flush, Some(&broken), false, false, Verdict::Fail),
            // Flushed after a wrong key broke it: the request is wrong.
            (
                &flush,
                Some(&wc(wc::REM_ACCESS_ERR)),
                false,
                true,
                Verdict::Fail,
            ),
            (&access, None, false, false, Verdict::Fail),
            // This request's own cancel or deadline is its answer, whatever the path did.
            (&retry, None, true, false, Verdict::Fail),
            (&timeout, None, false, false, Verdict::Fail),
            (
                &Error::Cancelled("c".into()),
                Some(&broken),
                false,
                true,
                Verdict::Fail,
            ),
            (
                &Error::ConnectionLost {
                    peer: "p".into(),
                    reason: "r".into(),
                },
                None,
                false,
                false,
                Verdict::Pause,
            ),
        ];
        for (i, (e, first, cancelled, broken, want)) in cases.into_iter().enumerate() {
            assert_eq!(judge(e, first, cancelled, broken), want, "case {i}: {e}");
        }
    }

    #[test]
    fn path_errors_are_told_from_request_errors() {
        let wc = |status| {
            Error::Rdma(RdmaError::new(
                RdmaErrorKind::WorkCompletion { status },
                "x",
            ))
        };
        assert!(is_path_error(&wc(12)), "retry exceeded");
        assert!(is_path_error(&wc(5)), "flushed");
        assert!(
            is_path_error(&wc(2)),
            "local QP operation error: a port that went down"
        );
        assert!(
            !is_path_error(&wc(10)),
            "remote access: the request is wrong"
        );
        assert!(!is_path_error(&Error::Rdma(RdmaError::new(
            RdmaErrorKind::Cancelled,
            "c"
        ))));
        assert!(is_path_error(&Error::ConnectionLost {
            peer: "p".into(),
            reason: "r".into()
        }));
        assert!(!is_path_error(&Error::Cancelled("c".into())));
        // A flush on a connection another request's deadline broke is no path failure; one
        // on a connection a port-down error broke is.
        let deadline = RdmaError::new(RdmaErrorKind::ConnectionBroken, "a deadline passed");
        let port = RdmaError::new(
            RdmaErrorKind::WorkCompletion {
                status: wc::LOC_QP_OP_ERR,
            },
            "port down",
        );
        assert!(!is_path_failure(Some(&deadline), &wc(5)));
        assert!(is_path_failure(Some(&port), &wc(5)));
        assert!(is_path_failure(None, &wc(12)));
        assert!(!is_path_error(&Error::Timeout {
            what: "w".into(),
            after: Duration::ZERO
        }));
    }

    #[test]
    fn pauses_double_while_failures_repeat_and_reset_after_a_quiet_spell() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = HealthBook::new(s(30));
        assert_eq!(b.paused_until("a", t0), None);
        assert_eq!(b.failed("a", t0), s(30));
        assert_eq!(b.paused_until("a", t0 + s(10)), Some(t0 + s(30)));
        assert_eq!(
            b.paused_until("a", t0 + s(30)),
            None,
            "used again after the cool-down"
        );
        assert_eq!(b.paused_until("b", t0), None, "other pairs unaffected");
        assert_eq!(b.failed("a", t0 + s(40)), s(60));
        assert_eq!(b.failed("a", t0 + s(110)), s(120));
        assert_eq!(b.failed("a", t0 + s(240)), s(240));
        assert_eq!(
            b.failed("a", t0 + s(490)),
            s(300),
            "capped at ten cool-downs"
        );
        // Quiet for longer than the longest pause: back to the first.
        assert_eq!(b.failed("a", t0 + s(1200)), s(30));
        b.delivered("a", 1000, s(1));
        b.delivered("a", 2000, s(1));
        let r = b.rate("a").unwrap();
        assert!((r - 1300.0).abs() < 1e-6, "{r}");
        assert_eq!(b.rate("b"), None);
    }
}
