//! The completion tracker with its notification built in: every change wakes the callers
//! waiting for something to finish, so no caller can change it and forget to.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::completion::{CompletionTracker, Finished};

/// The engine's completion tracker and the condition its waiters sleep on.
pub(crate) struct Completions {
    tracker: Mutex<CompletionTracker>,
    changed: Condvar,
}

impl Completions {
    pub(crate) fn new(tracker: CompletionTracker) -> Completions {
        Completions {
            tracker: Mutex::new(tracker),
            changed: Condvar::new(),
        }
    }

    /// Runs `f` on the tracker, then wakes every waiter (what `f` did may have finished a
    /// request).
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut CompletionTracker) -> R) -> R {
        let r = f(&mut self.tracker.lock());
        self.changed.notify_all();
        r
    }

    /// Reads the tracker (changing nothing, so waking no one).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&CompletionTracker) -> R) -> R {
        f(&self.tracker.lock())
    }

    /// Everything that finished by now, each request once (holds past their deadline end
    /// first).
    pub(crate) fn take_finished(&self) -> Finished {
        let mut t = self.tracker.lock();
        t.poll(Instant::now());
        t.take_finished()
    }

    /// [`take_finished`](Completions::take_finished), waiting up to `timeout` for something
    /// to finish: asleep until a change or the next hold's deadline, never spinning.
    pub(crate) fn wait_finished(&self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let mut t = self.tracker.lock();
        loop {
            let now = Instant::now();
            t.poll(now);
            if t.has_finished() || now >= deadline {
                return t.take_finished();
            }
            let wake = t.next_deadline().map_or(deadline, |d| d.min(deadline));
            self.changed.wait_until(&mut t, wake);
        }
    }
}
