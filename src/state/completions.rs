//! The completion tracker with its notification built in: every change that finishes a request
//! (or may bring a hold's end nearer) wakes the callers waiting for something to finish, so no
//! caller can change it and forget to.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::completion::{CompletionTracker, Finished};

/// The engine's completion tracker and the condition its waiters sleep on.
pub(crate) struct Completions {
    tracker: Mutex<CompletionTracker>,
    changed: Condvar,
    /// Moves each time an update finished a request: what a spinning waiter watches, without
    /// the lock.
    finished: AtomicU64,
    /// How long a waiter polls before it sleeps while reads are in flight (zero: never).
    spin: Duration,
}

impl Completions {
    pub(crate) fn new(tracker: CompletionTracker, spin: Duration) -> Completions {
        Completions {
            tracker: Mutex::new(tracker),
            changed: Condvar::new(),
            finished: AtomicU64::new(0),
            spin,
        }
    }

    /// Runs `f` on the tracker, then wakes the waiters when what `f` did finished a request or
    /// may have brought a hold's end nearer (they sleep until the next one); other changes
    /// wake no one.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut CompletionTracker) -> R) -> R {
        let mut t = self.tracker.lock();
        let before = (t.finished_count(), t.deadline_epoch());
        let r = f(&mut t);
        let after = (t.finished_count(), t.deadline_epoch());
        drop(t);
        if after.0 > before.0 {
            self.finished.fetch_add(1, Ordering::Release);
        }
        if after != before {
            self.changed.notify_all();
        }
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
    /// to finish: asleep until a change or the next hold's deadline. While reads are in flight,
    /// the first wait polls for up to the engine's `spin` before it sleeps (a read that
    /// finishes meanwhile is seen without a wake-up); with nothing in flight it never polls.
    pub(crate) fn wait_finished(&self, timeout: Duration) -> Finished {
        let deadline = Instant::now() + timeout;
        let mut t = self.tracker.lock();
        let mut spun = self.spin.is_zero();
        loop {
            let now = Instant::now();
            t.poll(now);
            if t.has_finished() || now >= deadline {
                return t.take_finished();
            }
            if !spun && t.receiving() > 0 {
                spun = true;
                self.spin_until((now + self.spin).min(deadline), &mut t);
                continue;
            }
            let wake = t.next_deadline().map_or(deadline, |d| d.min(deadline));
            self.changed.wait_until(&mut t, wake);
        }
    }

    /// Polls, without the lock, until a request finishes or `until`; yields the CPU between
    /// looks, so the threads moving the read's bytes keep running on a busy machine.
    fn spin_until(&self, until: Instant, t: &mut MutexGuard<'_, CompletionTracker>) {
        let seen = self.finished.load(Ordering::Acquire);
        MutexGuard::unlocked(t, || {
            while self.finished.load(Ordering::Acquire) == seen && Instant::now() < until {
                std::thread::yield_now();
            }
        });
    }
}
