//! Rate-limited warnings for events a remote peer can trigger at will (refused connections,
//! refused requests, dropped connections): the first event of each interval is logged with the
//! number suppressed since the previous line, so churn from a hostile or broken peer costs one
//! line per interval instead of one per event. Time is passed in.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One limiter per kind of event (a `static` at its call site).
pub(crate) struct LogLimit {
    interval: Duration,
    /// When the last line was logged, and events suppressed since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    /// A limiter allowing one line per `interval`.
    pub(crate) const fn new(interval: Duration) -> LogLimit {
        LogLimit {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Whether to log this event: `Some(n)` with the `n` events suppressed since the previous
    /// line, or `None` to stay quiet (the event is counted).
    pub(crate) fn allow(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match st.0 {
            Some(last) if now.saturating_duration_since(last) < self.interval => {
                st.1 += 1;
                None
            }
            _ => {
                let suppressed = st.1;
                *st = (Some(now), 0);
                Some(suppressed)
            }
        }
    }
}

/// Logs a warning through `limit`: `warn_limited!(LIMIT, %peer, "refused ...")`, adding the
/// number of lines suppressed since the previous one.
macro_rules! warn_limited {
    ($limit:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $limit.allow(std::time::Instant::now()) {
            tracing::warn!(suppressed, $($arg)+);
        }
    };
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_in_between() {
        let l = LogLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(l.allow(t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(l.allow(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(l.allow(t0 + Duration::from_secs(10)), Some(1000));
        assert_eq!(l.allow(t0 + Duration::from_secs(11)), None);
        assert_eq!(l.allow(t0 + Duration::from_secs(30)), Some(1));
    }
}
