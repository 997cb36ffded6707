//! Which reader engines show life: each has control sessions to this engine (kept alive by
//! their keep-alives), or had and lost them. A hold whose reader is gone ends when that
//! reader's lease ends, rather than at the abort timeout (`CompletionTracker`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The lease an engine gives its readers unless configured otherwise.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Live control sessions per reader engine, and the lease end of engines that lost them all.
#[derive(Debug)]
pub(crate) struct Presence {
    lease: Duration,
    live: HashMap<String, u32>,
    gone: HashMap<String, Instant>,
}

impl Presence {
    /// No engine seen yet; a reader that loses its last session keeps its holds for `lease`.
    pub(crate) fn new(lease: Duration) -> Presence {
        Presence {
            lease,
            live: HashMap::new(),
            gone: HashMap::new(),
        }
    }

    /// The lease length.
    pub(crate) fn lease(&self) -> Duration {
        self.lease
    }

    /// A control session of `engine` began. Returns whether the engine was gone (its holds'
    /// leases stop).
    pub(crate) fn opened(&mut self, engine: &str) -> bool {
        *self.live.entry(engine.to_string()).or_default() += 1;
        self.gone.remove(engine).is_some()
    }

    /// A control session of `engine` ended at `now`. Returns the end of its lease when that
    /// was its last session.
    pub(crate) fn closed(&mut self, engine: &str, now: Instant) -> Option<Instant> {
        let n = self.live.get_mut(engine)?;
        *n -= 1;
        if *n > 0 {
            return None;
        }
        self.live.remove(engine);
        let end = now + self.lease;
        self.gone.insert(engine.to_string(), end);
        Some(end)
    }

    /// A control session of `engine` ended in order (the reader said `Bye`: it closed an idle
    /// session and will open another when it reads again). When that was its last session
    /// the engine is neither present nor gone: its holds wait for it up to their abort timeout,
    /// as for a reader not seen yet. Returns whether it was its last.
    pub(crate) fn left(&mut self, engine: &str) -> bool {
        let Some(n) = self.live.get_mut(engine) else {
            return false;
        };
        *n -= 1;
        if *n > 0 {
            return false;
        }
        self.live.remove(engine);
        true
    }

    /// When `engine`'s lease ends, if it is gone.
    pub(crate) fn lease_end(&self, engine: &str) -> Option<Instant> {
        self.gone.get(engine).copied()
    }

    /// Forgets engines whose lease ended before `now`: their holds have expired, and a hold
    /// made for one later waits for it up to the abort timeout, as for a reader never seen.
    pub(crate) fn prune(&mut self, now: Instant) {
        self.gone.retain(|_, end| *end > now);
    }

    /// Engines with a live session.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_is_gone_only_once_its_last_session_ends() {
        let t0 = Instant::now();
        let mut p = Presence::new(Duration::from_secs(30));
        assert!(!p.opened("d"));
        assert!(!p.opened("d"));
        assert_eq!(p.closed("d", t0), None, "one session left");
        assert_eq!(p.lease_end("d"), None);
        let end = t0 + Duration::from_secs(31);
        assert_eq!(p.closed("d", t0 + Duration::from_secs(1)), Some(end));
        assert_eq!(p.lease_end("d"), Some(end));
        assert_eq!(p.live(), 0);
        assert_eq!(p.closed("d", t0), None, "no session to close");
        assert!(p.opened("d"), "back before its lease ended");
        assert_eq!(p.lease_end("d"), None);
        assert_eq!(p.closed("d", t0), Some(t0 + Duration::from_secs(30)));
        p.prune(t0 + Duration::from_secs(29));
        assert!(p.lease_end("d").is_some());
        p.prune(t0 + Duration::from_secs(30));
        assert_eq!(p.lease_end("d"), None, "forgotten once its lease ended");
    }

    #[test]
    fn an_engine_that_leaves_in_order_is_not_gone() {
        let t0 = Instant::now();
        let mut p = Presence::new(Duration::from_secs(30));
        assert!(!p.left("d"), "no session to leave");
        p.opened("d");
        p.opened("d");
        assert!(!p.left("d"), "one session left");
        assert!(p.left("d"), "its last session");
        assert_eq!(p.live(), 0);
        assert_eq!(p.lease_end("d"), None, "no lease: it is not gone");
        assert!(!p.opened("d"), "back, but it was never gone");
        assert_eq!(
            p.closed("d", t0),
            Some(t0 + Duration::from_secs(30)),
            "a later loss still starts the lease"
        );
    }
}
