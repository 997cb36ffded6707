//! When a cached session has been idle long enough to close: a sans-I/O clock per session,
//! touched on every use and ticked by the engine's reaper with the time passed in.
//!
//! A session is in use while anything besides the cache holds it (a read, its notices and
//! confirmations). It closes once it has been neither touched nor in use at any tick for a
//! whole `limit`, so it closes between `limit` and `limit` plus one tick period after its last
//! use.

use std::time::Duration;

use tokio::time::Instant;

/// How long one session has been idle, as the reaper sees it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdleClock {
    /// The first tick since the last use at which the session was unused.
    since: Option<Instant>,
}

impl IdleClock {
    /// The session was used (a read or a message took it from the cache).
    pub(crate) fn touch(&mut self) {
        self.since = None;
    }

    /// A reaper tick at `now`; `in_use` says whether anything besides the cache holds the
    /// session. Returns whether it has been idle for `limit` and should close now.
    pub(crate) fn tick(&mut self, now: Instant, in_use: bool, limit: Duration) -> bool {
        if in_use {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        now.saturating_duration_since(since) >= limit
    }
}

/// The longest time between two looks of the reaper.
pub(crate) const MAX_TICK: Duration = Duration::from_secs(5);

/// How often the reaper looks at the sessions for `limit`: a quarter of it, between 50 ms
/// and [`MAX_TICK`].
pub(crate) fn tick_period(limit: Duration) -> Duration {
    (limit / 4).clamp(Duration::from_millis(50), MAX_TICK)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    #[test]
    fn a_session_closes_a_whole_limit_after_the_first_idle_tick() {
        let t0 = Instant::now();
        let mut c = IdleClock::default();
        assert!(!c.tick(t0, false, LIMIT), "first seen idle");
        assert!(!c.tick(t0 + Duration::from_secs(9), false, LIMIT));
        assert!(c.tick(t0 + LIMIT, false, LIMIT), "idle for the whole limit");
    }

    #[test]
    fn use_and_touches_start_the_wait_again() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut c = IdleClock::default();
        c.tick(t0, false, LIMIT);
        assert!(!c.tick(t0 + s(8), true, LIMIT), "a read holds it");
        assert!(!c.tick(t0 + s(11), false, LIMIT), "idle again from 11 s");
        assert!(!c.tick(t0 + s(20), false, LIMIT));
        c.touch();
        assert!(
            !c.tick(t0 + s(21), false, LIMIT),
            "touched: idle again from 21 s"
        );
        assert!(!c.tick(t0 + s(30), false, LIMIT));
        assert!(c.tick(t0 + s(31), false, LIMIT));
    }

    #[test]
    fn a_session_in_use_never_closes() {
        let t0 = Instant::now();
        let mut c = IdleClock::default();
        for i in 0..100 {
            assert!(!c.tick(t0 + Duration::from_secs(i * 10), true, LIMIT));
        }
    }

    #[test]
    fn the_tick_is_a_quarter_of_the_limit_within_bounds() {
        assert_eq!(tick_period(LIMIT), Duration::from_millis(2500));
        assert_eq!(
            tick_period(Duration::from_millis(100)),
            Duration::from_millis(50)
        );
        assert_eq!(
            tick_period(Duration::from_secs(3600)),
            Duration::from_secs(5)
        );
    }
}
